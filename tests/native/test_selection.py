"""Which engine runs: ``engine=``, ``PREFIXCACHE_ENGINE`` and what the native engine supports;
and on it, where the facade binds the fused calls."""

from __future__ import annotations

import pytest
from prefixcache.policies import LRUPolicy
from prefixcache.policies.auto import AutoPolicy
from prefixcache.policies.page_aware import PageAwarePolicy

from prefixcache import KVBlockAllocator
from prefixcache.engine.native_engine import NATIVE_POLICIES, native_available
from prefixcache.errors import ConfigError, EngineMismatchError, PrefixCacheError

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
        {"name": "auto", "seed": 4, "safety_z": None, "switch_margin": 0.1},
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


def test_every_built_in_but_belady_is_native() -> None:
    from prefixcache import policies

    offline = {"belady"}
    assert set(NATIVE_POLICIES) == set(policies.available()) - offline


def test_auto_runs_natively_from_a_mapping_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """auto with options, through AllocatorConfig.from_dict, under engine="auto": native,
    with the sketch multipliers its seed picks in the Python class."""
    from prefixcache.engine.config import AllocatorConfig
    from prefixcache.engine.selection import native_policy_spec

    monkeypatch.delenv("PREFIXCACHE_ENGINE", raising=False)
    spec = {"name": "auto", "seed": 9, "safety_z": None}
    big = {"name": "auto", "seed": 2**70}  # past int64: the Python class takes any int
    assert KVBlockAllocator(total_count=8, device="cpu", eviction_policy=big).engine == "native"
    config = AllocatorConfig.from_dict({"total_count": 8, "device": "cpu", "eviction_policy": spec})
    allocator = KVBlockAllocator(config=config)
    assert allocator.engine == "native" and "runs this configuration" in allocator.engine_reason
    named = native_policy_spec(spec, AutoPolicy(seed=9, safety_z=None))
    assert named is not None and named[1]["safety_net"] == 0 and "safety_z" not in named[1]
    assert "seed" not in named[1]  # any int: it travels as the multipliers it picked
    multiplier = AutoPolicy(seed=9).sketch_multipliers[2]
    assert (named[1]["multiplier2_high"], named[1]["multiplier2_low"]) == divmod(multiplier, 2**32)


@pytest.mark.parametrize(
    ("config", "reason"),
    [
        ({"eviction_policy": PageAwarePolicy(4)}, "reads the Python engine's free list"),
        ({"eviction_policy": "auto", "hash_algo": "sha256"}, "would see keys"),
        ({"eviction_policy": {"name": "lru", "unused": 1}}, "unexpected keyword argument"),
    ],
)
def test_native_refuses_what_it_cannot_run(config: dict[str, object], reason: str) -> None:
    with pytest.raises(ConfigError, match=reason):
        KVBlockAllocator(total_count=8, device="cpu", engine="native", **config)


def test_a_policy_object_runs_on_the_native_engine_through_its_hooks() -> None:
    native = KVBlockAllocator(
        total_count=8, device="cpu", eviction_policy=LRUPolicy(), engine="native"
    )
    assert native.engine == "native" and "LRUPolicy object's hooks" in native.engine_reason
    with pytest.raises(ConfigError, match="would see keys"):
        KVBlockAllocator(
            total_count=8,
            device="cpu",
            eviction_policy=LRUPolicy(),
            engine="native",
            hash_algo="sha256",
        )


def test_environment_variable_overrides_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREFIXCACHE_ENGINE", "native")
    assert KVBlockAllocator(total_count=8, device="cpu").engine == "native"
    assert KVBlockAllocator(total_count=8, device="cpu", engine="python").engine == "python"
    with pytest.raises(ConfigError):
        KVBlockAllocator(total_count=8, device="cpu", eviction_policy=PageAwarePolicy(4))
    monkeypatch.setenv("PREFIXCACHE_ENGINE", "python")
    assert KVBlockAllocator(total_count=8, device="cpu").engine == "python"
    assert KVBlockAllocator(total_count=8, device="cpu", engine="native").engine == "native"
    monkeypatch.setenv("PREFIXCACHE_ENGINE", "fast")
    with pytest.raises(ConfigError, match="PREFIXCACHE_ENGINE"):
        KVBlockAllocator(total_count=8, device="cpu")


