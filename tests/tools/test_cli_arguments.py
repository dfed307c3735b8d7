"""Issue 15, item 5: every bad argument is one line naming it, exit status 2, before any work.

Real files in a temporary folder: bytes that are not UTF-8, truncated JSON,
an empty trace, folders that do not exist. "Before any work" is checked by
replacing the replay functions with ones that fail the test if called.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from prefixcache.tools import cli

REQUEST = {"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [1, 2]}


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(REQUEST) for _ in range(3)) + "\n", encoding="utf-8")
    return path


@pytest.fixture
def no_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any replay fails the test: a bad argument must be refused before the first one."""

    def forbidden(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a replay started before the arguments were checked")

    for name in ("replay", "replay_concurrent", "cluster_main"):
        monkeypatch.setattr(cli, name, forbidden)


def refused(
    capsys: pytest.CaptureFixture[str], argv: list[str], argument: str, reason: str = ""
) -> str:
    """Run the CLI; assert exit status 2 and a one-line error naming ``argument``."""
    try:
        status = cli.main(argv)
    except SystemExit as exit_:  # argparse's own errors
        status = exit_.code  # type: ignore[assignment]
    out, err = capsys.readouterr()
    assert status == 2, (status, err)
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("prefixcache") and "error:" in lines[0], err
    assert argument in lines[0], err
    assert reason in lines[0], err
    return lines[0]


def test_a_trace_that_is_not_utf8(
    tmp_path: Path, no_work: None, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(json.dumps(REQUEST).encode() + b"\n\xff\xfe caf\xe9\n")
    refused(capsys, ["replay", "--trace", str(path)], "--trace", "not UTF-8")


@pytest.mark.parametrize(
    "content",
    [
        '{"timestamp": 0, "input_length": 10, ',  # truncated JSON
        "hello\n",
        json.dumps([1, 2, 3]) + "\n",
        json.dumps({**REQUEST, "hash_ids": "abc"}) + "\n",
    ],
)
def test_a_trace_that_is_not_json_lines(
    tmp_path: Path, no_work: None, capsys: pytest.CaptureFixture[str], content: str
) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(REQUEST) + "\n" + content, encoding="utf-8")
    refused(capsys, ["compare", "--trace", str(path), "--no-plot"], "--trace", "line 2")


@pytest.mark.parametrize("make_path", [lambda d: d / "missing.jsonl", lambda d: d])
def test_a_trace_that_cannot_be_read(
    tmp_path: Path,
    no_work: None,
    capsys: pytest.CaptureFixture[str],
    make_path: Callable[[Path], Path],
) -> None:
    refused(capsys, ["replay", "--trace", str(make_path(tmp_path))], "--trace")


def test_an_empty_trace_and_limit_zero(
    tmp_path: Path, trace: Path, no_work: None, capsys: pytest.CaptureFixture[str]
) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n", encoding="utf-8")
    refused(capsys, ["replay", "--trace", str(empty)], "--trace", "no requests")
    refused(capsys, ["replay", "--trace", str(trace), "--limit", "0"], "--limit")


@pytest.mark.parametrize(
    ("argv", "argument"),
    [
        (["replay", "--capacity", "0"], "--capacity"),
        (["replay", "--capacity", "-3"], "--capacity"),
        (["replay", "--capacity", "many"], "--capacity"),
        (["replay", "--capacity", str(10**15)], "--capacity"),
        (["compare", "--capacities", "100,0"], "--capacities"),
        (["compare", "--capacities", f"100,{10**15}", "--no-plot"], "--capacities"),
        (["compare", "--workers", "2", "--total-capacity", "-5"], "--total-capacity"),
        (["compare", "--workers", "2", "--total-capacity", "0"], "--total-capacity"),
        (["compare", "--workers", "2", "--total-capacity", str(10**15)], "--total-capacity"),
        (["replay", "--policy", "nope"], "--policy"),
        (["compare", "--plot", "nowhere/at/all/out.png"], "--plot"),
        (["compare", "--plot", "out.txt"], "--plot"),
    ],
)
def test_bad_numbers_and_paths(
    trace: Path,
    no_work: None,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    argument: str,
) -> None:
    refused(capsys, [*argv, "--trace", str(trace)], argument)


def test_plot_prints_the_path_it_wrote(
    tmp_path: Path, trace: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if importlib.util.find_spec("matplotlib") is None:
        pytest.skip("matplotlib (the plot extra) is not installed")
    target = tmp_path / "out"
    argv = ["compare", "--trace", str(trace), "--policies", "lru", "--capacities", "4"]
    status = cli.main([*argv, "--no-progress", "--plot", str(target)])
    out, _ = capsys.readouterr()
    assert status == 0
    written = tmp_path / "out.png"
    assert written.is_file()
    assert f"plot written to {written}" in out


def test_a_good_run_still_works(trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status = cli.main(["replay", "--trace", str(trace), "--capacity", "4", "--no-progress"])
    out, err = capsys.readouterr()
    assert status == 0 and err == ""
    assert "hit rate:      0.667 (4/6)" in out


def test_the_example_table_is_aligned_for_long_policy_names(
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = Path(__file__).resolve().parents[2] / "examples" / "dynamic_batching.py"
    spec = importlib.util.spec_from_file_location("dynamic_batching_example", path)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    example.compare_policies(example.chat_workload(2))
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert any(line.startswith("protected_lru ") for line in lines)  # longer than 9
    assert len({len(line) for line in lines}) == 1, "\n".join(lines)


@pytest.mark.parametrize(
    "content",
    [
        '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": ['
        + "9" * 5000
        + "]}",
        "[" * 100_000 + "]" * 100_000,
    ],
    ids=["5000-digit-int", "deeply-nested"],
)
def test_a_trace_line_python_cannot_parse(
    tmp_path: Path, no_work: None, capsys: pytest.CaptureFixture[str], content: str
) -> None:
    """Issue 28, item 7: these ended in a ValueError / RecursionError traceback."""
    path = tmp_path / "hostile.jsonl"
    path.write_text(json.dumps(REQUEST) + "\n" + content + "\n", encoding="utf-8")
    refused(capsys, ["replay", "--trace", str(path)], "--trace", "line 2")


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="needs matplotlib")
@pytest.mark.parametrize(
    ("target", "reason"),
    [(".", "is a folder"), ("/", "is a folder"), ("/proc/plot.png", "cannot write")],
)
def test_a_plot_target_that_cannot_be_written(
    trace: Path, no_work: None, capsys: pytest.CaptureFixture[str], target: str, reason: str
) -> None:
    """Issue 28, item 7: checked before the replays (the last one failed after the run)."""
    refused(capsys, ["compare", "--trace", str(trace), "--plot", target], "--plot", reason)


def test_more_workers_than_blocks(
    trace: Path, no_work: None, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["compare", "--trace", str(trace), "--workers", "4", "--total-capacity", "2"]
    refused(capsys, argv, "--total-capacity", "cannot be split over 4")


# ---------------------------------------------------------------------- issue 29, item 7


def test_plot_is_refused_where_it_would_be_ignored(
    trace: Path, no_work: None, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    argv = ["compare", "--trace", str(trace), "--workers", "2", "--plot", str(tmp_path / "p.png")]
    refused(capsys, argv, "--plot", "--workers prints the cluster table")


def test_version_and_help_say_what_a_user_needs(capsys: pytest.CaptureFixture[str]) -> None:
    from prefixcache import __version__

    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"prefixcache {__version__}"
    for argv in (["--help"], ["compare", "--help"], ["replay", "--help"]):
        with pytest.raises(SystemExit):
            cli.main(argv)
        text = capsys.readouterr().out
        for needed in ("s3fifo", "auto", "belady", "hash_ids", "Mooncake JSONL"):
            assert needed in text, (argv, needed)


@pytest.mark.parametrize("terminal", [True, False])
def test_progress_is_drawn_only_on_a_terminal_and_names_the_run(
    terminal: bool, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(__import__("sys").modules, "tqdm", None)  # the plain counter
    monkeypatch.setattr(cli.sys.stderr, "isatty", lambda: terminal)
    assert cli.main(["replay", "--limit", "600", "--capacity", "200"]) == 0
    err = capsys.readouterr().err
    assert ("lru, 200 blocks: 600/600 requests" in err) is terminal, err


def test_compare_leaves_out_what_would_only_repeat_by_default(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["compare", "--limit", "30", "--capacities", "50", "--no-plot", "--no-progress"]
    assert cli.main(argv) == 0
    policies_shown = {
        line.split("|")[1].strip()
        for line in capsys.readouterr().out.splitlines()
        if line.startswith("| ") and "---" not in line
    }
    assert not set(cli.LEFT_OUT_BY_DEFAULT) & policies_shown
    assert {"lru", "s3fifo", "auto", "belady"} <= policies_shown


def test_compare_runs_a_left_out_policy_when_named(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["compare", "--limit", "30", "--capacities", "50", "--no-plot", "--no-progress"]
    assert cli.main([*argv, "--policies", "ref_zero,priority,lru"]) == 0
    out = capsys.readouterr().out
    for name in ("ref_zero", "priority", "lru"):
        assert f"| {name} " in out, (name, out)
