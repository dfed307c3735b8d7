"""A real forward pass served through prefixcache computes what the dense model computes.

For every request, the greedy tokens with prefix caching on equal those with it
off and those of the dense no-cache reference, the routed MoE experts are equal
(replayed from the per-block store for cached tokens), and the logits agree
within :func:`logits_tolerance` (1e-9 in float64; measured about 1e-14). This
holds under eviction pressure, pause/resume, requeue-and-recompute and every
built-in policy. A corrupted cached block or corrupted stored routing is caught,
so the check can fail.
"""

from __future__ import annotations

import random
import runpy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from prefixcache import ConfigError, InvalidArgumentError, InvariantError
from prefixcache.reference.model import TinyDecoder, TinyDecoderConfig
from prefixcache.reference.model_serving import (
    ReferenceOutput,
    RequestOutput,
    StepEntry,
    build_paged_batch,
    compare_outputs,
    compare_with_reference,
    logits_tolerance,
    reference_output,
)
from prefixcache.reference.sim import DynamicBatchingSim, SimConfig, SimReport, SimRequest
from prefixcache.tools.replay import online_policies

SHIPPED_POLICIES = online_policies()
"""Every registered policy but the offline optimum, which needs the future of a trace."""

VOCAB_SIZE = 64
SMALL_MODEL = TinyDecoderConfig(
    vocab_size=VOCAB_SIZE,
    hidden_size=32,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    mlp_hidden=64,
    moe_layer=1,
    num_experts=4,
    top_k=2,
    expert_hidden=32,
)

References = dict[tuple[tuple[int, ...], int], ReferenceOutput]


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """Matrices of 32 columns: threads only add overhead (10x on a loaded 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model() -> TinyDecoder:
    return TinyDecoder(SMALL_MODEL, dtype=torch.float64)


@pytest.fixture(scope="module")
def references() -> References:
    """Dense reference outputs by (prompt, length), shared by every test of the module."""
    return {}


def workload(num_requests: int, seed: int) -> list[SimRequest]:
    """Few system prompts, short unique tails, three arrivals a step; every fifth a trace request.

    Trace requests draw block IDs from a tiny alphabet, so their chains overlap too.
    """
    rng = random.Random(seed)
    systems = [[rng.randrange(VOCAB_SIZE) for _ in range(rng.randrange(6, 30))] for _ in range(4)]
    requests = []
    for index in range(num_requests):
        output_length = rng.randrange(0, 8)
        arrival = index // 3
        if index % 5 == 0:
            hash_ids = [rng.randrange(3)] + [rng.randrange(4) for _ in range(rng.randrange(1, 6))]
            length = len(hash_ids) * 4 - rng.randrange(4)
            requests.append(
                SimRequest.from_hash_ids(
                    index, hash_ids, length, output_length, arrival_step=arrival
                )
            )
        else:
            prompt = rng.choice(systems) + [
                rng.randrange(VOCAB_SIZE) for _ in range(rng.randrange(1, 10))
            ]
            requests.append(
                SimRequest.from_tokens(index, prompt, output_length, arrival_step=arrival)
            )
    return requests


def pressure_config(**overrides: Any) -> SimConfig:
    """A pool of 40 blocks of 4 tokens: far too small, so requests evict, pause and requeue."""
    options: dict[str, Any] = {
        "total_count": 40,
        "paused_count": 6,
        "block_size": 4,
        "max_requests": 12,
        "max_blocks_per_request": 20,
        "step_token_budget": 48,
        "record_logits": True,
    }
    options.update(overrides)
    return SimConfig(**options)


def serve(
    model: TinyDecoder, requests: list[SimRequest], config: SimConfig
) -> tuple[SimReport, list[RequestOutput]]:
    sim = DynamicBatchingSim(config, model=model)
    for request in requests:
        sim.submit(request)
    while not sim.is_done:
        sim.step()
        assert sim.allocator.get_total_used() <= sim.allocator.num_usable
    sim.allocator.check_invariants()
    return sim.report(), sim.outputs


@pytest.fixture(scope="module")
def uncached(model: TinyDecoder) -> list[RequestOutput]:
    """The workload served with prefix caching off."""
    report, outputs = serve(
        model, workload(60, seed=0), pressure_config(enable_prefix_caching=False)
    )
    assert report.prefill_tokens_saved == 0 and len(outputs) == 60
    return outputs


# ---------------------------------------------------------------------- the identity check


@pytest.mark.parametrize("policy", SHIPPED_POLICIES)
def test_caching_on_equals_off_equals_dense_under_eviction_pressure(
    model: TinyDecoder, references: References, uncached: list[RequestOutput], policy: str
) -> None:
    report, outputs = serve(model, workload(60, seed=0), pressure_config(eviction_policy=policy))
    # The run exercised what it claims to: hits, evictions, pauses or requeues.
    assert report.num_finished == 60
    assert report.prefill_tokens_saved > 0
    assert (
        report.num_evicted_blocks > 0 or policy == "ref_zero"
    )  # ref-zero frees instead of caching
    assert report.num_pauses + report.num_preemptions > 0
    assert any(output.num_cached_tokens for output in outputs)
    assert compare_with_reference(model, outputs, cache=references) == []
    assert compare_outputs(outputs, uncached, atol=logits_tolerance(model.dtype)) == []


def test_a_defragmentation_after_every_step_changes_no_token(
    model: TinyDecoder, references: References, uncached: list[RequestOutput]
) -> None:
    """K/V and stored routing move with their blocks: outputs equal the uncached run's."""
    sim = DynamicBatchingSim(pressure_config(), model=model)
    for request in workload(60, seed=0):
        sim.submit(request)
    moves = 0
    while not sim.is_done:
        sim.step()
        moves += sim.defragment()
    sim.allocator.check_invariants()
    assert moves > 0 and sim.report().prefill_tokens_saved > 0
    assert compare_with_reference(model, sim.outputs, cache=references) == []
    assert compare_outputs(sim.outputs, uncached, atol=logits_tolerance(model.dtype)) == []


