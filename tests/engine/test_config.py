"""Choosing the eviction policy through configuration, and plugging in a third-party one.

Covers the three spellings of a policy spec (name, ``{"name": ..., **kwargs}``,
a policy object), the behavioural difference between ``lru`` and
``ref_zero``, a policy registered at run time with ``policies.register`` and
one found through the ``prefixcache.policies`` entry-point group. Every test
that registers a policy works on a copy of ``policies._registry``.
"""

from __future__ import annotations

import sys
import textwrap
from collections.abc import Iterator
from importlib.metadata import EntryPoint
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from prefixcache.policies import EvictionPolicy, LRUPolicy, RefZeroPolicy

from prefixcache import AllocatorConfig, ConfigError, KVBlockAllocator, policies

BASE = {"total_count": 16, "block_size_tokens": 4, "device": "cpu"}


class FifoPolicy:
    """Evicts leaves in the order they became evictable; touches do not reorder."""

    retains_unreferenced = True

    def __init__(self, *, label: str = "fifo") -> None:
        self.label = label
        self._queue: dict[int, None] = {}

    def insert(
        self, block_id: int, block_hash: int, last_access: int, num_accesses: int, depth: int
    ) -> None:
        self._queue[block_id] = None

    def discard(self, block_id: int) -> None:
        del self._queue[block_id]

    def touch(self, block_id: int, now: int) -> None:
        if block_id not in self._queue:
            raise KeyError(block_id)

    def evict(self, num_blocks: int) -> list[int]:
        victims = list(self._queue)[:num_blocks]
        for block_id in victims:
            del self._queue[block_id]
        return victims

    def clear(self) -> None:
        self._queue.clear()

    def __len__(self) -> int:
        return len(self._queue)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._queue


@pytest.fixture
def registry_copy(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, type]]:
    """Let a test register policies; the original registry comes back afterwards."""
    original = policies._registry
    copy = dict(original)
    monkeypatch.setattr(policies, "_registry", copy)
    yield copy
    monkeypatch.undo()
    assert policies._registry is original


def cache_one_block(allocator: KVBlockAllocator, block_hash: int) -> int:
    """Allocate, register and release one block; return its ID."""
    block = allocator.allocate_memory_blocks(1)
    allocator.register_kv_block_hashes(block, [block_hash])
    allocator.release_memory_blocks(block)
    allocator.check_invariants()
    return int(block[0])


# ---------------------------------------------------------------- lru <-> ref_zero


@pytest.mark.parametrize(
    ("spec", "policy_type"),
    [
        ("lru", LRUPolicy),
        ("ref_zero", RefZeroPolicy),
        ({"name": "lru"}, LRUPolicy),
        ({"name": "ref_zero"}, RefZeroPolicy),
    ],
)
def test_policy_is_chosen_by_dict(spec: Any, policy_type: type) -> None:
    config = AllocatorConfig.from_dict({**BASE, "eviction_policy": spec})
    assert config.eviction_policy == spec
    assert isinstance(KVBlockAllocator(config).policy, policy_type)
    assert isinstance(KVBlockAllocator(**BASE, eviction_policy=spec).policy, policy_type)


def test_default_policy_is_lru() -> None:
    assert isinstance(KVBlockAllocator(**BASE).policy, LRUPolicy)


def test_lru_keeps_a_released_block_matchable_and_ref_zero_does_not() -> None:
    results = {}
    for name in ("lru", "ref_zero"):
        allocator = KVBlockAllocator(AllocatorConfig.from_dict({**BASE, "eviction_policy": name}))
        block = cache_one_block(allocator, 10)
        results[name] = (
            allocator.match_prefix([10]).tolist(),
            allocator.get_evictable_block_count(),
            allocator.pool.num_free,
            block,
        )
    lru_match, lru_cached, lru_free, lru_block = results["lru"]
    assert (lru_match, lru_cached, lru_free) == ([lru_block], 1, 14)
    ref_match, ref_cached, ref_free, _ = results["ref_zero"]
    assert (ref_match, ref_cached, ref_free) == ([], 0, 15)


def test_each_allocator_gets_its_own_policy_object() -> None:
    config = AllocatorConfig.from_dict({**BASE, "eviction_policy": {"name": "lru"}})
    first, second = KVBlockAllocator(config), KVBlockAllocator(config)
    assert first.policy is not second.policy
    cache_one_block(first, 10)
    assert len(first.policy) == 1 and len(second.policy) == 0


# ---------------------------------------------------------------- plugins by name


def test_a_registered_policy_is_used_through_config(registry_copy: dict[str, type]) -> None:
    assert "my_fifo" not in policies.available()
    policies.register("my_fifo")(FifoPolicy)
    assert "my_fifo" in policies.available()
    assert isinstance(policies.get("my_fifo"), FifoPolicy)
    config = AllocatorConfig.from_dict(
        {**BASE, "eviction_policy": {"name": "my_fifo", "label": "x"}}
    )
    allocator = KVBlockAllocator(config)
    assert isinstance(allocator.policy, FifoPolicy)
    assert allocator.policy.label == "x"
    assert isinstance(allocator.policy, EvictionPolicy)


