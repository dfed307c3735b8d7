"""The reference loop with ``queue_hints``: waiting requests keep their cached prefix.

A constructed case where the hints must help: one request at a time, a shared
prefix cached by the first request, three unrelated requests queued before the
one that repeats the prefix. Without hints LRU evicts the prefix to make room
for them; with hints it stays, and the repeat hits it whole.
"""

from __future__ import annotations

import pytest

from prefixcache.errors import ConfigError
from prefixcache.reference.sim import DynamicBatchingSim, SimConfig, SimReport, SimRequest

BLOCK = 4
PREFIX = list(range(1000, 1032))  # 8 full blocks


def _requests() -> list[SimRequest]:
    requests = [SimRequest.from_tokens(0, [*PREFIX, 1], output_length=1, arrival_step=0)]
    for index in range(1, 4):
        other = [10_000 * index + token for token in range(33)]
        requests.append(SimRequest.from_tokens(index, other, output_length=1, arrival_step=1))
    requests.append(SimRequest.from_tokens(4, [*PREFIX, 2], output_length=1, arrival_step=1))
    return requests


def _run(policy: str, engine: str, *, hints: bool) -> SimReport:
    config = SimConfig(
        total_count=21,
        block_size=BLOCK,
        eviction_policy=policy,
        max_requests=1,  # one request in flight: the rest wait in the queue
        queue_hints=hints,
    )
    sim = DynamicBatchingSim(config)
    assert sim.allocator.engine == engine
    for request in _requests():
        sim.submit(request)
    while not sim.is_done:
        sim.step()
        sim.allocator.check_invariants()
        # Every waiting request holds a hint, no admitted one does.
        assert sim.allocator.num_hints == (len(sim._waiting) if hints else 0)
    assert sim.allocator.num_hinted_blocks == 0
    return sim.report()


@pytest.mark.parametrize("engine", ["python", "native"])
@pytest.mark.parametrize("policy", ["lru", "s3fifo"])
def test_hints_keep_the_queued_prefix_cached(
    policy: str, engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PREFIXCACHE_ENGINE", engine)
    off = _run(policy, engine, hints=False)
    on = _run(policy, engine, hints=True)
    assert on.num_finished == off.num_finished == 5
    assert on.prompt_tokens == off.prompt_tokens
    assert off.prefill_tokens_saved < len(PREFIX)  # the prefix was (partly) evicted
    assert on.prefill_tokens_saved == len(PREFIX)  # the repeat hit all 8 blocks


def test_queue_hints_must_be_a_flag() -> None:
    with pytest.raises(ConfigError):
        SimConfig(queue_hints=1)  # type: ignore[arg-type]
