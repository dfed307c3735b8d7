"""What ``prefixcache compare`` prints and draws: the tables and the plot of hit rate by policy.

Kept apart from the command line (:mod:`prefixcache.tools.cli`) so that the
presentation can be read and tested alone. A plot must stay readable with a
dozen policies: each policy gets its own colour *and* marker (a colour alone
is lost on a grey print and between neighbouring hues), the legend sits
outside the data, and the offline optimum is a plain black line, the
ceiling every policy is read against.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from prefixcache.tools.replay import OPTIMUM_POLICY, ConcurrentReplayResult, ReplayResult

Results = Mapping[tuple[str, int], ReplayResult | ConcurrentReplayResult]
"""Replay results by (policy name, capacity)."""

COLOURS = (
    "#1f77b4",  # blue
    "#ff7f0e",  # orange
    "#2ca02c",  # green
    "#d62728",  # red
    "#9467bd",  # purple
    "#8c564b",  # brown
    "#e377c2",  # pink
    "#7f7f7f",  # grey
    "#bcbd22",  # olive
    "#17becf",  # cyan
    "#393b79",  # navy
    "#e7ba52",  # gold
    "#ad494a",  # brick
    "#637939",  # moss
)
"""Distinct colours, none black (black is the optimum's)."""

MARKERS = ("o", "s", "^", "v", "D", "P", "X", "*", "<", ">", "h", "p", "d", "8")
"""Distinct markers, as many as :data:`COLOURS`."""


def styles(names: Sequence[str]) -> dict[str, tuple[str, str]]:
    """A (colour, marker) per policy name, no two alike, the optimum left out.

    The i-th name (in the order given) gets the i-th colour and marker, so
    up to ``len(COLOURS)`` policies differ in both; beyond that, the
    marker sequence is shifted per round of colours, so pairs stay distinct.
    Complexity: O(len(names)).
    """
    drawn = [name for name in names if name != OPTIMUM_POLICY]
    count = len(COLOURS)
    return {
        name: (COLOURS[index % count], MARKERS[(index + index // count) % len(MARKERS)])
        for index, name in enumerate(drawn)
    }


def results_table(results: Results, names: Sequence[str], capacities: Sequence[int]) -> str:
    """A markdown table, one row per policy and capacity."""
    lines = [
        "| policy | capacity | hit rate | of optimum | tokens saved | evictions | req/s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for capacity in capacities:
        optimum = results[OPTIMUM_POLICY, capacity].hit_rate
        for name in names:
            result = results[name, capacity]
            share = f"{result.hit_rate / optimum:.2f}" if optimum else "-"
            lines.append(
                f"| {name} | {capacity:,} | {result.hit_rate:.3f} | {share} "
                f"| {result.tokens_saved:,} | {result.evictions:,} "
                f"| {result.requests_per_second:,.0f} |"
            )
    return "\n".join(lines)


def share_table(results: Results, names: Sequence[str], capacities: Sequence[int]) -> str:
    """A markdown table of each policy's share of the offline optimum, one column per capacity.

    The last row is the optimum's own hit rate; a cell is ``-`` where the
    optimum hits nothing. The best policy of each column is in bold.
    """
    drawn = [name for name in names if name != OPTIMUM_POLICY]
    optimum = {capacity: results[OPTIMUM_POLICY, capacity].hit_rate for capacity in capacities}
    best = {
        capacity: max((results[name, capacity].hit_rate for name in drawn), default=0.0)
        for capacity in capacities
    }
    lines = [
        "| policy / share of optimum | " + " | ".join(f"{c:,} blocks" for c in capacities) + " |",
        "| --- |" + " ---: |" * len(capacities),
    ]
    for name in drawn:
        cells = []
        for capacity in capacities:
            rate = results[name, capacity].hit_rate
            cell = f"{rate / optimum[capacity]:.2f}" if optimum[capacity] else "-"
            cells.append(f"**{cell}**" if rate == best[capacity] else cell)
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines.append(
        f"| {OPTIMUM_POLICY} (hit rate) | "
        + " | ".join(f"{optimum[capacity]:.3f}" for capacity in capacities)
        + " |"
    )
    return "\n".join(lines)


def build_figure(
    results: Results, names: Sequence[str], capacities: Sequence[int], title: str
) -> Any:
    """A matplotlib ``Figure`` of hit rate against capacity, one styled line per policy.

    Raises:
        ImportError: matplotlib is not installed.
    """
    from matplotlib.figure import Figure

    drawn = styles(names)
    figure = Figure(figsize=(9, 5), layout="constrained")
    axes = figure.add_subplot()
    xs = sorted(capacities)
    for name in names:
        ys = [results[name, capacity].hit_rate for capacity in xs]
        if name == OPTIMUM_POLICY:
            axes.plot(
                xs,
                ys,
                "-",
                color="black",
                linewidth=2.5,
                zorder=3,
                label=f"{name} (offline optimum)",
            )
        else:
            colour, marker = drawn[name]
            axes.plot(xs, ys, "-", color=colour, marker=marker, markersize=6, label=name)
    if min(xs) > 0 and max(xs) > 10 * min(xs):
        axes.set_xscale("log")
        axes.minorticks_off()
    axes.set_xticks(xs, [f"{capacity:,}" for capacity in xs])
    axes.set_xlabel("capacity (blocks of 512 tokens)")
    axes.set_ylabel("prefix hit rate")
    axes.set_ylim(bottom=0)
    axes.grid(True, alpha=0.3)
    axes.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0, frameon=False)
    axes.set_title(f"Prefix hit rate by eviction policy ({title})")
    return figure


def write_plot(
    results: Results,
    names: Sequence[str],
    capacities: Sequence[int],
    target: Path,
    title: str,
) -> int:
    """Plot hit rate against capacity to ``target``; without matplotlib, say so.

    ``--plot`` without matplotlib was refused before the replays; only the
    default plot is skipped with a note. Returns the exit status (0).
    """
    try:
        figure = build_figure(results, names, capacities, title)
    except ImportError:
        print("note: no plot written; install matplotlib (pip install -e '.[plot]' in a clone)")
        return 0
    figure.savefig(target, dpi=120)
    print(f"plot written to {target}")
    return 0
