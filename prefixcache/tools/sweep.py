"""``prefixcache sweep``: hit rate against cache memory, and the smallest size worth buying.

A sweep is ``compare`` over many capacities with one policy beside the offline
optimum: the same replays (:func:`replay_grid`, which ``compare`` runs too), a
table with the memory each capacity takes when ``--model-shape`` is given, and a
recommendation: the smallest capacity whose hit rate is at least ``1 - --within``
of the best one measured (0.05: 95% of it). Without ``--capacities`` it doubles
from 1/128 of the trace's distinct blocks up to all of them, where a cache holds
everything the trace ever reuses (the unbounded cache's hit rate)::

    $ prefixcache sweep --trace mine.jsonl \
          --model-shape layers=32,kv_heads=8,head_dim=128,dtype=bf16
    $ prefixcache sweep --capacities 8GiB,16GiB,32GiB,64GiB --model-shape ... --within 0.02

>>> recommend({100: 0.20, 200: 0.48, 400: 0.50}, within=0.05)
Recommendation(capacity=200, hit_rate=0.48, best_capacity=400, best_hit_rate=0.5)
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prefixcache.reference.trace import TraceRequest, trace_block_hashes
from prefixcache.tools.cli_arguments import (
    add_memory_arguments,
    add_trace_arguments,
    capacity_list,
    policy_name,
    show_progress,
)
from prefixcache.tools.compare_report import Results
from prefixcache.tools.memory import format_bytes
from prefixcache.tools.replay import OPTIMUM_POLICY, replay

__all__ = ["Recommendation", "add_sweep_parser", "default_capacities", "recommend", "replay_grid"]

DEFAULT_WITHIN = 0.05
DEFAULT_POINTS = 8
"""Capacities a default sweep tries: the trace's distinct blocks, halved 7 times."""


def replay_grid(
    run: Callable[..., Any],
    requests: Sequence[TraceRequest],
    names: Sequence[str],
    capacities: Sequence[int],
    *,
    progress: bool,
) -> Results:
    """Every policy at every capacity: ``run(requests, capacity, name, progress=...)``.

    The loop ``compare`` and ``sweep`` share; ``run`` is
    :func:`~prefixcache.tools.replay.replay` or ``replay_concurrent``.
    Complexity: that of ``len(names) * len(capacities)`` replays.
    """
    return {
        (name, capacity): run(requests, capacity, name, progress=progress)
        for capacity in capacities
        for name in names
    }


@dataclass(frozen=True, slots=True)
class Recommendation:
    """The smallest capacity within a share of the best hit rate a sweep measured.

    Attributes:
        capacity: the recommended capacity, in blocks.
        hit_rate: its hit rate.
        best_capacity: the smallest capacity with the best hit rate measured.
        best_hit_rate: that best hit rate.
    """

    capacity: int
    hit_rate: float
    best_capacity: int
    best_hit_rate: float


def recommend(hit_rates: Mapping[int, float], within: float) -> Recommendation:
    """The smallest capacity whose hit rate is at least ``(1 - within) * best``.

    Args:
        hit_rates: hit rate by capacity (blocks); not empty.
        within: the share of the best hit rate one may give up (0.05: keep 95% of it).

    Raises:
        ValueError: ``hit_rates`` is empty or ``within`` is not in ``[0, 1]``.

    Complexity: O(len(hit_rates)).
    """
    if not hit_rates:
        raise ValueError("no hit rates to recommend from")
    if not 0.0 <= within <= 1.0:
        raise ValueError(f"within must be in [0, 1], got {within!r}")
    best = max(hit_rates.values())
    best_capacity = min(c for c, rate in hit_rates.items() if rate == best)
    chosen = min(c for c, rate in hit_rates.items() if rate >= best * (1.0 - within))
    return Recommendation(chosen, hit_rates[chosen], best_capacity, best)


def default_capacities(requests: Sequence[TraceRequest], points: int = DEFAULT_POINTS) -> list[int]:
    """Doubling capacities up to the trace's distinct blocks (where nothing reused is lost).

    Complexity: O(prompt blocks of the trace).
    """
    distinct = len({h for request in requests for h in trace_block_hashes(request.hash_ids)})
    top = max(distinct, 1)
    return sorted({max(top >> shift, 1) for shift in range(points)})