def test_a_fifo_plugin_ignores_touches_where_lru_does_not(registry_copy: dict[str, type]) -> None:
    """The plugin's own order decides: FIFO evicts the first cached block despite its touch."""
    policies.register("my_fifo")(FifoPolicy)
    survivor = {}
    for name in ("my_fifo", "lru"):
        allocator = KVBlockAllocator(**BASE, eviction_policy=name)
        first = cache_one_block(allocator, 10)
        cache_one_block(allocator, 20)
        allocator.update_timestamps([first])
        assert allocator.evict_cached_blocks(1) == 1
        allocator.check_invariants()
        survivor[name] = [h for h in (10, 20) if allocator.match_prefix([h]).numel()]
    assert survivor == {"my_fifo": [20], "lru": [10]}


def test_register_decorator_returns_the_class(registry_copy: dict[str, type]) -> None:
    @policies.register("decorated")
    class Decorated(FifoPolicy):
        pass

    assert Decorated.__name__ == "Decorated"
    assert registry_copy["decorated"] is Decorated
    assert type(policies.get("decorated")) is Decorated


@pytest.mark.parametrize("name", ["", None, 3])
def test_register_refuses_an_empty_or_non_string_name(name: Any) -> None:
    with pytest.raises(ValueError):
        policies.register(name)


def test_registry_copy_is_restored() -> None:
    """Runs after the tests above in file order: none of their names leaked."""
    assert "my_fifo" not in policies.available()
    assert "decorated" not in policies.available()


# ---------------------------------------------------------------- entry points


PLUGIN_SOURCE = textwrap.dedent(
    """
    class EntryFifo:
        retains_unreferenced = True

        def __init__(self, *, limit=None):
            self.limit = limit
            self._queue = {}

        def insert(self, block_id, block_hash, last_access, num_accesses, depth):
            self._queue[block_id] = None

        def discard(self, block_id):
            del self._queue[block_id]

        def touch(self, block_id, now):
            pass

        def evict(self, num_blocks):
            victims = list(self._queue)[:num_blocks]
            for block_id in victims:
                del self._queue[block_id]
            return victims

        def clear(self):
            self._queue.clear()

        def __len__(self):
            return len(self._queue)

        def __contains__(self, block_id):
            return block_id in self._queue
    """
)


