"""examples/defragment.py runs as written and every cached prompt keeps its K/V."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest


def test_the_example_runs_and_keeps_every_prompt(capsys: pytest.CaptureFixture[str]) -> None:
    example = Path(__file__).resolve().parents[2] / "examples" / "defragment.py"
    runpy.run_path(str(example), run_name="__main__")  # it asserts each prompt's K/V itself
    printed = capsys.readouterr().out
    assert "fragmentation 0.00" in printed
    assert "every cached prompt still reads its own K/V after the move" in printed
    assert "PageAwarePolicy: 16 blocks evicted, 2 whole pages free" in printed
