"""The agent-tool-loops family: agent sessions that call tools in a loop, each step
resending the session so far plus the tool's output, behind a few shared agent
system prompts; some steps retry from an earlier step.

One family a module, so each generator reads on its own.
"""

from __future__ import annotations

import random
from itertools import count

from prefixcache.engine.validation import require_fraction
from prefixcache.reference.trace import TraceRequest
from prefixcache.tools.workloads._common import (
    _arrivals,
    _blocks,
    _check_positive,
    _request,
    _zipf_weights,
)


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
    ``max_steps`` steps a session ends and a new one starts; its last step is
    marked ``ends_conversation`` (the agent closes its own session).

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
        trace.append(_request(rng, next(arrivals), prompt, steps_left <= 1))
        sessions[index] = new_session() if steps_left <= 1 else ([*steps, prompt], steps_left - 1)
    return trace
