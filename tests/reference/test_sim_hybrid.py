"""HybridBatchingSim: the hybrid loop exercises each piece and its exact check can fail.

Every run verifies each finished request against a run of the same model with no
cache (``torch.equal`` on every computed output). Each piece gets a run that uses it
and a broken twin that the check must catch: a state not restored, a sliding-window
block given back one block early, a shared partial block written without a copy, a
defragmentation in the middle of a run that does not copy the KV data.
"""

from __future__ import annotations

import random
import runpy
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixcache.errors import CapacityError, ConfigError, InvalidArgumentError, InvariantError
from prefixcache.reference.sim_hybrid import (
    HybridBatchingSim,
    HybridSimRequest,
    HybridStepReport,
    run_hybrid,
)
from prefixcache.reference.toy_hybrid import ToyHybridModel
from prefixcache.serving import layer_groups
from prefixcache.serving.hybrid import HybridMemory, build_hybrid_memory
from prefixcache.serving.layer_groups import LayerGroupSpec
from prefixcache.serving.state_pool import StateShape

B = 4
VOCAB = 32
FULL = LayerGroupSpec("full", "full", num_layers=2, k_heads=2, k_head_dim=4)
SWA = LayerGroupSpec("swa", "sliding_window", 2, 2, 4, window=6, pool="full")
IDX = LayerGroupSpec("idx", "indexer", num_layers=1, k_heads=1, k_head_dim=4)
LINEAR = StateShape(num_layers=2, num_heads=2, k_dim=3, v_dim=3, conv_dim=5, conv_kernel=3)
SYSTEM = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]


def make(groups=(FULL, SWA, IDX), linear=LINEAR, **kwargs) -> ToyHybridModel:
    options = {
        "num_blocks": 96,
        "block_size": B,
        "max_requests": 6,
        "max_blocks_per_request": 16,
        "num_checkpoints": 8 if linear is not None else 0,
        "checkpoint_every": 2,
        "dtype": torch.float32,
        "device": "cpu",
    }
    memory = build_hybrid_memory(list(groups), linear=linear, **(options | kwargs))
    return ToyHybridModel(memory, vocab_size=VOCAB)


def shared_prompt_requests(count: int = 3, **kwargs) -> list[HybridSimRequest]:
    return [
        HybridSimRequest(i, (*SYSTEM, 20 + i, 21), 5, arrival_step=4 * i, **kwargs)
        for i in range(count)
    ]


def checked(sim: HybridBatchingSim, report: HybridStepReport) -> None:
    sim.memory.check_invariants()


def assert_equal_to_uncached(model: ToyHybridModel, outputs) -> None:
    """The test's own comparison, independent of the loop's."""
    for output in outputs:
        tokens = [*output.prompt_tokens, *output.tokens]
        reference = model.forward_reference(tokens)
        for row, position in enumerate(output.positions):
            assert torch.equal(output.outputs[row], reference[position])


def drained(memory: HybridMemory) -> None:
    memory.check_invariants()
    assert memory.groups.num_held_blocks() == {spec.name: 0 for spec in memory.groups.specs}
    for allocator in memory.groups.allocators.values():
        assert allocator.stats().num_active == 0
    if memory.state_pool is not None and memory.checkpoints is not None:  # reserved slots only
        assert memory.state_pool.num_allocated == memory.checkpoints.capacity


# ---------------------------------------------------------------------- hybrid hits


def test_a_hybrid_prefix_hit_restores_kv_and_state_and_matches_the_uncached_run() -> None:
    model = make()
    report, outputs = run_hybrid(
        model, shared_prompt_requests(), step_token_budget=8, between_steps=checked
    )
    assert report.num_finished == 3 and len(outputs) == 3
    later = [output for output in outputs if output.request_id != 0]
    # Checkpoints every 2 blocks: the 14 shared tokens give a hit of 8 tokens, state included.
    assert all(o.num_hit_tokens == 8 and o.num_restored_states == 1 for o in later)
    assert all(o.positions[0] == 8 for o in later)  # nothing before the hit was computed
    assert report.num_restored_states == 2 and report.hit_tokens == 16
    assert report.num_checkpoints_saved > 0
    assert_equal_to_uncached(model, outputs)
    drained(model.memory)


def test_the_check_catches_a_state_that_was_not_restored(monkeypatch) -> None:
    model = make()
    checkpoints = model.memory.checkpoints
    assert checkpoints is not None
    monkeypatch.setattr(checkpoints, "restore", lambda block_hash, dst_slot: 0)  # KV only
    with pytest.raises(InvariantError, match="differs from the uncached run"):
        run_hybrid(model, shared_prompt_requests(), step_token_budget=8)


def test_a_checkpoint_evicted_mid_run_shortens_the_hit_and_stays_exact() -> None:
    model = make(num_checkpoints=1, checkpoint_every=1)
    report, outputs = run_hybrid(model, shared_prompt_requests(4), step_token_budget=5)
    assert report.num_finished == 4
    stats = model.memory.checkpoints.stats()  # type: ignore[union-attr]
    assert stats.num_evicted > 0
    assert_equal_to_uncached(model, outputs)


