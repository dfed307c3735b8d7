"""Every policy against the offline optimum on both sides of the train/test split.

Replays (the no-concurrency model of ``prefixcache.tools.replay``, through
``prefixcache.tools.sweep.replay_grid`` as ``prefixcache compare`` does) every
trace of :mod:`prefixcache.tools.workloads.split`, train side then test side,
with every built-in policy (``auto`` included; ``ref_zero`` left out: it
caches nothing) and ``belady``, at three capacities per trace, and prints
markdown: per trace, each policy's hit rate and its share of the optimum; per
side, a summary against issue 26's bounds.

Capacities (:func:`capacities`): small, mid and large are 2%, 10% and 40% of
the trace's distinct blocks (rounded, at least 1 block). A fixed block count
would be large for one family and tiny for another; a share of the distinct
blocks puts every trace in the same regime: 40% holds most of what is
reused, 2% holds only the hottest prefixes.

Usage, from the repository root::

    python benchmarks/bench_policy_split.py  # 1,500 requests a trace (the sample's length)
    python benchmarks/bench_policy_split.py --quick  # 300 requests a trace
    python benchmarks/bench_policy_split.py --policies lru,s3fifo,auto --out table.md
    python benchmarks/bench_policy_split.py --sides test  # the README's table: test side only

Policies run on the default engine: the native one for every built-in, the
Python one for ``belady`` (the hit rates are the same on both: the native
policies are bit-identical to their Python classes).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from prefixcache.reference.trace import TraceRequest
from prefixcache.tools.replay import OPTIMUM_POLICY, online_policies, replay
from prefixcache.tools.sweep import default_capacities, replay_grid
from prefixcache.tools.workloads import split

SHARES = {"small": 0.02, "mid": 0.10, "large": 0.40}
"""Capacity as a share of the trace's distinct blocks."""
LRU_MARGIN = 0.005  # issue 26: auto >= LRU - 0.005
BEST_MARGIN = 0.01  # issue 26: auto >= best built-in - 0.01
CHAT_SHARE = 0.60  # issue 26: >= 0.60 of the optimum at mid capacity on chat families
QUICK_REQUESTS = 300
DEFAULT_REQUESTS = 1500

Rates = dict[tuple[str, str], float]  # (policy, capacity label) -> hit rate


def capacities(requests: Sequence[TraceRequest]) -> dict[str, int]:
    """Small, mid and large capacity of a trace: :data:`SHARES` of its distinct blocks, >= 1.

    >>> from prefixcache.reference.trace import TraceRequest
    >>> capacities([TraceRequest(0, 512 * 100, 1, tuple(range(100)))])
    {'small': 2, 'mid': 10, 'large': 40}
    """
    distinct = default_capacities(requests, points=1)[0]  # the trace's distinct blocks
    return {label: max(1, round(distinct * share)) for label, share in SHARES.items()}


def run_trace(
    requests: Sequence[TraceRequest], names: Sequence[str]
) -> tuple[dict[str, int], Rates]:
    """Every policy and the optimum at the trace's three capacities: the hit rates."""
    sizes = capacities(requests)
    results = replay_grid(
        replay, requests, [*names, OPTIMUM_POLICY], list(sizes.values()), progress=False
    )
    rates = {
        (name, label): results[name, size].hit_rate
        for label, size in sizes.items()
        for name in [*names, OPTIMUM_POLICY]
    }
    return sizes, rates


def trace_table(
    title: str, sizes: Mapping[str, int], rates: Rates, names: Sequence[str]
) -> list[str]:
    """One trace: a row per policy, ``hit rate (share of optimum)`` per capacity."""
    head = " | ".join(f"{label} ({size:,})" for label, size in sizes.items())
    lines = [f"#### {title}", "", f"| policy | {head} |", "| --- |" + " ---: |" * len(sizes)]
    for name in [*names, OPTIMUM_POLICY]:
        cells = []
        for label in sizes:
            optimum = rates[OPTIMUM_POLICY, label]
            share = rates[name, label] / optimum if optimum else 0.0
            cells.append(f"{rates[name, label]:.3f} ({share:.2f})")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return [*lines, ""]