def add_sweep_parser(commands: Any, epilog: str) -> None:
    """The ``sweep`` command's arguments, on the ``prefixcache`` command's subparsers."""
    sweep = commands.add_parser(
        "sweep",
        help="hit rate against cache memory, with the smallest size worth having",
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_trace_arguments(sweep)
    sweep.add_argument("--policy", default="lru", type=policy_name, help="default: lru")
    sweep.add_argument(
        "--capacities",
        type=capacity_list,
        default=None,
        help="comma-separated capacities, in blocks (5000) or bytes (8GiB, with --model-shape); "
        "default: doubling up to the trace's distinct blocks",
    )
    add_memory_arguments(sweep)
    sweep.add_argument(
        "--within",
        type=_margin,
        default=DEFAULT_WITHIN,
        help="recommend the smallest capacity whose hit rate is within this share of the "
        f"best measured (default: {DEFAULT_WITHIN}, i.e. 95%% of it)",
    )
    sweep.set_defaults(handler=run_sweep)


def _margin(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a share in [0, 1], got {text!r}")
    return value


def run_sweep(args: argparse.Namespace) -> int:
    """Replay the policy and the optimum at every capacity; print the table and the pick."""
    requests = args.requests
    capacities = sorted(args.capacities or default_capacities(requests))
    names = (args.policy, OPTIMUM_POLICY) if args.policy != OPTIMUM_POLICY else (OPTIMUM_POLICY,)

    def run(trace: Sequence[TraceRequest], capacity: int, name: str, *, progress: bool) -> Any:
        return replay(trace, capacity, name, progress=progress, block_size=args.block_size)

    results = replay_grid(run, requests, names, capacities, progress=show_progress(args))
    block_bytes = args.model_shape.bytes_per_block(args.block_size) if args.model_shape else None
    print(f"{args.trace_path.name}: {len(requests)} requests, one at a time, {args.policy}\n")
    print(_table(results, args.policy, capacities, block_bytes))
    rates = {capacity: results[args.policy, capacity].hit_rate for capacity in capacities}
    pick = recommend(rates, args.within)
    print(
        f"\nrecommended: {_size(pick.capacity, block_bytes)}, {args.policy} hit rate "
        f"{pick.hit_rate:.3f}: the smallest capacity with {1 - args.within:.0%} of the best "
        f"hit rate measured, {pick.best_hit_rate:.3f} at {_size(pick.best_capacity, block_bytes)}"
    )
    if args.capacities is None:
        print("(the largest capacity holds every distinct block: no cache can do better)")
    elif len(capacities) > 1 and rates[capacities[-1]] > rates[capacities[-2]]:
        print("note: the hit rate still grows at the largest capacity tried; try larger ones")
    return 0


def _size(capacity: int, block_bytes: int | None) -> str:
    if block_bytes is None:
        return f"{capacity:,} blocks"
    return f"{format_bytes(capacity * block_bytes)} ({capacity:,} blocks)"


def _table(
    results: Results, policy: str, capacities: Sequence[int], block_bytes: int | None
) -> str:
    memory = ("memory | ", "---: | ") if block_bytes is not None else ("", "")
    lines = [
        f"| {memory[0]}blocks | {policy} | {OPTIMUM_POLICY} | {policy} / {OPTIMUM_POLICY} "
        "| tokens saved |",
        f"| {memory[1]}---: | ---: | ---: | ---: | ---: |",
    ]
    for capacity in capacities:
        result, optimum = results[policy, capacity], results[OPTIMUM_POLICY, capacity]
        share = f"{result.hit_rate / optimum.hit_rate:.2f}" if optimum.hit_rate else "-"
        size = f"{format_bytes(capacity * block_bytes)} | " if block_bytes is not None else ""
        lines.append(
            f"| {size}{capacity:,} | {result.hit_rate:.3f} | {optimum.hit_rate:.3f} | {share} "
            f"| {result.tokens_saved:,} |"
        )
    return "\n".join(lines)
