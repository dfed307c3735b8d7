"""The vLLM plugin's native queue (``_native.VllmQueue``) against the Python queue.

The native queue must hand out exactly what :class:`PolicyFreeBlockQueue` does with the
policy's Python class: the same random programs of vLLM's queue calls
(:func:`prefixcache.testing.vllm_queue_driver.queue_run`) run on both, per built-in policy,
and every hand-out order is compared. The pool-level twin (the fake vLLM's ``BlockPool``,
moves and evictions by ID included) is in ``test_vllm_plugin.py``.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest

from prefixcache import policies
from prefixcache.engine.native_engine import NATIVE_POLICIES, native_available, native_module
from prefixcache.errors import InvalidArgumentError, InvalidBlockIdError
from prefixcache.integrations.vllm_native_queue import native_queue
from prefixcache.integrations.vllm_queue import PolicyFreeBlockQueue
from prefixcache.testing.vllm_queue_driver import Block, ids, queue_run

pytestmark = pytest.mark.skipif(not native_available(), reason="the native engine is not built")

NAMES = sorted(set(NATIVE_POLICIES) - {"ref_zero"})


def both(name: str, num_blocks: int) -> list[tuple[PolicyFreeBlockQueue, list[Block]]]:
    """A Python queue with the policy's class and a native queue, each with its blocks."""
    sample = policies.get(name)
    python_blocks = [Block(i) for i in range(num_blocks)]
    native_blocks = [Block(i) for i in range(num_blocks)]
    on_register = policies.has_hook(sample, "on_register")
    return [
        (PolicyFreeBlockQueue(python_blocks, sample), python_blocks),
        (native_queue(native_blocks, name, {}, on_register=on_register), native_blocks),
    ]


@pytest.mark.parametrize("name", NAMES)
def test_the_native_queue_hands_out_what_the_python_queue_does(name: str) -> None:
    for seed in range(12):
        runs = [queue_run(queue, blocks, seed) for queue, blocks in both(name, 12)]
        assert runs[0] == runs[1], (name, seed)


@pytest.mark.parametrize("name", NAMES)
def test_the_two_queues_agree_with_scheduler_hints(name: str) -> None:
    """Hinted sections replaced between vLLM's calls: the same counts hinted and the
    same hand-out orders in both queues, and every run hints some blocks."""
    for seed in range(12):
        runs = [queue_run(queue, blocks, seed, hints=True) for queue, blocks in both(name, 12)]
        assert runs[0] == runs[1], (name, seed)
        assert any(isinstance(step, tuple) and step[0] > 0 for step in runs[0]), (name, seed)


@pytest.mark.parametrize("name", ["lru", "s3fifo", "arc"])
def test_a_reset_keeps_the_hand_out_order_and_forgets_the_rest(name: str) -> None:
    orders = []
    for queue, blocks in both(name, 10):
        queue_run(queue, blocks, seed=3, steps=60)
        queue.note_reset()
        queue.check_invariants()
        orders.append((ids(queue.get_all_free_blocks()), queue.num_free_blocks))
        orders.append([queue.knows(block.block_id) for block in blocks])
    assert orders[0] == orders[2] and orders[1] == orders[3]


def test_the_native_queue_refuses_what_vllms_refuses_before_any_change() -> None:
    blocks = [Block(i, bytes([i]) * 12) for i in range(4)]
    queue = native_queue(blocks[:1], "lru", {}, on_register=False)
    with pytest.raises(InvalidBlockIdError):  # IDs lie below the largest given at the start
        queue.append(Block(1))
    queue = native_queue(blocks, "lru", {}, on_register=False)
    with pytest.raises(ValueError, match="cannot take 5 free blocks: 4 are free"):
        queue.popleft_n(5)
    before = ids(queue.get_all_free_blocks())
    for free in (queue.prepend_n, queue.append_n):
        with pytest.raises(RuntimeError, match="already free"):
            free([blocks[0]])
    taken = queue.popleft_n(3)
    with pytest.raises(RuntimeError, match="already free"):
        queue.append_n([taken[0], taken[1], taken[0]])
    assert queue.num_free_blocks == 1 and ids(taken) == before[:3]
    with pytest.raises(RuntimeError, match="invalid block"):
        queue.remove(taken[0])
    queue.append_n(taken)
    queue.check_invariants()
    assert queue.popleft() is blocks[3] and queue.num_free_blocks == 3
    queue.popleft_n(3)
    with pytest.raises(ValueError, match="No free blocks available"):
        queue.popleft()