# ---------------------------------------------------------------------- sliding windows


def test_a_sliding_window_run_gives_back_blocks_mid_run_and_stays_exact() -> None:
    model = make(groups=(FULL, SWA))
    requests = [HybridSimRequest(i, tuple(range(i, i + 13)), 12) for i in range(2)]
    report, outputs = run_hybrid(model, requests, step_token_budget=6, between_steps=checked)
    running = [step for step in report.steps if step.num_running]
    # Window 6 spans at most 3 blocks of 4: the sliding group holds fewer while requests run.
    assert any(step.held_blocks["swa"] < step.held_blocks["full"] for step in running)
    assert all(step.held_blocks["swa"] <= 3 * step.num_running for step in running)
    assert_equal_to_uncached(model, outputs)
    drained(model.memory)


def test_the_check_catches_a_window_block_given_back_one_block_early(monkeypatch) -> None:
    real = layer_groups.first_needed_block
    monkeypatch.setattr(
        layer_groups,
        "first_needed_block",
        lambda num_tokens, window, block_size: real(num_tokens, window, block_size) + 1,
    )
    model = make(groups=(FULL, SWA))
    requests = [HybridSimRequest(0, tuple(range(13)), 12)]
    with pytest.raises(InvariantError, match="differs from the uncached run"):
        run_hybrid(model, requests, step_token_budget=6)


# ---------------------------------------------------------------------- copy on write


def test_a_fork_copies_the_shared_partial_block_on_write_and_both_stay_exact() -> None:
    model = make()
    prompt = (*SYSTEM, 30)  # 15 tokens: the last block holds 3
    report, outputs = run_hybrid(
        model,
        [HybridSimRequest("a", prompt, 6, fork_ranks=(1, 2))],
        step_token_budget=8,
        between_steps=checked,
    )
    assert report.num_forks == 2 and report.num_finished == 3
    # Each of the first two writers copies the partial block, once per layer group.
    assert report.num_copies == 2 * 3 == model.memory.tails.num_copies
    by_id = {output.request_id: output for output in outputs}
    assert len({by_id[name].tokens[0] for name in ("a", "a/1", "a/2")}) == 3  # they diverge
    assert by_id["a/1"].num_hit_tokens == len(prompt)  # the fork computed no prompt token
    assert by_id["a/1"].positions[0] == len(prompt) - 1  # its first token's output, shared
    assert_equal_to_uncached(model, outputs)
    drained(model.memory)


def test_the_check_catches_a_shared_partial_block_written_without_a_copy(monkeypatch) -> None:
    model = make()
    tails = model.memory.tails
    monkeypatch.setattr(tails, "write", lambda slot, n: [])
    monkeypatch.setattr(tails, "fresh_blocks_needed", lambda slot, n: {"full": 0, "idx": 0})
    # 13 prompt tokens, 3 generated: both write positions 13 and 14 into the shared block,
    # which never fills (a full one would also clash at registration).
    with pytest.raises(InvariantError, match="differs from the uncached run"):
        run_hybrid(model, [HybridSimRequest("a", tuple(SYSTEM[:13]), 3, fork_ranks=(1,))])


def test_a_fork_at_a_block_boundary_shares_no_partial_block() -> None:
    model = make()
    report, outputs = run_hybrid(
        model, [HybridSimRequest("a", tuple(SYSTEM[:12]), 4, fork_ranks=(1,))]
    )
    assert report.num_forks == 1 and report.num_copies == 0
    assert_equal_to_uncached(model, outputs)
    drained(model.memory)


def test_a_fork_without_a_free_row_is_refused_and_counted() -> None:
    model = make(max_requests=1)
    report, outputs = run_hybrid(model, [HybridSimRequest("a", (*SYSTEM, 30), 3, fork_ranks=(1,))])
    assert report.num_forks == 0 and report.num_forks_refused == 1 and len(outputs) == 1


# ---------------------------------------------------------------------- defragmentation


def staggered_requests() -> list[HybridSimRequest]:
    """Short and long requests interleaved, so finishing ones leave holes among running ones."""
    return [
        HybridSimRequest(i, (*SYSTEM[: 5 + i], 25 + i), 3 if i % 2 else 14, arrival_step=i)
        for i in range(6)
    ]


def test_a_defragmentation_in_the_middle_of_a_run_keeps_every_output_exact() -> None:
    model = make()
    moves = []

    def defragment(sim: HybridBatchingSim, report: HybridStepReport) -> None:
        if report.num_running:
            moves.append(sum(sim.memory.defragment().values()))
            sim.memory.check_invariants()
            for allocator in sim.memory.groups.allocators.values():
                assert allocator.stats().fragmentation == 0.0

    report, outputs = run_hybrid(model, staggered_requests(), between_steps=defragment)
    assert sum(moves) > 0 and report.num_finished == 6
    assert_equal_to_uncached(model, outputs)
    drained(model.memory)