def test_caching_off_equals_dense(
    model: TinyDecoder, references: References, uncached: list[RequestOutput]
) -> None:
    assert compare_with_reference(model, uncached, cache=references) == []


@pytest.mark.parametrize(("paused_count", "what"), [(0, "num_preemptions"), (8, "num_resumes")])
def test_pause_resume_and_requeue_change_no_token(
    model: TinyDecoder, references: References, paused_count: int, what: str
) -> None:
    """No paused budget: a pause requeues (generated tokens recomputed); with one it waits."""
    config = pressure_config(total_count=28, paused_count=paused_count, verify=True)
    report, outputs = serve(model, workload(45, seed=4), config)
    assert getattr(report, what) > 0
    assert compare_with_reference(model, outputs, cache=references) == []


def test_logits_agree_far_inside_the_tolerance(model: TinyDecoder, references: References) -> None:
    """The stated tolerance is loose on purpose: the measured error is about 1e-14."""
    _, outputs = serve(model, workload(30, seed=2), pressure_config())
    errors = []
    for output in outputs:
        expected = references.get((output.prompt_tokens, len(output.tokens)))
        if expected is None:
            expected = reference_output(model, output.prompt_tokens, len(output.tokens))
        assert output.logits is not None
        if len(output.tokens):
            errors.append(float((output.logits - expected.logits).abs().max()))
    assert errors and max(errors) < 1e-11 < logits_tolerance(torch.float64)


def test_float32_serving_agrees_within_its_tolerance() -> None:
    model32 = TinyDecoder(SMALL_MODEL, dtype=torch.float32)
    requests = workload(20, seed=6)
    _, cached = serve(model32, requests, pressure_config())
    _, uncached = serve(model32, requests, pressure_config(enable_prefix_caching=False))
    assert compare_with_reference(model32, cached) == []
    assert compare_outputs(cached, uncached, atol=logits_tolerance(torch.float32)) == []


