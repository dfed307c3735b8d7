"""Eviction order of ``protected_lru``: reused prefixes outlive one-off ones, across evictions.

The shared laws run over every built-in policy in ``test_policy_orders.py``
and ``test_contract.py``; this file checks what makes this one different.
"""

from __future__ import annotations

import pytest
import torch
from prefixcache.policies import EvictionPolicy, ProtectedLRUPolicy

from prefixcache import KVBlockAllocator
from prefixcache.reference.trace import TraceRequest
from prefixcache.tools.replay import replay


def insert(policy, block_id: int, last_access: int, num_accesses: int = 1, block_hash=None) -> None:
    """Insert at depth 0, with the block ID times 1000 as the hash unless given."""
    block_hash = block_id * 1000 if block_hash is None else block_hash
    policy.insert(block_id, block_hash, last_access, num_accesses, 0)


@pytest.mark.parametrize("history_capacity", [-1, 1.5, True, "10"])
def test_bad_history_capacity_is_refused(history_capacity) -> None:
    with pytest.raises(ValueError, match="history_capacity"):
        ProtectedLRUPolicy(history_capacity=history_capacity)


def test_a_reused_block_survives_a_scan_of_one_hit_blocks() -> None:
    policy = ProtectedLRUPolicy()
    insert(policy, 1, last_access=1, num_accesses=2)
    for block_id in range(2, 12):
        insert(policy, block_id, last_access=block_id)
    assert policy.evict(10) == list(range(2, 12))
    assert policy.evict(1) == [1]


def test_lru_order_within_each_class() -> None:
    policy = ProtectedLRUPolicy()
    insert(policy, 1, last_access=5, num_accesses=3)
    insert(policy, 2, last_access=2, num_accesses=2)
    insert(policy, 3, last_access=9)
    insert(policy, 4, last_access=7)
    assert policy.eviction_order() == [4, 3, 2, 1]
    assert policy.evict(4) == [4, 3, 2, 1]


def test_use_count_outlives_eviction_by_hash() -> None:
    policy = ProtectedLRUPolicy()
    insert(policy, 1, last_access=1, block_hash=77)
    assert policy.evict(1) == [1]
    assert policy.remembered_uses(77) == 1
    insert(policy, 2, last_access=2, block_hash=77)  # same prefix, recomputed in another block
    insert(policy, 3, last_access=3)
    assert policy.is_protected(2)
    assert not policy.is_protected(3)
    assert policy.evict(1) == [3]
    assert policy.remembered_uses(77) == 0  # taken back from the history while tracked


def test_without_history_a_returning_hash_starts_over() -> None:
    policy = ProtectedLRUPolicy(history_capacity=0)
    insert(policy, 1, last_access=1, block_hash=77)
    policy.evict(1)
    insert(policy, 2, last_access=2, block_hash=77)
    assert not policy.is_protected(2)


def test_history_keeps_only_the_most_recently_evicted_hashes() -> None:
    policy = ProtectedLRUPolicy(history_capacity=2)
    for block_id in (1, 2, 3):
        insert(policy, block_id, last_access=block_id)
    assert policy.evict(3) == [1, 2, 3]
    assert [policy.remembered_uses(h) for h in (1000, 2000, 3000)] == [0, 1, 1]


def test_a_hit_and_release_counts_the_hit_once() -> None:
    policy = ProtectedLRUPolicy()
    insert(policy, 1, last_access=1, block_hash=77)
    policy.discard(1)  # it gained a child: the allocator re-inserts it unchanged later
    insert(policy, 1, last_access=1, block_hash=77)
    assert not policy.is_protected(1)
    policy.discard(1)  # a prefix hit: the release re-inserts it with one more hand-out
    insert(policy, 1, last_access=4, num_accesses=2, block_hash=77)
    assert policy.is_protected(1)
    policy.evict(1)
    assert policy.remembered_uses(77) == 2


def test_a_recycled_block_id_does_not_inherit_the_old_stay() -> None:
    policy = ProtectedLRUPolicy()
    insert(policy, 1, last_access=1, num_accesses=3, block_hash=77)
    policy.discard(1)
    insert(policy, 1, last_access=2, block_hash=88)  # the ID now holds another prefix
    assert not policy.is_protected(1)


def test_a_victim_put_back_by_abort_keeps_its_class_and_place() -> None:
    policy = ProtectedLRUPolicy()
    insert(policy, 1, last_access=1, block_hash=77)
    insert(policy, 2, last_access=2)
    policy.begin()
    assert policy.evict(1) == [1]
    policy.abort()  # a failed engine call
    assert not policy.is_protected(1)
    assert policy.eviction_order() == [1, 2]
    assert policy.remembered_uses(77) == 0


def test_a_victim_inserted_again_outside_a_transaction_is_a_returning_prefix() -> None:
    policy = ProtectedLRUPolicy()
    insert(policy, 1, last_access=1, block_hash=77)
    insert(policy, 2, last_access=2)
    assert policy.evict(1) == [1]
    insert(policy, 1, last_access=1, block_hash=77)  # computed again: its earlier use counts
    assert policy.is_protected(1)
    assert policy.eviction_order() == [2, 1]


