"""The trace generators: seeded, well-formed, and sharing exactly the prefixes they describe."""

from __future__ import annotations

import pytest

from prefixcache.errors import InvalidArgumentError
from prefixcache.reference.trace import TRACE_BLOCK_SIZE, load_mooncake_trace
from prefixcache.tools import workloads

GENERATORS = [
    workloads.shared_system_prompts,
    workloads.multi_turn_chats,
    workloads.documents_with_hot_prefixes,
    workloads.agent_tool_loops,
    workloads.document_qa,
    workloads.long_agent_sessions,
    workloads.heavy_tailed_chats,
    workloads.multi_tenant_mix,
    workloads.scan_pollution,
]


@pytest.mark.parametrize("generate", GENERATORS)
def test_same_seed_same_trace_other_seed_other_trace(generate) -> None:
    assert generate(50, seed=3) == generate(50, seed=3)
    assert generate(50, seed=3) != generate(50, seed=4)


@pytest.mark.parametrize("generate", GENERATORS)
def test_requests_are_well_formed(generate) -> None:
    trace = generate(200, seed=1)
    assert len(trace) == 200
    times = [request.timestamp_ms for request in trace]
    assert times == sorted(times) and times[0] == 0
    for request in trace:
        assert request.num_blocks >= 1
        full = (request.num_blocks - 1) * TRACE_BLOCK_SIZE
        assert full < request.input_length <= request.num_blocks * TRACE_BLOCK_SIZE
        assert request.output_length >= 1


def test_system_prompts_share_only_the_prompts() -> None:
    trace = workloads.shared_system_prompts(300, seed=2, num_prompts=3, prompt_blocks=5)
    assert len({request.hash_ids[:5] for request in trace}) <= 3
    tails = [block for request in trace for block in request.hash_ids[5:]]
    assert len(tails) == len(set(tails))


def test_multi_turn_turns_extend_the_previous_prompt() -> None:
    trace = workloads.multi_turn_chats(300, seed=5, num_conversations=4)
    last_by_root: dict[int, tuple[int, ...]] = {}
    extensions = 0
    for request in trace:
        previous = last_by_root.get(request.hash_ids[0])
        if previous is not None:
            assert request.hash_ids[: len(previous)] == previous
            assert len(request.hash_ids) > len(previous)
            extensions += 1
        last_by_root[request.hash_ids[0]] = request.hash_ids
    assert extensions > 200  # most requests continue a conversation


def test_documents_are_one_offs_and_questions_hit_hot_prefixes() -> None:
    trace = workloads.documents_with_hot_prefixes(
        400, seed=6, scan_fraction=0.5, num_hot_prefixes=2, hot_prefix_blocks=4
    )
    prefixes = {request.hash_ids[:4] for request in trace}
    hot = [prefix for prefix in prefixes if sum(r.hash_ids[:4] == prefix for r in trace) > 1]
    assert len(hot) == 2
    num_scans = sum(request.hash_ids[:4] not in hot for request in trace)
    assert 150 < num_scans < 250
    assert all(request.num_blocks >= 40 for request in trace if request.hash_ids[:4] not in hot)


def test_agent_steps_extend_their_session_and_some_retry_from_an_earlier_step() -> None:
    trace = workloads.agent_tool_loops(
        600, seed=4, num_agents=3, agent_prompt_blocks=5, num_sessions=8, retry_fraction=0.2
    )
    assert len({request.hash_ids[:5] for request in trace}) <= 3  # the agents' prompts
    by_task: dict[int, list[tuple[int, ...]]] = {}
    extensions = retries = 0
    for request in trace:
        earlier = by_task.setdefault(request.hash_ids[5], [])
        size = len(request.hash_ids)
        bases = [p for p in earlier if request.hash_ids[: len(p)] == p and len(p) < size]
        if earlier:  # a later step: it extends the last step, or retries from an earlier one
            extensions += bool(bases) and max(bases, key=len) == earlier[-1]
            retries += not bases or max(bases, key=len) != earlier[-1]
        earlier.append(request.hash_ids)
    assert extensions > 300 and 40 < retries < 200


def test_document_questions_start_with_a_shared_document_or_follow_one_up() -> None:
    trace = workloads.document_qa(
        500, seed=8, num_documents=4, min_document_blocks=10, max_document_blocks=20
    )
    documents = {request.hash_ids[:10] for request in trace}
    assert len(documents) <= 4  # every prompt starts with one of the four documents
    seen: list[tuple[int, ...]] = []
    follow_ups = 0
    for request in trace:
        follow_ups += any(request.hash_ids[: len(p)] == p for p in seen[-32:])
        seen.append(request.hash_ids)
    assert 80 < follow_ups < 250  # about 30 %


@pytest.mark.parametrize(
    "call",
    [
        lambda: workloads.shared_system_prompts(0),
        lambda: workloads.shared_system_prompts(5, zipf_exponent=-1.0),
        lambda: workloads.shared_system_prompts(5, zipf_exponent=float("nan")),  # as document_qa
        lambda: workloads.multi_turn_chats(5, max_turns=0),
        lambda: workloads.documents_with_hot_prefixes(5, scan_fraction=1.5),
        lambda: workloads.documents_with_hot_prefixes(
            5, min_document_blocks=9, max_document_blocks=3
        ),
        lambda: workloads.agent_tool_loops(5, retry_fraction=2.0),
        lambda: workloads.agent_tool_loops(5, num_sessions=0),
        lambda: workloads.document_qa(5, zipf_exponent=-0.5),
        lambda: workloads.document_qa(5, min_document_blocks=9, max_document_blocks=3),
        lambda: workloads.document_qa(5, follow_up_fraction=-0.1),
        lambda: workloads.document_qa(5, follow_up_fraction="0.5"),  # not a bare TypeError
        lambda: workloads.agent_tool_loops(5, retry_fraction=True),
    ],
)
def test_bad_arguments_raise(call) -> None:
    with pytest.raises(InvalidArgumentError):
        call()


def test_written_trace_loads_back(tmp_path) -> None:
    trace = workloads.multi_turn_chats(30, seed=9)
    path = tmp_path / "chats.jsonl"
    workloads.write_mooncake_trace(trace, path)
    assert load_mooncake_trace(path) == trace