@pytest.fixture
def entry_point_plugin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, registry_copy: dict[str, type]
) -> Iterator[str]:
    """An importable module holding a policy, advertised under the name ``ep_fifo``."""
    module_name = "prefixcache_test_plugin_ep"
    (tmp_path / f"{module_name}.py").write_text(PLUGIN_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    entry = EntryPoint(
        name="ep_fifo", value=f"{module_name}:EntryFifo", group=policies.ENTRY_POINT_GROUP
    )

    def fake_entry_points(*, group: str) -> list[EntryPoint]:
        return [entry] if group == policies.ENTRY_POINT_GROUP else []

    monkeypatch.setattr(policies, "entry_points", fake_entry_points)
    yield "ep_fifo"
    sys.modules.pop(module_name, None)


def test_an_entry_point_policy_is_found_by_name(entry_point_plugin: str) -> None:
    assert policies.is_registered("lru") and not policies.is_registered("no_such_policy")
    assert policies.is_registered(entry_point_plugin)  # its class loaded and registered
    assert entry_point_plugin in policies.available()
    assert {"lru", "ref_zero"} <= set(policies.available())
    policy = policies.get(entry_point_plugin, limit=3)
    assert type(policy).__name__ == "EntryFifo"
    assert policy.limit == 3
    assert isinstance(policy, EvictionPolicy)


def test_an_entry_point_policy_is_used_through_config(entry_point_plugin: str) -> None:
    allocator = KVBlockAllocator(
        AllocatorConfig.from_dict({**BASE, "eviction_policy": {"name": entry_point_plugin}})
    )
    assert type(allocator.policy).__name__ == "EntryFifo"
    block = cache_one_block(allocator, 10)
    assert block in allocator.policy
    assert allocator.evict_cached_blocks(1) == 1
    allocator.check_invariants()


def test_unknown_name_lists_entry_point_policies_too(entry_point_plugin: str) -> None:
    with pytest.raises(ConfigError) as info:
        KVBlockAllocator(**BASE, eviction_policy="nope")
    assert entry_point_plugin in str(info.value)
    assert "lru" in str(info.value) and "ref_zero" in str(info.value)


# ---------------------------------------------------------------- policy objects and errors


def test_a_policy_object_is_used_as_given() -> None:
    policy = FifoPolicy()
    allocator = KVBlockAllocator(**BASE, eviction_policy=policy)
    assert allocator.policy is policy
    block = cache_one_block(allocator, 10)
    assert block in policy


def test_unknown_policy_name_lists_the_known_names() -> None:
    with pytest.raises(ConfigError) as info:
        KVBlockAllocator(AllocatorConfig.from_dict({**BASE, "eviction_policy": "lfu_typo"}))
    message = str(info.value)
    assert "lfu_typo" in message
    assert "lru" in message and "ref_zero" in message


@pytest.mark.parametrize(
    "spec",
    [{"name": "lru", "size": 4}, {"name": "ref_zero", "threshold": 0.5}, {"label": "x"}],
)
def test_bad_policy_kwargs_are_config_errors(spec: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        KVBlockAllocator(AllocatorConfig.from_dict({**BASE, "eviction_policy": spec}))


def test_bad_plugin_kwargs_are_config_errors(registry_copy: dict[str, type]) -> None:
    policies.register("my_fifo")(FifoPolicy)
    with pytest.raises(ConfigError, match="my_fifo"):
        KVBlockAllocator(**BASE, eviction_policy={"name": "my_fifo", "lable": "x"})


def test_an_object_that_is_not_a_policy_is_refused() -> None:
    with pytest.raises(ConfigError):
        KVBlockAllocator(**BASE, eviction_policy=object())


def test_a_registered_class_that_is_not_a_policy_is_refused(
    registry_copy: dict[str, type],
) -> None:
    class NotAPolicy:
        pass

    policies.register("not_a_policy")(NotAPolicy)
    with pytest.raises(ConfigError, match="not_a_policy"):
        KVBlockAllocator(**BASE, eviction_policy="not_a_policy")


def test_a_broken_entry_point_is_a_config_error(
    monkeypatch: pytest.MonkeyPatch, registry_copy: dict[str, type]
) -> None:
    entry = EntryPoint(
        name="broken", value="prefixcache_no_such_module:Policy", group=policies.ENTRY_POINT_GROUP
    )
    monkeypatch.setattr(policies, "entry_points", lambda *, group: [entry])
    with pytest.raises(ConfigError, match="broken"):
        KVBlockAllocator(**BASE, eviction_policy="broken")


# ---------------------------------------------------------------- hash_algo


def chained_sum(tokens, block_size, *, parent=None, salt=None, extra_keys=None) -> list[int]:
    """A toy user hash function with the signature the allocator calls."""
    hashes, previous = [], parent or 1
    for start in range(0, len(tokens) - block_size + 1, block_size):
        previous = previous * 31 + sum(tokens[start : start + block_size]) + 1
        hashes.append(previous)
    return hashes


def hash_through_kwargs(tokens, block_size, **options: Any) -> list[int]:
    return chained_sum(tokens, block_size, **options)


@pytest.mark.parametrize(
    "algo",
    ["xxh3_64", "xxh3_128", "sha256", chained_sum, hash_through_kwargs],
    ids=["xxh3_64", "xxh3_128", "sha256", "keywords", "kwargs"],
)
def test_a_known_name_or_a_hash_function_is_accepted(algo: Any) -> None:
    allocator = KVBlockAllocator(**BASE, hash_algo=algo)
    hashes = allocator.hash_tokens(list(range(8)))
    assert len(hashes) == 2 and hashes[0] != hashes[1]
    if callable(algo):
        assert hashes == chained_sum(list(range(8)), 4)


def _two_positional_only(tokens, block_size) -> list[int]:
    return []


def _keyword_only_tokens(*, tokens, block_size, parent, salt, extra_keys) -> list[int]:
    return []


@pytest.mark.parametrize(
    ("algo", "match"),
    [
        ("md5", "unknown hash_algo 'md5'; valid: xxh3_64, xxh3_128, sha256"),
        (None, "got NoneType"),
        (np.zeros(2), "got ndarray"),  # once a bare ValueError from `in` on an array
        (torch.zeros(2), "got Tensor"),
        (["xxh3_64"], "got list"),
        (np.array, "unexpected keyword argument 'parent'"),  # callable, but not a hash
        (print, "unexpected keyword argument 'parent'"),
        (_two_positional_only, "unexpected keyword argument 'parent'"),
        (_keyword_only_tokens, "too many positional arguments"),
        (dict, "no readable signature"),
    ],
    ids=[
        "md5",
        "none",
        "array",
        "tensor",
        "list",
        "np.array",
        "print",
        "no-keywords",
        "keyword-only-tokens",
        "dict",
    ],
)
def test_a_bad_hash_algo_is_refused_at_config_time(algo: Any, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        AllocatorConfig(16, hash_algo=algo)
    with pytest.raises(ConfigError, match=match):
        AllocatorConfig.from_dict({"total_count": 16, "hash_algo": algo})
