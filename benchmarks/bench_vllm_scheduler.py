"""Queue hints inside vLLM: hit rates of a trace served by vLLM's real ``Scheduler`` with
the plugin, hints off and on, beside the reference loop's (``bench_queue_hints.py``).

Each trace request becomes a vLLM ``Request`` (``bench_vllm_manager.prompts``: ``BLOCK_SIZE``
equal tokens per trace block, so prompts share vLLM block hashes where the trace shares
blocks). The trace's 512-token blocks are 16 tokens here, so time is scaled by 32 too, to
keep the reference loop's load in blocks: ``output_length`` / 32 output tokens (at least
one), a step here for 32 of the reference loop's (arrival at step ``timestamp_ms //
(32 * step_ms)``), and its 8,192 tokens a step (256 of its blocks per 32 steps). At most
``--in-flight`` requests run (``max_num_seqs``); tokens are sampled by a stand-in model
runner (``update_from_output`` with one token per request whose prompt
is done). The pool holds the trace's mid capacity (10% of its distinct blocks, as
``bench_queue_hints.py``), at least the largest request. The hit rate is the prompt tokens
found cached at each admission over the tokens admitted (a preempted request's
readmission counts again, as the reference loop counts it; the preemptions are printed).

Columns: ``vLLM`` (this loop: hints off, then on with ``--share``), ``reference`` (the
reference loop, ``replay_concurrent``, hints off and on, same N and step), ``belady`` (its
look-ahead reference). Run where vLLM 0.33 is installed, from the checkout::

    PYTHONPATH=. $PEERS_VENV/bin/python benchmarks/bench_vllm_scheduler.py --requests 300
"""

from __future__ import annotations

import argparse
import functools
import importlib
import platform
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_policy_split import capacities
from bench_vllm_manager import BLOCK_SIZE, prompts

from prefixcache.integrations import vllm as plugin
from prefixcache.reference.trace import TRACE_BLOCK_SIZE, TraceRequest
from prefixcache.testing.vllm_scheduler import make_request, make_scheduler, run_step
from prefixcache.tools.replay import OPTIMUM_POLICY, replay_concurrent
from prefixcache.tools.workloads import split

SCALE = TRACE_BLOCK_SIZE // BLOCK_SIZE  # trace tokens per token here
STEP_TOKEN_BUDGET = 8192  # replay_concurrent's default, tokens a step


def serve(
    requests: list[TraceRequest], capacity: int, policy: str, share: float, args: Any
) -> tuple[float, int, float]:
    """Hit rate, preemptions and seconds of ``requests`` through vLLM's scheduler."""
    plugin.install(policy, queue_hints=share)
    tokens = prompts(requests)
    lengths = [len(t) + r.output_length // SCALE + 1 for t, r in zip(tokens, requests, strict=True)]
    longest = -(-max(lengths) // BLOCK_SIZE)
    scheduler = make_scheduler(
        Path(args.model_dir),
        max(capacity, longest) + 1,
        max_num_seqs=args.in_flight,
        max_num_batched_tokens=STEP_TOKEN_BUDGET,
        max_model_len=BLOCK_SIZE * (longest + 1),
    )
    pending = deque(sorted(range(len(requests)), key=lambda i: requests[i].timestamp_ms))
    live: dict[str, Any] = {}
    step = preemptions = 0
    fresh: dict[str, int] = {}  # the live requests with nothing computed: their prompt tokens
    admitted: list[tuple[int, int]] = []  # (hit tokens, prompt tokens) of each admission

    def count_admissions(output: Any) -> None:
        for request_id, count in output.num_scheduled_tokens.items():
            if request_id in fresh:  # an admission (a readmission after a preemption too)
                request = live[request_id]
                admitted.append((request.num_computed_tokens - count, fresh[request_id]))

    start = time.perf_counter()
    while pending or live:
        while pending and requests[pending[0]].timestamp_ms // (args.step_ms * SCALE) <= step:
            index = pending.popleft()
            out_tokens = max(1, requests[index].output_length // SCALE)
            request = make_request(str(index), tokens[index], BLOCK_SIZE, out_tokens)
            live[request.request_id] = request
            scheduler.add_request(request)
        if not live:
            step = requests[pending[0]].timestamp_ms // (args.step_ms * SCALE)
            continue
        fresh.clear()
        fresh.update({i: r.num_tokens for i, r in live.items() if r.num_computed_tokens == 0})
        output = run_step(scheduler, live, count_admissions)
        preemptions += len(getattr(output, "preempted_req_ids", None) or ())
        step += 1
    plugin.uninstall()
    hit_tokens = sum(hit for hit, _ in admitted)
    prompt_tokens = sum(prompt for _, prompt in admitted)
    return hit_tokens / prompt_tokens, preemptions, time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    """Parse the arguments, serve each trace hints off and on, print markdown."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--side", choices=("train", "test"), default="test")
    parser.add_argument("--families", default=",".join(split.CHAT_FAMILIES))
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--in-flight", type=int, default=16)
    parser.add_argument("--step-ms", type=int, default=50)
    parser.add_argument("--policies", default="lru,s3fifo")
    parser.add_argument("--share", type=float, default=1.0, help="hint share when on")
    parser.add_argument("--model-dir", default=tempfile.mkdtemp(prefix="tiny-llama-"))
    args = parser.parse_args(argv)
    vllm = importlib.import_module("vllm")
    print(
        f"vLLM {vllm.__version__}, Python {platform.python_version()}, N = {args.in_flight}, "
        f"{args.step_ms} ms a step, hint share {args.share}, {args.requests} requests\n"
    )
    print("| trace | policy | vLLM off | vLLM on | ref. off | ref. on | belady | preempted |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    pairs = [
        p
        for p in (split.TRAIN if args.side == "train" else split.TEST)
        if p[0] in args.families.split(",")
    ]
    for family, seed in pairs:
        requests = split.load_trace(family, seed, args.requests)
        capacity = capacities(requests)["mid"]
        reference = functools.partial(
            replay_concurrent, requests, capacity, max_requests=args.in_flight, step_ms=args.step_ms
        )
        best = reference(OPTIMUM_POLICY).hit_rate
        for policy in args.policies.split(","):
            off, pre_off, seconds_off = serve(requests, capacity, policy, 0.0, args)
            on, pre_on, seconds = serve(requests, capacity, policy, args.share, args)
            ref_off = reference(policy).hit_rate
            ref_on = reference(policy, queue_hints=True).hit_rate
            print(
                f"| {family}({seed}), {capacity} blocks | {policy} | {off:.3f} | {on:.3f} | "
                f"{ref_off:.3f} | {ref_on:.3f} | {best:.3f} | "
                f"{pre_off}/{pre_on} |",
                flush=True,
            )
            print(
                f"{family} {policy}: vLLM runs {seconds_off:.1f} s hints off, {seconds:.1f} s on",
                file=sys.stderr,
                flush=True,
            )


if __name__ == "__main__":
    main()
