"""HostTier bookkeeping: slots, leaf-only eviction through a policy, pins, retired epochs."""

from __future__ import annotations

import pytest
from prefixcache.policies import LRUPolicy

from prefixcache.engine.events import BlockRemoved, BlockStored
from prefixcache.errors import ConfigError, InvalidArgumentError, InvariantError
from prefixcache.tiers import HostTier


def chain(tier: HostTier, hashes: list[int], parent: int | None = None, epoch: int = 0) -> list:
    slots = []
    for depth, block_hash in enumerate(hashes):
        slots.append(tier.put(block_hash, parent, depth=depth, epoch=epoch))
        parent = block_hash
    return slots


def test_lookup_finds_the_longest_leading_run():
    tier = HostTier(8)
    slots = chain(tier, [11, 12, 13])
    assert tier.lookup([11, 12, 13, 14]) == slots
    assert tier.lookup([12, 13]) == slots[1:]
    assert tier.lookup([99, 11]) == []
    assert 11 in tier and len(tier) == 3 and tier.slot_of(13) == slots[2]
    assert tier.put(12, 11, depth=1) == slots[1]  # already held: same slot, nothing stored
    assert tier.stats().num_stored == 3
    tier.check()


def test_a_chain_is_evicted_from_its_end():
    tier = HostTier(3)
    chain(tier, [1, 2, 3])
    slot = tier.put(50, None, depth=0)  # full: the leaf 3 goes first, not the root
    assert slot is not None and 3 not in tier and {1, 2, 50} <= {1, 2, 50} and 1 in tier
    tier.put(51, None, depth=0)  # next: 2 (now a leaf) or 50, by LRU age; 1 stays a parent
    assert 1 in tier or 2 not in tier
    assert tier.stats().num_evicted == 2
    tier.check()


def test_a_child_stored_before_its_parent_keeps_the_parent_from_eviction():
    tier = HostTier(3)
    tier.put(2, 1, depth=1)
    tier.put(1, None, depth=0)  # 1 arrives with a child already held
    tier.put(9, None, depth=0)
    tier.put(10, None, depth=0)  # evicts a leaf: 2 or 9, never 1 while 2 is held
    assert 1 in tier or 2 not in tier
    tier.check()


def test_pinned_slots_are_never_taken():
    tier = HostTier(2)
    slots = chain(tier, [1]) + chain(tier, [2])
    tier.pin(slots)
    assert tier.put(3, None, depth=0) is None  # everything pinned: nothing to free
    tier.pin(slots[:1])
    tier.unpin(slots)
    assert tier.put(3, None, depth=0) == slots[1]  # slot 0 is still pinned once
    tier.unpin(slots[:1])
    with pytest.raises(InvalidArgumentError):
        tier.unpin(slots[:1])
    tier.check()


def test_touch_keeps_a_slot_longer():
    tier = HostTier(2)
    first = chain(tier, [1])
    chain(tier, [2])
    tier.touch(first)
    tier.put(3, None, depth=0)
    assert 1 in tier and 2 not in tier


def test_retired_epochs_go_first_and_oldest_first():
    tier = HostTier(4)
    chain(tier, [1, 2], epoch=0)
    chain(tier, [3], epoch=1)
    chain(tier, [4], epoch=2)
    tier.retire_epochs_before(2)
    assert tier.lookup([1]) == [] and tier.lookup([4]) != []
    assert tier.put(5, None, depth=0, epoch=2) is not None  # a retired entry made room
    assert 4 in tier and tier.stats().num_evicted == 0 and tier.stats().num_retired == 1
    assert 1 not in tier and 2 in tier and 3 in tier  # the oldest epoch's first entry went
    assert tier.reclaim(1) == 1 and 2 not in tier and 3 in tier and tier.reclaim(0) == 0
    assert tier.reclaim(5) == 1 and tier.reclaim(5) == 0
    assert len(tier) == 2
    tier.retire_epochs_before(1)  # never goes back
    assert tier.lookup([4]) != []
    tier.check()


def test_reclaim_stops_at_a_pinned_slot():
    tier = HostTier(4)
    slots = chain(tier, [1, 2])
    tier.pin(slots[:1])
    tier.retire_epochs_before(1)
    assert tier.reclaim(5) == 0
    tier.unpin(slots[:1])
    assert tier.reclaim(5) == 2
    tier.check()


def test_events_are_cpu_stored_and_removed():
    tier = HostTier(1, events_capacity=8, block_size=4)
    tier.put(1, None, depth=0)
    tier.put(2, None, depth=0)
    tier.retire_epochs_before(1)
    tier.reclaim(1)
    events = tier.take_events()
    assert [type(e) for e in events] == [BlockStored, BlockRemoved, BlockStored, BlockRemoved]
    assert {e.medium for e in events} == {"CPU"}
    assert HostTier(1).take_events() == []


def test_policies_by_name_or_object():
    assert isinstance(HostTier(2, policy=LRUPolicy()).policy, LRUPolicy)
    assert type(HostTier(2, policy="s3fifo").policy).__name__ == "S3FIFOPolicy"
    for bad in ("belady", "ref_zero", "nope", 3):
        with pytest.raises(ConfigError):
            HostTier(2, policy=bad)  # type: ignore[arg-type]
    for bad_count in (0, True, "2"):
        with pytest.raises(ConfigError):
            HostTier(bad_count)  # type: ignore[arg-type]


def test_bad_arguments_change_nothing():
    tier = HostTier(2)
    for kwargs in ({"depth": -1}, {"depth": 0, "epoch": True}):
        with pytest.raises(InvalidArgumentError):
            tier.put(1, None, **kwargs)
    with pytest.raises(InvalidArgumentError):
        tier.touch([0])  # empty slot
    with pytest.raises(InvalidArgumentError):
        tier.pin([5])
    assert len(tier) == 0 and tier.stats().as_dict()["num_used"] == 0


def test_check_reports_a_corrupted_tier():
    tier = HostTier(3)
    chain(tier, [1, 2])
    tier.policy.insert(tier.slot_of(1), 1, 0, 1, 0)  # an inner entry tracked as a leaf
    with pytest.raises(InvariantError, match="leaves"):
        tier.check()
    broken = HostTier(3)
    chain(broken, [1, 2])
    broken._num_children.clear()
    broken._free_slots.append(0)
    broken._slot_of[99] = 0
    problems = broken.find_problems()
    assert len(problems) == 4


@pytest.mark.parametrize("method", ["pin", "touch", "unpin"])
def test_a_refused_slot_list_changes_nothing(method: str) -> None:
    """Issue 28, item 5: pin/touch kept what they did before reaching a bad slot."""
    tier = HostTier(4)
    slots = chain(tier, [11, 12])
    tier.pin([slots[0]])
    before = (dict(tier._pinned), tier.stats(), tier.lookup([11, 12]))
    bad = [slots[1], 99] if method != "unpin" else [slots[0], slots[0]]
    with pytest.raises(InvalidArgumentError):
        getattr(tier, method)(bad)
    assert (dict(tier._pinned), tier.stats(), tier.lookup([11, 12])) == before
    tier.check()
