"""Serve a tiny model through prefixcache: what prefix caching saves, and that it changes no token.

Run it from the repository root::

    python examples/serve_tiny_model.py                    # about 23 s of CPU, 30 s wall, 2 cores
    python examples/serve_tiny_model.py --device cuda      # when a GPU is present
    python examples/serve_tiny_model.py --family multi_turn_chats --policies lru,arc,fifo

A few hundred requests of a trace family (:mod:`prefixcache.tools.workloads`,
scaled from 512-token blocks down to ``--block-size``) arrive over time and are
served by the dynamic-batching loop in model mode: a seeded 3-layer decoder
with grouped-query attention, rotary positions and one mixture-of-experts layer
(:mod:`prefixcache.reference.model`), whose attention reads and writes K/V only
through the block table and the KV cache that prefixcache manages. The loop
batches prefill chunks and decodes, prefills only what the prefix cache misses,
decodes greedily, pauses and evicts under memory pressure.

It prints, per eviction policy and once with prefix caching off, the prefill
tokens computed and saved and the wall time per step; checks that every request
generated the same tokens and routed experts with caching on as off (and, for
the first ``--reference`` requests, as the dense no-cache model); and, when
matplotlib is installed, plots tokens saved and hit rate over time per policy.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

import torch

from prefixcache.reference.model import TinyDecoder, TinyDecoderConfig
from prefixcache.reference.model_serving import (
    RequestOutput,
    compare_outputs,
    compare_with_reference,
    logits_tolerance,
)
from prefixcache.reference.sim import DynamicBatchingSim, SimConfig, SimRequest
from prefixcache.reference.trace import TRACE_BLOCK_SIZE, TraceRequest
from prefixcache.tools import workloads

# Each family, shrunk so a few hundred requests run in seconds on a CPU (in trace blocks).
FAMILIES = {
    "shared_system_prompts": lambda n, seed: workloads.shared_system_prompts(
        n, seed=seed, num_prompts=40, prompt_blocks=12, max_user_blocks=6
    ),
    "multi_turn_chats": lambda n, seed: workloads.multi_turn_chats(
        n, seed=seed, num_conversations=40, first_turn_blocks=8, max_turn_blocks=3, max_turns=6
    ),
    "documents_with_hot_prefixes": lambda n, seed: workloads.documents_with_hot_prefixes(
        n,
        seed=seed,
        min_document_blocks=16,
        max_document_blocks=40,
        num_hot_prefixes=10,
        hot_prefix_blocks=12,
        max_question_blocks=3,
    ),
}


@dataclass
class Run:
    """One served run: its label, totals, step times and what each request produced."""

    label: str
    wall_s: float
    cpu_s: float  # this process's CPU time: steadier than wall time on a shared machine
    step_s: list[float]
    saved: list[int]  # cumulative prefill tokens saved after each step
    prompt: list[int]  # cumulative prompt tokens admitted after each step
    prefill_tokens: int
    prefill_tokens_saved: int
    num_evicted_blocks: int
    num_pauses: int
    outputs: list[RequestOutput]


def scale(
    trace: list[TraceRequest], block_size: int, max_output: int, ms_per_step: int
) -> list[SimRequest]:
    """Trace requests with each 512-token block shrunk to ``block_size`` tokens."""
    requests = []
    for index, request in enumerate(trace):
        length = -(-request.input_length * block_size // TRACE_BLOCK_SIZE)
        output = min(max_output, max(1, request.output_length * block_size // TRACE_BLOCK_SIZE))
        requests.append(
            SimRequest.from_hash_ids(
                index,
                request.hash_ids,
                length,
                output,
                arrival_step=request.timestamp_ms // ms_per_step,
            )
        )
    return requests


def serve(model: TinyDecoder, requests: list[SimRequest], config: SimConfig, label: str) -> Run:
    """Serve ``requests``, drawing a plain-text progress bar."""
    sim = DynamicBatchingSim(config, model=model)
    for request in requests:
        sim.submit(request)
    step_s, saved, prompt = [], [], []
    done = total_saved = total_prompt = 0
    tty = sys.stdout.isatty()  # redraw the bar in place on a terminal; one line in a log
    start, cpu_start = time.perf_counter(), time.process_time()
    while not sim.is_done:
        before = time.perf_counter()
        step = sim.step()
        step_s.append(time.perf_counter() - before)
        done += step.num_finished
        total_saved += step.prefill_tokens_saved
        total_prompt += step.prompt_tokens
        saved.append(total_saved)
        prompt.append(total_prompt)
        if (sim.num_steps % 20 == 0 and tty) or sim.is_done:
            bar = "#" * (30 * done // len(requests))
            sys.stdout.write(
                f"\r  {label:<10} [{bar:<30}] {done:4d}/{len(requests)} requests, "
                f"{sim.num_steps:5d} steps"
            )
            sys.stdout.flush()
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    print(f"  {wall:5.1f} s")
    report = sim.report()
    return Run(
        label,
        wall,
        cpu,
        step_s,
        saved,
        prompt,
        report.prefill_tokens,
        report.prefill_tokens_saved,
        report.num_evicted_blocks,
        report.num_pauses,
        sim.outputs,
    )


def print_table(runs: list[Run], uncached: Run) -> None:
    """Prefill tokens computed and saved, steps and time per step, per run."""
    columns = ("computed", "saved", "hit rate", "evicted", "pauses", "steps", "ms/step")
    print(f"\n{'prefill':<10} " + " ".join(f"{name:>8}" for name in columns), end="")
    print(f" {'wall s':>7} {'cpu s':>7} {'cpu vs off':>10}")
    for run in [uncached, *runs]:
        admitted = run.prefill_tokens + run.prefill_tokens_saved
        print(
            f"{run.label:<10} {run.prefill_tokens:>8,} {run.prefill_tokens_saved:>8,} "
            f"{run.prefill_tokens_saved / max(admitted, 1):>8.1%} {run.num_evicted_blocks:>8,} "
            f"{run.num_pauses:>8,} {len(run.step_s):>8,} "
            f"{1000 * run.wall_s / len(run.step_s):>8.2f} {run.wall_s:>7.2f} "
            f"{run.cpu_s:>7.2f} {uncached.cpu_s / run.cpu_s:>9.2f}x"
        )


def check_identity(model: TinyDecoder, runs: list[Run], uncached: Run, num_reference: int) -> bool:
    """Same tokens and routed experts with caching on as off, and as the dense model."""
    ok = True
    for run in runs:
        problems = compare_outputs(
            run.outputs, uncached.outputs, atol=logits_tolerance(model.dtype)
        )
        ok &= not problems
        verdict = (
            "identical" if not problems else f"{len(problems)} DIFFERENCES, first: {problems[0]}"
        )
        print(
            f"{run.label:<10} vs caching off: {len(run.outputs)} requests, "
            f"tokens and experts {verdict}"
        )
    if num_reference and runs:
        # The first requests by ID: the dense reference recomputes every prefix, so sample.
        sample = sorted(runs[0].outputs, key=lambda output: int(output.request_id))[:num_reference]
        problems = compare_with_reference(model, sample)
        ok &= not problems
        verdict = "identical" if not problems else f"{len(problems)} DIFFERENCES: {problems[0]}"
        print(f"{runs[0].label:<10} vs dense no-cache model: {len(sample)} requests, {verdict}")
    return ok


def plot(runs: list[Run], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install matplotlib): no plot")
        return
    figure, (saved_axis, rate_axis) = plt.subplots(1, 2, figsize=(11, 4))
    for run in runs:
        steps = range(1, len(run.saved) + 1)
        saved_axis.plot(steps, run.saved, label=run.label)
        rate_axis.plot(
            steps,
            [s / p if p else 0.0 for s, p in zip(run.saved, run.prompt, strict=True)],
            label=run.label,
        )
    saved_axis.set(xlabel="step", ylabel="prefill tokens saved (cumulative)")
    rate_axis.set(xlabel="step", ylabel="prefix hit rate (cumulative, tokens)", ylim=(0, 1))
    rate_axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    print(f"plot written to {path}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=sorted(FAMILIES), default="shared_system_prompts")
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument(
        "--policies", default="lru,s3fifo,arc", help="comma-separated; 'all' for every one"
    )
    parser.add_argument("--blocks", type=int, default=160, help="KV blocks in the pool")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-output", type=int, default=16, help="cap on generated tokens")
    parser.add_argument(
        "--ms-per-step", type=int, default=400, help="trace time one step stands for"
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (small matrices)")
    parser.add_argument(
        "--reference", type=int, default=20, help="requests checked against the dense model"
    )
    parser.add_argument("--plot", default="serve_tiny_model.png", help="'' for no plot")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("--device cuda: no CUDA device here", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    names = args.policies.split(",")
    if args.policies == "all":
        from prefixcache import policies

        names = [name for name in policies.available() if name != "belady"]  # belady is offline
    model = TinyDecoder(
        TinyDecoderConfig(seed=args.seed), dtype=getattr(torch, args.dtype), device=args.device
    )
    trace = FAMILIES[args.family](args.requests, args.seed)
    requests = scale(trace, args.block_size, args.max_output, args.ms_per_step)
    prompt_tokens = sum(request.input_length for request in requests)
    print(
        f"{len(requests)} requests of {args.family}, {prompt_tokens:,} prompt tokens; model of "
        f"{model.num_parameters * model.dtype.itemsize / 1e6:.1f} MB on {model.device}; "
        f"{args.blocks} blocks of {args.block_size} tokens"
    )

    longest = max(request.input_length + request.output_length for request in requests)

    def config(policy: str, caching: bool = True) -> SimConfig:
        return SimConfig(
            total_count=args.blocks,
            paused_count=args.blocks // 8,
            block_size=args.block_size,
            max_requests=32,
            max_blocks_per_request=longest // args.block_size + 1,
            step_token_budget=512,
            device=args.device,
            eviction_policy=policy,
            enable_prefix_caching=caching,
        )

    uncached = serve(model, requests, config("lru", caching=False), "no caching")
    runs = [serve(model, requests, config(name), name) for name in names]
    print_table(runs, uncached)
    print()
    ok = check_identity(model, runs, uncached, args.reference)
    if args.plot:
        plot(runs, args.plot)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
