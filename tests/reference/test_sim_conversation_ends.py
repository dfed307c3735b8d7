"""The reference loop with ``conversation_ends``: a marked request's chain is freed at its end.

Three conversations of two turns each, one request in flight: the loop must call
``allocator.end_conversation`` exactly once per request marked
``ends_conversation``, with that request's block hashes (prompt and decode
blocks), after it finished; never for an unmarked one, and never with the option
off. The freed chain is gone from the cache, and the other conversations' chains
stay.
"""

from __future__ import annotations

from typing import Any

import pytest

from prefixcache.engine.allocator import KVBlockAllocator
from prefixcache.errors import ConfigError, InvalidArgumentError
from prefixcache.reference.sim import DynamicBatchingSim, SimConfig, SimRequest

BLOCK = 4


def _requests() -> list[SimRequest]:
    """Conversation c: a first turn of 9 tokens, then (marked for c in 0, 2) a second turn."""
    requests = []
    for conversation in range(3):
        first = [100 * (conversation + 1) + token for token in range(9)]
        requests.append(SimRequest.from_tokens(f"{conversation}a", first, 2, arrival_step=0))
        requests.append(
            SimRequest.from_tokens(
                f"{conversation}b",
                [*first, 7, 7, 7],
                output_length=2,
                arrival_step=1,
                ends_conversation=conversation != 1,
            )
        )
    return requests


def _run(
    monkeypatch: pytest.MonkeyPatch, engine: str, *, ends: bool
) -> tuple[DynamicBatchingSim, list[tuple[Any, list[int], int]]]:
    """Run the loop; return it and the calls ``(request id, hashes, cached before)`` made."""
    monkeypatch.setenv("PREFIXCACHE_ENGINE", engine)
    calls: list[tuple[Any, list[int], int]] = []
    original = KVBlockAllocator.end_conversation

    def spy(allocator: KVBlockAllocator, block_hashes: Any) -> int:
        finished = [s for s in sim._running if s.is_finished]
        owner = [s.request.request_id for s in finished if s.block_hashes == list(block_hashes)]
        calls.append(
            (owner[0] if owner else None, list(block_hashes), allocator.stats().num_cached)
        )
        return original(allocator, block_hashes)

    monkeypatch.setattr(KVBlockAllocator, "end_conversation", spy)
    config = SimConfig(
        total_count=64, block_size=BLOCK, max_requests=1, conversation_ends=ends, engine=engine
    )
    sim = DynamicBatchingSim(config)
    for request in _requests():
        sim.submit(request)
    while not sim.is_done:
        sim.step()
        sim.allocator.check_invariants()
    return sim, calls


@pytest.mark.parametrize("engine", ["python", "native"])
def test_the_loop_ends_exactly_the_marked_conversations(
    engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    sim, calls = _run(monkeypatch, engine, ends=True)
    assert [request_id for request_id, _, _ in calls] == ["0b", "2b"]
    for _, hashes, cached_before in calls:
        assert len(hashes) == (12 + 2 - 1) // BLOCK  # prompt and generated tokens, full blocks
        assert cached_before >= len(hashes)  # called once the request released its blocks
    allocator = sim.allocator
    for request_id, hashes, _ in calls:
        assert len(allocator.match_prefix(hashes, acquire=False)) == 0, request_id
    # The unmarked conversation's chain is still cached.
    kept = allocator.hash_tokens(list(_requests()[3].prompt_tokens or ()))
    assert len(allocator.match_prefix(kept, acquire=False)) == len(kept)
    assert sim.report().num_finished == 6


@pytest.mark.parametrize("engine", ["python", "native"])
def test_the_option_off_calls_nothing(engine: str, monkeypatch: pytest.MonkeyPatch) -> None:
    sim, calls = _run(monkeypatch, engine, ends=False)
    assert calls == []
    assert sim.report().num_finished == 6


def test_bad_flags_are_refused() -> None:
    with pytest.raises(ConfigError, match="conversation_ends"):
        SimConfig(conversation_ends=1)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="ends_conversation"):
        SimRequest.from_tokens(0, [1, 2], 1, ends_conversation="yes")  # type: ignore[arg-type]
