"""The train/test split: no trace on both sides, held-out traces on the test side only,
and the capacity rule of ``benchmarks/bench_policy_split.py`` that reports on it."""

from __future__ import annotations

import runpy
from pathlib import Path
from typing import Any

import pytest

from prefixcache.errors import InvalidArgumentError
from prefixcache.reference.trace import TraceRequest, load_mooncake_trace, sample_trace_path
from prefixcache.tools import workloads
from prefixcache.tools.workloads import split

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_policy_split.py"


def test_no_trace_lies_on_both_sides() -> None:
    assert not set(split.TRAIN) & set(split.TEST)
    assert len(set(split.TRAIN)) == len(split.TRAIN) and len(set(split.TEST)) == len(split.TEST)


def test_held_out_traces_are_test_only_and_every_family_is_reported() -> None:
    train_families = {family for family, _ in split.TRAIN}
    test_families = {family for family, _ in split.TEST}
    assert not train_families & set(split.HELD_OUT)
    assert set(split.HELD_OUT) <= test_families
    assert set(split.FAMILIES) | {split.MOONCAKE_SAMPLE} == test_families
    assert (split.MOONCAKE_SAMPLE, None) in split.TEST
    assert set(split.CHAT_FAMILIES) <= set(split.FAMILIES)
    assert {name for name in workloads.__all__ if name != "write_mooncake_trace"} == set(
        split.FAMILIES
    )  # a new family must be placed on the split


def test_side_of_names_the_side_and_refuses_an_unplaced_pair() -> None:
    assert all(split.side_of(family, seed) == "train" for family, seed in split.TRAIN)
    assert all(split.side_of(family, seed) == "test" for family, seed in split.TEST)
    with pytest.raises(InvalidArgumentError):
        split.side_of("multi_turn_chats", 99)
    with pytest.raises(InvalidArgumentError):
        split.side_of("scan_pollution", split.TRAIN_SEEDS[0])  # held out: no train seed
    with pytest.raises(InvalidArgumentError):
        split.load_trace("no_such_family", 0, 10)


def test_load_trace_gives_the_family_at_its_seed_and_the_sample() -> None:
    assert split.load_trace("heavy_tailed_chats", 0, 40) == workloads.heavy_tailed_chats(40, seed=0)
    sample = split.load_trace(split.MOONCAKE_SAMPLE, None, 25)
    assert sample == load_mooncake_trace(sample_trace_path(), limit=25)
    with pytest.raises(InvalidArgumentError):
        split.load_trace(split.MOONCAKE_SAMPLE, None, 0)


def _bench() -> dict[str, Any]:
    """The bench script's globals, run by path (benchmarks/ is no package; main() stays idle)."""
    if not BENCH.is_file():
        pytest.skip("benchmarks/ is not beside the tests (installed package)")
    return runpy.run_path(str(BENCH))


def test_bench_capacities_are_shares_of_the_distinct_blocks() -> None:
    bench = _bench()
    # 250 distinct blocks over two requests: the shared prefix counts once.
    trace = [
        TraceRequest(0, 512 * 200, 1, tuple(range(200))),
        TraceRequest(1, 512 * 150, 1, (*range(100), *range(1000, 1050))),
    ]
    assert bench["capacities"](trace) == {"small": 5, "mid": 25, "large": 100}
    tiny = [TraceRequest(0, 512 * 3, 1, (7, 8, 9))]
    assert bench["capacities"](tiny) == {"small": 1, "mid": 1, "large": 1}


def test_bench_replays_every_policy_and_the_optimum_at_the_three_capacities() -> None:
    bench = _bench()
    trace = workloads.multi_turn_chats(60, seed=1, num_conversations=5)
    sizes, rates = bench["run_trace"](trace, ["lru", "fifo"])
    assert list(sizes) == ["small", "mid", "large"]
    assert set(rates) == {(p, label) for p in ("lru", "fifo", "belady") for label in sizes}
    for label in sizes:
        assert rates["belady", label] >= rates["lru", label]
    lines = bench["summary"]({("multi_turn_chats", 1): rates}, ["lru", "fifo"])
    assert lines[2].startswith("| lru |") and "3/3" in lines[2]  # lru is within 0.005 of itself


def test_bench_family_table_gives_each_share_and_names_the_best_built_in() -> None:
    bench = _bench()
    labels = ("small", "mid", "large")
    rates = {("belady", label): 0.5 for label in labels}
    rates |= {("lru", label): 0.1 for label in labels}
    rates |= {("fifo", "small"): 0.2, ("fifo", "mid"): 0.05, ("fifo", "large"): 0.25}
    rates |= {("auto", label): 0.4 for label in labels}
    lines = bench["family_table"]({("chats", 3): rates}, ["lru", "fifo", "auto"])
    cells = [cell.strip() for cell in lines[2].strip("|").split("|")]
    assert cells == [
        "`chats` seed 3",
        "0.20 / 0.20 / 0.20",
        "0.80 / 0.80 / 0.80",
        "0.40 / 0.20 / 0.50 (mid: lru)",  # auto, the lead, is not a built-in here
        "0.500",
    ]
