"""The issue-26 trace families: each shows the production pattern its docstring names.

Long agent sessions grow one chain for 50-200 calls on their own log-normal
clocks; heavy-tailed chats end (abandoned or not) and never come back; tenants
share no block and differ in rate; scan blocks are used once and come in bursts.
(Determinism and well-formedness: ``test_workloads.py``, which runs every family.)
"""

from __future__ import annotations

from collections import Counter
from itertools import pairwise

import pytest

from prefixcache.errors import InvalidArgumentError
from prefixcache.reference.trace import TraceRequest
from prefixcache.tools import workloads


def _sessions(trace: list[TraceRequest], key_index: int) -> dict[int, list[TraceRequest]]:
    """Requests grouped by the block at ``key_index`` (a session's own first block), in order."""
    sessions: dict[int, list[TraceRequest]] = {}
    for request in trace:
        sessions.setdefault(request.hash_ids[key_index], []).append(request)
    return sessions


def _assert_each_call_extends_the_last(sessions: dict[int, list[TraceRequest]]) -> None:
    for calls in sessions.values():
        for before, after in pairwise(calls):
            assert after.hash_ids[: before.num_blocks] == before.hash_ids
            assert after.num_blocks > before.num_blocks


def test_long_agent_sessions_grow_one_chain_for_min_to_max_turns() -> None:
    trace = workloads.long_agent_sessions(
        600, seed=3, num_agents=2, agent_prompt_blocks=4, num_sessions=3, min_turns=20, max_turns=40
    )
    assert len({request.hash_ids[:4] for request in trace}) <= 2  # the agents' prompts
    sessions = _sessions(trace, 4)  # block 4: the session's task, fresh per session
    _assert_each_call_extends_the_last(sessions)
    lengths = [len(calls) for calls in sessions.values()]
    assert max(lengths) <= 40
    assert sum(length < 20 for length in lengths) <= 3  # only sessions still running at the end
    assert len(sessions) >= 15  # sessions ended and new ones took their slots


def test_long_agent_gaps_are_the_medians_without_spread_and_heavy_tailed_with_it() -> None:
    def gaps(sigma: float) -> list[int]:
        trace = workloads.long_agent_sessions(
            400, seed=1, num_sessions=2, agent_prompt_blocks=3, user_turn_fraction=0.0,
            median_tool_gap_ms=1000, gap_sigma=sigma,
        )  # fmt: skip
        sessions = _sessions(trace, 3)
        return [
            after.timestamp_ms - before.timestamp_ms
            for calls in sessions.values()
            for before, after in pairwise(calls)
        ]

    assert all(999 <= gap <= 1001 for gap in gaps(0.0))  # ms truncation only
    spread = sorted(gaps(1.5))
    median, p99 = spread[len(spread) // 2], spread[int(len(spread) * 0.99)]
    assert p99 > 10 * median  # log-normal, sigma 1.5: p99 / median = e^3.5, about 33


def test_abandoned_chats_stop_after_few_turns_and_never_return() -> None:
    def turns(abandon_fraction: float) -> list[int]:
        trace = workloads.heavy_tailed_chats(
            500, seed=2, num_conversations=10, max_turns=20,
            abandon_fraction=abandon_fraction, max_abandoned_turns=2,
        )  # fmt: skip
        sessions = _sessions(trace, 0)  # block 0: the conversation's fresh first prompt
        _assert_each_call_extends_the_last(sessions)
        return [len(calls) for calls in sessions.values()]

    assert max(turns(1.0)) <= 2  # every conversation abandoned: none comes back for turn 3
    kept = turns(0.0)
    assert max(kept) > 2 and max(kept) <= 20


def test_chat_think_times_follow_their_median() -> None:
    trace = workloads.heavy_tailed_chats(
        200, seed=5, num_conversations=4, max_turns=50, abandon_fraction=0.0,
        median_think_ms=5000, think_sigma=0.0,
    )  # fmt: skip
    for calls in _sessions(trace, 0).values():
        for before, after in pairwise(calls):
            assert 4999 <= after.timestamp_ms - before.timestamp_ms <= 5001


def test_tenants_share_no_block_and_the_first_is_the_busiest() -> None:
    trace = workloads.multi_tenant_mix(2000, seed=4, num_tenants=4, tenant_prompt_blocks=3)
    tenants = _sessions(trace, 0)  # block 0 starts the tenant's own system prompt
    assert len(tenants) == 4
    prompts = {request.hash_ids[:3] for request in trace}
    assert len(prompts) == 4  # one system prompt per tenant, every request behind one
    blocks = [{h for r in requests for h in r.hash_ids} for requests in tenants.values()]
    assert sum(len(b) for b in blocks) == len(set().union(*blocks))  # disjoint
    counts = sorted((len(requests) for requests in tenants.values()), reverse=True)
    assert counts[0] > 3 * counts[-1]  # rates 1 : 1/2 : 1/3 : 1/4


def test_scan_blocks_are_one_off_and_come_in_bursts() -> None:
    trace = workloads.scan_pollution(
        3000, seed=6, num_hot_prefixes=4, hot_prefix_blocks=8, burst_probability=0.02,
        max_burst_scans=20, min_scan_blocks=30, max_scan_blocks=40,
    )  # fmt: skip
    hot = {request.hash_ids[:8] for request in trace if request.num_blocks <= 10}
    assert len(hot) <= 4
    uses = Counter(h for request in trace for h in request.hash_ids)
    is_scan = [request.hash_ids[:8] not in hot for request in trace]
    scans = [request for request, scan in zip(trace, is_scan, strict=True) if scan]
    assert len(scans) > 300
    assert all(uses[h] == 1 for request in scans for h in request.hash_ids)  # one-off
    assert all(30 <= request.num_blocks <= 40 for request in scans)
    bursts = sum(scan and not before for before, scan in pairwise([False, *is_scan]))
    assert bursts < len(scans) / 4  # clustered: about 10 scans a burst


@pytest.mark.parametrize(
    "call",
    [
        lambda: workloads.long_agent_sessions(5, min_turns=10, max_turns=5),
        lambda: workloads.long_agent_sessions(5, gap_sigma=-1.0),
        lambda: workloads.long_agent_sessions(5, user_turn_fraction=1.5),
        lambda: workloads.long_agent_sessions(5, median_tool_gap_ms=0),
        lambda: workloads.heavy_tailed_chats(5, abandon_fraction=-0.1),
        lambda: workloads.heavy_tailed_chats(5, think_sigma=float("nan")),
        lambda: workloads.heavy_tailed_chats(5, think_sigma="1"),  # not a bare TypeError
        lambda: workloads.heavy_tailed_chats(5, max_abandoned_turns=0),
        lambda: workloads.multi_tenant_mix(5, num_tenants=0),
        lambda: workloads.multi_tenant_mix(5, tenant_prompt_blocks=0),
        lambda: workloads.scan_pollution(5, min_scan_blocks=9, max_scan_blocks=3),
        lambda: workloads.scan_pollution(5, burst_probability=2.0),
        lambda: workloads.scan_pollution(5, zipf_exponent=-1.0),
    ],
)
def test_bad_arguments_raise(call) -> None:
    with pytest.raises(InvalidArgumentError):
        call()