def test_every_device_runs_the_native_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bookkeeping is on the host in both engines: the device only places the mirror."""
    monkeypatch.delenv("PREFIXCACHE_ENGINE", raising=False)
    allocator = KVBlockAllocator(total_count=8, device="meta")
    assert allocator.engine == "native"
    assert "runs this configuration" in allocator.engine_reason
    mirror = allocator.device_free_ids()
    assert mirror is not None and mirror.device.type == "meta" and mirror.shape == (7,)


def test_a_fallback_says_why_and_is_logged_once_per_reason(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from prefixcache.engine import selection

    monkeypatch.delenv("PREFIXCACHE_ENGINE", raising=False)
    monkeypatch.setattr(selection, "_logged_reasons", set())
    with caplog.at_level("WARNING", logger="prefixcache.engine.selection"):
        paged = {"free_list": "lowest", "page_size_blocks": 4}
        first = KVBlockAllocator(total_count=8, eviction_policy=PageAwarePolicy(4), **paged)
        KVBlockAllocator(total_count=8, eviction_policy=PageAwarePolicy(4), **paged)
        other = KVBlockAllocator(
            total_count=8, device="cpu", eviction_policy=LRUPolicy(), hash_algo="sha256"
        )
    assert first.engine == "python" and "free list" in first.engine_reason
    assert other.engine == "python" and "LRUPolicy" in other.engine_reason
    messages = [record.getMessage() for record in caplog.records]
    assert len(messages) == 2, messages
    assert "PageAwarePolicy" in messages[0] and "LRUPolicy" in messages[1]


def test_asking_for_python_is_not_a_fallback(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from prefixcache.engine import selection

    monkeypatch.setattr(selection, "_logged_reasons", set())
    monkeypatch.setenv("PREFIXCACHE_ENGINE", "python")
    with caplog.at_level("WARNING", logger="prefixcache.engine.selection"):
        by_environment = KVBlockAllocator(total_count=8, device="cpu", hash_algo="sha256")
        by_config = KVBlockAllocator(total_count=8, device="cpu", engine="python")
    assert by_environment.engine_reason == "PREFIXCACHE_ENGINE=python asks for it"
    assert by_config.engine_reason == "engine='python' asks for it"
    assert caplog.records == []


@pytest.mark.parametrize("name", ["pool", "registry"])
def test_the_python_engines_internals_are_refused_by_name_on_the_native_engine(
    name: str,
) -> None:
    native = KVBlockAllocator(total_count=8, device="cpu", engine="native")
    with pytest.raises(
        EngineMismatchError, match=rf"allocator\.{name} is the Python engine's.*native"
    ):
        getattr(native, name)
    assert issubclass(EngineMismatchError, PrefixCacheError)
    assert not hasattr(native, name)  # still an AttributeError for hasattr and getattr
    python = KVBlockAllocator(total_count=8, device="cpu", engine="python")
    assert getattr(python, name) is getattr(python._engine, name)


@pytest.mark.parametrize("hash_algo", ["xxh3_128", "sha256"])
def test_wide_hashes_run_the_native_engine(hash_algo: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 25 item 4: the keyed-hash deployments keep the native engine (wide_keys.py)."""
    monkeypatch.delenv("PREFIXCACHE_ENGINE", raising=False)
    allocator = KVBlockAllocator(
        total_count=16, block_size_tokens=4, device="cpu", hash_algo=hash_algo
    )
    assert allocator.engine == "native"
    chain = allocator.hash_tokens(list(range(12)))
    assert max(chain) > 2**63, "the wide hashes themselves cross the facade"
    ids = allocator.allocate_memory_blocks(3)
    assert allocator.register_kv_block_hashes(ids, chain).tolist() == [True] * 3
    allocator.release_memory_blocks(ids)
    assert allocator.match_prefix(chain, acquire=False).tolist() == ids.tolist()
    assert allocator._engine.hash_of(int(ids[2])) == chain[2]
    assert allocator.evict_cached_blocks(3) == 3
    assert allocator._engine._key_of == {}, "a removed hash keeps no key"
    allocator.check_invariants()


def test_fused_path_is_bound_only_without_collaborators() -> None:
    """The fused calls are the extension's when nothing above the engine must see them."""
    fused = KVBlockAllocator(total_count=8, device="cpu", engine="native")
    assert type(fused.admit_request).__name__ == "builtin_function_or_method"
    with_events = KVBlockAllocator(
        total_count=8, device="cpu", engine="native", kv_events_capacity=10
    )
    assert type(with_events.admit_request).__name__ == "method"
