"""Trace loading, trace hashing, the Belady policy, the replay model and the CLI.

The replay tests use a five-request trace whose hit counts are worked out by
hand in :data:`TINY_TRACE`'s docstring, and a few hundred requests of the
shipped sample, replayed both through the allocator and through a plain
dict-and-sorted-list model of ``../shared/traces/README.md`` (the model that
made its reference numbers): hit counts must be equal, not just close.
"""

from __future__ import annotations

import io
import sys
from collections import OrderedDict
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prefixcache.policies import BeladyPolicy, EvictionPolicy
from sortedcontainers import SortedList

from prefixcache import policies
from prefixcache.errors import ConfigError, InvalidArgumentError
from prefixcache.reference.trace import (
    TraceRequest,
    load_mooncake_trace,
    sample_trace_path,
    trace_block_hashes,
)
from prefixcache.tools.cli import main
from prefixcache.tools.replay import replay, replay_concurrent

TINY_TRACE = [
    TraceRequest(0, 1100, 1, (1, 2, 3)),
    TraceRequest(1, 1536, 1, (1, 2, 4)),
    TraceRequest(2, 1100, 1, (1, 2, 3)),
    TraceRequest(3, 512, 1, (5,)),
    TraceRequest(4, 1100, 1, (1, 2, 3)),
]
"""13 prompt blocks; replayed at capacity 3 (chains a=1,2,3 and b=1,2,4, c=5).

LRU: r0 misses 3. r1 hits 1,2, adds 4; trim evicts leaf 3 (older than 4).
r2 hits 1,2, adds 3; trim evicts 4. r3 misses, adds 5; trim evicts 3 (older
than 5). r4 hits 1,2, adds 3; trim evicts 5. Hits 0+2+2+0+2 = 6, 4
evictions, tokens saved 1024 * 3 = 3072.

Belady: r1's trim evicts 4 (never used again) instead of 3 (used by r2).
r2 hits all 3. r3's trim evicts 5 (never used) instead of 3 (used by r4).
r4 hits 3. Hits 0+2+3+0+3 = 8, 2 evictions, tokens saved 1024 + 1100 + 1100
(a full-chain hit saves at most the prompt's 1,100 tokens).
"""

LINE = '{"timestamp": 0, "input_length": 600, "output_length": 2, "hash_ids": [7, 8]}'


def load_text(text: str) -> list[TraceRequest]:
    return load_mooncake_trace(io.StringIO(text))


# ---------------------------------------------------------------------- loading


def test_load_reads_fields_in_order_and_skips_blank_lines() -> None:
    requests = load_text(f"{LINE}\n\n{LINE.replace('[7, 8]', '[7, 9]')}\n")
    assert requests == [TraceRequest(0, 600, 2, (7, 8)), TraceRequest(0, 600, 2, (7, 9))]


def test_load_limit_and_paths(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text(f"{LINE}\n" * 5)
    assert len(load_mooncake_trace(path, limit=3)) == 3
    assert len(load_mooncake_trace(str(path))) == 5
    assert load_mooncake_trace(path, limit=0) == []
    with pytest.raises(InvalidArgumentError, match="limit"):
        load_mooncake_trace(path, limit=-1)


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"timestamp": 0, "input_length": 1, "hash_ids": [1]}', "missing field.*output_length"),
        (LINE.replace('"input_length": 600', '"input_length": -5'), "input_length must be"),
        (LINE.replace('"output_length": 2', '"output_length": true'), "output_length must be"),
        (LINE.replace('"timestamp": 0', '"timestamp": 1.5'), "timestamp must be"),
        (LINE.replace("[7, 8]", '"7,8"'), "hash_ids must be a list"),
        (LINE.replace("[7, 8]", "[7, -8]"), "hash_ids must hold ints"),
        (LINE.replace("[7, 8]", f"[7, {2**63}]"), "hash_ids must hold ints"),
    ],
)
def test_load_names_the_bad_line(bad_line: str, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=f"line 3: {message}"):
        load_text(f"{LINE}\n\n{bad_line}\n{LINE}\n")


