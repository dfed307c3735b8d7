"""Hit rates of ``auto`` against every built-in policy and the offline optimum.

Replays (the no-concurrency model of ``prefixcache.tools.replay``) the Mooncake
trace and the generated families of ``prefixcache.tools.workloads`` at several
capacities, through the Python engine, and writes one markdown table per
trace: each policy's hit rate, the optimum, the best built-in policy and
``auto`` minus it. It then times ``lru`` and ``auto`` on the first trace.

Usage, from the repository root::

    python benchmarks/bench_auto.py \\
        --trace ../shared/traces/mooncake_synthetic_trace.jsonl \\
        --out benchmarks/results/auto_<date>_<commit>.md

``--trace`` defaults to ``../shared/traces/mooncake_synthetic_trace.jsonl``
(the full Mooncake trace beside the checkout; a missing file is skipped
with a note) and ``--seeds 0,1`` picks the generated traces (4,000
requests each, ``--requests``) of the families in ``--families`` (default:
all). ``--time-only`` skips the tables and times lru and auto on the first
trace (interleaved runs, median CPU seconds of ``--repeats``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

os.environ.setdefault("PREFIXCACHE_ENGINE", "python")  # every policy on the same engine

from prefixcache import policies
from prefixcache.reference.trace import TraceRequest, load_mooncake_trace
from prefixcache.tools import workloads
from prefixcache.tools.replay import OPTIMUM_POLICY, replay

SKIPPED = ("ref_zero", OPTIMUM_POLICY, "auto")  # ref_zero caches nothing
FAMILIES: dict[str, Callable[..., list[TraceRequest]]] = {
    "shared_system_prompts": workloads.shared_system_prompts,
    "multi_turn_chats": workloads.multi_turn_chats,
    "documents_with_hot_prefixes": workloads.documents_with_hot_prefixes,
    "agent_tool_loops": workloads.agent_tool_loops,
    "document_qa": workloads.document_qa,
}


def table(name: str, trace: Sequence[TraceRequest], capacities: list[int]) -> list[str]:
    """One markdown table: every policy's hit rate per capacity, the optimum, auto's margin."""
    builtins = [p for p in policies.available() if p not in SKIPPED]
    names = ["auto", *builtins]
    lines = [
        f"### {name}",
        "",
        "| capacity | "
        + " | ".join(names)
        + " | optimum | best built-in | auto - best | auto / opt |",
        "| ---: |" + " ---: |" * (len(names) + 4),
    ]
    for capacity in capacities:
        rates = {p: replay(trace, capacity, p).hit_rate for p in names}
        optimum = replay(trace, capacity, OPTIMUM_POLICY).hit_rate
        best = max(builtins, key=lambda p: rates[p])
        cells = [f"{rates[p]:.3f}" for p in names]
        share = rates["auto"] / optimum if optimum else 0.0
        lines.append(
            f"| {capacity:,} | "
            + " | ".join(cells)
            + f" | {optimum:.3f} | {best} {rates[best]:.3f} | {rates['auto'] - rates[best]:+.3f}"
            + f" | {share:.2f} |"
        )
        print(lines[-1], file=sys.stderr, flush=True)
    return [*lines, ""]


def throughput(trace: Sequence[TraceRequest], capacity: int, repeats: int) -> list[str]:
    """Replay CPU seconds of lru and auto on the Python engine: interleaved, median of ``repeats``.

    CPU time of this process (``time.process_time``), so that other work on
    a shared machine inflates neither; the runs alternate so that drift
    hits both. The ratio is the figure to compare (the issue's bound: 2).
    """
    seconds: dict[str, list[float]] = {"lru": [], "auto": []}
    for _ in range(repeats):
        for policy in seconds:
            seconds[policy].append(_timed(trace, capacity, policy))
    lines = [
        "| policy | capacity | median CPU seconds | requests/s | / lru |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    lru = statistics.median(seconds["lru"])
    for policy, runs in seconds.items():
        median = statistics.median(runs)
        lines.append(
            f"| {policy} | {capacity:,} | {median:.2f} | {len(trace) / median:,.0f} "
            f"| {median / lru:.2f} |"
        )
    return [*lines, ""]


def _timed(trace: Sequence[TraceRequest], capacity: int, policy: str) -> float:
    start = time.process_time()
    replay(trace, capacity, policy)
    return time.process_time() - start


def main(argv: list[str] | None = None) -> None:
    """Parse the arguments, run every table, write the markdown."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--trace", type=Path, default=Path("../shared/traces/mooncake_synthetic_trace.jsonl")
    )
    parser.add_argument("--capacities", default="1000,5000,20000")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument(
        "--families", default=",".join(FAMILIES), help="comma-separated generated families"
    )
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--time-only", action="store_true", help="only the replay times of lru and auto"
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    capacities = [int(c) for c in args.capacities.split(",")]
    traces: list[tuple[str, Sequence[TraceRequest]]] = []
    if args.trace.is_file():
        traces.append((f"Mooncake trace (`{args.trace.name}`)", load_mooncake_trace(args.trace)))
    else:
        print(f"note: {args.trace} not found; generated families only", file=sys.stderr)
    for seed in (int(s) for s in args.seeds.split(",")):
        for family in args.families.split(","):
            generate = FAMILIES[family]
            traces.append(
                (f"`{family}({args.requests}, seed={seed})`", generate(args.requests, seed=seed))
            )
    lines = [
        "# `auto` against every built-in policy and the offline optimum",
        "",
        "Command: `python " + " ".join(["benchmarks/bench_auto.py", *(argv or sys.argv[1:])]) + "`",
        "(no-concurrency replay model, Python engine; hit rate = hit blocks / prompt blocks).",
        "",
    ]
    if not args.time_only:
        for name, trace in traces:
            lines += table(name, trace, capacities)
    first_name, first = traces[0]
    lines += [f"### Replay time on {first_name}, median of {args.repeats}, interleaved", ""]
    lines += throughput(first, capacities[len(capacities) // 2], args.repeats)
    text = "\n".join(lines)
    if args.out is not None:
        args.out.write_text(text + "\n", encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