def test_the_check_catches_a_defragmentation_that_does_not_copy_the_kv(monkeypatch) -> None:
    model = make()
    for cache in model.memory.groups.kv_caches.values():
        monkeypatch.setattr(cache, "copy_blocks", lambda sources, destinations: None)
    moves = []

    def defragment(sim: HybridBatchingSim, report: HybridStepReport) -> None:
        if report.num_running:
            moves.append(sum(sim.memory.defragment().values()))

    with pytest.raises(InvariantError, match="differs from the uncached run"):
        run_hybrid(model, staggered_requests(), between_steps=defragment)
    assert sum(moves) > 0


# ---------------------------------------------------------------------- pressure


def test_memory_pressure_requeues_and_every_output_stays_exact() -> None:
    model = make(num_blocks=24, max_requests=4)
    requests = [HybridSimRequest(i, tuple(range(i, i + 9)), 10) for i in range(4)]
    report, outputs = run_hybrid(model, requests, step_token_budget=16, between_steps=checked)
    assert report.num_preemptions > 0 and report.num_finished == 4
    assert_equal_to_uncached(model, outputs)
    drained(model.memory)


def test_a_request_that_cannot_fit_alone_is_a_capacity_error() -> None:
    model = make(num_blocks=8)
    with pytest.raises(CapacityError, match="alone"):
        run_hybrid(model, [HybridSimRequest(0, tuple(range(20)), 4)])


# ---------------------------------------------------------------------- randomised


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1))
def test_random_workloads_always_match_the_uncached_run(seed: int) -> None:
    """Shared prefixes, forks, windows, checkpoint eviction and pressure, all at once."""
    rng = random.Random(seed)
    model = make(
        num_blocks=rng.randrange(40, 97),
        num_checkpoints=rng.randrange(1, 6),
        checkpoint_every=rng.randrange(1, 4),
        max_requests=rng.randrange(2, 6),
    )
    prefixes = [[rng.randrange(VOCAB) for _ in range(rng.randrange(3, 12))] for _ in range(2)]
    requests = []
    for i in range(rng.randrange(2, 6)):
        tail = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 6))]
        requests.append(
            HybridSimRequest(
                i,
                (*rng.choice(prefixes), *tail),
                rng.randrange(1, 7),
                arrival_step=rng.randrange(6),
                sample_rank=rng.randrange(2),
                fork_ranks=tuple(rng.sample(range(3), rng.randrange(2))),
            )
        )
    report, outputs = run_hybrid(
        model, requests, step_token_budget=rng.randrange(1, 12), between_steps=checked
    )
    assert report.num_finished == report.num_requests == len(outputs)
    assert report.num_requests == len(requests) + report.num_forks
    drained(model.memory)


# ---------------------------------------------------------------------- input rules


@pytest.mark.parametrize(
    "build",
    [
        lambda: HybridSimRequest(0, (), 1),
        lambda: HybridSimRequest(0, (1.5,), 1),  # type: ignore[arg-type]
        lambda: HybridSimRequest(0, (1,), 0),
        lambda: HybridSimRequest(0, (1,), 1, fork_ranks=(-1,)),
    ],
)
def test_bad_requests_are_invalid_argument_errors(build) -> None:
    with pytest.raises(InvalidArgumentError):
        build()


def test_submit_refuses_tokens_ranks_and_lengths_that_cannot_run() -> None:
    sim = HybridBatchingSim(make())
    with pytest.raises(InvalidArgumentError, match="vocabulary"):
        sim.submit(HybridSimRequest(0, (VOCAB,), 1))
    with pytest.raises(InvalidArgumentError, match="rank"):
        sim.submit(HybridSimRequest(0, (1,), 1, fork_ranks=(VOCAB,)))
    with pytest.raises(CapacityError):
        sim.submit(HybridSimRequest(0, tuple(range(30)) * 2, 8))
    with pytest.raises(InvalidArgumentError):
        sim.submit("not a request")  # type: ignore[arg-type]
    assert sim.is_done and sim.num_steps == 0


def test_bad_configuration_is_a_config_error() -> None:
    with pytest.raises(ConfigError):
        HybridBatchingSim(make(), step_token_budget=0)
    with pytest.raises(ConfigError):
        HybridBatchingSim(make(), verify=1)  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        HybridBatchingSim(object())  # type: ignore[arg-type]


def test_the_serving_example_hits_forks_copies_defragments_and_stays_exact(capsys) -> None:
    example = Path(__file__).parents[2] / "examples" / "hybrid_serving.py"
    runpy.run_path(str(example), run_name="__main__")
    lines = capsys.readouterr().out.splitlines()
    assert "q1: reused 16 prompt tokens (state restored 1x)" in "\n".join(lines)
    assert lines[-1].endswith("all 5 requests equal to the uncached run")
    assert "6 copy-on-write copies" in lines[-1]
    moved = [line for line in lines if "defragmented mid-run" in line]
    assert len(moved) == 1 and "'full': 0" not in moved[0]  # blocks moved under a running request