def test_prefix_hits_replay_the_stored_routing(model: TinyDecoder, references: References) -> None:
    prompt = [(7 * i) % VOCAB_SIZE for i in range(21)]
    requests = [
        SimRequest.from_tokens(name, prompt, 3, arrival_step=step)
        for name, step in (("a", 0), ("b", 20))
    ]
    sim = DynamicBatchingSim(pressure_config(total_count=64), model=model)
    for request in requests:
        sim.submit(request)
    while not sim.is_done:
        sim.step()
    first, second = sim.outputs
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, 20)
    np.testing.assert_array_equal(second.routing[:20], first.routing[:20])
    assert compare_with_reference(model, sim.outputs, cache=references) == []


def test_wrong_stored_routing_is_caught(
    model: TinyDecoder, references: References, monkeypatch: pytest.MonkeyPatch
) -> None:
    """If the store handed back other experts, the routing check would say which token."""
    prompt = [(5 * i + 1) % VOCAB_SIZE for i in range(13)]
    sim = DynamicBatchingSim(pressure_config(total_count=64), model=model)
    sim.submit(SimRequest.from_tokens("a", prompt, 1))
    while not sim.is_done:
        sim.step()
    real = sim.allocator.reconstruct_routing_from_blocks

    def shifted(block_ids: Any, total_tokens: int) -> torch.Tensor | None:
        routing = real(block_ids, total_tokens)
        return None if routing is None else (routing + 1) % SMALL_MODEL.num_experts

    monkeypatch.setattr(sim.allocator, "reconstruct_routing_from_blocks", shifted)
    sim.submit(SimRequest.from_tokens("b", prompt, 1))
    while not sim.is_done:
        sim.step()
    problems = compare_with_reference(model, sim.outputs, cache=references)
    assert problems == ["request 'b': routed experts of token 0 differ"]


