"""New weights without draining: old blocks serve their holders and nobody else."""

from __future__ import annotations

import random

import pytest

from prefixcache.errors import InvalidArgumentError
from prefixcache.tiers import WeightEpochs

BLOCK = 4


def prompt(seed: int, num_blocks: int) -> list[int]:
    return [seed * 1000 + i for i in range(num_blocks * BLOCK)]


def test_a_request_running_across_a_weight_update_keeps_its_blocks(make_loop):
    loop = make_loop(17, 16)
    shared = prompt(1, 3)
    loop.admit("old", shared)
    old_hashes = loop.requests.hashes_of("old")
    assert loop.requests.begin_weight_epoch("step-1") == 1
    assert loop.admit("new", shared) == 0  # never matches blocks computed under old weights
    new_hashes = loop.requests.hashes_of("new")
    assert not set(new_hashes) & set(old_hashes)
    # The old request goes on: its blocks stay valid, its chain grows in its own epoch.
    grown = loop.requests.append("old", [5] * (2 * BLOCK))
    assert grown is not None and len(grown) == 5
    loop.block_ids["old"] = grown.tolist()
    loop.compute("old", 3)
    loop.check("old")
    assert loop.requests.epoch_of("old") == 0 and loop.requests.epoch_of("new") == 1
    loop.requests.finish("old")
    # Later requests of the new epoch share the new blocks only.
    assert loop.admit("later", shared + [5] * (2 * BLOCK)) == 3 * BLOCK
    assert loop.requests.hashes_of("later")[:3] == new_hashes
    loop.tiered.check()


def test_no_request_ever_reads_a_block_computed_under_other_weights(make_loop):
    rng = random.Random(3)
    loop = make_loop(13, 12)
    family = [prompt(seed, rng.randint(1, 4)) for seed in range(6)]
    epoch_of_hash: dict[int, int] = {}
    running: list[str] = []
    for step in range(240):
        if step % 40 == 39:
            loop.requests.begin_weight_epoch(f"w{step}")
        if running and (len(running) > 2 or rng.random() < 0.4):
            loop.requests.finish(running.pop(rng.randrange(len(running))))
            continue
        name = f"r{step}"
        admission = loop.requests.admit(name, rng.choice(family))
        if admission is None:
            continue
        loop.block_ids[name] = admission.block_ids.tolist()
        loop.copy()
        first = admission.num_cached_tokens // BLOCK
        hashes = loop.requests.hashes_of(name)
        for block_hash in hashes[:first]:
            assert epoch_of_hash[block_hash] == admission.epoch  # a hit of its own epoch
        for block_hash in hashes[first:]:
            epoch_of_hash[block_hash] = admission.epoch
        loop.compute(name, first)
        loop.check(name)
        running.append(name)
    stats = loop.tiered.stats()
    assert stats.weight_epoch == 6 and stats.num_promoted_blocks > 0
    assert stats.host.num_retired > 0  # old host entries were dropped, before live ones
    loop.tiered.check()


def test_old_epochs_leave_the_host_tier_and_are_never_demoted(make_loop):
    loop = make_loop(5, 8)
    loop.admit("a", prompt(1, 4))
    loop.requests.finish("a")
    loop.admit("b", prompt(2, 4))  # a's chain demoted
    loop.requests.finish("b")
    assert len(loop.host) == 4
    demoted = loop.tiered.stats().num_demoted_blocks
    loop.requests.begin_weight_epoch("next")
    loop.tiered.reclaim_per_call = 2
    loop.admit("c", prompt(3, 4))  # b's chain (old epoch) evicted from the device: not demoted
    assert loop.tiered.stats().num_demoted_blocks == demoted
    assert loop.host.stats().num_retired == 2  # two per allocation
    assert loop.host.reclaim(10) == 2 and len(loop.host) == 0
    loop.tiered.check()


def test_the_host_tier_does_not_match_a_retired_epoch(make_loop):
    loop = make_loop(5, 8)
    loop.admit("a", prompt(1, 4))
    a_hashes = loop.requests.hashes_of("a")
    loop.requests.finish("a")
    loop.admit("b", prompt(2, 4))
    assert len(loop.host.lookup(a_hashes[:1])) == 1
    loop.tiered.begin_weight_epoch(7)
    assert loop.host.lookup(a_hashes[:1]) == []


def test_epochs_have_tags_and_keys():
    epochs = WeightEpochs("base")
    assert epochs.current == 0 and epochs.tag_of(0) == "base"
    assert epochs.begin(42) == 1 and epochs.tag_of(1) == 42
    assert epochs.is_retired(0) and not epochs.is_retired(1)
    assert epochs.hash_keys() == epochs.hash_keys(1) != epochs.hash_keys(0)
    epochs.begin("base")  # a tag used again still starts a fresh chain
    assert epochs.hash_keys(2) != epochs.hash_keys(0)
    for bad in ("", None, True, 1.5):
        with pytest.raises(InvalidArgumentError):
            epochs.begin(bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        epochs.tag_of(3)
    with pytest.raises(InvalidArgumentError):
        epochs.hash_keys(-1)
    assert epochs.current == 2  # refused tags changed nothing


def test_a_registration_in_a_future_epoch_is_refused(make_loop):
    loop = make_loop(5, 4)
    ids = loop.tiered.allocate(1)
    with pytest.raises(InvalidArgumentError):
        loop.tiered.register(ids, [123], epoch=1)
    assert loop.tiered.stats().device.num_registered == 0
