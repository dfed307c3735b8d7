"""Issue 26: ``conversation_ends`` in both replays, ``--conversation-ends`` on the CLI, and the
mark through ``prefixcache convert``.

The replays call ``end_conversation`` exactly for the requests the trace marks
(never for ``belady``, never with the option off), and ending a dead chain
lets a live one stay cached: a case where LRU loses the live chain without the
ends and keeps it with them. The flag reaches both replays from the command
line; bad values and combinations are refused with the library's errors.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from prefixcache.engine.allocator import KVBlockAllocator
from prefixcache.errors import InvalidArgumentError
from prefixcache.reference.trace import TraceRequest, load_mooncake_trace
from prefixcache.tools import cli
from prefixcache.tools.convert import convert, read_token_requests
from prefixcache.tools.replay import replay, replay_concurrent
from prefixcache.tools.workloads import write_mooncake_trace


def _trace() -> list[TraceRequest]:
    """Conversation A (blocks 1-4) ends; B (10-13) is used, then C (20-23) passes, then B.

    Capacity 8: after C, LRU evicts from the oldest chain. With A's end freed,
    B and C fit and B's return hits it whole; without, B's head goes first.
    """
    a = (1, 2, 3, 4)
    b = (10, 11, 12, 13)
    c = (20, 21, 22, 23)
    return [
        TraceRequest(0, 2048, 4, b),
        TraceRequest(100, 2048, 4, a, ends_conversation=True),
        TraceRequest(200, 2048, 4, c),
        TraceRequest(300, 2048, 4, (*b, 14)[:4]),
    ]


@pytest.fixture
def end_calls(monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """Every ``end_conversation`` call's hashes, on any allocator."""
    calls: list[list[int]] = []
    original = KVBlockAllocator.end_conversation

    def spy(allocator: KVBlockAllocator, block_hashes: Any) -> int:
        calls.append([int(h) for h in block_hashes])
        return original(allocator, block_hashes)

    monkeypatch.setattr(KVBlockAllocator, "end_conversation", spy)
    return calls


def test_the_sequential_replay_ends_exactly_the_marked_requests(
    end_calls: list[list[int]],
) -> None:
    off = replay(_trace(), 8, "lru")
    assert end_calls == []
    on = replay(_trace(), 8, "lru", conversation_ends=True)
    assert len(end_calls) == 1 and len(end_calls[0]) == 4  # A's chain, once
    assert on.hit_blocks == 4 > off.hit_blocks  # B's return hits it whole only with the end
    unmarked = [replace(r, ends_conversation=False) for r in _trace()]
    assert replay(unmarked, 8, "lru", conversation_ends=True).hit_blocks == off.hit_blocks
    end_calls.clear()
    replay(_trace(), 8, "belady", conversation_ends=True)
    assert end_calls == []  # the optimum knows the future already


def test_the_concurrent_replay_ends_exactly_the_marked_requests(
    end_calls: list[list[int]],
) -> None:
    replay_concurrent(_trace(), 16, "lru", max_requests=1)
    assert end_calls == []
    replay_concurrent(_trace(), 16, "lru", max_requests=1, conversation_ends=True)
    assert len(end_calls) == 1  # A's request, once it finished
    assert len(end_calls[0]) >= 4  # its prompt's blocks (and any full decode block)
    end_calls.clear()
    replay_concurrent(_trace(), 16, "belady", max_requests=1, conversation_ends=True)
    assert end_calls == []


@pytest.mark.parametrize("run", [replay, replay_concurrent])
def test_a_flag_that_is_not_a_bool_is_refused(run: Any) -> None:
    with pytest.raises(InvalidArgumentError, match="conversation_ends"):
        run(_trace(), 8, "lru", conversation_ends=1)


def test_the_cli_flag_reaches_both_replays(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], end_calls: list[list[int]]
) -> None:
    path = tmp_path / "trace.jsonl"
    write_mooncake_trace(_trace(), path)
    base = ["--trace", str(path), "--no-progress"]
    assert cli.main(["replay", *base, "--capacity", "8", "--conversation-ends"]) == 0
    assert "conversation ends on" in capsys.readouterr().out
    assert len(end_calls) == 1
    compare = ["compare", *base, "--capacities", "16", "--no-plot", "--policies", "lru,fifo"]
    for extra in ([], ["--concurrency", "2"]):
        end_calls.clear()
        assert cli.main([*compare, *extra, "--conversation-ends"]) == 0
        assert "conversation ends on (1 marked requests)" in capsys.readouterr().out
        assert len(end_calls) == 2  # lru and fifo; never belady
    end_calls.clear()
    assert cli.main([*compare, "--concurrency", "2"]) == 0
    assert end_calls == []


def test_the_cli_refuses_ends_where_they_do_not_apply(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["replay", "--conversation-ends", "--host-capacity", "10"]) == 2
    assert "--conversation-ends: not with --host-capacity" in capsys.readouterr().err
    assert cli.main(["compare", "--conversation-ends", "--workers", "2", "--no-plot"]) == 2
    assert "--conversation-ends: not with --workers" in capsys.readouterr().err


def test_convert_keeps_the_mark_and_refuses_a_bad_one(tmp_path: Path) -> None:
    lines = [
        json.dumps({"token_ids": list(range(600)), "session_id": "s"}),
        json.dumps({"token_ids": list(range(700)), "session_id": "s", "ends_conversation": True}),
    ]
    out = tmp_path / "trace.jsonl"
    with out.open("w") as file:
        assert convert(read_token_requests(lines), file, 512) == 2
    assert [r.ends_conversation for r in load_mooncake_trace(out)] == [False, True]
    bad = [json.dumps({"token_ids": [1, 2], "ends_conversation": "true"})]
    with pytest.raises(InvalidArgumentError, match="line 1: ends_conversation must be a bool"):
        list(read_token_requests(bad))
