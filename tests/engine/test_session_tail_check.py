"""The per-session check (issue 27): a turn trusts its remembered chain by its tail's
registration generation, in O(1), and looks up only what was lost.

Under eviction pressure the allocator's structure key changes at every eviction
anywhere, so a session checks its own chain: an unchanged generation on the tail
vouches for every ancestor (the leaf rule), a binary search finds the blocks still
held otherwise, and only the hashes after them are looked up (DESIGN.md,
"Sessions"). Each test runs on both engines and every session object, and checks
hits and rows against the registry itself (``lookup`` of the whole conversation,
what ``admit_request`` matches): a check that trusted too much (``hash_of`` on the
tail alone, no generation compare, no epoch) hands out a wrong row.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from prefixcache import KVBlockAllocator
from prefixcache.engine.sessions import Session
from prefixcache.testing.engine_setup import (
    SESSION_KINDS,
    cache_chain,
    open_session,
    small_allocator,
)

BLOCK = 2


def engine_of(kind: str) -> str:
    return "python" if kind == "python" else "native"


def expected_row(allocator: KVBlockAllocator, conversation: list[int]) -> list[int]:
    """The blocks a new request over the whole conversation would hit (read-only)."""
    hashes = allocator.hash_tokens(conversation)[: (len(conversation) - 1) // BLOCK]
    return lookup(allocator, hashes)


def lookup(allocator: KVBlockAllocator, hashes: list[int]) -> list[int]:
    """The engine's lookup, past any counting wrapper on the instance."""
    engine = allocator._engine
    return [int(block_id) for block_id in type(engine).lookup(engine, hashes).tolist()]


class Lookups:
    """Hashes a session looks up: the native session counts them, the Python one's engine
    lookups are counted here."""

    def __init__(self, allocator: KVBlockAllocator, session: Any, monkeypatch: Any) -> None:
        self.session, self.counted = session, 0
        if not isinstance(session, Session):
            self.counted = -session.num_looked_up  # counted since the session opened
        else:
            lookup = allocator._engine.lookup

            def counting(hashes: list[int]) -> Any:
                self.counted += len(hashes)
                return lookup(hashes)

            monkeypatch.setattr(allocator._engine, "lookup", counting)

    def total(self) -> int:
        if isinstance(self.session, Session):
            return self.counted
        count: int = self.session.num_looked_up
        return count + self.counted


def admit_checked(
    allocator: KVBlockAllocator, session: Any, conversation: list[int], new: list[int]
) -> int:
    """Admit ``new``: the hits and row equal the registry's match of the whole conversation."""
    conversation.extend(new)
    want = expected_row(allocator, conversation)
    assert session.admit(new) == len(want)
    assert session.block_ids.tolist()[: len(want)] == want
    return len(want)


@pytest.mark.parametrize("kind", SESSION_KINDS)
def test_a_chain_recomputed_with_its_tail_on_the_old_id_is_looked_up_again(kind: str) -> None:
    """The chain is evicted, then registered again into other blocks, its tail landing on
    the tail's old ID under the same hash: ``hash_of(tail)`` matches, the ancestors moved.
    The tail's generation changed, so the session finds the new row."""
    allocator = small_allocator(engine_of(kind), total_count=16)  # 15 usable blocks
    session, conversation = open_session(allocator, kind), [1, 2, 3, 4, 5, 6, 7]
    session.admit(conversation)
    old = session.block_ids.tolist()[:3]
    session.release()
    assert allocator.evict_cached_blocks(3) == 3  # the whole chain: every block is free
    free = allocator.allocate_block_ids(allocator.stats().num_free)
    others = [block_id for block_id in free.tolist() if block_id not in old]
    moved = [others[0], others[1], old[2]]  # the tail's old ID, the ancestors elsewhere
    hashes = allocator.hash_tokens(conversation)[:3]
    allocator.register_kv_block_hashes(np.array(moved, dtype=np.int32), hashes)
    allocator.release_request(free)
    assert allocator._engine.hash_of(old[2]) == hashes[2]  # what a hash check would trust
    assert admit_checked(allocator, session, conversation, [8]) == 3
    assert session.block_ids.tolist()[:3] == moved
    session.release()
    allocator.check_invariants()


