"""``python -m prefixcache.cluster``: the cluster comparison's own command line."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest

from prefixcache.cluster import ROUTERS, main

SMALL = ["--limit", "12", "--workers", "2", "--total-capacity", "400"]


def test_main_prints_one_row_per_router(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*SMALL, "--routers", "round_robin,prefix_aware", "--policy", "fifo"]) == 0
    out = capsys.readouterr().out
    assert "12 requests" in out and "policy fifo" in out
    rows = [line for line in out.splitlines() if line.startswith("| 2 |")]
    assert [row.split("|")[2].strip() for row in rows] == ["round_robin", "prefix_aware"]


def test_main_reports_an_unreadable_trace_as_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*SMALL, "--trace", str(tmp_path / "missing.jsonl")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("prefixcache: error: cannot read trace") and err.count("\n") == 1


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--workers", "0"], "expected comma-separated ints >= 1, got '0'"),
        (["--workers", "two"], "expected comma-separated ints >= 1, got 'two'"),
        (["--routers", "round_robin,nearest"], "unknown router(s) ['nearest']"),
    ],
)
def test_bad_lists_are_usage_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_duplicates_in_a_list_run_once(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*SMALL[:2], "--workers", "2,2", "--routers", "least_loaded,least_loaded"]) == 0
    assert capsys.readouterr().out.count("| least_loaded |") == 1


def test_python_dash_m_runs_the_same_command(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "argv", ["python -m prefixcache.cluster", *SMALL])
    with pytest.raises(SystemExit) as exited:
        runpy.run_module("prefixcache.cluster", run_name="__main__")
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert all(f"| {name} |" in out for name in ROUTERS)
