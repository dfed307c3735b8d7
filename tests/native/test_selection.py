"""Which engine runs: ``engine=``, ``PREFIXCACHE_ENGINE`` and what the native engine supports."""

from __future__ import annotations

import pytest
from prefixcache.policies import LRUPolicy

from prefixcache import KVBlockAllocator
from prefixcache.engine.native_engine import NATIVE_POLICIES, native_available
from prefixcache.errors import ConfigError

pytestmark = pytest.mark.skipif(
    not native_available(), reason="the native engine (prefixcache.engine._native) is not built"
)


@pytest.mark.parametrize(
    "policy",
    [
        *NATIVE_POLICIES,
        {"name": "lru"},
        {"name": "s3fifo", "ghost_capacity": 7, "small_fraction": 0.2},
        {"name": "hazard", "window": 2.5},
    ],
    ids=str,
)
def test_native_runs_the_built_in_policies_by_name(
    policy: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    allocator = KVBlockAllocator(
        total_count=8, device="cpu", eviction_policy=policy, engine="native"
    )
    assert allocator.engine == "native"
    monkeypatch.delenv("PREFIXCACHE_ENGINE", raising=False)  # the suite's default is python
    assert KVBlockAllocator(total_count=8, device="cpu", eviction_policy=policy).engine == "native"


def test_every_built_in_but_auto_and_belady_is_native() -> None:
    from prefixcache import policies

    offline_or_not_yet = {"auto", "belady"}
    assert set(NATIVE_POLICIES) == set(policies.available()) - offline_or_not_yet


@pytest.mark.parametrize(
    ("config", "reason"),
    [
        ({"eviction_policy": "auto"}, "runs the policies"),
        ({"eviction_policy": {"name": "lru", "unused": 1}}, ""),
        ({"hash_algo": "sha256"}, "64-bit hashes"),
    ],
)
def test_native_refuses_what_it_cannot_run(config: dict[str, object], reason: str) -> None:
    with pytest.raises(ConfigError, match=reason):
        KVBlockAllocator(total_count=8, device="cpu", engine="native", **config)


def test_a_policy_object_keeps_the_python_engine() -> None:
    with pytest.raises(ConfigError, match="runs the policies"):
        KVBlockAllocator(total_count=8, device="cpu", eviction_policy=LRUPolicy(), engine="native")
    auto = KVBlockAllocator(total_count=8, device="cpu", eviction_policy=LRUPolicy())
    assert auto.engine == "python"


def test_environment_variable_overrides_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREFIXCACHE_ENGINE", "native")
    assert KVBlockAllocator(total_count=8, device="cpu").engine == "native"
    assert KVBlockAllocator(total_count=8, device="cpu", engine="python").engine == "python"
    with pytest.raises(ConfigError):
        KVBlockAllocator(total_count=8, device="cpu", eviction_policy="auto")
    monkeypatch.setenv("PREFIXCACHE_ENGINE", "python")
    assert KVBlockAllocator(total_count=8, device="cpu").engine == "python"
    assert KVBlockAllocator(total_count=8, device="cpu", engine="native").engine == "native"
    monkeypatch.setenv("PREFIXCACHE_ENGINE", "fast")
    with pytest.raises(ConfigError, match="PREFIXCACHE_ENGINE"):
        KVBlockAllocator(total_count=8, device="cpu")
