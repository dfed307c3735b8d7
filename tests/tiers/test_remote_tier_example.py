"""``examples/remote_tier.py``: B copies from Redis what A computed; a dead server is a miss."""

from __future__ import annotations

import runpy
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "remote_tier.py"


def test_the_example_on_a_given_server(redis_server, capsys):
    runpy.run_path(str(EXAMPLE))["main"]([redis_server.url])
    out = capsys.readouterr().out
    assert "A document: 0 of 16 tokens cached" in out
    assert "B document: 16 of 16 tokens cached (device 0, host 0, remote 16)" in out
    assert "'remote_hit_blocks': 4" in out
    assert "server down" not in out  # not its server to stop


def test_the_example_with_a_server_of_its_own(redis_server, capsys):
    # redis_server only makes the test skip (or fail in the integration stage) without Redis
    runpy.run_path(str(EXAMPLE))["main"]([])
    out = capsys.readouterr().out
    assert "B document: 16 of 16 tokens cached (device 0, host 0, remote 16)" in out
    assert "B new document: 0 of 16 tokens cached" in out
    assert "server down: 1 warning, 1 failed lookup" in out
