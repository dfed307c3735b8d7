"""Seeded generators of Mooncake-format traces, for judging eviction policies off one trace.

Each generator returns ``list[TraceRequest]`` (see :mod:`prefixcache.reference.trace`):
arrivals in timestamp order (Poisson, ``mean_gap_ms`` apart), one hash ID per
512-token block, a partial last block. Equal seeds give equal traces. Block
IDs are fresh integers except where a family shares them on purpose, so two
requests share exactly the prefixes the family describes.

- :func:`shared_system_prompts`: many users behind few long system prompts
  of Zipf popularity, each request with its own short tail.
- :func:`multi_turn_chats`: conversations whose every turn resends the
  previous prompt plus the reply and a new message, interleaved.
- :func:`documents_with_hot_prefixes`: the scan-heavy mix: a scan of
  one-off long documents mixed with requests on a few hot prefixes.
- :func:`agent_tool_loops`: agent sessions that call tools in a loop, each
  step resending the session so far plus the tool's output, behind a few
  shared agent system prompts; some steps retry from an earlier step.
- :func:`document_qa`: questions, and follow-ups, over a few long shared
  documents of Zipf popularity.

:func:`write_mooncake_trace` writes a trace as JSONL, so ``prefixcache
compare --trace`` can replay it.

>>> trace = multi_turn_chats(6, seed=1, num_conversations=2)
>>> len(trace), trace == multi_turn_chats(6, seed=1, num_conversations=2)
(6, True)
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator, Sequence
from itertools import count
from os import PathLike

from prefixcache.engine.validation import require_fraction, require_int
from prefixcache.errors import InvalidArgumentError
from prefixcache.reference.trace import TRACE_BLOCK_SIZE, TraceRequest

__all__ = [
    "agent_tool_loops",
    "document_qa",
    "documents_with_hot_prefixes",
    "multi_turn_chats",
    "shared_system_prompts",
    "write_mooncake_trace",
]


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        require_int(value, name, minimum=1)


def _arrivals(rng: random.Random, mean_gap_ms: int) -> Iterator[int]:
    """Poisson arrival times in milliseconds, starting at 0."""
    now = 0.0
    while True:
        yield int(now)
        now += rng.expovariate(1.0 / mean_gap_ms)


def _request(rng: random.Random, timestamp: int, hash_ids: Sequence[int]) -> TraceRequest:
    """A request over ``hash_ids`` whose last block is partly filled."""
    input_length = len(hash_ids) * TRACE_BLOCK_SIZE - rng.randrange(TRACE_BLOCK_SIZE)
    return TraceRequest(timestamp, input_length, rng.randint(16, 512), tuple(hash_ids))


def _zipf_weights(num_items: int, exponent: float) -> list[float]:
    return [1.0 / (rank**exponent) for rank in range(1, num_items + 1)]


def _check_exponent(zipf_exponent: float) -> None:
    """Refuse a negative (or NaN) popularity skew."""
    if not zipf_exponent >= 0:
        raise InvalidArgumentError(f"zipf_exponent must be >= 0, got {zipf_exponent!r}")


def _check_document_range(min_document_blocks: int, max_document_blocks: int) -> None:
    """Refuse a longest document shorter than the shortest."""
    if max_document_blocks < min_document_blocks:
        raise InvalidArgumentError(
            f"max_document_blocks {max_document_blocks} < min_document_blocks {min_document_blocks}"
        )


def _blocks(fresh: Iterator[int], num_blocks: int) -> list[int]:
    """``num_blocks`` hash IDs never used before (the next ones of ``fresh``)."""
    return [next(fresh) for _ in range(num_blocks)]


def shared_system_prompts(
    num_requests: int,
    *,
    seed: int = 0,
    num_prompts: int = 200,
    prompt_blocks: int = 24,
    max_user_blocks: int = 16,
    zipf_exponent: float = 1.0,
    mean_gap_ms: int = 200,
) -> list[TraceRequest]:
    """Many users sharing few long system prompts.

    Each request is one of ``num_prompts`` system prompts (``prompt_blocks``
    blocks each, picked with Zipf popularity) followed by 1 to
    ``max_user_blocks`` blocks of its own. Hits come from the prompts; the
    user tails are never reused, so a policy must not let them flush the
    prompts.

    Args:
        num_requests: requests to generate (>= 1).
        seed: random seed.
        num_prompts: distinct system prompts (>= 1).
        prompt_blocks: blocks per system prompt (>= 1).
        max_user_blocks: longest user tail in blocks (>= 1).
        zipf_exponent: popularity skew of the prompts (>= 0; 0 is uniform).
        mean_gap_ms: mean time between arrivals (>= 1).

    Returns:
        The trace, in arrival order.

    Raises:
        InvalidArgumentError: an argument is out of range.

    Complexity: O(blocks generated).
    """
    _check_positive(
        num_requests=num_requests,
        num_prompts=num_prompts,
        prompt_blocks=prompt_blocks,
        max_user_blocks=max_user_blocks,
        mean_gap_ms=mean_gap_ms,
    )
    _check_exponent(zipf_exponent)
    rng = random.Random(seed)
    fresh = count()
    prompts = [_blocks(fresh, prompt_blocks) for _ in range(num_prompts)]
    weights = _zipf_weights(num_prompts, zipf_exponent)
    arrivals = _arrivals(rng, mean_gap_ms)
    trace = []
    for _ in range(num_requests):
        prompt = rng.choices(prompts, weights)[0]
        tail = _blocks(fresh, rng.randint(1, max_user_blocks))
        trace.append(_request(rng, next(arrivals), prompt + tail))
    return trace


def multi_turn_chats(
    num_requests: int,
    *,
    seed: int = 0,
    num_conversations: int = 500,
    first_turn_blocks: int = 8,
    max_turn_blocks: int = 4,
    max_turns: int = 12,
    mean_gap_ms: int = 200,
) -> list[TraceRequest]:
    """Multi-turn chats whose every turn extends the previous prompt.

    ``num_conversations`` conversations are open at a time; each request
    continues a random open one: its prompt is the previous prompt of that
    conversation plus 1 to ``max_turn_blocks`` new blocks (the reply and the
    next message). After ``max_turns`` turns (at least 1, drawn per
    conversation) a conversation closes and a new one, with a fresh first
    prompt of 1 to ``first_turn_blocks`` blocks, takes its place. The reuse
    distance is the time between turns, long when many chats are open.

    Args:
        num_requests: requests to generate (>= 1).
        seed: random seed.
        num_conversations: conversations open at a time (>= 1).
        first_turn_blocks: longest first prompt in blocks (>= 1).
        max_turn_blocks: most blocks a turn adds (>= 1).
        max_turns: most turns of a conversation (>= 1).
        mean_gap_ms: mean time between arrivals (>= 1).

    Returns:
        The trace, in arrival order.

    Raises:
        InvalidArgumentError: an argument is out of range.

    Complexity: O(blocks generated).
    """
    _check_positive(
        num_requests=num_requests,
        num_conversations=num_conversations,
        first_turn_blocks=first_turn_blocks,
        max_turn_blocks=max_turn_blocks,
        max_turns=max_turns,
        mean_gap_ms=mean_gap_ms,
    )
    rng = random.Random(seed)
    fresh = count()

    def open_chat() -> list:
        prompt = _blocks(fresh, rng.randint(1, first_turn_blocks))
        return [prompt, rng.randint(1, max_turns)]  # [prompt so far, turns left]

    chats = [open_chat() for _ in range(num_conversations)]
    arrivals = _arrivals(rng, mean_gap_ms)
    trace = []
    for _ in range(num_requests):
        index = rng.randrange(num_conversations)
        prompt, turns_left = chats[index]
        trace.append(_request(rng, next(arrivals), prompt))
        if turns_left <= 1:
            chats[index] = open_chat()
        else:
            grown = prompt + _blocks(fresh, rng.randint(1, max_turn_blocks))
            chats[index] = [grown, turns_left - 1]
    return trace


def documents_with_hot_prefixes(
    num_requests: int,
    *,
    seed: int = 0,
    scan_fraction: float = 0.5,
    min_document_blocks: int = 40,
    max_document_blocks: int = 120,
    num_hot_prefixes: int = 40,
    hot_prefix_blocks: int = 32,
    max_question_blocks: int = 4,
    mean_gap_ms: int = 200,
) -> list[TraceRequest]:
    """A scan of one-off long documents mixed with questions on a few hot prefixes.

    With probability ``scan_fraction`` a request is a long document seen
    once (``min_document_blocks`` to ``max_document_blocks`` fresh blocks);
    otherwise it is one of ``num_hot_prefixes`` shared prefixes (uniform)
    plus a question of its own. LRU lets each scan flush the hot prefixes; a
    scan-resistant policy keeps them.

    Args:
        num_requests: requests to generate (>= 1).
        seed: random seed.
        scan_fraction: share of one-off documents, in ``[0, 1]``.
        min_document_blocks: shortest document (>= 1).
        max_document_blocks: longest document (>= min_document_blocks).
        num_hot_prefixes: shared prefixes (>= 1).
        hot_prefix_blocks: blocks per shared prefix (>= 1).
        max_question_blocks: longest question (>= 1).
        mean_gap_ms: mean time between arrivals (>= 1).

    Returns:
        The trace, in arrival order.

    Raises:
        InvalidArgumentError: an argument is out of range.

    Complexity: O(blocks generated).
    """
    _check_positive(
        num_requests=num_requests,
        min_document_blocks=min_document_blocks,
        max_document_blocks=max_document_blocks,
        num_hot_prefixes=num_hot_prefixes,
        hot_prefix_blocks=hot_prefix_blocks,
        max_question_blocks=max_question_blocks,
        mean_gap_ms=mean_gap_ms,
    )
    require_fraction(scan_fraction, "scan_fraction")
    _check_document_range(min_document_blocks, max_document_blocks)
    rng = random.Random(seed)
    fresh = count()
    hot = [_blocks(fresh, hot_prefix_blocks) for _ in range(num_hot_prefixes)]
    arrivals = _arrivals(rng, mean_gap_ms)
    trace = []
    for _ in range(num_requests):
        if rng.random() < scan_fraction:
            size = rng.randint(min_document_blocks, max_document_blocks)
            hash_ids = _blocks(fresh, size)
        else:
            question = _blocks(fresh, rng.randint(1, max_question_blocks))
            hash_ids = rng.choice(hot) + question
        trace.append(_request(rng, next(arrivals), hash_ids))
    return trace


def agent_tool_loops(
    num_requests: int,
    *,
    seed: int = 0,
    num_agents: int = 6,
    agent_prompt_blocks: int = 24,
    num_sessions: int = 200,
    max_steps: int = 16,
    max_tool_blocks: int = 6,
    retry_fraction: float = 0.1,
    mean_gap_ms: int = 50,
) -> list[TraceRequest]:
    """Agent sessions calling tools in a loop behind a few shared agent prompts.

    Stands for coding and tool-use agents: each agent kind has a long
    system prompt with its tool definitions (``agent_prompt_blocks``),
    shared by every session of that kind (Zipf popularity over
    ``num_agents`` kinds). ``num_sessions`` sessions run at a time; each
    request advances a random one by a step: the session so far plus the
    last tool's output and the model's next call (1 to ``max_tool_blocks``
    new blocks). Steps come fast (a tool call takes seconds, not a user's
    minutes), so reuse distances are short, and the history grows long.
    With probability ``retry_fraction`` a step instead retries from an
    earlier step of its session (a failed tool call, a re-plan): a branch
    that shares the session's prefix up to that step. After 1 to
    ``max_steps`` steps a session ends and a new one starts.

    Args:
        num_requests: requests to generate (>= 1).
        seed: random seed.
        num_agents: agent kinds, each with its own system prompt (>= 1).
        agent_prompt_blocks: blocks per agent system prompt (>= 1).
        num_sessions: sessions running at a time (>= 1).
        max_steps: most steps of a session (>= 1).
        max_tool_blocks: most blocks one step adds (>= 1).
        retry_fraction: share of steps that branch from an earlier step, in ``[0, 1]``.
        mean_gap_ms: mean time between arrivals (>= 1).

    Returns:
        The trace, in arrival order.

    Raises:
        InvalidArgumentError: an argument is out of range.

    Complexity: O(blocks generated).
    """
    _check_positive(
        num_requests=num_requests,
        num_agents=num_agents,
        agent_prompt_blocks=agent_prompt_blocks,
        num_sessions=num_sessions,
        max_steps=max_steps,
        max_tool_blocks=max_tool_blocks,
        mean_gap_ms=mean_gap_ms,
    )
    require_fraction(retry_fraction, "retry_fraction")
    rng = random.Random(seed)
    fresh = count()
    agents = [_blocks(fresh, agent_prompt_blocks) for _ in range(num_agents)]
    weights = _zipf_weights(num_agents, 1.0)

    def new_session() -> tuple[list[list[int]], int]:
        """(the prompt after each step so far, steps left)."""
        prompt = rng.choices(agents, weights)[0] + [next(fresh)]  # the task
        return [prompt], rng.randint(1, max_steps)

    sessions = [new_session() for _ in range(num_sessions)]
    arrivals = _arrivals(rng, mean_gap_ms)
    trace = []
    for _ in range(num_requests):
        index = rng.randrange(num_sessions)
        steps, steps_left = sessions[index]
        base = steps[-1]
        if len(steps) > 1 and rng.random() < retry_fraction:
            base = steps[rng.randrange(len(steps) - 1)]  # retry from an earlier step
        prompt = base + _blocks(fresh, rng.randint(1, max_tool_blocks))
        trace.append(_request(rng, next(arrivals), prompt))
        sessions[index] = new_session() if steps_left <= 1 else ([*steps, prompt], steps_left - 1)
    return trace


def document_qa(
    num_requests: int,
    *,
    seed: int = 0,
    num_documents: int = 100,
    min_document_blocks: int = 20,
    max_document_blocks: int = 100,
    zipf_exponent: float = 0.8,
    max_question_blocks: int = 3,
    follow_up_fraction: float = 0.3,
    mean_gap_ms: int = 200,
) -> list[TraceRequest]:
    """Questions, and follow-ups, over a few long shared documents.

    Stands for retrieval over a small corpus (a contract, a code base, a
    manual loaded whole into the prompt): ``num_documents`` documents of
    ``min_document_blocks`` to ``max_document_blocks`` blocks, chosen with
    Zipf popularity, each request the document plus a question of its own.
    With probability ``follow_up_fraction`` a request follows up a recent
    question instead: that question's prompt plus the answer and a new
    question. The documents are long beside the cache, so which ones stay
    cached decides the hit rate.

    Args:
        num_requests: requests to generate (>= 1).
        seed: random seed.
        num_documents: shared documents (>= 1).
        min_document_blocks: shortest document (>= 1).
        max_document_blocks: longest document (>= min_document_blocks).
        zipf_exponent: skew of document popularity (>= 0; 0 is uniform).
        max_question_blocks: longest question or follow-up (>= 1).
        follow_up_fraction: share of follow-ups, in ``[0, 1]``.
        mean_gap_ms: mean time between arrivals (>= 1).

    Returns:
        The trace, in arrival order.

    Raises:
        InvalidArgumentError: an argument is out of range.

    Complexity: O(blocks generated).
    """
    _check_positive(
        num_requests=num_requests,
        num_documents=num_documents,
        min_document_blocks=min_document_blocks,
        max_document_blocks=max_document_blocks,
        max_question_blocks=max_question_blocks,
        mean_gap_ms=mean_gap_ms,
    )
    _check_document_range(min_document_blocks, max_document_blocks)
    _check_exponent(zipf_exponent)
    require_fraction(follow_up_fraction, "follow_up_fraction")
    rng = random.Random(seed)
    fresh = count()
    documents = [
        _blocks(fresh, rng.randint(min_document_blocks, max_document_blocks))
        for _ in range(num_documents)
    ]
    weights = _zipf_weights(num_documents, zipf_exponent)
    recent: list[list[int]] = []  # the last prompts, for follow-ups
    arrivals = _arrivals(rng, mean_gap_ms)
    trace = []
    for _ in range(num_requests):
        question = _blocks(fresh, rng.randint(1, max_question_blocks))
        if recent and rng.random() < follow_up_fraction:
            prompt = recent.pop(rng.randrange(len(recent))) + question
        else:
            prompt = rng.choices(documents, weights)[0] + question
        trace.append(_request(rng, next(arrivals), prompt))
        recent = [*recent[-31:], prompt]
    return trace


def write_mooncake_trace(requests: Sequence[TraceRequest], path: str | PathLike[str]) -> None:
    """Write ``requests`` as a Mooncake JSONL trace (readable by ``load_mooncake_trace``).

    Raises:
        OSError: the file cannot be written.

    Complexity: O(size of the trace).
    """
    with open(path, "w", encoding="utf-8") as file:
        for request in requests:
            record = {
                "timestamp": request.timestamp_ms,
                "input_length": request.input_length,
                "output_length": request.output_length,
                "hash_ids": list(request.hash_ids),
            }
            file.write(json.dumps(record) + "\n")
