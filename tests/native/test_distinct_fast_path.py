"""The native engine's fast path for distinct IDs, at its edges, against the Python engine.

``acquire`` (``take_hit``) and ``release`` on the native engine first try one checking
pass that also detects a repeated ID, then one writing pass (DESIGN.md, "Sessions");
a repeat or a failed check sends the call to the general path, which raises its own
errors. This program runs both paths and both ways out of the fast one (a repeat, a
refusal at the last ID) on both engines with every native policy, and requires the same
outcomes (error messages included), the same state after every step, nothing changed by a
refusal, and the same eviction order at the end (which reads the access stamps and counts
the fast path writes).
"""

from __future__ import annotations

from typing import Any

import pytest

from prefixcache import KVBlockAllocator, PrefixCacheError
from prefixcache.engine.native_engine import NATIVE_POLICIES, native_available
from prefixcache.testing import changed_fields, state_digest

pytestmark = pytest.mark.skipif(
    not native_available(), reason="the native engine (prefixcache.engine._native) is not built"
)

HASHES = [11, 12, 13, 21, 22, 31]


def _common(allocator: KVBlockAllocator) -> dict[str, Any]:
    """The digest fields both engines expose."""
    digest = state_digest(allocator)
    shared = set(state_digest(KVBlockAllocator(total_count=2, device="cpu", engine="native")))
    return {key: value for key, value in digest.items() if key in shared and key != "engine"}


def _program(allocator: KVBlockAllocator, caches: bool) -> list[Any]:
    """Each step's outcome and the state after it; refusals must change nothing. Without
    caching (``ref_zero``) a release frees the chain: the later hits are refused."""
    log: list[Any] = []

    def step(call: Any, refused: bool = False) -> None:
        before = state_digest(allocator)
        try:
            call()
            outcome: tuple[str, ...] = ("ok",)
        except PrefixCacheError as error:
            outcome = (type(error).__name__, str(error))
            after = state_digest(allocator)
            assert after == before, changed_fields(before, after)
        assert not caches or (outcome[0] != "ok") == refused, outcome
        log.append((outcome, _common(allocator)))

    ids = allocator.allocate_memory_blocks(7).tolist()
    free_id = ids.pop()
    step(lambda: allocator.release_memory_blocks([free_id]))
    step(lambda: allocator.register_kv_block_hashes(ids[:3], [11, 12, 13]))
    step(lambda: allocator.register_kv_block_hashes(ids[3:5], [21, 22]))
    step(lambda: allocator.register_kv_block_hashes(ids[5:], [31], parent_hash=11))
    # Distinct: three leaves (31, 22, 13) go to the policy in this order (fifo shows it).
    step(lambda: allocator.release_memory_blocks(ids[::-1]))
    step(lambda: allocator.acquire_blocks([ids[5], ids[5]]))  # a repeat: the general path
    # Distinct, no clock advance between: a stamp one tick off would tie with ids[5]'s.
    step(lambda: allocator.acquire_blocks([ids[2], ids[1], ids[0]]))
    step(lambda: allocator.acquire_blocks([ids[3], ids[4], free_id]), refused=True)  # last free
    step(lambda: allocator.acquire_blocks([ids[4], ids[3]]))
    step(lambda: allocator.acquire_blocks([ids[4]]))
    if caches:  # (pausing an unheld block words its refusal differently in the two engines)
        step(lambda: allocator.pause([ids[4]]))  # ids[4]: one active, one paused reference
    step(lambda: allocator.release_memory_blocks([ids[2], free_id]), refused=True)  # last unheld
    step(lambda: allocator.release_memory_blocks([ids[2], ids[2]]), refused=True)  # repeat, short
    step(lambda: allocator.release_memory_blocks([ids[0], ids[5], ids[5], ids[1]]))  # a repeat
    step(lambda: allocator.release_memory_blocks([ids[4], ids[3], ids[2]]))  # ids[4] paused-held
    step(lambda: allocator.release_memory_blocks([ids[4]], paused=True))
    evicted = []
    while allocator.evict_cached_blocks(1):
        gone = [h for h in HASHES if not allocator.is_hash_registered(h) and h not in evicted]
        evicted.extend(gone)
        log.append(("evicted", gone, _common(allocator)))
    log.append(("order", evicted))
    assert allocator._engine.find_problems() == []
    return log


@pytest.mark.parametrize("policy", NATIVE_POLICIES)
def test_distinct_and_repeated_ids_take_and_drop_references_as_the_python_engine(
    policy: str,
) -> None:
    logs = [
        _program(
            KVBlockAllocator(
                total_count=10, paused_count=2, device="cpu", engine=engine, eviction_policy=policy
            ),
            caches=policy != "ref_zero",
        )
        for engine in ("python", "native")
    ]
    assert len(logs[0]) == len(logs[1])
    for number, (python_step, native_step) in enumerate(zip(*logs, strict=True)):
        assert native_step == python_step, f"step {number}"
