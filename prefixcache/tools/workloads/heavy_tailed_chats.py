"""The heavy-tailed-chats family: multi-turn chats whose users think for log-normal
times between turns, and a share of which are abandoned after a turn or two.

One family a module, so each generator reads on its own.
"""

from __future__ import annotations

import random
from itertools import count

from prefixcache.engine.validation import require_fraction
from prefixcache.reference.trace import TraceRequest
from prefixcache.tools.workloads._common import (
    _blocks,
    _by_time,
    _check_positive,
    _check_sigma,
    _lognormal_ms,
    _slot_turns,
)


def heavy_tailed_chats(
    num_requests: int,
    *,
    seed: int = 0,
    num_conversations: int = 200,
    first_turn_blocks: int = 8,
    max_turn_blocks: int = 4,
    max_turns: int = 20,
    abandon_fraction: float = 0.3,
    max_abandoned_turns: int = 2,
    median_think_ms: int = 20_000,
    think_sigma: float = 1.2,
) -> list[TraceRequest]:
    """Chats with heavy-tailed think times, some of them abandoned early.

    Stands for consumer chat as production traces show it: the time a user
    takes before the next turn is roughly log-normal (median
    ``median_think_ms``, spread ``think_sigma``: most replies within a
    minute, a few after an hour), and many conversations are dropped after
    the first reply or two and never resumed. Each of ``num_conversations``
    slots holds one conversation; its turns resend the previous prompt plus
    1 to ``max_turn_blocks`` new blocks (as in
    :func:`~prefixcache.tools.workloads.multi_turn_chats`), each a
    log-normal think time after the last. A conversation plans 1 to
    ``max_turns`` turns; with probability ``abandon_fraction`` it is
    abandoned instead after 1 to ``max_abandoned_turns`` of them (when that
    is fewer). An ended conversation, finished or abandoned, never comes
    back: a recency policy keeps its chain warm for nothing, while a policy
    that learns the gap distribution can tell a thinking user from a gone
    one. A new conversation takes the slot after another think time. The
    last turn of a finished conversation is marked ``ends_conversation`` (its
    user closed the chat); an abandoned one's is not (nobody said so).

    Args:
        num_requests: requests to generate (>= 1).
        seed: random seed.
        num_conversations: conversations open at a time (>= 1).
        first_turn_blocks: longest first prompt in blocks (>= 1).
        max_turn_blocks: most blocks a turn adds (>= 1).
        max_turns: most turns of a conversation that is not abandoned (>= 1).
        abandon_fraction: share of conversations abandoned early, in ``[0, 1]``.
        max_abandoned_turns: most turns of an abandoned conversation (>= 1).
        median_think_ms: median think time between turns (>= 1).
        think_sigma: log-normal spread of the think times (>= 0).

    Returns:
        The trace, in arrival order.

    Raises:
        InvalidArgumentError: an argument is out of range.

    Complexity: O(blocks generated + num_requests log num_conversations).
    """
    _check_positive(
        num_requests=num_requests,
        num_conversations=num_conversations,
        first_turn_blocks=first_turn_blocks,
        max_turn_blocks=max_turn_blocks,
        max_turns=max_turns,
        max_abandoned_turns=max_abandoned_turns,
        median_think_ms=median_think_ms,
    )
    require_fraction(abandon_fraction, "abandon_fraction")
    _check_sigma(think_sigma=think_sigma)
    rng = random.Random(seed)
    fresh = count()

    def open_chat() -> tuple[list[int], int, bool]:
        """(the first prompt, turns it will have, whether its user closes it)."""
        turns = rng.randint(1, max_turns)
        closed = True
        if rng.random() < abandon_fraction:
            abandoned_after = rng.randint(1, max_abandoned_turns)
            closed = abandoned_after >= turns
            turns = min(turns, abandoned_after)
        return _blocks(fresh, rng.randint(1, first_turn_blocks)), turns, closed

    chats = [open_chat() for _ in range(num_conversations)]

    def think() -> float:
        return _lognormal_ms(rng, median_think_ms, think_sigma)

    def turn(slot: int) -> tuple[list[int], float, bool]:
        prompt, turns_left, closed = chats[slot]
        if turns_left <= 1:
            chats[slot] = open_chat()
        else:
            grown = prompt + _blocks(fresh, rng.randint(1, max_turn_blocks))
            chats[slot] = (grown, turns_left - 1, closed)
        return prompt, think(), closed and turns_left <= 1

    events = _slot_turns(num_conversations, num_requests, think, turn)
    return _by_time(rng, events)
