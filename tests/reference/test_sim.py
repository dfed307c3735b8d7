"""The reference dynamic-batching loop, and the end-to-end check that prefix sharing is correct."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from prefixcache import CapacityError, ConfigError, InvalidArgumentError, InvariantError
from prefixcache.reference.sim import (
    DynamicBatchingSim,
    SimConfig,
    SimRequest,
    StepReport,
    run,
)
from prefixcache.serving.kv_cache import KVCache
from prefixcache.tools.replay import online_policies

SHIPPED_POLICIES = online_policies()
"""Every registered policy but the offline optimum, which needs the future of a trace."""


def small_config(**overrides: Any) -> SimConfig:
    """Blocks of 4 tokens, 12 request slots of 20 blocks; ``overrides`` on top."""
    options: dict[str, Any] = {"block_size": 4, "max_requests": 12, "max_blocks_per_request": 20}
    options.update(overrides)
    return SimConfig(**options)


def shared_prefix_workload(num_requests: int, seed: int) -> list[SimRequest]:
    """Heavy prefix overlap: few system prompts x few documents, short unique tails.

    Every fifth request is a trace request whose block IDs come from a tiny
    alphabet, so trace chains overlap too. Three requests arrive per step.
    """
    rng = random.Random(seed)
    systems = [[rng.randrange(1000) for _ in range(rng.randrange(6, 30))] for _ in range(5)]
    documents = [[rng.randrange(1000) for _ in range(20)] for _ in range(8)]
    requests = []
    for index in range(num_requests):
        output_length = rng.randrange(1, 12)
        if index % 5 == 0:
            hash_ids = [rng.randrange(3)] + [rng.randrange(4) for _ in range(rng.randrange(1, 9))]
            input_length = len(hash_ids) * 4 - rng.randrange(4)
            request = SimRequest.from_hash_ids(
                index, hash_ids, input_length, output_length, arrival_step=index // 3
            )
        else:
            prompt = rng.choice(systems) + rng.choice(documents)[: rng.randrange(21)]
            prompt += [rng.randrange(1000) for _ in range(rng.randrange(6))]
            request = SimRequest.from_tokens(index, prompt, output_length, arrival_step=index // 3)
        requests.append(request)
    return requests


def check_step(sim: DynamicBatchingSim, step: StepReport) -> None:
    """Per-step consistency: states partition the pool, the table matches the requests."""
    usable = sim.allocator.num_usable
    blocks = (
        step.num_free_blocks
        + step.num_active_blocks
        + step.num_paused_blocks
        + step.num_cached_blocks
    )
    assert blocks == usable
    assert step.num_running + step.num_paused == sim.block_table.num_requests
    assert step.num_running + step.num_paused <= sim.config.max_requests


# ---------------------------------------------------------------------- end to end


@pytest.mark.slow  # the full suite (--full)
@pytest.mark.parametrize("policy", SHIPPED_POLICIES)
def test_prefix_sharing_serves_correct_kv_under_eviction_pressure(policy: str) -> None:
    """Thousands of overlapping requests, a pool far too small, every hit checked.

    ``verify`` compares the K/V of every prefix hit with values recomputed from
    the request's own tokens, so a block handed out while still registered, a
    hash registered on the wrong block, or a row of the block table pointing
    at another request's block fails here.
    """
    config = small_config(
        total_count=72, paused_count=8, step_token_budget=64, eviction_policy=policy, verify=True
    )
    sim = DynamicBatchingSim(config)
    requests = shared_prefix_workload(2500, seed=11)
    for request in requests:
        sim.submit(request)
    while not sim.is_done:
        step = sim.step()
        check_step(sim, step)
        if sim.num_steps % 20 == 0:
            sim.allocator.check_invariants()
    sim.allocator.check_invariants()
    report = sim.report()
    assert report.num_finished == len(requests)
    assert report.hit_rate > 0.3
    stats = sim.allocator.stats()
    assert report.num_evicted_blocks == stats.num_evicted_blocks
    assert stats.num_evicted_blocks + stats.num_dropped_blocks > 0  # ref-zero drops, LRU evicts
    assert report.num_pauses + report.num_preemptions > 0
    assert report.decode_tokens == sum(request.output_length for request in requests)
    # Every block is back: nothing held, only (policy-dependent) cached blocks remain.
    stats = sim.allocator.stats()
    assert stats.num_active == stats.num_paused == 0
    assert sim.allocator.get_total_used() == stats.num_cached
    assert sim.block_table.num_requests == 0


def defragmenting_run(
    config: SimConfig, requests: list[SimRequest]
) -> tuple[DynamicBatchingSim, int]:
    """Serve ``requests``, compacting the pool after every step; return the loop and the moves."""
    sim = DynamicBatchingSim(config)
    for request in requests:
        sim.submit(request)
    moves = 0
    while not sim.is_done:
        check_step(sim, sim.step())
        moves += sim.defragment()
        assert sim.allocator.stats().fragmentation == 0.0
        sim.allocator.check_invariants()
    return sim, moves


def test_a_defragmentation_after_every_step_keeps_every_hit_correct() -> None:
    """Running, paused and cached blocks move mid-run; ``verify`` checks every later hit."""
    config = small_config(total_count=48, paused_count=6, step_token_budget=32, verify=True)
    requests = shared_prefix_workload(150, seed=3)
    sim, moves = defragmenting_run(config, requests)
    report = sim.report()
    assert moves > 0 and report.num_finished == len(requests)
    assert report.prefill_tokens_saved > 0 and report.num_evicted_blocks > 0


def test_verify_catches_a_defragmentation_that_does_not_copy_the_kv(monkeypatch) -> None:
    config = small_config(total_count=48, paused_count=6, step_token_budget=32, verify=True)
    sim = DynamicBatchingSim(config)
    assert sim.kv_cache is not None
    monkeypatch.setattr(sim.kv_cache, "copy_blocks", lambda sources, destinations: None)
    for request in shared_prefix_workload(150, seed=3):
        sim.submit(request)
    with pytest.raises(InvariantError, match="prefix hit on block"):
        while not sim.is_done:
            sim.step()
            sim.defragment()


def test_verify_detects_a_corrupted_cached_block() -> None:
    sim = DynamicBatchingSim(SimConfig(total_count=32, block_size=4, verify=True))
    prompt = [*range(12), 99]
    sim.submit(SimRequest.from_tokens("first", prompt, 1))
    while not sim.is_done:
        sim.step()
    cached = sim.allocator.match_prefix(sim.allocator.hash_tokens(prompt))
    assert len(cached) == 3
    cache = sim.kv_cache
    assert cache is not None
    zeros_k = torch.zeros(1, cache.k_heads, cache.k_head_dim)
    zeros_v = torch.zeros(1, cache.v_heads, cache.v_head_dim)
    cache.write(1, cached[1:2], [2], zeros_k, zeros_v)
    sim.submit(SimRequest.from_tokens("second", prompt, 1))
    with pytest.raises(InvariantError, match=rf"block {int(cached[1])} .* token 6 .* layer 1"):
        sim.step()


@pytest.mark.parametrize(
    "cache_shape",
    [
        {"k_heads": 1, "k_head_dim": 6, "v_head_dim": 0},  # MLA-like
        {"k_heads": 2, "k_head_dim": 4, "v_heads": 1, "v_head_dim": 2},
    ],
)
def test_verify_with_a_custom_half_precision_cache(cache_shape: dict[str, int]) -> None:
    cache = KVCache(3, 64, 4, dtype=torch.float16, device="cpu", **cache_shape)  # type: ignore[arg-type]
    config = small_config(total_count=64, paused_count=6, step_token_budget=48, verify=True)
    report = run(shared_prefix_workload(300, seed=3), config, kv_cache=cache)
    assert report.num_finished == 300 and report.prefill_tokens_saved > 0
    assert cache.k_caches[2].any()


def test_meta_device_runs_without_reading_device_memory() -> None:
    # Allocator and block table mirrors on "meta" hold no values: any read fails.
    config = small_config(total_count=64, paused_count=6, device="meta", verify=True)
    sim = DynamicBatchingSim(config)
    assert sim.block_table.device_table.device.type == "meta"
    for request in shared_prefix_workload(200, seed=5):
        sim.submit(request)
    while not sim.is_done:
        sim.step()
    assert sim.report().num_finished == 200
    assert sim.allocator.get_active_used() == 0


# ---------------------------------------------------------------------- the loop's behaviour


def test_hits_are_counted_per_admission() -> None:
    shared = list(range(40))
    requests = [
        SimRequest.from_tokens(i, [*shared, 100 + i], output_length=2, arrival_step=i)
        for i in range(4)
    ]
    report = run(requests, SimConfig(total_count=64, block_size=8))
    # The first request computes the 5 shared blocks; each later one hits all of them.
    assert report.prompt_tokens == 4 * 41
    assert report.prefill_tokens_saved == 3 * 40
    assert report.prefill_tokens == 4 * 41 - 3 * 40
    assert report.hit_rate == pytest.approx(120 / 164)
    assert report.num_steps == len(report.steps) and report.steps[1].prefill_tokens_saved == 40


def test_requests_arriving_together_do_not_hit_unwritten_blocks() -> None:
    requests = [SimRequest.from_tokens(i, [5] * 17, output_length=1) for i in range(3)]
    report = run(requests, SimConfig(total_count=64, block_size=4, verify=True))
    assert report.prefill_tokens_saved == 0  # nothing was registered when they were admitted


def test_a_whole_cached_prompt_still_computes_its_last_token() -> None:
    requests = [SimRequest.from_tokens(i, [5] * 16, 1, arrival_step=2 * i) for i in range(2)]
    report = run(requests, SimConfig(total_count=64, block_size=4, verify=True))
    assert report.prefill_tokens_saved == 12  # 3 of 4 blocks: the last one yields the token


def test_decode_blocks_are_registered_when_they_fill() -> None:
    sim = DynamicBatchingSim(SimConfig(total_count=32, block_size=4))
    sim.submit(SimRequest.from_tokens("r", list(range(10)), output_length=7))
    while not sim.is_done:
        sim.step()
    # 17 tokens: 2 full prompt blocks, 2 blocks completed by decoding, 1 partial (freed).
    stats = sim.allocator.stats()
    assert stats.num_cached == 4 and stats.num_registered == 4
    assert stats.num_free == sim.allocator.num_usable - 4


def test_prefill_is_chunked_by_the_step_budget() -> None:
    sim = DynamicBatchingSim(SimConfig(total_count=64, block_size=4, step_token_budget=10))
    sim.submit(SimRequest.from_tokens("a", list(range(23)), output_length=3))
    sim.submit(SimRequest.from_tokens("b", list(range(100, 105)), output_length=1))
    steps = [sim.step() for _ in range(3)]
    assert [s.prefill_tokens for s in steps] == [10, 10, 8]
    assert [s.decode_tokens for s in steps] == [0, 0, 0]
    assert sim.step().decode_tokens == 2  # both requests decode once their prefill is done


def test_pauses_and_resumes_under_pressure() -> None:
    config = small_config(total_count=48, paused_count=12, step_token_budget=64)
    report = run(shared_prefix_workload(400, seed=1), config, on_step=check_step)
    assert report.num_finished == 400
    assert report.num_pauses > 0 and report.num_resumes > 0


def test_without_a_paused_budget_a_pause_requeues() -> None:
    config = small_config(total_count=48, paused_count=0, step_token_budget=64)
    report = run(shared_prefix_workload(400, seed=1), config, on_step=check_step)
    assert report.num_finished == 400
    assert report.num_pauses == 0 and report.num_preemptions > 0


def test_requests_arrive_at_their_step() -> None:
    requests = [SimRequest.from_tokens("late", [1, 2, 3], 1, arrival_step=50)]
    sim = DynamicBatchingSim(SimConfig(total_count=16, block_size=4))
    sim.submit(requests[0])
    first = sim.step()
    assert first.step == 50 and first.prefill_tokens == 3  # an idle loop skips ahead


def test_max_steps_stops_early() -> None:
    report = run(shared_prefix_workload(60, seed=2), small_config(), max_steps=5)
    assert report.num_steps == 5 and report.num_finished < 60


def test_trace_requests_share_by_hash_ids() -> None:
    requests = [
        SimRequest.from_hash_ids("a", [7, 8, 9, 1, 2], 18, 1),
        SimRequest.from_hash_ids("b", [7, 8, 9, 3, 4], 18, 1, arrival_step=5),
        SimRequest.from_hash_ids("c", [6, 8, 9, 1, 2], 18, 1, arrival_step=10),
    ]
    report = run(requests, SimConfig(total_count=32, block_size=4, verify=True))
    assert report.prefill_tokens_saved == 3 * 4  # b shares 3 blocks with a; c shares none


def test_from_hash_ids_chains_the_ids() -> None:
    first = SimRequest.from_hash_ids(0, [0, 1, 2], 12, 1).block_hashes
    assert first is not None and len(set(first)) == 3 and min(first) > 0
    assert SimRequest.from_hash_ids(1, [0, 1], 8, 1).block_hashes == first[:2]
    other = SimRequest.from_hash_ids(2, [5, 1, 2], 12, 1).block_hashes
    assert other is not None and other[1] != first[1]


# ---------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "kwargs",
    [
        {"output_length": 1},
        {"output_length": 1, "prompt_tokens": (1,), "block_hashes": (5,), "input_length": 1},
        {"output_length": 1, "prompt_tokens": ()},
        {"output_length": 1, "prompt_tokens": (1, 2), "input_length": 3},
        {"output_length": -1, "prompt_tokens": (1,)},
        {"output_length": 1, "prompt_tokens": (1,), "arrival_step": -1},
        {"output_length": 1, "block_hashes": (5,)},
    ],
)
def test_malformed_requests_are_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(InvalidArgumentError):
        SimRequest("r", **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("num_hashes", [3, 6])
def test_hashes_must_cover_the_full_blocks(num_hashes: int) -> None:
    sim = DynamicBatchingSim(SimConfig(total_count=32, block_size=4))
    request = SimRequest("r", 1, block_hashes=tuple(range(1, num_hashes + 1)), input_length=18)
    with pytest.raises(InvalidArgumentError, match="block hashes"):
        sim.submit(request)
    assert sim.is_done


def test_a_request_that_can_never_fit_is_refused() -> None:
    sim = DynamicBatchingSim(SimConfig(total_count=32, block_size=4, max_blocks_per_request=5))
    with pytest.raises(CapacityError, match="needs 6 blocks"):
        sim.submit(SimRequest.from_tokens("r", range(20), output_length=4))
    with pytest.raises(CapacityError):  # 31 usable blocks minus a paused budget of 4
        DynamicBatchingSim(SimConfig(total_count=32, block_size=4)).submit(
            SimRequest.from_tokens("r", range(100), output_length=10)
        )
    assert sim.is_done


@pytest.mark.parametrize(
    "kwargs",
    [
        {"total_count": 0},
        {"block_size": 0},
        {"max_requests": 0},
        {"step_token_budget": 0},
        {"block_size": 2.0},
        {"verify": 1},
    ],
)
def test_bad_config_is_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        SimConfig(**kwargs)  # type: ignore[arg-type]


def test_kv_cache_must_match_the_pool() -> None:
    cache = KVCache(1, 16, 4, 1, 2, device="cpu")
    with pytest.raises(ConfigError, match="kv_cache"):
        DynamicBatchingSim(SimConfig(total_count=32, block_size=4), kv_cache=cache)
