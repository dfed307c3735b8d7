"""Issue 26: the ``ends_conversation`` mark of a trace request, and where the families put it.

The mark round-trips through the writer and the reader; a trace written before
it existed (no field) reads as unmarked; a bad value is refused naming its line.
The families mark the last turn of a conversation their client closes and never
an abandoned one, and adding the mark changed nothing else: every (family,
seed) of the split gives the requests it gave before (digests taken on the
commit before the mark), so the policy tables' hit rates do not move.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from prefixcache.errors import InvalidArgumentError
from prefixcache.reference.trace import TraceRequest, load_mooncake_trace, trace_block_hashes
from prefixcache.tools.replay import replay
from prefixcache.tools.workloads import (
    heavy_tailed_chats,
    multi_tenant_mix,
    multi_turn_chats,
    split,
    write_mooncake_trace,
)

# sha256 (first 16 hex digits) of repr([(timestamp, input, output, hash_ids), ...]) of the
# first 300 requests of each generated (family, seed) of the split, before the mark existed.
BEFORE = {
    ("agent_tool_loops", 0): "5c6dc696e82da369",
    ("agent_tool_loops", 1): "bc0a41edcdd0f8ac",
    ("agent_tool_loops", 2): "80927fb0949b103d",
    ("document_qa", 0): "7101b21f5321344d",
    ("document_qa", 1): "9dbe928a8ed5acaf",
    ("document_qa", 2): "f6131ce6dc20a847",
    ("documents_with_hot_prefixes", 0): "f2343806b60d622b",
    ("documents_with_hot_prefixes", 1): "0986988aecf43158",
    ("documents_with_hot_prefixes", 2): "4aeaea09dae2c0eb",
    ("heavy_tailed_chats", 0): "44619e275af9ff60",
    ("heavy_tailed_chats", 1): "1715965e7d6442ea",
    ("heavy_tailed_chats", 2): "f1ba39c9cc5039b4",
    ("long_agent_sessions", 0): "eb91883169c5bb4e",
    ("long_agent_sessions", 1): "6b848d9027bfa62a",
    ("long_agent_sessions", 2): "78a9218d8dbfc247",
    ("multi_tenant_mix", 2): "04f75927bd95b1b1",
    ("multi_turn_chats", 0): "21defba7b8dab242",
    ("multi_turn_chats", 1): "4368eecbd8c53b6f",
    ("multi_turn_chats", 2): "1a6d09ce7705169e",
    ("scan_pollution", 2): "a4fa4c44f5a1326e",
    ("shared_system_prompts", 0): "35a89fe0f23e7d3b",
    ("shared_system_prompts", 1): "4b88718122e1b868",
    ("shared_system_prompts", 2): "92245d944d6a3e9b",
}


def _digest(trace: list[TraceRequest]) -> str:
    fields = [(r.timestamp_ms, r.input_length, r.output_length, r.hash_ids) for r in trace]
    return hashlib.sha256(repr(fields).encode()).hexdigest()[:16]


def test_every_generated_trace_of_the_split_is_unchanged_but_for_the_mark() -> None:
    pairs = {pair for pair in (*split.TRAIN, *split.TEST) if pair[0] != split.MOONCAKE_SAMPLE}
    assert pairs == set(BEFORE)
    changed = [
        pair for pair in sorted(BEFORE) if _digest(split.load_trace(*pair, 300)) != BEFORE[pair]
    ]
    assert changed == []


@pytest.mark.parametrize(
    ("family", "lru", "optimum"),
    [("multi_turn_chats", 0.105, 0.374), ("heavy_tailed_chats", 0.176, 0.496)],
)
def test_the_policy_tables_mid_capacity_cells_do_not_move(
    family: str, lru: float, optimum: float
) -> None:
    """``benchmarks/policy_tables.md``, test side, mid capacity (10% of the distinct blocks)."""
    trace = split.load_trace(family, split.TEST_SEED, 1500)
    capacity = round(len({h for r in trace for h in trace_block_hashes(r.hash_ids)}) * 0.1)
    assert round(replay(trace, capacity, "lru").hit_rate, 3) == lru
    assert round(replay(trace, capacity, "belady").hit_rate, 3) == optimum
    assert sum(r.ends_conversation for r in trace) > 0  # the trace is the marked one


def test_the_mark_round_trips_and_old_traces_read_unmarked(tmp_path: Path) -> None:
    trace = [
        TraceRequest(0, 1000, 8, (1, 2)),
        TraceRequest(5, 1500, 8, (1, 2, 3), ends_conversation=True),
        TraceRequest(9, 400, 8, (4,)),
    ]
    path = tmp_path / "marked.jsonl"
    write_mooncake_trace(trace, path)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [("ends_conversation" in line) for line in lines] == [False, True, False]
    assert lines[1]["ends_conversation"] is True
    assert load_mooncake_trace(path) == trace
    old = tmp_path / "old.jsonl"  # a line as every trace was written before the mark
    old.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [7]}\n')
    assert load_mooncake_trace(old) == [TraceRequest(0, 10, 1, (7,), False)]


@pytest.mark.parametrize("value", ["1", '"yes"', "null", "0"])
def test_a_mark_that_is_not_a_bool_is_refused_naming_its_line(tmp_path: Path, value: str) -> None:
    path = tmp_path / "bad.jsonl"
    good = '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [7]}'
    bad = good[:-1] + f', "ends_conversation": {value}}}'
    path.write_text(f"{good}\n{bad}\n")
    with pytest.raises(InvalidArgumentError, match="line 2: ends_conversation must be a bool"):
        load_mooncake_trace(path)


def test_chats_mark_the_last_turn_of_each_closed_conversation() -> None:
    trace = multi_turn_chats(400, seed=3, num_conversations=4, max_turns=3)
    chains = [trace_block_hashes(r.hash_ids) for r in trace]
    for index, request in enumerate(trace):
        extended = any(
            chain[: len(chains[index])] == chains[index] for chain in chains[index + 1 :]
        )
        if request.ends_conversation:
            assert not extended  # a closed conversation never comes back
    # Each conversation lasts at most 3 turns, 4 open at a time: at most 4 are cut off by
    # the trace's end, so at least a third of the requests, less those, close one.
    assert sum(r.ends_conversation for r in trace) >= 400 // 3 - 4


def test_an_abandoned_chat_is_never_marked() -> None:
    every_turn = heavy_tailed_chats(300, seed=1, max_turns=1, abandon_fraction=0.0)
    assert all(r.ends_conversation for r in every_turn)  # one-turn chats, all closed
    # Every chat abandoned after one turn: only those that planned one turn anyway are
    # closed by their user (a fifth of them, for plans of 1 to 5 turns).
    abandoned = heavy_tailed_chats(
        2000, seed=1, max_turns=5, abandon_fraction=1.0, max_abandoned_turns=1
    )
    share = sum(r.ends_conversation for r in abandoned) / len(abandoned)
    assert 0.1 < share < 0.3


def test_the_multi_tenant_mix_keeps_its_tenants_marks() -> None:
    trace = multi_tenant_mix(600, seed=2)
    assert any(r.ends_conversation for r in trace)
