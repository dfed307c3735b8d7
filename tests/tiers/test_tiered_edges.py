"""TieredCache corner cases: re-registration, chains begun elsewhere, a host tier with no room."""

from __future__ import annotations

import pytest

from prefixcache import InvalidArgumentError
from prefixcache.tiers import HostTier

BLOCK = 4


def prompt(seed: int, num_blocks: int) -> list[int]:
    return [seed * 1000 + i for i in range(num_blocks * BLOCK)]


def test_a_demotion_is_skipped_when_every_host_slot_is_being_read(make_loop):
    loop = make_loop(3, 1)  # 2 usable device blocks, 1 host slot
    loop.admit("a", prompt(1, 1))
    loop.requests.finish("a")
    loop.admit("b", prompt(2, 2))  # evicts a's block: demoted into the only slot
    loop.requests.finish("b")
    demoted = loop.tiered.stats().num_demoted_blocks
    assert loop.admit("a2", prompt(1, 1)) == BLOCK  # promoted; b's leaf evicted meanwhile
    assert loop.tiered.stats().num_demoted_blocks == demoted  # its slot was pinned: no room
    loop.tiered.check()


def test_a_hash_registered_again_elsewhere_is_not_demoted(make_loop):
    loop = make_loop(5, 4)
    tiered, allocator = loop.tiered, loop.allocator
    (first,) = tiered.allocate(1).tolist()
    tiered.register([first], [777])
    tiered.release([first])
    (second,) = tiered.allocate(1).tolist()  # the free stack's top, not the cached block
    assert allocator.evict_cached_blocks(1) == 1  # 777 leaves the device, its block is free
    tiered.register([second], [777])  # computed again in another block
    assert first in tiered.allocate(1).tolist()
    assert tiered.stats().num_demoted_blocks == 0 and 777 not in loop.host
    tiered.check()


def test_registering_a_block_again_and_chains_begun_elsewhere(make_loop):
    loop = make_loop(5, 4)
    tiered, allocator = loop.tiered, loop.allocator
    ids = tiered.allocate(2)
    allocator.register_kv_block_hashes(ids[:1], [10])  # not through the tier
    tiered.register(ids[1:], [11], parent_hash=10)  # depth unknown: counted from 0
    tiered.register(ids[1:], [11], parent_hash=10)  # idempotent
    tiered.release(ids)
    tiered.reclaim_per_call = 0
    allocator.evict_cached_blocks(2)
    tiered.allocate(2)
    assert 11 in loop.host and 10 not in loop.host
    tiered.check()


def test_a_parent_with_two_children_stays_until_both_are_gone():
    tier = HostTier(3)
    tier.put(1, None, depth=0)
    tier.put(2, 1, depth=1)
    tier.put(3, 1, depth=1)
    tier.put(4, None, depth=0)  # evicts a child; the parent still has the other
    assert 1 in tier and (2 in tier) != (3 in tier)
    tier.put(5, None, depth=0)  # the other child (or 4): never the parent first
    assert 1 in tier or (2 not in tier and 3 not in tier)
    tier.check()


def test_finish_and_epoch_of_refuse_an_unknown_request(make_loop):
    loop = make_loop(5, 2)
    loop.admit("a", prompt(1, 2))
    before = (loop.requests.hashes_of("a"), loop.requests.counters(), loop.tiered.stats())
    for call in (loop.requests.finish, loop.requests.epoch_of):
        with pytest.raises(InvalidArgumentError, match="request 'b' is unknown"):
            call("b")
    assert (loop.requests.hashes_of("a"), loop.requests.counters(), loop.tiered.stats()) == before
    loop.requests.finish("a")
    with pytest.raises(InvalidArgumentError, match="request 'a' is unknown"):
        loop.requests.finish("a")  # finished: forgotten
    loop.tiered.check()