def test_a_queue_in_a_reference_cycle_is_collected() -> None:
    """vLLM's blocks point at their pool, which holds the queue, which holds the blocks."""

    class Pool:
        pass

    pool = Pool()
    blocks = [Block(i) for i in range(3)]
    for block in blocks:
        block.pool = pool  # type: ignore[attr-defined]
    pool.queue = native_queue(blocks, "lru", {}, on_register=False)  # type: ignore[attr-defined]
    gone = weakref.ref(pool.queue)  # type: ignore[attr-defined]
    del pool, blocks, block
    gc.collect()
    assert gone() is None


def give_queue(pool: Any) -> tuple[list[Block], Any]:
    """Four free blocks with hashes (ID ``i``: ``bytes([i + 1]) * 12``) in a native lru
    queue set as ``pool.free_block_queue``; the blocks and the queue."""
    blocks = [Block(i, bytes([i + 1]) * 12) for i in range(4)]
    for block in blocks:
        block.ref_cnt = 0  # type: ignore[attr-defined]
    pool.free_block_queue = native_queue(blocks, "lru", {}, on_register=False)
    return blocks, pool.free_block_queue


def test_the_hash_removal_hook_does_the_wrappers_work_in_c() -> None:
    calls: list[str] = []

    def original(pool: Any, block: Block) -> list[bytes]:
        calls.append("vllm")
        removed = [block.block_hash] if block.block_hash is not None else []
        block.block_hash = None
        return removed

    def fallback(pool: Any, block: Block) -> list[bytes]:
        calls.append("python")
        return original(pool, block)

    class Pool:
        remove_hashes = native_module().BlockPoolHook(
            "_remove_cached_block_hashes", original, fallback
        )

    pool = Pool()
    blocks, queue = give_queue(pool)
    taken = queue.popleft_n(2)
    queue.note_registered(taken, 0, 2)
    queue.append_n(taken[::-1])  # 1 is a free leaf, 0 its free inner parent
    assert pool.remove_hashes(taken[0]) == [b"\x01" * 12]  # a known block: note_hash_removed
    assert ids(queue.get_all_free_blocks())[-1] == 1 and queue.take_evictions() == 0
    victim = queue.popleft_n(3)[-1]  # hash-less 2, 3, 0 first... then the leaf 1
    assert victim.block_id == 0 and pool.remove_hashes(queue.popleft()) == [b"\x02" * 12]
    assert queue.take_evictions() == 1 and queue.take_evictions() == 0
    pool.free_block_queue = None  # type: ignore[attr-defined]
    pool.remove_hashes(blocks[2])
    assert (
        calls[-2:] == ["python", "vllm"] and Pool.remove_hashes.__prefixcache_original__ is original
    )


def test_the_touch_and_register_hooks_do_the_wrappers_work_in_c() -> None:
    """``touch`` and ``cache_full_blocks`` behind ``BlockPoolHook``: vLLM's function, then
    the learning call and the counts in C; a call by keyword gets the Python wrapper."""
    calls: list[str] = []

    def vllm_touch(pool: Any, blocks: list[Block]) -> None:  # vLLM's: free blocks leave the queue
        calls.append("vllm touch")
        for block in blocks:
            if block.ref_cnt == 0:  # type: ignore[attr-defined]
                pool.free_block_queue.remove(block)
            block.ref_cnt += 1  # type: ignore[attr-defined]

    def cache(pool: Any, request: Any, blocks: list[Block], *args: Any, **kwargs: Any) -> None:
        calls.append("vllm cache")

    def fallback(*args: Any, **kwargs: Any) -> None:
        calls.append("python")

    hook = native_module().BlockPoolHook

    class Pool:
        touch = hook("touch", vllm_touch, fallback)
        cache_full_blocks = hook("cache_full_blocks", cache, fallback)

    pool = Pool()
    _, queue = give_queue(pool)
    taken = queue.popleft_n(2)
    pool.cache_full_blocks(None, taken, 0, 2, 16, 0)  # 0 is 1's parent now
    queue.append_n(taken)  # 0 freed first, but inner: 1, its child, goes before it
    assert ids(queue.get_all_free_blocks()) == [2, 3, 1, 0]
    pool.touch(block for block in taken)  # an iterator is listed once, as the wrapper does
    assert ids(queue.get_all_free_blocks()) == [2, 3] and [b.ref_cnt for b in taken] == [1, 1]  # type: ignore[attr-defined]
    assert queue.take_counts() == (2, 0) and queue.take_counts() == (0, 0)
    pool.cache_full_blocks(None, blocks=taken, num_cached_blocks=0, num_full_blocks=2)
    assert calls == ["vllm cache", "vllm touch", "python"]
    assert Pool.touch.__prefixcache_original__ is vllm_touch
    with pytest.raises(InvalidArgumentError, match="no method"):
        hook("free_blocks", vllm_touch, fallback)
