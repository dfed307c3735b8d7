"""Trace replay through a device pool and a host tier: per-tier hit rates."""

from __future__ import annotations

import pytest

from prefixcache.errors import InvalidArgumentError
from prefixcache.reference.trace import TraceRequest
from prefixcache.tiers.replay import replay_tiered
from prefixcache.tools.replay import replay
from prefixcache.tools.workloads import multi_turn_chats


def test_without_a_host_tier_the_device_hit_rate_is_replays():
    trace = multi_turn_chats(300, seed=2)
    device_only = replay_tiered(trace, 40, 0)
    assert device_only.device_hit_blocks == replay(trace, 40).hit_blocks
    assert device_only.host_hit_blocks == device_only.promoted_blocks == 0


def test_a_host_tier_adds_hits_and_leaves_the_device_tier_as_it_was():
    trace = multi_turn_chats(300, seed=2)
    device_only = replay_tiered(trace, 40, 0)
    tiered = replay_tiered(trace, 40, 160)
    assert tiered.device_hit_blocks == device_only.device_hit_blocks  # promotion == recompute
    assert tiered.host_hit_blocks > 0 and tiered.hit_rate > device_only.hit_rate
    assert tiered.promoted_blocks == tiered.host_hit_blocks
    assert tiered.promoted_per_request == tiered.promoted_blocks / 300
    assert tiered.demoted_blocks > 0


def test_an_empty_trace_and_bad_counts():
    empty = replay_tiered([], 4, 4)
    assert (empty.hit_rate, empty.device_hit_rate, empty.promoted_per_request) == (0.0, 0.0, 0.0)
    request = [TraceRequest(0, 512, 1, (1,))]
    for capacity, host in ((-1, 0), (0, True)):
        with pytest.raises(InvalidArgumentError):
            replay_tiered(request, capacity, host)


def test_evict_demotes_what_it_evicts(make_loop):
    loop = make_loop(9, 8)
    loop.admit("a", list(range(12)))
    loop.requests.finish("a")
    assert loop.tiered.evict(0) == 0
    assert loop.tiered.evict(2) == 2
    assert loop.tiered.stats().num_demoted_blocks == 2 and len(loop.host) == 2
    assert loop.tiered.evict(5) == 1 and loop.tiered.evict(1) == 0
    loop.copy()
    assert loop.admit("a2", list(range(12))) == 12  # all three back from the host tier
    with pytest.raises(InvalidArgumentError):
        loop.tiered.evict(-1)
