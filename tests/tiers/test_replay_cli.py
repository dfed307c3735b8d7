"""``prefixcache replay --host-capacity``: per-tier hit rates, and its arguments refused early.

A bad argument is one line naming it, exit status 2, before any replay
(the replay functions are replaced by ones that fail the test if called).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from prefixcache.reference.trace import load_mooncake_trace
from prefixcache.tiers import replay_tiered
from prefixcache.tools import cli

# Three documents read twice each: a 2-block device pool keeps none, a host tier keeps them.
HASHES = [[1, 2, 3], [4, 5, 6], [7, 8, 9]] * 2


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    path = tmp_path / "trace.jsonl"
    lines = [
        json.dumps({"timestamp": i, "input_length": 1536, "output_length": 1, "hash_ids": h})
        for i, h in enumerate(HASHES)
    ]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.fixture
def no_work(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a replay started before the arguments were checked")

    for name in ("replay", "replay_tiered"):
        monkeypatch.setattr(cli, name, forbidden)


def field(out: str, name: str) -> str:
    match = re.search(rf"^{name}:\s+(.*)$", out, re.MULTILINE)
    assert match is not None, out
    return match.group(1)


def test_per_tier_hit_rates_match_the_library(trace: Path, capsys) -> None:
    argv = ["replay", "--trace", str(trace), "--capacity", "2", "--host-capacity", "16"]
    assert cli.main([*argv, "--host-policy", "fifo"]) == 0
    out = capsys.readouterr().out
    want = replay_tiered(load_mooncake_trace(trace), 2, 16, host_policy="fifo")
    assert want.host_hit_blocks == 9  # the second reading of each document
    blocks = want.prompt_blocks
    assert field(out, "host tier") == "fifo, 16 slots"
    assert field(out, "device hits").startswith(f"{want.device_hit_rate:.3f} ")
    assert f"({want.device_hit_blocks}/{blocks})" in field(out, "device hits")
    assert f"({want.host_hit_blocks}/{blocks})" in field(out, "host hits")
    assert field(out, "hit rate").startswith(f"{want.hit_rate:.3f} ")
    copies = field(out, "copies")
    assert f"{want.demoted_blocks} demoted, {want.promoted_blocks} promoted" in copies


def test_without_a_host_tier_replay_prints_what_it_did(trace: Path, capsys) -> None:
    assert cli.main(["replay", "--trace", str(trace), "--capacity", "2", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "host tier:" not in out and field(out, "hit rate").startswith("0.000 ")


@pytest.mark.parametrize(
    ("extra", "argument", "reason"),
    [
        (["--host-capacity", "-1"], "--host-capacity", "int >= 0"),
        (["--host-capacity", "many"], "--host-capacity", "int >= 0"),
        (["--host-policy", "lru"], "--host-policy", "needs --host-capacity"),
        (["--host-capacity", "4", "--host-policy", "nope"], "--host-policy", "unknown policy"),
        (["--host-capacity", "4", "--host-policy", "belady"], "--host-policy", "host tier"),
        (["--host-capacity", "4", "--policy", "belady"], "--policy", "host tier"),
        (["--host-capacity", str(10**15)], "--host-capacity", "memory"),
    ],
)
def test_bad_host_tier_arguments_are_refused_before_any_work(
    trace: Path, capsys, no_work, extra: list[str], argument: str, reason: str
) -> None:
    try:
        status = cli.main(["replay", "--trace", str(trace), *extra])
    except SystemExit as exit_:  # argparse's own errors
        status = exit_.code  # type: ignore[assignment]
    out, err = capsys.readouterr()
    assert status == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("prefixcache"), err
    assert argument in lines[0] and reason in lines[0], err
