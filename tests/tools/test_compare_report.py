"""``prefixcache compare``: auto by default, the share-of-optimum table, a readable plot."""

from __future__ import annotations

import pytest
from prefixcache.policies import available

from prefixcache.tools.cli import LEFT_OUT_BY_DEFAULT, main
from prefixcache.tools.compare_report import build_figure, share_table, styles
from prefixcache.tools.replay import OPTIMUM_POLICY, ReplayResult


def _result(policy: str, capacity: int, hit_blocks: int) -> ReplayResult:
    return ReplayResult(policy, capacity, 10, 100, hit_blocks, 1000, 10 * hit_blocks, 5, 0.1)


def test_compare_runs_auto_by_default_and_prints_the_share_table(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["compare", "--limit", "40", "--capacities", "30,200", "--no-plot", "--no-progress"]
    assert main([*argv, "--table"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "---" not in line]
    header = next(row for row in rows if row.startswith("| policy / share of optimum"))
    assert "30 blocks" in header and "200 blocks" in header
    split = rows.index(header)

    def cells(row: str) -> list[str]:
        return [cell.strip() for cell in row.strip("|").split("|")]

    first = {  # the long table: (policy, capacity) -> (hit rate, of optimum)
        (c[0], c[1].replace(",", "")): (float(c[2]), c[3]) for c in map(cells, rows[1:split])
    }
    assert ("auto", "30") in first and ("auto", "200") in first  # auto is in the default list
    shares = {c[0]: [cell.strip("*") for cell in c[1:]] for c in map(cells, rows[split + 1 :])}
    defaults = set(available()) - {OPTIMUM_POLICY, *LEFT_OUT_BY_DEFAULT}
    assert defaults <= set(shares) and not set(LEFT_OUT_BY_DEFAULT) & set(shares)
    for name in defaults:  # the same share as the long table's
        assert shares[name] == [first[name, "30"][1], first[name, "200"][1]]
    assert shares[f"{OPTIMUM_POLICY} (hit rate)"] == [
        f"{first[OPTIMUM_POLICY, '30'][0]:.3f}",
        f"{first[OPTIMUM_POLICY, '200'][0]:.3f}",
    ]


def test_the_share_table_bolds_the_best_of_each_capacity() -> None:
    results = {
        ("lru", 10): _result("lru", 10, 20),
        ("auto", 10): _result("auto", 10, 30),
        (OPTIMUM_POLICY, 10): _result(OPTIMUM_POLICY, 10, 40),
    }
    lines = share_table(results, ["lru", "auto", OPTIMUM_POLICY], [10]).splitlines()
    assert lines[2:] == ["| lru | 0.50 |", "| auto | **0.75** |", "| belady (hit rate) | 0.400 |"]


def test_every_policy_gets_its_own_colour_and_marker() -> None:
    names = [*available(), *(f"extra{i}" for i in range(20))]
    drawn = styles(names)
    assert OPTIMUM_POLICY not in drawn
    pairs = list(drawn.values())
    assert len(set(pairs)) == len(pairs)
    first = pairs[: len(set(available()) - {OPTIMUM_POLICY})]  # the registered ones: a dozen
    assert len({colour for colour, _ in first}) == len(first)
    assert len({marker for _, marker in first}) == len(first)
    assert all(colour.lower() not in ("black", "#000000") for colour, _ in pairs)


def test_the_plot_draws_the_optimum_as_a_line_and_the_legend_outside() -> None:
    pytest.importorskip("matplotlib")
    names = [name for name in available() if name != OPTIMUM_POLICY] + [OPTIMUM_POLICY]
    capacities = [100, 1000, 10000]
    results = {
        (name, capacity): _result(name, capacity, (index + 1) * (c + 1))
        for index, name in enumerate(names)
        for c, capacity in enumerate(capacities)
    }
    figure = build_figure(results, names, capacities, "test")
    axes = figure.axes[0]
    lines = {line.get_label(): line for line in axes.get_lines()}
    optimum = lines[f"{OPTIMUM_POLICY} (offline optimum)"]
    assert optimum.get_color() == "black" and optimum.get_marker() in ("None", "", None)
    assert optimum.get_linestyle() == "-"
    drawn = [lines[name] for name in names if name != OPTIMUM_POLICY]
    assert len({(line.get_color(), line.get_marker()) for line in drawn}) == len(drawn)
    assert len({line.get_color() for line in drawn}) == len(drawn)
    legend = axes.get_legend()
    anchor = legend.get_bbox_to_anchor().transformed(axes.transAxes.inverted())
    assert anchor.x0 >= 1.0  # left edge of the legend's anchor is right of the axes
    assert len(legend.get_texts()) == len(names)
    assert axes.get_xscale() == "log"  # capacities spanning two decades
    assert axes.get_title() == "Prefix hit rate by eviction policy (test)"