def test_a_hit_without_stored_routing_is_an_invariant_error(
    model: TinyDecoder, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompt = [(5 * i + 3) % VOCAB_SIZE for i in range(9)]
    sim = DynamicBatchingSim(pressure_config(total_count=64), model=model)
    sim.submit(SimRequest.from_tokens("a", prompt, 1))
    while not sim.is_done:
        sim.step()
    monkeypatch.setattr(sim.allocator, "reconstruct_routing_from_blocks", lambda *args: None)
    sim.submit(SimRequest.from_tokens("b", prompt, 1))
    with pytest.raises(InvariantError, match="routing is not all stored"):
        sim.step()


# ---------------------------------------------------------------------- the check can fail


def corrupted_run(model: TinyDecoder, *, verify: bool) -> tuple[DynamicBatchingSim, int]:
    """Serve a prompt, corrupt one of its cached blocks, then serve it again (a prefix hit)."""
    prompt = [(3 * i + 2) % VOCAB_SIZE for i in range(17)]
    sim = DynamicBatchingSim(pressure_config(total_count=64, verify=verify), model=model)
    sim.submit(SimRequest.from_tokens("first", prompt, 2))
    while not sim.is_done:
        sim.step()
    cached = sim.allocator.match_prefix(sim.allocator.hash_tokens(prompt))
    assert len(cached) == 4
    block_id = int(cached[2])
    sim.corrupt_block_kv(block_id)
    sim.submit(SimRequest.from_tokens("second", prompt, 2))
    return sim, block_id


def test_a_corrupted_cached_block_fails_the_reference_check(
    model: TinyDecoder, references: References
) -> None:
    sim, _ = corrupted_run(model, verify=False)
    while not sim.is_done:
        sim.step()
    first, second = sim.outputs
    assert second.num_cached_tokens == 16
    assert compare_with_reference(model, [first], cache=references) == []
    problems = compare_with_reference(model, [second], cache=references)
    assert problems and all(line.startswith("request 'second': ") for line in problems)
    assert any("logits" in line for line in problems)
    assert compare_outputs([second], [first], atol=logits_tolerance(model.dtype))


def test_verify_names_the_corrupted_block_at_the_hit(model: TinyDecoder) -> None:
    sim, block_id = corrupted_run(model, verify=True)
    with pytest.raises(
        InvariantError, match=rf"block {block_id} serves wrong K at token 8 .* layer 0"
    ):
        sim.step()


def test_compare_outputs_names_every_kind_of_difference() -> None:
    def output(name: str, tokens: tuple[int, ...], experts: int = 0) -> RequestOutput:
        routing = np.full((2 + len(tokens), 1, 2), experts)
        return RequestOutput(name, (1, 2), tokens, routing, torch.zeros(len(tokens), 4), 0)

    first = [output("a", (5,)), output("b", (5, 6)), output("c", (5,), experts=1)]
    second = [output("a", (6, 7)), output("b", (5, 6)), output("c", (5,)), output("d", ())]
    assert compare_outputs(first, second, atol=1e-9) == [
        "request 'a': generated token 0 differs ([5] vs [6])",
        "request 'a': logits of shape (1, 4) vs (2, 4)",
        "request 'a': routing of shape (3, 1, 2) vs (4, 1, 2)",
        "request 'c': routed experts of token 0 differ",
        "request 'd': missing from the first run",
    ]
    assert compare_outputs(second[:1], [], atol=1e-9) == [
        "request 'a': missing from the second run"
    ]


# ---------------------------------------------------------------------- the model itself


def test_the_model_is_a_few_mb_and_seeded() -> None:
    default = TinyDecoder()
    assert 500_000 < default.num_parameters * 4 < 8_000_000  # float32 bytes
    again = TinyDecoder()
    tokens = torch.tensor([1, 2, 3, 4])
    assert torch.equal(default.forward_dense(tokens).logits, again.forward_dense(tokens).logits)
    other = TinyDecoder(TinyDecoderConfig(seed=1))
    assert not torch.equal(default.forward_dense(tokens).logits, other.forward_dense(tokens).logits)


def test_paged_prefill_in_chunks_equals_dense(model: TinyDecoder) -> None:
    """Two chunks of one request through the block table give the dense logits and K/V."""
    sim = DynamicBatchingSim(pressure_config(total_count=16), model=model)
    tokens = [(11 * i) % VOCAB_SIZE for i in range(10)]
    block_ids = sim.allocator.allocate_memory_blocks(3)
    assert block_ids is not None
    slot = sim.block_table.add_request(block_ids.flip(0))  # any block order works
    cache = sim.kv_cache
    assert cache is not None
    rows = []
    for start, stop in ((0, 6), (6, 10)):
        entry = StepEntry(slot, start, stop, tokens[start:stop], wants_logits=True)
        plan = build_paged_batch([], [entry], sim.block_table, 4, model.device)
        rows.append(model.forward_paged(plan.batch, cache).logits[0])
    dense = model.forward_dense(torch.tensor(tokens))
    assert float((torch.stack(rows) - dense.logits[[5, 9]]).abs().max()) < 1e-12
    cached_k, _ = cache.gather(2, block_ids.flip(0))
    assert float((cached_k[:10] - dense.keys[2]).abs().max()) < 1e-12


def test_generation_is_deterministic_and_uses_the_vocabulary(model: TinyDecoder) -> None:
    out, again = reference_output(model, [1, 2, 3], 12), reference_output(model, [1, 2, 3], 12)
    assert out.tokens == again.tokens and torch.equal(out.logits, again.logits)
    assert len(out.tokens) == 12 and all(0 <= token < VOCAB_SIZE for token in out.tokens)
    assert out.logits.shape == (12, VOCAB_SIZE) and out.routing.shape == (15, 1, 2)
    assert len(set(out.tokens)) > 1  # random weights, but not a constant model


# ---------------------------------------------------------------------- misuse


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_kv_heads": 3},
        {"head_dim": 7},
        {"top_k": 9},
        {"moe_layer": 3},
        {"vocab_size": 0},
        {"num_layers": True},
        {"rope_theta": 1.0},
        {"seed": -1},
        {"moe_layer": "1"},
    ],
)
def test_bad_model_config_is_refused(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        TinyDecoderConfig(**kwargs)


def test_bad_dtype_is_refused() -> None:
    with pytest.raises(ConfigError, match="dtype"):
        TinyDecoder(SMALL_MODEL, dtype=torch.int32)


def test_model_and_cache_must_fit_the_loop(model: TinyDecoder) -> None:
    with pytest.raises(ConfigError, match="device"):
        DynamicBatchingSim(pressure_config(device="meta"), model=model)
    with pytest.raises(ConfigError, match="TinyDecoder"):
        DynamicBatchingSim(pressure_config(), model="tiny")  # type: ignore[arg-type]
    wrong_dtype = TinyDecoder(SMALL_MODEL, dtype=torch.float32).new_kv_cache(40, 4)
    with pytest.raises(ConfigError, match="dtype"):
        DynamicBatchingSim(pressure_config(), model=model, kv_cache=wrong_dtype)


def test_out_of_vocabulary_prompts_are_refused_before_anything_changes(
    model: TinyDecoder,
) -> None:
    sim = DynamicBatchingSim(pressure_config(), model=model)
    with pytest.raises(InvalidArgumentError, match="vocabulary"):
        sim.submit(SimRequest.from_tokens("r", [1, VOCAB_SIZE], 1))
    assert sim.is_done and sim.report().num_requests == 0


def test_bad_hook_and_batch_arguments_are_refused(model: TinyDecoder) -> None:
    sim = DynamicBatchingSim(pressure_config(), model=model)
    with pytest.raises(InvalidArgumentError):
        sim.corrupt_block_kv(sim.allocator.dummy_block_id)
    with pytest.raises(ConfigError):
        DynamicBatchingSim(pressure_config()).corrupt_block_kv(0)
    with pytest.raises(InvalidArgumentError):
        build_paged_batch([], [], sim.block_table, 4, model.device)
    slot = sim.block_table.add_request([0])
    with pytest.raises(InvalidArgumentError, match="exactly one token"):
        build_paged_batch(
            [StepEntry(slot, 0, 2, [1, 2], True)], [], sim.block_table, 4, model.device
        )
    with pytest.raises(InvalidArgumentError, match="tokens"):
        build_paged_batch([], [StepEntry(slot, 0, 2, [1], True)], sim.block_table, 4, model.device)
    with pytest.raises(InvalidArgumentError, match="holds 1 blocks"):
        build_paged_batch(
            [], [StepEntry(slot, 0, 5, [1] * 5, True)], sim.block_table, 4, model.device
        )
    with pytest.raises(InvalidArgumentError):
        reference_output(model, [1], -1)
    for bad in (torch.tensor([VOCAB_SIZE]), torch.tensor([1.0]), torch.tensor([]), [1, 2]):
        with pytest.raises(InvalidArgumentError):
            model.forward_dense(bad)  # type: ignore[arg-type]


def test_the_example_serves_a_trace_and_finds_the_runs_identical(
    capsys: pytest.CaptureFixture[str],
) -> None:
    example = Path(__file__).parents[2] / "examples" / "serve_tiny_model.py"
    main = runpy.run_path(str(example), run_name="serve_tiny_model")["main"]
    arguments = "--requests 24 --block-size 4 --policies lru,fifo --reference 3 --plot="
    assert main(arguments.split()) == 0
    lines = capsys.readouterr().out.splitlines()
    assert sum("vs caching off: 24 requests, tokens and experts identical" in x for x in lines) == 2
    assert any("vs dense no-cache model: 3 requests, identical" in line for line in lines)
    table = [line.split() for line in lines if line.startswith(("lru ", "fifo "))]
    saved = [int(row[2].replace(",", "")) for row in table if row[1][0].isdigit()]
    assert len(saved) == 2 and min(saved) > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_serving_matches_the_cpu_reference(references: References) -> None:
    gpu_model = TinyDecoder(SMALL_MODEL, dtype=torch.float64, device="cuda")
    cpu_model = TinyDecoder(SMALL_MODEL, dtype=torch.float64)
    _, outputs = serve(gpu_model, workload(30, seed=0), pressure_config(device="cuda"))
    assert compare_with_reference(cpu_model, outputs, cache=references, atol=1e-9) == []
