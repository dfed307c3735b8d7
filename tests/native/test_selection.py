"""Which engine runs: ``engine=``, ``PREFIXCACHE_ENGINE`` and what the native engine supports."""

from __future__ import annotations

import pytest
from prefixcache.policies import LRUPolicy

from prefixcache import KVBlockAllocator
from prefixcache.engine.native_engine import native_available
from prefixcache.errors import ConfigError

pytestmark = pytest.mark.skipif(
    not native_available(), reason="the native engine (prefixcache.engine._native) is not built"
)


@pytest.mark.parametrize("policy", ["lru", "fifo", "ref_zero", {"name": "lru"}])
def test_native_runs_the_built_in_policies_by_name(policy: object) -> None:
    allocator = KVBlockAllocator(
        total_count=8, device="cpu", eviction_policy=policy, engine="native"
    )
    assert allocator.engine == "native"


@pytest.mark.parametrize(
    ("config", "reason"),
    [
        ({"eviction_policy": "lfu"}, "runs the policies"),
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
        KVBlockAllocator(total_count=8, device="cpu", eviction_policy="lfu")
    monkeypatch.setenv("PREFIXCACHE_ENGINE", "python")
    assert KVBlockAllocator(total_count=8, device="cpu").engine == "python"
    assert KVBlockAllocator(total_count=8, device="cpu", engine="native").engine == "native"
    monkeypatch.setenv("PREFIXCACHE_ENGINE", "fast")
    with pytest.raises(ConfigError, match="PREFIXCACHE_ENGINE"):
        KVBlockAllocator(total_count=8, device="cpu")