def test_touch_protects_and_refreshes() -> None:
    policy = ProtectedLRUPolicy()
    insert(policy, 1, last_access=1)
    insert(policy, 2, last_access=2)
    policy.touch(1, now=3)
    assert policy.is_protected(1)
    assert policy.evict(2) == [2, 1]
    with pytest.raises(KeyError):
        policy.touch(1, now=4)


def test_many_discards_keep_the_heaps_bounded_and_the_order_right() -> None:
    policy = ProtectedLRUPolicy()
    for round_ in range(200):
        insert(policy, 1, last_access=round_, num_accesses=1 + round_ % 2, block_hash=5)
        policy.discard(1)
    insert(policy, 1, last_access=500, block_hash=5)
    insert(policy, 2, last_access=1, num_accesses=2)
    assert sum(len(heap) for heap in policy._heaps) < 200
    assert policy.evict(2) == [1, 2]


def test_replay_keeps_a_reused_prefix_through_one_off_prompts_where_lru_does_not() -> None:
    hot = TraceRequest(0, 4 * 512, 1, (1, 2, 3, 4))
    one_offs = [TraceRequest(0, 4 * 512, 1, tuple(range(10 * i, 10 * i + 4))) for i in range(1, 5)]
    requests = [hot, hot, *one_offs, hot]
    protected = replay(requests, capacity=8, policy="protected_lru")
    lru = replay(requests, capacity=8, policy="lru")
    assert protected.hit_blocks == 8  # the second and the last request hit all four blocks
    assert lru.hit_blocks == 4


def test_on_register_keeps_a_returning_hash_at_the_recent_end_of_the_history() -> None:
    policy = ProtectedLRUPolicy(history_capacity=2)
    for block_id in (1, 2):
        insert(policy, block_id, last_access=block_id)
    assert policy.evict(2) == [1, 2]  # history: 1000, 2000
    policy.on_register([1000, 999], first_depth=0)  # 1000 computed again; 999 is new
    insert(policy, 3, last_access=3)
    assert policy.evict(1) == [3]  # history overflows: 2000 goes, not the returned 1000
    assert [policy.remembered_uses(h) for h in (1000, 2000, 999)] == [1, 0, 0]


def _returning_prefix_is_protected(policy: ProtectedLRUPolicy, observe: bool) -> bool:
    """A prefix used twice, evicted, then computed again inside a longer request.

    Before its block is a leaf again, four more hashes are evicted after it,
    more than a history of four keeps unless the return refreshed it. Returns
    whether the prefix is protected once its block is a leaf again.
    ``observe=False`` hides the registration hook from the allocator (a
    wrapper without ``on_register``), as before the hook.
    """
    allocator = KVBlockAllocator(
        total_count=16,
        block_size_tokens=2,
        device="cpu",
        eviction_policy=policy if observe else _WithoutHook(policy),
    )

    def compute(hashes: list[int]) -> torch.Tensor:
        ids = allocator.allocate_memory_blocks(len(hashes))
        allocator.register_kv_block_hashes(ids, hashes)
        allocator.release_memory_blocks(ids)
        return ids

    prefix, one_off, other = 100, 200, 300
    compute([prefix])
    allocator.release_memory_blocks(allocator.match_prefix([prefix], acquire=True))  # a reuse
    allocator.evict_cached_blocks(1)  # history: prefix (2 uses)
    compute([one_off])
    allocator.evict_cached_blocks(1)  # history: prefix, one_off
    compute([other])
    longer = compute([prefix, 101, 102])  # the prefix returns as an inner block
    allocator.evict_cached_blocks(1)  # `other`, the oldest leaf
    allocator.evict_cached_blocks(2)  # 102, then 101: the history overflows, the prefix is a leaf
    prefix_id = int(longer[0])
    assert prefix_id in policy
    return policy.is_protected(prefix_id)


class _WithoutHook(EvictionPolicy):
    """Delegates to ``policy``, transactions included, but keeps the default ``on_register``."""

    def __init__(self, policy: ProtectedLRUPolicy) -> None:
        self._policy = policy

    def insert(
        self, block_id: int, block_hash: int, last_access: int, num_accesses: int, depth: int
    ) -> None:
        self._policy.insert(block_id, block_hash, last_access, num_accesses, depth)

    def discard(self, block_id: int) -> None:
        self._policy.discard(block_id)

    def touch(self, block_id: int, now: int) -> None:
        self._policy.touch(block_id, now)

    def evict(self, num_blocks: int) -> list[int]:
        return self._policy.evict(num_blocks)

    def clear(self) -> None:
        self._policy.clear()

    def begin(self) -> None:
        self._policy.begin()

    def commit(self) -> None:
        self._policy.commit()

    def abort(self) -> None:
        self._policy.abort()

    def __len__(self) -> int:
        return len(self._policy)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._policy


def test_a_reused_prefix_recomputed_inside_a_longer_request_comes_back_protected() -> None:
    assert _returning_prefix_is_protected(ProtectedLRUPolicy(history_capacity=4), observe=True)


def test_without_the_hook_the_same_prefix_is_forgotten_by_then() -> None:
    assert not _returning_prefix_is_protected(ProtectedLRUPolicy(history_capacity=4), observe=False)
