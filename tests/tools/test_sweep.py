"""Issue 29, item 5: ``prefixcache sweep``, hit rate against memory and the size it recommends.

The recommendation is the knee (where a step up in memory gains less than the sweep's
average per block); the size within ``--within`` of the best is printed beside it.

The tiny trace alternates two 4-block prompts: a cache of 8 blocks holds both,
so every request after the first two hits fully, and no larger cache does
better; 4 blocks or fewer keep at most a part of one prompt.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prefixcache.reference.trace import TraceRequest
from prefixcache.tools import cli
from prefixcache.tools.sweep import default_capacities, knee, recommend

SHAPE = "layers=1,kv_heads=1,head_dim=64,dtype=fp16"  # 2 x 64 x 2 bytes x 512 = 128 KiB a block


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    path = tmp_path / "alternating.jsonl"
    prompts = ([1, 2, 3, 4], [5, 6, 7, 8])
    lines = [
        json.dumps({"timestamp": i, "input_length": 2048, "output_length": 1, "hash_ids": ids})
        for i, ids in enumerate(prompts * 4)
    ]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_recommend_picks_the_smallest_capacity_within_the_share_of_the_best() -> None:
    rates = {100: 0.10, 200: 0.40, 400: 0.46, 800: 0.48, 1600: 0.48}
    pick = recommend(rates, within=0.05)  # at least 0.456
    assert (pick.capacity, pick.hit_rate) == (400, 0.46)
    assert (pick.best_capacity, pick.best_hit_rate) == (800, 0.48)
    assert recommend(rates, within=0.0).capacity == 800
    assert recommend(rates, within=0.2).capacity == 200
    assert recommend({5: 0.0, 10: 0.0}, within=0.05).capacity == 5
    with pytest.raises(ValueError):
        recommend({}, within=0.05)
    with pytest.raises(ValueError):
        recommend(rates, within=1.5)


# The shipped sample's lru curve (``prefixcache sweep``, default capacities): it never
# saturates before the largest capacity, where the cache holds every distinct block.
SAMPLE = {
    209: 0.009,
    418: 0.012,
    836: 0.015,
    1672: 0.022,
    3344: 0.046,
    6688: 0.097,
    13376: 0.180,
    26752: 0.239,
}


def test_the_knee_of_a_curve_that_never_saturates_is_where_gains_per_block_fall() -> None:
    found = knee(SAMPLE)
    average = (0.239 - 0.009) / (26752 - 209)
    assert (found.capacity, found.hit_rate) == (13376, 0.180)
    assert found.average_gain == pytest.approx(average)
    assert (found.next_capacity, found.next_gain) == (26752, pytest.approx(0.059 / 13376))
    assert (0.180 - 0.097) / 6688 >= average > found.next_gain  # why 13,376 and not more
    assert recommend(SAMPLE, within=0.05).capacity == 26752  # the rule that bought it all


def test_the_knee_of_a_saturating_curve_is_where_it_flattens() -> None:
    rates = {100: 0.10, 200: 0.30, 400: 0.50, 800: 0.55, 1600: 0.56}
    assert knee(rates).capacity == 400
    assert knee(rates, slope=0.2).capacity == 800  # a lower bar takes the 400 -> 800 step
    # Steps over the average (0.46 / 1500 a block): 6.5x, 3.3x, 0.41x, 0.04x.
    assert knee(rates, slope=4.0).capacity == 200  # only the steepest step clears 4x
    assert knee(rates, slope=10.0).capacity == 100


def test_the_knee_takes_the_largest_capacity_while_every_step_pays_its_average() -> None:
    assert knee({1: 0.125, 2: 0.25, 4: 0.5}).capacity == 4  # a straight line: no knee
    top = knee({1: 0.125, 2: 0.25, 4: 0.5})
    assert top.next_capacity is None and top.next_gain is None


def test_the_knee_of_a_flat_or_falling_curve_is_the_smallest_capacity() -> None:
    assert knee({5: 0.3, 10: 0.3, 20: 0.3}).capacity == 5
    assert knee({5: 0.3, 10: 0.2, 20: 0.1}).capacity == 5  # a step that loses is no gain
    assert knee({5: 0.1, 10: 0.4, 20: 0.3}).capacity == 10
    single = knee({7: 0.4})
    assert (single.capacity, single.average_gain, single.next_capacity) == (7, 0.0, None)
    with pytest.raises(ValueError):
        knee({})
    with pytest.raises(ValueError):
        knee({5: 0.1}, slope=0.0)


def test_default_capacities_double_up_to_the_distinct_blocks() -> None:
    requests = [TraceRequest(0, 2048, 1, (1, 2, 3, 4)), TraceRequest(0, 2048, 1, (1, 2, 9, 9))]
    assert default_capacities(requests, points=3) == [1, 3, 6]  # 6 distinct chained blocks


def test_sweep_prints_the_table_and_recommends_the_size_that_holds_the_working_set(
    trace: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["sweep", "--trace", str(trace), "--capacities", "256KiB,512KiB,1MiB,2MiB,4"]
    assert cli.main([*argv, "--model-shape", SHAPE]) == 0
    out = capsys.readouterr().out
    assert "capacity 1 MiB = 8 blocks" in out
    rows = {
        int(cells[2].replace(",", "")): float(cells[3])
        for cells in (line.split("|") for line in out.splitlines())
        if len(cells) > 3 and cells[2].strip().replace(",", "").isdigit()
    }
    assert sorted(rows) == [2, 4, 8, 16]  # sorted; 512 KiB and 4 blocks are one capacity
    assert rows[8] == rows[16] == 0.75  # 24 of 32 blocks: all but the first two prompts
    assert rows[4] < 0.75 * 0.95
    assert "| 1 MiB | 8 | 0.750 | 0.750 | 1.00 | 12,288 | 153,600 |" in out  # 75 points / 4 blocks
    assert "| 2 MiB | 16 | 0.750 | 0.750 | 1.00 | 12,288 | 0 |" in out
    # 75 points over 4 blocks, and on average over 14 (2 -> 16); a GiB holds 8,192 blocks.
    assert (
        "recommended: 1 MiB (8 blocks), lru hit rate 0.750, the knee: every step up from it "
        "gains less than the sweep's average of 43,886 hit-rate points per GiB" in out
    )
    assert "the next, to 2 MiB (16 blocks), gains 0 per GiB" in out
    assert (
        "smallest with 95% of the best hit rate measured (0.750, first at 8 blocks): 1 MiB" in out
    )
    assert "still grows" not in out


def test_sweep_without_capacities_runs_up_to_every_distinct_block(
    trace: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["sweep", "--trace", str(trace), "--within", "0"]) == 0
    out = capsys.readouterr().out
    assert "| 8 | 0.750 |" in out  # the top: 8 distinct blocks
    assert "recommended: 8 blocks, lru hit rate 0.750, the largest capacity tried" in out
    assert "smallest with 100% of the best hit rate measured" in out
    assert "holds every distinct block" in out


def test_a_single_capacity_is_its_own_recommendation(
    trace: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["sweep", "--trace", str(trace), "--capacities", "8"]) == 0
    assert "recommended: 8 blocks, lru hit rate 0.750 (the only capacity tried)" in (
        capsys.readouterr().out
    )


def test_a_knee_slope_changes_the_bar_and_is_printed(
    trace: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["sweep", "--trace", str(trace), "--capacities", "4,8,16", "--knee-slope", "2.5"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    # The average is 75 points over 12 blocks; 4 -> 8 gains 75 over 4 blocks, 3 times it.
    assert "recommended: 8 blocks, lru hit rate 0.750, the knee: every step up from it " in out
    assert "less than 2.5 x the sweep's average of 6,250 hit-rate points per 1,000 blocks" in out
    assert cli.main([*argv[:-1], "3.5"]) == 0
    assert "recommended: 4 blocks, lru hit rate 0.000, the knee" in capsys.readouterr().out


@pytest.mark.parametrize("value", ["0", "-1", "x", "inf", "nan"])
def test_a_knee_slope_that_is_not_positive_is_refused(
    trace: Path, capsys: pytest.CaptureFixture[str], value: str
) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["sweep", "--trace", str(trace), "--knee-slope", value])
    assert exit_.value.code == 2
    assert "--knee-slope" in capsys.readouterr().err


def test_a_margin_outside_zero_to_one_is_refused(
    trace: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["sweep", "--trace", str(trace), "--within", "2"])
    assert exit_.value.code == 2
    assert "--within" in capsys.readouterr().err
