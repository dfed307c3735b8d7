"""``prefixcache sweep``: hit rate against cache memory, and the smallest size worth buying.

A sweep is ``compare`` over many capacities with one policy beside the offline
optimum: the same replays (:func:`replay_grid`, which ``compare`` runs too), a
table with the memory each capacity takes when ``--model-shape`` is given and what
each step up bought, and two sizes:

- recommended, the knee (:func:`knee`): the smallest capacity past which memory buys
  less hit rate than it does on average over the sweep, i.e. past which every step
  gains less per block than ``--knee-slope`` (default 1) times the chord from the
  smallest capacity's hit rate to the largest one's. Where the hit rate saturates, the
  knee is where it flattens; where it never does (a trace whose reuse spans every
  capacity tried), the knee is where the gains per GiB start falling, not the largest
  capacity. It depends on the range swept: a longer flat tail lowers the average.
- the smallest capacity whose hit rate is at least ``1 - --within`` of the best one
  measured (:func:`recommend`; 0.05: 95% of it), for whoever needs that hit rate.

Without ``--capacities`` it doubles from 1/128 of the trace's distinct blocks up to
all of them, where a cache holds everything the trace ever reuses (the unbounded
cache's hit rate)::

    $ prefixcache sweep --trace mine.jsonl \
          --model-shape layers=32,kv_heads=8,head_dim=128,dtype=bf16
    $ prefixcache sweep --capacities 8GiB,16GiB,32GiB,64GiB --model-shape ... --within 0.02

>>> recommend({100: 0.20, 200: 0.48, 400: 0.50}, within=0.05)
Recommendation(capacity=200, hit_rate=0.48, best_capacity=400, best_hit_rate=0.5)
>>> knee({100: 0.10, 200: 0.30, 400: 0.50, 800: 0.55}).capacity  # chord: 0.45 / 700 blocks
400
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

__all__ = [
    "Knee",
    "Recommendation",
    "add_sweep_parser",
    "default_capacities",
    "knee",
    "recommend",
    "replay_grid",
]

DEFAULT_WITHIN = 0.05
DEFAULT_KNEE_SLOPE = 1.0
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


@dataclass(frozen=True, slots=True)
class Knee:
    """Where added memory stops paying its average: :func:`knee`'s answer.

    Attributes:
        capacity: the knee, in blocks.
        hit_rate: its hit rate.
        average_gain: hit rate per block over the sweep: (last rate - first rate) /
            (last capacity - first capacity); 0.0 with one capacity.
        next_capacity: the next capacity measured (None: the knee is the largest).
        next_gain: hit rate per block from the knee to ``next_capacity`` (None likewise).
    """

    capacity: int
    hit_rate: float
    average_gain: float
    next_capacity: int | None
    next_gain: float | None


def knee(hit_rates: Mapping[int, float], slope: float = DEFAULT_KNEE_SLOPE) -> Knee:
    """The smallest capacity past which every step gains less than ``slope`` x average.

    The steps are between consecutive capacities measured; a step's gain is its hit-rate
    increase per added block, the average is the chord's from the smallest capacity to the
    largest. A step that gains nothing (or loses) always counts as below. With ``slope``
    1 this is the knee of the curve (the point farthest above the chord, when the curve
    is concave there); a larger ``slope`` stops earlier, a smaller one later.

    Args:
        hit_rates: hit rate by capacity (blocks); not empty.
        slope: the multiple of the average gain a step must reach to be worth taking.

    Raises:
        ValueError: ``hit_rates`` is empty or ``slope`` is not positive.

    Complexity: O(n log n) in the capacities.
    """
    if not hit_rates:
        raise ValueError("no hit rates to find a knee in")
    if not slope > 0.0:
        raise ValueError(f"slope must be positive, got {slope!r}")
    capacities = sorted(hit_rates)
    first, last = capacities[0], capacities[-1]
    span = last - first
    average = (hit_rates[last] - hit_rates[first]) / span if span else 0.0
    chosen = len(capacities) - 1
    while chosen > 0:  # walk down while the step above the candidate is still steep
        low, high = capacities[chosen - 1], capacities[chosen]
        gain = (hit_rates[high] - hit_rates[low]) / (high - low)
        if gain > 0.0 and gain >= slope * average:
            break
        chosen -= 1
    capacity = capacities[chosen]
    following = capacities[chosen + 1] if chosen + 1 < len(capacities) else None
    next_gain = (
        None
        if following is None
        else (hit_rates[following] - hit_rates[capacity]) / (following - capacity)
    )
    return Knee(capacity, hit_rates[capacity], average, following, next_gain)


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
    sweep.add_argument(
        "--knee-slope",
        type=_positive,
        default=DEFAULT_KNEE_SLOPE,
        help="recommend the smallest capacity past which every step up gains less hit rate "
        "per block than this multiple of the sweep's average (last minus first hit rate over "
        f"last minus first capacity; default: {DEFAULT_KNEE_SLOPE:g}, the knee)",
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


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0.0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
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
    found = knee(rates, args.knee_slope)
    print("\n" + _knee_line(found, args.policy, args.knee_slope, len(rates) == 1, block_bytes))
    pick = recommend(rates, args.within)
    print(
        f"smallest with {1 - args.within:.0%} of the best hit rate measured "
        f"({pick.best_hit_rate:.3f}, first at {pick.best_capacity:,} blocks): "
        f"{_size(pick.capacity, block_bytes)}, {args.policy} hit rate {pick.hit_rate:.3f}"
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


def _gain_unit(block_bytes: int | None) -> tuple[str, float]:
    """The unit gains are printed in, and blocks per unit: GiB with a model shape."""
    if block_bytes is None:
        return "1,000 blocks", 1000.0
    return "GiB", float(1 << 30) / block_bytes


def _points(gain_per_block: float, block_bytes: int | None) -> str:
    """Hit-rate percentage points per GiB (or per 1,000 blocks): 3 significant digits,
    whole numbers from 1,000 up."""
    points = 100.0 * gain_per_block * _gain_unit(block_bytes)[1]
    return f"{points:,.0f}" if abs(points) >= 1000 else f"{points:.3g}"


def _knee_line(
    found: Knee, policy: str, slope: float, single: bool, block_bytes: int | None
) -> str:
    """The recommendation, with the arithmetic that chose it."""
    unit = _gain_unit(block_bytes)[0]
    head = f"recommended: {_size(found.capacity, block_bytes)}, {policy} hit rate "
    head += f"{found.hit_rate:.3f}"
    if single:
        return f"{head} (the only capacity tried)"
    average = (
        f"the sweep's average of {_points(found.average_gain, block_bytes)} hit-rate points "
        f"per {unit} (from the smallest capacity's hit rate to the largest's)"
    )
    if slope != 1.0:
        average = f"{slope:g} x {average}"
    if found.next_capacity is None or found.next_gain is None:
        return f"{head}, the largest capacity tried: the step up to it gained at least {average}"
    return (
        f"{head}, the knee: every step up from it gains less than {average}; the next, "
        f"to {_size(found.next_capacity, block_bytes)}, gains "
        f"{_points(found.next_gain, block_bytes)} per {unit}"
    )


def _table(
    results: Results, policy: str, capacities: Sequence[int], block_bytes: int | None
) -> str:
    memory = ("memory | ", "---: | ") if block_bytes is not None else ("", "")
    unit = _gain_unit(block_bytes)[0]
    lines = [
        f"| {memory[0]}blocks | {policy} | {OPTIMUM_POLICY} | {policy} / {OPTIMUM_POLICY} "
        f"| tokens saved | {policy} gain, points per {unit} |",
        f"| {memory[1]}---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    previous: int | None = None
    for capacity in capacities:
        result, optimum = results[policy, capacity], results[OPTIMUM_POLICY, capacity]
        share = f"{result.hit_rate / optimum.hit_rate:.2f}" if optimum.hit_rate else "-"
        size = f"{format_bytes(capacity * block_bytes)} | " if block_bytes is not None else ""
        step = "-"
        if previous is not None:
            gain = (result.hit_rate - results[policy, previous].hit_rate) / (capacity - previous)
            step = _points(gain, block_bytes)
        lines.append(
            f"| {size}{capacity:,} | {result.hit_rate:.3f} | {optimum.hit_rate:.3f} | {share} "
            f"| {result.tokens_saved:,} | {step} |"
        )
        previous = capacity
    return "\n".join(lines)
