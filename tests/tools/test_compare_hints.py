"""``prefixcache compare --concurrency N --queue-hints``: the loop's queue hints from the CLI.

A trace where every third request repeats one long prefix, all arriving at once,
replayed with one request in flight: the queue holds every later request.
Two unrelated prompts run between repeats and the pool holds two requests'
blocks, so LRU evicts the prefix for the second of them; with hints the
queued repeats protect it and the second takes the first one's blocks.
"""

from __future__ import annotations

import pytest

from prefixcache.reference.trace import TraceRequest
from prefixcache.tools.cli import main
from prefixcache.tools.replay import replay_concurrent


def _trace() -> list[TraceRequest]:
    """A repeat of an 8-block prefix, then two unrelated 10-block prompts, four times."""
    requests = []
    for index in range(4):
        requests.append(TraceRequest(0, 512 * 9, 1, (*range(8), 100 + index)))
        for other in (2 * index, 2 * index + 1):
            first = 1000 * (other + 1)
            requests.append(TraceRequest(0, 512 * 10, 1, tuple(range(first, first + 10))))
    return requests


def test_the_optimum_runs_concurrently_on_either_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    saved = {}
    for engine in ("python", "auto"):
        monkeypatch.setenv("PREFIXCACHE_ENGINE", engine)
        saved[engine] = replay_concurrent(
            _trace(), capacity=20, policy="belady", max_requests=1
        ).tokens_saved
    lru = replay_concurrent(_trace(), capacity=20, policy="lru", max_requests=1).tokens_saved
    assert saved["python"] == saved["auto"] >= lru


def test_queue_hints_raise_the_hits_of_a_queued_repeat() -> None:
    off = replay_concurrent(_trace(), capacity=20, policy="lru", max_requests=1)
    on = replay_concurrent(_trace(), capacity=20, policy="lru", max_requests=1, queue_hints=True)
    assert off.prompt_tokens == on.prompt_tokens
    assert on.tokens_saved > off.tokens_saved
    assert on.tokens_saved == 3 * 8 * 512  # every repeat after the first hits the prefix


def test_the_cli_runs_hints_and_names_them(
    tmp_path: object, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["compare", "--limit", "40", "--capacities", "800", "--no-plot", "--no-progress"]
    assert main([*argv, "--concurrency", "4", "--queue-hints", "--policies", "lru"]) == 0
    out = capsys.readouterr().out
    assert "at most 4 in flight, queue hints on" in out
    assert main([*argv, "--concurrency", "--policies", "lru"]) == 0  # N defaults
    assert "at most 256 in flight, queue hints off" in capsys.readouterr().out
    assert main([*argv, "--queue-hints"]) == 2
    assert "--queue-hints: needs --concurrency" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:  # argparse's own error: exit status 2
        main([*argv, "--concurrency", "0"])
    assert info.value.code == 2
    assert "--concurrency: expected an int >= 1" in capsys.readouterr().err
