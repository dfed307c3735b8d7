"""The multi-turn-chats family: conversations whose every turn resends the previous
prompt plus the reply and a new message, interleaved.

One family a module, so each generator reads on its own.
"""

from __future__ import annotations

import random
from itertools import count

from prefixcache.reference.trace import TraceRequest
from prefixcache.tools.workloads._common import (
    _arrivals,
    _blocks,
    _check_positive,
    _request,
)


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
    prompt of 1 to ``first_turn_blocks`` blocks, takes its place; its last
    turn is marked ``ends_conversation`` (the user closed it). The reuse
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
        trace.append(_request(rng, next(arrivals), prompt, turns_left <= 1))
        if turns_left <= 1:
            chats[index] = open_chat()
        else:
            grown = prompt + _blocks(fresh, rng.randint(1, max_turn_blocks))
            chats[index] = [grown, turns_left - 1]
    return trace
