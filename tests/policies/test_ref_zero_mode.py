"""Ref-zero is a mode of the configuration; ``eviction_policy="ref_zero"`` is its alias.

The engine asks ``AllocatorConfig.cache_unreferenced``: True keeps a released
hashed block cached until the policy evicts it, False drops it at once (and
the policy tracks nothing). The engine's ``PolicyJournal`` drives the
policy's transaction; a policy of the old protocol gets inverse calls.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
from prefixcache.policies import LRUPolicy, RefZeroPolicy

from prefixcache import AllocatorConfig, ConfigError, KVBlockAllocator
from prefixcache.engine.journal import InverseCallJournal, PolicyJournal
from prefixcache.engine.python_engine import PythonEngine
from prefixcache.reference.trace import TraceRequest
from prefixcache.tools.replay import replay

BASE: dict[str, Any] = {"total_count": 8, "block_size_tokens": 2, "device": "cpu"}


@pytest.mark.parametrize("spec", ["ref_zero", {"name": "ref_zero"}, RefZeroPolicy()])
def test_the_ref_zero_policy_is_an_alias_of_the_mode(spec: Any) -> None:
    assert AllocatorConfig(**BASE, eviction_policy=spec).cache_unreferenced is False


def test_every_other_policy_caches_unreferenced_blocks_by_default() -> None:
    assert AllocatorConfig(**BASE).cache_unreferenced is True
    assert AllocatorConfig(**BASE, eviction_policy="arc").cache_unreferenced is True
    assert AllocatorConfig(**BASE, cache_unreferenced=False).eviction_policy == "lru"


def test_the_alias_and_an_explicit_true_contradict() -> None:
    with pytest.raises(ConfigError, match="cache_unreferenced=False"):
        AllocatorConfig(**BASE, eviction_policy="ref_zero", cache_unreferenced=True)
    assert AllocatorConfig(
        **BASE, eviction_policy="ref_zero", cache_unreferenced=False
    ) == AllocatorConfig(**BASE, eviction_policy="ref_zero")


@pytest.mark.parametrize("value", [0, 1, "no"])
def test_a_non_bool_mode_is_refused(value: Any) -> None:
    with pytest.raises(ConfigError, match="cache_unreferenced must be a bool"):
        AllocatorConfig(**BASE, cache_unreferenced=value)


def test_the_mode_survives_a_dict_round_trip() -> None:
    config = AllocatorConfig.from_dict({**BASE, "eviction_policy": "ref_zero"})
    assert config.cache_unreferenced is False
    fields = {name: getattr(config, name) for name in ("total_count", "cache_unreferenced")}
    assert AllocatorConfig.from_dict(fields).cache_unreferenced is False


def _release_one_registered_block(allocator: KVBlockAllocator) -> None:
    blocks = allocator.allocate_memory_blocks(1)
    allocator.register_kv_block_hashes(blocks, [4242])
    allocator.release_memory_blocks(blocks)


@pytest.mark.parametrize("mode", [True, False])
def test_the_engine_takes_the_mode_from_its_argument_not_the_policy(mode: bool) -> None:
    engine = PythonEngine(8, 0, LRUPolicy(), cache_unreferenced=mode)
    assert engine.retains_unreferenced is mode
    engine_default = PythonEngine(8, 0, RefZeroPolicy())  # no mode given: the policy's
    assert engine_default.retains_unreferenced is False


def test_ref_zero_drops_a_released_block_through_the_allocator() -> None:
    allocator = KVBlockAllocator(**BASE, eviction_policy="ref_zero")
    _release_one_registered_block(allocator)
    assert allocator.stats().num_cached == 0
    assert len(allocator.match_prefix([4242])) == 0
    assert len(allocator.policy) == 0


def test_cache_unreferenced_false_with_any_policy_is_ref_zero() -> None:
    allocator = KVBlockAllocator(**BASE, engine="python", cache_unreferenced=False)
    _release_one_registered_block(allocator)
    assert allocator.stats().num_cached == 0
    assert len(allocator.policy) == 0


def test_replay_runs_the_ref_zero_alias() -> None:
    requests = [TraceRequest(0, 64, 1, [1, 2, 3, 4]), TraceRequest(1, 64, 1, [1, 2, 3, 4])]
    assert replay(requests, capacity=8, policy="ref_zero").hit_rate == 0.0
    assert replay(requests, capacity=8, policy="lru").hit_rate == 0.5


# ---------------------------------------------------------------- the journal


class OldProtocolLRU:
    """A policy of the old protocol: the methods, no EvictionPolicy base class."""

    def __init__(self) -> None:
        self.lru = LRUPolicy()

    def insert(self, *args: int) -> None:
        self.lru.insert(*args)

    def discard(self, block_id: int) -> None:
        self.lru.discard(block_id)

    def touch(self, block_id: int, now: int) -> None:
        self.lru.touch(block_id, now)

    def evict(self, num_blocks: int) -> list[int]:
        return self.lru.evict(num_blocks)

    def clear(self) -> None:
        self.lru.clear()

    def __len__(self) -> int:
        return len(self.lru)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self.lru


def test_the_journal_opens_commits_and_aborts_the_policy_transaction() -> None:
    policy = LRUPolicy()
    journal = PolicyJournal(policy, lambda block_id: policy.insert(block_id, 1, 5, 1, 0))
    assert type(journal) is PolicyJournal and not journal.NOTES_VICTIMS
    journal.begin()
    journal.insert(3)
    assert policy.in_transaction and 3 in policy
    journal.commit()
    assert not policy.in_transaction and 3 in policy
    journal.begin()
    journal.touch(3, 9)
    journal.discard(3)
    journal.rollback()
    assert policy.eviction_order() == [3] and not policy.in_transaction
    assert policy.evict(1) == [3]


def test_an_old_protocol_policy_warns_and_is_taken_back_with_inverse_calls() -> None:
    policy = OldProtocolLRU()
    with pytest.warns(DeprecationWarning, match="does not subclass"):
        allocator = KVBlockAllocator(**BASE, eviction_policy=policy)
    journal = PolicyJournal(policy, lambda block_id: policy.insert(block_id, 1, 5, 1, 0))
    assert type(journal) is InverseCallJournal and journal.NOTES_VICTIMS
    journal.begin()
    journal.insert(3)
    journal.commit()
    journal.begin()
    journal.discard(3)
    journal.insert(4)
    journal.rollback()
    assert sorted(policy.lru.eviction_order()) == [3]
    _release_one_registered_block(allocator)  # the allocator drives it too
    assert allocator.stats().num_cached == 1


def test_the_deprecated_protocol_names_import_with_a_warning_and_still_answer() -> None:
    from prefixcache import policies

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        supports_retention = policies.SupportsRetention
        observes_rollbacks = policies.ObservesRollbacks
    assert all(issubclass(w.category, DeprecationWarning) for w in caught) and len(caught) == 2
    assert isinstance(policies.get("priority"), supports_retention)
    assert not isinstance(policies.get("lru"), supports_retention)
    assert not isinstance(policies.get("arc"), observes_rollbacks)
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        _ = policies.Nope  # type: ignore[attr-defined]