def summary(runs: Mapping[tuple[str, int | None], Rates], names: Sequence[str]) -> list[str]:
    """Per policy, over every cell (trace x capacity) of one side: the bounds of issue 26."""
    builtins = [name for name in names if name != "auto"] or list(names)
    cells = [(key, label) for key in runs for label in SHARES]
    chat = [key for key in runs if key[0] in split.CHAT_FAMILIES]
    lines = [
        f"| policy | mean hit rate | cells >= lru - {LRU_MARGIN} | cells >= best built-in - "
        f"{BEST_MARGIN} | cells best | mean share of optimum, mid | min share, mid, chat |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name in names:
        near_lru = near_best = best = 0
        for key, label in cells:
            rates = runs[key]
            rate = rates[name, label]
            top = max(rates[other, label] for other in builtins)
            near_lru += "lru" not in names or rate >= rates["lru", label] - LRU_MARGIN
            near_best += rate >= top - BEST_MARGIN
            best += rate >= max(rates[other, label] for other in names)
        shares = [_share(runs[key], name, "mid") for key in runs]
        chat_shares = [_share(runs[key], name, "mid") for key in chat]
        lowest_chat = f"{min(chat_shares):.2f}" if chat_shares else "-"
        mean_rate = statistics.fmean(runs[key][name, label] for key, label in cells)
        lines.append(
            f"| {name} | {mean_rate:.3f} | {near_lru}/{len(cells)} | {near_best}/{len(cells)} "
            f"| {best}/{len(cells)} | {statistics.fmean(shares):.2f} | {lowest_chat} |"
        )
    return [*lines, ""]


def family_table(
    runs: Mapping[tuple[str, int | None], Rates], names: Sequence[str], lead: str = "auto"
) -> list[str]:
    """Per trace, the share of the optimum of ``lru``, ``lead`` and the best built-in.

    The README's policy table (issue 26, item 5): one row a trace, each cell
    ``small / mid / large`` shares; the best built-in is named at mid capacity.
    """
    heads = " | ".join(f"{name}: small / mid / large" for name in ("lru", lead, "best built-in"))
    lines = [f"| trace | {heads} | optimum, mid |", "| --- |" + " ---: |" * 4]
    for (family, seed), rates in runs.items():
        best = {
            label: max((name for name in names if name != lead), key=lambda n: rates[n, label])
            for label in SHARES
        }
        row = [
            f"`{family}`" + (f" seed {seed}" if seed is not None else ""),
            _shares(rates, dict.fromkeys(SHARES, "lru")) if "lru" in names else "-",
            _shares(rates, dict.fromkeys(SHARES, lead)) if lead in names else "-",
            f"{_shares(rates, best)} (mid: {best['mid']})",
            f"{rates[OPTIMUM_POLICY, 'mid']:.3f}",
        ]
        lines.append("| " + " | ".join(row) + " |")
    return [*lines, ""]


def _shares(rates: Rates, policy_at: Mapping[str, str]) -> str:
    """``small / mid / large``: the share of the optimum of ``policy_at[label]`` at each."""
    return " / ".join(f"{_share(rates, policy_at[label], label):.2f}" for label in SHARES)


def _share(rates: Rates, name: str, label: str) -> float:
    optimum = rates[OPTIMUM_POLICY, label]
    return rates[name, label] / optimum if optimum else 0.0


def _title(family: str, seed: int | None, requests: Sequence[TraceRequest]) -> str:
    if seed is None:
        return f"`{family}` ({len(requests):,} requests)"
    return f"`{family}({len(requests)}, seed={seed})`"


def header(argv: Sequence[str]) -> list[str]:
    """The command, commit and machine the tables come from."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from machine import cpu_model  # benchmarks/machine.py, beside this script

    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "?"
    return [
        "Command: `python " + " ".join(["benchmarks/bench_policy_split.py", *argv]) + "`",
        f"(commit {commit}; {cpu_model()}, {os.cpu_count()} CPUs, {platform.platform()}, "
        f"Python {platform.python_version()}). Cells: hit rate (share of the optimum).",
        "",
    ]


def main(argv: list[str] | None = None) -> None:
    """Parse the arguments, replay both sides, print (and optionally write) the markdown."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=DEFAULT_REQUESTS)
    parser.add_argument(
        "--quick", action="store_true", help=f"{QUICK_REQUESTS} requests a trace (about a minute)"
    )
    default_policies = [name for name in online_policies() if name != "ref_zero"]
    parser.add_argument("--policies", default=",".join(default_policies))
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--sides", default="train,test", help="which sides to replay: train, test or both"
    )
    args = parser.parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    num_requests = QUICK_REQUESTS if args.quick else args.requests
    names = [name for name in args.policies.split(",") if name != OPTIMUM_POLICY]
    lines = ["## Train/test split: every policy against the optimum", "", *header(argv)]
    start = time.perf_counter()
    sides = [side for side in args.sides.split(",") if side]
    if not sides or set(sides) - {"train", "test"}:
        parser.error(f"--sides takes train, test or train,test; got {args.sides!r}")
    for side, pairs in (("train", split.TRAIN), ("test", split.TEST)):
        if side not in sides:
            continue
        runs: dict[tuple[str, int | None], Rates] = {}
        tables: list[str] = []
        for family, seed in pairs:
            requests = split.load_trace(family, seed, num_requests)
            sizes, runs[family, seed] = run_trace(requests, names)
            tables += trace_table(_title(family, seed, requests), sizes, runs[family, seed], names)
            elapsed = time.perf_counter() - start
            print(f"{side} {family} {seed}: {elapsed:.0f} s", file=sys.stderr, flush=True)
        lines += [f"### {side.capitalize()} side: summary ({len(pairs)} traces x 3 capacities)", ""]
        lines += summary(runs, names)
        lines += [f"Share of the optimum per trace ({side} side):", "", *family_table(runs, names)]
        lines += tables
    lines.append(f"Run time: {time.perf_counter() - start:.0f} s.")
    text = "\n".join(lines)
    if args.out is not None:
        args.out.write_text(text + "\n", encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
