"""The long-agent-sessions family: agentic sessions of 50 to 200 turns, tool loops
between the user's messages, contexts that grow all session long, heavy-tailed gaps.

One family a module, so each generator reads on its own.
"""

from __future__ import annotations

import random
from itertools import count

from prefixcache.engine.validation import require_fraction
from prefixcache.errors import InvalidArgumentError
from prefixcache.reference.trace import TraceRequest
from prefixcache.tools.workloads._common import (
    _blocks,
    _by_time,
    _check_positive,
    _check_sigma,
    _lognormal_ms,
    _slot_turns,
    _zipf_weights,
)


def long_agent_sessions(
    num_requests: int,
    *,
    seed: int = 0,
    num_agents: int = 4,
    agent_prompt_blocks: int = 16,
    num_sessions: int = 8,
    min_turns: int = 50,
    max_turns: int = 200,
    max_step_blocks: int = 2,
    user_turn_fraction: float = 0.2,
    median_tool_gap_ms: int = 2_000,
    median_user_gap_ms: int = 30_000,
    gap_sigma: float = 1.0,
) -> list[TraceRequest]:
    """Long agentic sessions (coding agents): tool loops, growing contexts, session ends.

    Stands for agentic-coding traffic as production traces show it: a
    session lives for 50 to 200 model calls, every call resends the whole
    session so far (one long chain that only grows), and the gaps between a
    session's calls are heavy-tailed: a tool call returns in seconds, the
    user answers in minutes, now and then much later. Unlike
    :func:`~prefixcache.tools.workloads.agent_tool_loops` (short sessions,
    one Poisson stream), each session keeps its own clock: the next call
    comes a log-normal gap after the last one, with median
    ``median_tool_gap_ms`` after a tool step, or ``median_user_gap_ms``
    when the step was the user's turn (with probability
    ``user_turn_fraction``). ``num_sessions`` sessions run at a time behind
    ``num_agents`` agent system prompts of Zipf popularity; each step adds
    1 to ``max_step_blocks`` blocks. A session ends after ``min_turns`` to
    ``max_turns`` calls and never comes back (its chain is dead: what an
    optimum evicts first); a new one takes its place after a user gap. The
    agent closes its session itself, so a session's last call is marked
    ``ends_conversation``.

    Args:
        num_requests: requests to generate (>= 1).
        seed: random seed.
        num_agents: agent kinds, each with its own system prompt (>= 1).
        agent_prompt_blocks: blocks per agent system prompt (>= 1).
        num_sessions: sessions running at a time (>= 1).
        min_turns: fewest calls of a session (>= 1).
        max_turns: most calls of a session (>= min_turns).
        max_step_blocks: most blocks one call adds (>= 1).
        user_turn_fraction: share of steps that wait for the user, in ``[0, 1]``.
        median_tool_gap_ms: median gap after a tool step (>= 1).
        median_user_gap_ms: median gap after a user's turn, and before a new session (>= 1).
        gap_sigma: log-normal spread of every gap (>= 0; 0: every gap is its median).

    Returns:
        The trace, in arrival order.

    Raises:
        InvalidArgumentError: an argument is out of range.

    Complexity: O(blocks generated + num_requests log num_sessions).
    """
    _check_positive(
        num_requests=num_requests,
        num_agents=num_agents,
        agent_prompt_blocks=agent_prompt_blocks,
        num_sessions=num_sessions,
        min_turns=min_turns,
        max_turns=max_turns,
        max_step_blocks=max_step_blocks,
        median_tool_gap_ms=median_tool_gap_ms,
        median_user_gap_ms=median_user_gap_ms,
    )
    if max_turns < min_turns:
        raise InvalidArgumentError(f"max_turns {max_turns} < min_turns {min_turns}")
    require_fraction(user_turn_fraction, "user_turn_fraction")
    _check_sigma(gap_sigma=gap_sigma)
    rng = random.Random(seed)
    fresh = count()
    agents = [_blocks(fresh, agent_prompt_blocks) for _ in range(num_agents)]
    weights = _zipf_weights(num_agents, 1.0)

    def new_session() -> tuple[list[int], int]:
        """(the prompt so far: agent prompt + task, calls left)."""
        prompt = rng.choices(agents, weights)[0] + [next(fresh)]
        return prompt, rng.randint(min_turns, max_turns)

    sessions = [new_session() for _ in range(num_sessions)]

    def turn(slot: int) -> tuple[list[int], float, bool]:
        prompt, calls_left = sessions[slot]
        prompt = prompt + _blocks(fresh, rng.randint(1, max_step_blocks))
        if calls_left <= 1:
            sessions[slot] = new_session()
            median = median_user_gap_ms
        else:
            sessions[slot] = (prompt, calls_left - 1)
            is_user = rng.random() < user_turn_fraction
            median = median_user_gap_ms if is_user else median_tool_gap_ms
        return prompt, _lognormal_ms(rng, median, gap_sigma), calls_left <= 1

    def first_gap() -> float:
        return _lognormal_ms(rng, median_user_gap_ms, gap_sigma)

    events = _slot_turns(num_sessions, num_requests, first_gap, turn)
    return _by_time(rng, events)