@pytest.mark.parametrize("kind", SESSION_KINDS)
def test_a_lost_tail_costs_the_lost_blocks_and_an_intact_one_nothing(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Evictions elsewhere change the structure key but not the session's tail: only the new
    blocks are looked up. Its last blocks evicted: the lost ones and the new ones."""
    allocator = small_allocator(engine_of(kind), total_count=64)
    other = cache_chain(allocator, [101, 102, 103, 104])  # older: LRU evicts it first
    session, conversation = open_session(allocator, kind), list(range(41))
    session.admit(conversation)  # 20 full blocks
    session.release()
    lookups = Lookups(allocator, session, monkeypatch)
    assert allocator.evict_cached_blocks(2) == 2  # the other chain's last two
    assert lookup(allocator, [101, 102, 103, 104]) == other[:2]
    assert admit_checked(allocator, session, conversation, [41, 42, 43, 44]) == 20
    assert lookups.total() == 2  # the new full blocks only
    row = session.block_ids.tolist()
    session.release()
    assert allocator.evict_blocks(np.array(row[15:22], dtype=np.int32)) == 7  # the tail's
    assert admit_checked(allocator, session, conversation, [45, 46, 47, 48]) == 15
    assert lookups.total() == 2 + 7 + 2  # the 7 lost, the 2 new
    session.release()
    allocator.check_invariants()


@pytest.mark.parametrize("kind", SESSION_KINDS)
def test_defragmentation_and_reset_are_not_trusted_to_the_tail(kind: str) -> None:
    """Relocation moves an ancestor and leaves the tail (its generation unchanged): the leaf
    rule says nothing about moves, so the layout epoch sends the session to a full lookup.
    After a reset the chain registered anew is found again."""
    allocator = small_allocator(engine_of(kind), total_count=32)  # lowest free IDs first
    session, conversation = open_session(allocator, kind), [1, 2, 3, 4, 5]
    held = allocator.allocate_block_ids(3)
    session.admit(conversation)  # blocks 3, 4 (and 5, freed at release)
    session.release()
    allocator.release_request(held)
    admit_checked(allocator, session, conversation, [6, 7, 8, 9])
    row = session.block_ids.tolist()[:4]  # [3, 4, 2, 1]: the tail below an ancestor
    session.release()
    plan = allocator.plan_defragment()
    assert row[1] in plan.sources.tolist() and row[3] not in plan.sources.tolist()
    allocator.apply_defragment(plan)
    admit_checked(allocator, session, conversation, [10, 11])
    assert session.block_ids.tolist()[:4] != row
    session.release()
    allocator.reset()
    cache_chain(allocator, allocator.hash_tokens(conversation)[:4])  # the same hashes, anew
    admit_checked(allocator, session, conversation, [12])
    session.release()
    allocator.check_invariants()


@pytest.mark.parametrize("engine", ["python", "native"])
def test_a_rolled_back_call_leaves_the_chain_trusted_only_where_it_is(
    engine: str, flaky: Any, injected_fault: Any
) -> None:
    """A call that evicted the session's tail and failed is rolled back (the native engine
    restores its checkpoint, registration counter included): the tail is the same
    registration again. A later committed eviction and a recomputation into the tail's old
    ID are then seen; generations handed out by the failed call are never trusted."""
    if engine == "native":
        small_allocator("native")  # skips where the extension is not built
    policy, allocator = flaky(total_count=12, engine=engine)  # a Python policy object
    session, conversation = open_session(allocator, "python"), [1, 2, 3, 4, 5, 6, 7]
    session.admit(conversation)
    old = session.block_ids.tolist()[:3]
    session.release()
    policy.fail_at, policy.calls = (
        {"insert": 1},
        {},
    )  # the tail's eviction makes its parent a leaf: raises
    with pytest.raises(injected_fault):
        allocator.allocate_block_ids(allocator.stats().num_free + 2)
    policy.fail_at = {}
    allocator.check_invariants()
    admit_checked(allocator, session, conversation, [8])
    assert session.block_ids.tolist()[:3] == old
    session.release()
    assert allocator.evict_cached_blocks(4) == 4
    free = allocator.allocate_block_ids(allocator.stats().num_free)
    others = [block_id for block_id in free.tolist() if block_id not in old]
    hashes = allocator.hash_tokens(conversation)[:4]
    moved = [others[0], others[1], old[2], others[2]]
    allocator.register_kv_block_hashes(np.array(moved, dtype=np.int32), hashes)
    allocator.release_request(free)
    policy.fail_at, policy.calls = {"insert": 1}, {}
    with pytest.raises(injected_fault):  # evicts the moved tail, then fails: rolled back
        allocator.allocate_block_ids(allocator.stats().num_free + 2)
    policy.fail_at = {}
    admit_checked(allocator, session, conversation, [9])
    assert session.block_ids.tolist()[:4] == moved
    session.release()
    allocator.check_invariants()
