"""Issue 29, item 5: ``prefixcache sweep``, hit rate against memory and the size it recommends.

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
from prefixcache.tools.sweep import default_capacities, recommend

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
    assert "| 1 MiB | 8 | 0.750 | 0.750 | 1.00 |" in out
    assert "recommended: 1 MiB (8 blocks), lru hit rate 0.750" in out
    assert "still grows" not in out


def test_sweep_without_capacities_runs_up_to_every_distinct_block(
    trace: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["sweep", "--trace", str(trace), "--within", "0"]) == 0
    out = capsys.readouterr().out
    assert "| 8 | 0.750 |" in out  # the top: 8 distinct blocks
    assert "recommended: 8 blocks" in out
    assert "holds every distinct block" in out


def test_a_margin_outside_zero_to_one_is_refused(
    trace: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["sweep", "--trace", str(trace), "--within", "2"])
    assert exit_.value.code == 2
    assert "--within" in capsys.readouterr().err
