"""A block evicted from the device comes back from the host tier with the K/V it had."""

from __future__ import annotations

import random

import pytest
import torch

from prefixcache.engine.events import BlockRemoved, BlockStored
from prefixcache.errors import ConfigError
from prefixcache.tiers import HostTier, TieredCache

BLOCK = 4


def prompt(seed: int, num_blocks: int) -> list[int]:
    return [seed * 1000 + i for i in range(num_blocks * BLOCK)]


@pytest.mark.parametrize("batched", [True, False])
def test_an_evicted_prefix_is_promoted_with_the_kv_it_was_demoted_with(make_loop, batched):
    loop = make_loop(9, 32, batched=batched)  # 8 usable device blocks
    a, b = prompt(1, 6), prompt(2, 6)
    assert loop.admit("a", a) == 0
    loop.requests.finish("a")
    assert loop.admit("b", b) == 0  # evicts most of a's cached chain: demoted to the host
    loop.requests.finish("b")
    stats = loop.tiered.stats()
    assert stats.num_demoted_blocks >= 4
    before = loop.num_computed_blocks
    cached = loop.admit("a2", a)  # device hits, then host hits; check() compares the K/V
    assert cached == len(a)
    assert loop.num_computed_blocks == before  # nothing recomputed
    stats = loop.tiered.stats()
    assert stats.num_promoted_blocks == stats.host.num_hit_blocks >= 4
    assert loop.transfer.num_promoted == stats.num_promoted_blocks
    loop.tiered.check()


def engines() -> list[str]:
    from prefixcache.engine.native_engine import native_available

    return ["python", "native"] if native_available() else ["python"]


@pytest.mark.parametrize("engine", engines())
def test_a_random_workload_always_reads_the_kv_of_its_hashes(make_loop, engine):
    rng = random.Random(7)
    loop = make_loop(13, 12, engine=engine)
    family = [prompt(seed, rng.randint(1, 5)) for seed in range(10)]
    running: list[str] = []
    for step in range(200):
        if running and (len(running) > 2 or rng.random() < 0.4):
            loop.requests.finish(running.pop(rng.randrange(len(running))))
            continue
        tokens = rng.choice(family) + [7] * rng.randint(0, 3)  # a partial block sometimes
        name = f"r{step}"
        admission = loop.requests.admit(name, tokens)
        if admission is None:
            continue
        loop.block_ids[name] = admission.block_ids.tolist()
        loop.copy()
        loop.compute(name, admission.num_cached_tokens // BLOCK)
        for other in [*running, name]:
            loop.check(other)
        running.append(name)
        loop.tiered.check()
    stats = loop.tiered.stats()
    assert stats.num_promoted_blocks > 0 and stats.num_demoted_blocks > 0
    assert stats.host.num_evicted > 0  # the host tier filled and evicted too


def test_a_full_host_tier_evicts_leaves_through_its_policy(make_loop):
    loop = make_loop(5, 2, policy="fifo")  # 4 usable device blocks, 2 host slots
    for seed in range(4):
        loop.admit(seed, prompt(seed, 4))
        loop.requests.finish(seed)
    loop.tiered.check()
    assert len(loop.host) == 2 and loop.host.stats().num_evicted > 0


def test_events_name_the_medium_of_each_tier(make_loop):
    loop = make_loop(5, 8, events=64)
    loop.admit("a", prompt(1, 4))
    loop.requests.finish("a")
    loop.admit("b", prompt(2, 4))
    events = loop.tiered.take_events()
    stored = {e.medium for e in events if isinstance(e, BlockStored)}
    removed = {e.medium for e in events if isinstance(e, BlockRemoved)}
    assert stored == {"GPU", "CPU"} and removed == {"GPU"}
    on_host = {
        h
        for e in events
        if isinstance(e, BlockStored) and e.medium == "CPU"
        for h in e.block_hashes
    }
    off_device = {h for e in events if isinstance(e, BlockRemoved) for h in e.block_hashes}
    assert on_host and on_host <= off_device  # a demoted hash left the device


def test_a_tier_needs_prefix_caching_and_the_right_types():
    from prefixcache import KVBlockAllocator

    off = KVBlockAllocator(total_count=4, device="cpu", enable_prefix_caching=False)
    with pytest.raises(ConfigError):
        TieredCache(off, HostTier(2))
    on = KVBlockAllocator(total_count=4, device="cpu")
    with pytest.raises(ConfigError):
        TieredCache("allocator", HostTier(2))  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        TieredCache(on, "host")  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        TieredCache(on, HostTier(2), reclaim_per_call=-1)


def test_an_allocation_that_cannot_be_served_changes_nothing(make_loop):
    loop = make_loop(5, 4)
    assert loop.tiered.allocate(5) is None
    assert loop.tiered.stats().device.num_free == 4
    assert loop.requests.admit("x", prompt(1, 5)) is None


def test_stats_as_dict_is_plain(make_loop):
    loop = make_loop(5, 4)
    loop.admit("a", prompt(1, 2))
    flat = loop.tiered.stats().as_dict()
    assert flat["host"]["num_slots"] == 4 and flat["weight_epoch"] == 0
    assert isinstance(flat["device"]["num_registered"], int)
    assert torch.is_tensor(loop.kv.k_caches[0])
