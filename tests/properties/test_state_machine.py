"""Stateful property test: the allocator against a model of who holds which reference.

The machine drives random programs of allocate, serve-a-prompt (match +
acquire + allocate + register), release with duplicates (plain and in free
groups), pause, resume, acquire, touch, evict and reset, plus calls that must
fail. After every step it checks the six invariants of DESIGN.md:
``check_invariants()`` covers the partition, the registry maps, ancestor
closure and the policy's tracked set; the machine adds the model's reference
counts (invariant 2), the correctness of every prefix hit, the rule that
a failing call changes nothing (invariant 6), and the paused budget: blocks
holding any paused reference never exceed ``paused_count`` (a pause that would
is refused, unchanged), whatever releases follow.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from prefixcache import (
    BudgetExceededError,
    KVBlockAllocator,
    PrefixCacheError,
    ReferenceCountError,
    policies,
)
from prefixcache.engine.events import AllBlocksCleared, BlockRemoved, BlockStored
from prefixcache.testing import ReferenceModel, changed_fields, state_digest

pytestmark = pytest.mark.slow  # long programs: the full suite (--full)

TOTAL_COUNT = 13
PAUSED_COUNT = 3
MASK_63 = (1 << 63) - 1

prompts = st.lists(st.integers(0, 2), min_size=1, max_size=5)
"""A prompt as one small symbol per block, so that prompts share prefixes often."""


def chain_hashes(prompt: list[int]) -> list[int]:
    """Chained positive hashes of a prompt's blocks (independent of the library's hashing)."""
    hashes, parent = [], 17
    for symbol in prompt:
        parent = (hash((parent, symbol)) & MASK_63) | 1
        hashes.append(parent)
    return hashes


class AllocatorMachine(RuleBasedStateMachine):
    """One allocator, and the references the test holds on it (the kit's reference model)."""

    policy_name = "lru"

    def __init__(self) -> None:
        super().__init__()
        self.allocator = KVBlockAllocator(
            total_count=TOTAL_COUNT,
            paused_count=PAUSED_COUNT,
            eviction_policy=self.policy_name,
            device="cpu",
            kv_events_capacity=10_000,
        )
        self.resident_by_events: set[int] = set()  # hashes replayed from KV events
        self.model = ReferenceModel()
        # The model's lists, one entry per reference held, and what it saw registered.
        self.active, self.paused = self.model.active, self.model.paused

    @property
    def block_of_hash(self) -> dict[int, int]:
        return self.model.block_of_hash

    # ----------------------------------------------------------------- helpers

    def _take(self, data: st.DataObject, pool: list[int], label: str) -> list[int]:
        """Draw a sub-multiset of held references out of ``pool`` (removing them)."""
        if not pool:
            return []
        picks = data.draw(
            st.lists(st.integers(0, len(pool) - 1), unique=True, max_size=len(pool)), label=label
        )
        return self.model.take(pool, picks)

    def _expect_failure(self, call, error: type[Exception]) -> None:
        before = state_digest(self.allocator)
        with pytest.raises(error):
            call()
        after = state_digest(self.allocator)
        assert after == before, changed_fields(before, after)

    # ----------------------------------------------------------------- rules

    @initialize()
    def start_clean(self) -> None:
        self.allocator.check_invariants()

    @rule(num_blocks=st.integers(0, 6))
    def allocate(self, num_blocks: int) -> None:
        possible = self.allocator.is_memory_available(num_blocks)
        ids = self.allocator.allocate_memory_blocks(num_blocks)
        if not possible:
            assert ids is None
            return
        assert ids is not None and len(set(ids.tolist())) == num_blocks
        self.model.handed_out(ids.tolist())

    @rule(prompt=prompts, skip_match=st.booleans())
    def serve_prompt(self, prompt: list[int], skip_match: bool) -> None:
        """Serve a prompt; ``skip_match`` models a concurrent twin that computed it anew."""
        hashes = chain_hashes(prompt)
        matched = [] if skip_match else self.allocator.match_prefix(hashes, acquire=True).tolist()
        for block_hash, block_id in zip(hashes, matched, strict=False):
            assert self.block_of_hash.get(block_hash) == block_id, "prefix hit served wrong block"
        self.active.extend(matched)
        rest = len(hashes) - len(matched)
        new_ids = self.allocator.allocate_memory_blocks(rest)
        if new_ids is None:
            return
        self.model.handed_out(new_ids.tolist())
        parent = hashes[len(matched) - 1] if matched else None
        accepted = self.allocator.register_kv_block_hashes(
            new_ids, hashes[len(matched) :], parent_hash=parent
        )
        for block_id, block_hash, ok in zip(
            new_ids.tolist(), hashes[len(matched) :], accepted.tolist(), strict=True
        ):
            holder = self.allocator.registry.block_of(block_hash)
            if ok:
                assert holder == block_id
                self.block_of_hash[block_hash] = block_id
            else:  # refused: an earlier registration the model saw still holds the hash
                assert holder is not None and self.block_of_hash.get(block_hash) == holder

    @rule(data=st.data(), grouped=st.booleans())
    def release(self, data: st.DataObject, grouped: bool) -> None:
        taken = self._take(data, self.active, "released")
        if grouped:
            half = len(taken) // 2
            with self.allocator.free_group():
                self.allocator.release_memory_blocks(taken[:half])
                self.allocator.release_memory_blocks(taken[half:])
        else:
            self.allocator.release_memory_blocks(taken)
        self._forget_dropped_hashes()

    @rule(data=st.data())
    def release_paused(self, data: st.DataObject) -> None:
        taken = self._take(data, self.paused, "released paused")
        self.allocator.release_memory_blocks(taken, paused=True)
        self._forget_dropped_hashes()

    def _forget_dropped_hashes(self) -> None:
        """Drop model entries the allocator no longer holds (ref-zero drops, detached chains).

        The model only ever loses entries this way; a hit on an entry it lost
        would fail the check in :meth:`serve_prompt`.
        """
        registry = self.allocator.registry
        self.model.block_of_hash = {
            h: b for h, b in self.block_of_hash.items() if registry.block_of(h) == b
        }

    @rule(data=st.data())
    def pause(self, data: st.DataObject) -> None:
        taken = self._take(data, self.active, "paused")
        if self.model.pause_exceeds(taken, PAUSED_COUNT):
            self.active.extend(taken)
            self._expect_failure(lambda: self.allocator.pause(taken), BudgetExceededError)
            return
        self.allocator.pause(taken)
        self.paused.extend(taken)

    @rule(data=st.data())
    def resume(self, data: st.DataObject) -> None:
        taken = self._take(data, self.paused, "resumed")
        if self.model.resume_exceeds(taken, self.allocator.active_count):
            self.paused.extend(taken)
            self._expect_failure(lambda: self.allocator.resume(taken), BudgetExceededError)
            return
        self.allocator.resume(taken)
        self.active.extend(taken)

    @rule(data=st.data())
    def acquire_held(self, data: st.DataObject) -> None:
        if not self.active:
            return
        block_id = data.draw(st.sampled_from(self.active), label="acquired")
        self.allocator.acquire_blocks([block_id, block_id])
        self.active.extend([block_id, block_id])

    @rule(data=st.data())
    def touch(self, data: st.DataObject) -> None:
        if self.active:
            self.allocator.update_timestamps(data.draw(st.lists(st.sampled_from(self.active))))

    @rule(num_blocks=st.integers(0, 4))
    def evict(self, num_blocks: int) -> None:
        cached = self.allocator.get_evictable_block_count()
        freed = self.allocator.evict_cached_blocks(num_blocks)
        assert min(num_blocks, cached) <= freed <= cached

    @rule()
    def reset(self) -> None:
        self.allocator.reset()
        self.model.reset()

    # ----------------------------------------------------------------- calls that must fail

    @rule(data=st.data())
    def over_release(self, data: st.DataObject) -> None:
        block_id = data.draw(st.integers(0, TOTAL_COUNT - 2), label="over-released")
        extra = self.active.count(block_id) + 1
        self._expect_failure(
            lambda: self.allocator.release_memory_blocks([block_id] * extra), ReferenceCountError
        )

    @precondition(lambda self: self.active)
    @rule(data=st.data())
    def batch_with_one_bad_id(self, data: st.DataObject) -> None:
        good = data.draw(st.lists(st.sampled_from(self.active), max_size=3))
        bad = data.draw(st.sampled_from([-1, TOTAL_COUNT - 1, TOTAL_COUNT, 10**9]))
        self._expect_failure(
            lambda: self.allocator.release_memory_blocks([*good, bad]), PrefixCacheError
        )

    @rule(data=st.data())
    def over_resume(self, data: st.DataObject) -> None:
        block_id = data.draw(st.integers(0, TOTAL_COUNT - 2), label="over-resumed")
        extra = self.paused.count(block_id) + 1
        self._expect_failure(lambda: self.allocator.resume([block_id] * extra), ReferenceCountError)

    # ----------------------------------------------------------------- invariants

    @invariant()
    def invariants_hold(self) -> None:
        self.allocator.check_invariants()

    @invariant()
    def reference_counts_match_model(self) -> None:
        self.model.check(self.allocator)

    @invariant()
    def events_replay_to_the_resident_hashes(self) -> None:
        """A router that applies the events in order knows exactly what is resident."""
        for event in self.allocator.take_events():
            if isinstance(event, BlockStored):
                assert not self.resident_by_events & set(event.block_hashes), "stored twice"
                self.resident_by_events.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                assert set(event.block_hashes) <= self.resident_by_events, "removed unknown"
                self.resident_by_events.difference_update(event.block_hashes)
            else:
                assert isinstance(event, AllBlocksCleared)
                self.resident_by_events.clear()
        assert self.resident_by_events == {h for h, _ in self.allocator.registry.items()}

    @invariant()
    def paused_holders_stay_within_the_budget(self) -> None:
        """Issue 15 item 3: blocks holding paused references never exceed ``paused_count``."""
        holders = len(set(self.paused))
        assert holders <= PAUSED_COUNT, f"{holders} blocks hold paused references"
        assert self.allocator.get_paused_avail() == PAUSED_COUNT - holders
        assert self.allocator.get_paused_used() <= holders

    @invariant()
    def partition_adds_up(self) -> None:
        stats = self.allocator.stats()
        assert stats.num_free + stats.num_active + stats.num_paused + stats.num_cached == (
            stats.num_usable
        )
        assert np.all(self.allocator.pool.free_ids() < self.allocator.num_usable)


STATEFUL_POLICIES = [name for name in policies.available() if name != "belady"]


def _machine_for(policy_name: str) -> type[AllocatorMachine]:
    return type(
        f"AllocatorMachine_{policy_name}", (AllocatorMachine,), {"policy_name": policy_name}
    )


@pytest.mark.parametrize("policy_name", STATEFUL_POLICIES)
def test_allocator_state_machine(policy_name: str) -> None:
    _machine_for(policy_name).TestCase().runTest()