def test_sample_trace_ships_with_the_package() -> None:
    requests = load_mooncake_trace(sample_trace_path())
    assert len(requests) == 1500
    assert requests[0].hash_ids[:3] == (0, 1, 2)
    assert all(r.num_blocks == -(-r.input_length // 512) for r in requests)


# ---------------------------------------------------------------------- hashing

ids_lists = st.lists(st.integers(min_value=0, max_value=2**63 - 1), max_size=8)


@given(ids_lists, ids_lists)
def test_trace_hashes_are_chained_prefix_hashes(first: list[int], second: list[int]) -> None:
    a, b = trace_block_hashes(first), trace_block_hashes(second)
    assert len(a) == len(first)
    assert all(0 < value < 2**63 for value in a)
    assert trace_block_hashes(first + second)[: len(a)] == a
    for position in range(min(len(a), len(b))):
        same_prefix = first[: position + 1] == second[: position + 1]
        assert (a[position] == b[position]) == same_prefix


def test_trace_hashes_differ_for_an_equal_id_after_a_different_prefix() -> None:
    assert trace_block_hashes([1, 9])[1] != trace_block_hashes([2, 9])[1]
    assert trace_block_hashes([9])[0] != trace_block_hashes([1, 9])[1]


@pytest.mark.parametrize("bad", [1.0, True, "3", 2**63, -(2**63) - 1])
def test_trace_hashes_refuse_non_int64_ids(bad: object) -> None:
    with pytest.raises(InvalidArgumentError):
        trace_block_hashes([1, bad])  # type: ignore[list-item]


# ---------------------------------------------------------------------- Belady policy


def test_belady_follows_the_protocol_and_is_registered() -> None:
    policy = policies.get("belady", next_use=lambda block_id: 0)
    assert isinstance(policy, BeladyPolicy)
    assert isinstance(policy, EvictionPolicy)
    assert policy.retains_unreferenced


def test_belady_evicts_furthest_next_use_then_deeper_then_higher_id() -> None:
    future = {10: 5, 11: 9, 12: 9, 13: 9, 14: 2}
    depth = {10: 0, 11: 1, 12: 4, 13: 4, 14: 7}
    policy = BeladyPolicy(future.__getitem__)
    for block_id in future:
        policy.insert(
            block_id,
            block_hash=block_id + 1000,
            last_access=block_id,
            num_accesses=1,
            depth=depth[block_id],
        )
    assert len(policy) == 5
    assert policy.evict(2) == [13, 12]  # next use 9 at depth 4: higher ID first
    assert policy.evict(1) == [11]
    assert 11 not in policy
    assert policy.evict(5) == [10, 14]
    assert len(policy) == 0
    assert policy.evict(1) == []


def test_belady_ignores_recency_and_asks_again_on_touch() -> None:
    future = {1: 3, 2: 8}
    policy = BeladyPolicy(future.__getitem__)
    policy.insert(1, block_hash=1001, last_access=100, num_accesses=5, depth=0)
    policy.insert(2, block_hash=1002, last_access=0, num_accesses=1, depth=0)
    future[2] = 1  # a touch is a use: the next use moves
    policy.touch(2, now=101)
    assert policy.evict(1) == [1]
    policy.discard(2)
    assert 2 not in policy
    assert len(policy) == 0


def test_belady_clear_and_bad_oracle() -> None:
    policy = BeladyPolicy(lambda block_id: block_id)
    policy.insert(4, block_hash=1004, last_access=0, num_accesses=1, depth=0)
    policy.clear()
    assert len(policy) == 0
    assert 4 not in policy
    with pytest.raises(TypeError, match="callable"):
        BeladyPolicy(3)  # type: ignore[arg-type]


# ---------------------------------------------------------------------- replay


def test_lru_replay_matches_the_hand_computed_model() -> None:
    result = replay(TINY_TRACE, capacity=3, policy="lru")
    assert (result.hit_blocks, result.prompt_blocks) == (6, 13)
    assert result.hit_rate == pytest.approx(6 / 13)
    assert result.evictions == 4
    assert result.tokens_saved == 3072
    assert result.prompt_tokens == 1100 * 3 + 1536 + 512
    assert result.num_requests == 5


def test_belady_replay_matches_the_hand_computed_model() -> None:
    result = replay(TINY_TRACE, capacity=3, policy="belady")
    assert (result.hit_blocks, result.evictions) == (8, 2)
    assert result.tokens_saved == 1024 + 1100 + 1100


def lru_model(chains: list[list[int]], capacity: int) -> int:
    """Hit blocks of the README model under LRU: a request touches its chain leaf-first."""
    cache: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for chain in chains:
        hits += next((k for k, value in enumerate(chain) if value not in cache), len(chain))
        for value in reversed(chain):
            cache[value] = None
            cache.move_to_end(value)
        while len(cache) > capacity:
            cache.popitem(last=False)
    return hits


def belady_model(chains: list[list[int]], capacity: int) -> int:
    """Hit blocks of the README model under Belady over all cached blocks (not leaves only)."""
    uses: dict[int, list[int]] = {}
    for index, chain in enumerate(chains):
        for value in chain:
            uses.setdefault(value, []).append(index)
    key_of: dict[int, tuple[int, int, int]] = {}
    order: SortedList = SortedList()
    hits = 0
    for index, chain in enumerate(chains):
        hits += next((k for k, value in enumerate(chain) if value not in key_of), len(chain))
        for depth, value in enumerate(chain):
            if value in key_of:
                order.remove(key_of[value])
            later = [use for use in uses[value] if use > index]
            key_of[value] = (later[0] if later else len(chains), depth, value)
            order.add(key_of[value])
        while len(order) > capacity:
            del key_of[order.pop()[2]]
    return hits


@pytest.mark.parametrize(("policy", "model"), [("lru", lru_model), ("belady", belady_model)])
def test_replay_equals_a_plain_model_of_the_traces_readme(policy: str, model: Any) -> None:
    requests = load_mooncake_trace(sample_trace_path(), limit=400)
    chains = [trace_block_hashes(request.hash_ids) for request in requests]
    assert replay(requests, capacity=300, policy=policy).hit_blocks == model(chains, 300)


def test_unbounded_and_zero_capacity() -> None:
    assert replay(TINY_TRACE, capacity=100).evictions == 0
    assert replay(TINY_TRACE, capacity=100).hit_blocks == 2 + 3 + 3
    assert replay(TINY_TRACE, capacity=0).hit_blocks == 0
    assert replay([], capacity=5).hit_rate == 0.0
    with pytest.raises(InvalidArgumentError, match="capacity"):
        replay(TINY_TRACE, capacity=-1)
    with pytest.raises(ConfigError, match="no_such_policy"):
        replay(TINY_TRACE, capacity=3, policy="no_such_policy")


def test_belady_beats_or_equals_every_policy_on_the_sample() -> None:
    requests = load_mooncake_trace(sample_trace_path(), limit=400)
    optimum = replay(requests, capacity=300, policy="belady")
    lru = replay(requests, capacity=300, policy="lru")
    assert lru.hit_rate > 0
    assert optimum.hit_rate >= lru.hit_rate
    assert replay(requests, capacity=300, policy="ref_zero").hit_blocks == 0


def test_progress_falls_back_to_a_stderr_counter(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)
    requests = load_mooncake_trace(sample_trace_path(), limit=500)
    replay(requests, capacity=100, progress=True)
    assert "500/500 requests" in capsys.readouterr().err


# ---------------------------------------------------------------------- CLI


def test_cli_replay_prints_the_summary(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["replay", "--limit", "60", "--capacity", "200", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "mooncake_sample.jsonl (60 requests)" in out
    assert "policy:        lru, capacity 200 blocks" in out
    for label in ("hit rate:", "tokens saved:", "evictions:", "req/s"):
        assert label in out


def test_cli_compare_prints_a_table_with_the_optimum(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["compare", "--limit", "80", "--capacities", "50,400", "--policies", "lru"]
    assert main([*argv, "--no-plot", "--no-progress"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "---" not in line]
    assert rows[0].startswith("| policy | capacity | hit rate | of optimum")
    assert [row.split(" | ")[:2] for row in rows[1:]] == [
        ["| lru", "50"],
        ["| belady", "50"],
        ["| lru", "400"],
        ["| belady", "400"],
    ]
    assert all(row.split(" | ")[3] == "1.00" for row in rows[1:] if "belady" in row)


def test_cli_compare_writes_the_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    target = tmp_path / "plot.png"
    argv = ["compare", "--limit", "30", "--capacities", "20,60", "--policies", "lru"]
    assert main([*argv, "--plot", str(target), "--no-progress"]) == 0
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"plot written to {target}" in capsys.readouterr().out


def test_cli_compare_without_matplotlib_still_prints_the_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    argv = ["compare", "--limit", "20", "--capacities", "30", "--no-progress"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "| belady | 30 |" in out
    assert "note: no plot written; install matplotlib" in out
    assert main([*argv, "--plot", "out.png"]) == 2
    assert list(tmp_path.iterdir()) == []


def test_concurrent_replay_through_the_loop(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("prefixcache.reference.sim")
    argv = ["compare", "--concurrency", "--limit", "60", "--capacities", "800"]
    assert main([*argv, "--policies", "lru,ref_zero", "--no-plot", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "with concurrency" in out
    assert [line.split(" | ")[0] for line in out.splitlines() if "| 800 |" in line] == [
        "| lru",
        "| ref_zero",
        "| belady",
    ]
    spread = [replace(r, timestamp_ms=i * 1000) for i, r in enumerate(TINY_TRACE * 2)]
    result = replay_concurrent(spread, capacity=40, policy="lru")
    assert result.num_requests == 10
    assert 0 < result.tokens_saved <= result.prompt_tokens
    with pytest.raises(InvalidArgumentError, match="capacity"):
        replay_concurrent(TINY_TRACE, capacity=0)


def test_cli_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(f"{LINE}\nnot json\n")
    assert main(["replay", "--trace", str(bad)]) == 2
    assert "line 2: not valid JSON" in capsys.readouterr().err
    assert main(["replay", "--trace", str(tmp_path / "missing.jsonl")]) == 2
    assert "cannot read" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main(["replay", "--policy", "no_such_policy"])
    assert info.value.code == 2
    assert "known policies" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "prefixcache.reference.sim", None)
    assert main(["compare", "--concurrency", "--limit", "5"]) == 1
    assert "concurrency mode needs prefixcache.reference.sim" in capsys.readouterr().err
