"""What every trace family shares: arrivals, requests, Zipf weights, fresh block IDs, checks.

Kept apart so each family's module holds only its own generator.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable, Iterator, Sequence

from prefixcache.engine.validation import is_number, require_int
from prefixcache.errors import InvalidArgumentError
from prefixcache.reference.trace import TRACE_BLOCK_SIZE, TraceRequest


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        require_int(value, name, minimum=1)


def _arrivals(rng: random.Random, mean_gap_ms: int) -> Iterator[int]:
    """Poisson arrival times in milliseconds, starting at 0."""
    now = 0.0
    while True:
        yield int(now)
        now += rng.expovariate(1.0 / mean_gap_ms)


def _request(
    rng: random.Random, timestamp: int, hash_ids: Sequence[int], ends: bool = False
) -> TraceRequest:
    """A request over ``hash_ids`` whose last block is partly filled.

    ``ends``: it is the last turn of a conversation its client closes (the
    request's ``ends_conversation`` mark). The mark draws nothing from
    ``rng``, so a family's traces are the same with or without it.
    """
    input_length = len(hash_ids) * TRACE_BLOCK_SIZE - rng.randrange(TRACE_BLOCK_SIZE)
    return TraceRequest(timestamp, input_length, rng.randint(16, 512), tuple(hash_ids), ends)


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


def _check_sigma(**values: float) -> None:
    """Refuse a log-normal spread that is not a number >= 0 (NaN included)."""
    for name, value in values.items():
        if not (is_number(value) and value >= 0):
            raise InvalidArgumentError(f"{name} must be >= 0, got {value!r}")


def _lognormal_ms(rng: random.Random, median_ms: int, sigma: float) -> float:
    """A heavy-tailed gap in milliseconds: log-normal with median ``median_ms``.

    The shape measured for the time between a session's turns (most gaps
    short, a few very long); ``sigma`` 0 gives exactly ``median_ms``.
    """
    return rng.lognormvariate(math.log(median_ms), sigma)


Event = tuple[float, list[int], bool]
"""A session's turn: (time in ms, hash IDs, whether it ends the conversation)."""


def _by_time(rng: random.Random, events: list[Event]) -> list[TraceRequest]:
    """Requests from events, in time order (a stable sort: ties keep their order), the first at 0.

    For the families whose sessions keep their own clocks (log-normal gaps)
    instead of one Poisson stream; each request is drawn by :func:`_request`.
    """
    events.sort(key=lambda event: event[0])
    start = events[0][0] if events else 0.0
    return [_request(rng, int(time - start), ids, ends) for time, ids, ends in events]


def _slot_turns(
    num_slots: int,
    num_events: int,
    first_gap: Callable[[], float],
    turn: Callable[[int], tuple[list[int], float, bool]],
) -> list[Event]:
    """The events (:data:`Event`) of sessions that each keep their own clock.

    Each of ``num_slots`` slots holds one session at a time. Slot ``s`` first
    fires after ``first_gap()``; each time it fires, ``turn(s)`` gives the
    prompt it sends, the gap to its next turn and whether that prompt ends
    its conversation (the slot's session state lives with the caller). The
    earliest slot fires next; ``first_gap`` is called for every slot, in slot
    order, before any turn, so a family's random draws keep their order.
    """
    clock = [(first_gap(), slot) for slot in range(num_slots)]
    heapq.heapify(clock)
    events: list[Event] = []
    while len(events) < num_events:
        now, slot = heapq.heappop(clock)
        prompt, gap, ends = turn(slot)
        events.append((now, prompt, ends))
        heapq.heappush(clock, (now + gap, slot))
    return events
