"""``examples/megatron_dynamic_context.py`` runs against real megatron-core and prints sense.

Skipped when megatron-core is not importable (the unit suite); the
integration stage installs it, so there this test runs (a skip fails it).
The example runs in a subprocess (it sets up its own process group and CPU
shim), from the repository root, with the checkout on ``PYTHONPATH`` so it
also runs where prefixcache is not installed.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip(
    "megatron.core.inference.contexts.dynamic_context", reason="megatron-core is not installed"
)

ROOT = Path(__file__).resolve().parents[2]
ROW = re.compile(
    r"^(?P<name>.+) \((?P<policy>[\w-]+)(?:, (?P<engine>\w+) engine)?\): hit rate "
    r"(?P<hit_rate>[\d.]+), (?P<evicting>\d+) evicting allocations at (?P<us>\d+) us each, "
    r"(?P<seconds>[\d.]+) s$"
)


@pytest.fixture(scope="module")
def printed() -> list[str]:
    """The example's stdout lines (it must exit 0)."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "megatron_dynamic_context.py")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": path},
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.splitlines()


def test_the_example_reports_each_allocator(printed: list[str]) -> None:
    header = re.match(r"^(\d+) requests, (\d+) blocks of (\d+) tokens$", printed[0])
    assert header is not None, printed
    rows = [ROW.match(line) for line in printed[1:]]
    assert all(rows) and len(rows) == 3, printed
    theirs, ours, other = (row.groupdict() for row in rows if row is not None)
    assert (theirs["name"], theirs["policy"], theirs["engine"]) == (
        "megatron-core KVBlockAllocator",
        "lru",
        None,
    )
    assert (ours["name"], ours["policy"]) == ("prefixcache drop-in", "lru")
    assert (other["name"], other["policy"]) == ("prefixcache drop-in", "s3fifo")
    assert ours["engine"] in ("native", "python") and other["engine"] in ("native", "python")
    for row in (theirs, ours, other):
        assert 0.0 < float(row["hit_rate"]) <= 1.0
        assert int(row["evicting"]) > 0  # the pool is small enough that the policy matters
    # Same LRU semantics on the same deterministic workload: the same blocks hit (the
    # differential test pins the state step by step; this is the end-to-end figure).
    assert ours["hit_rate"] == theirs["hit_rate"]
    assert ours["evicting"] == theirs["evicting"]
