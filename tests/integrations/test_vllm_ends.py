"""Conversation ends in the vLLM plugin (:mod:`prefixcache.integrations.vllm_ends`) on
the plugin's queues, without vLLM: a stand-in pool whose ``_maybe_evict_cached_block``
does what vLLM's does to the queue (the hash goes, the hash-removal hook tells the queue).
``test_vllm_scheduler_ends.py`` runs vLLM's real scheduler."""

from __future__ import annotations

from typing import Any

import pytest

from prefixcache import policies
from prefixcache.engine.native_engine import native_available
from prefixcache.integrations.vllm_ends import end_session
from prefixcache.integrations.vllm_native_queue import native_queue
from prefixcache.integrations.vllm_queue import PolicyFreeBlockQueue
from prefixcache.testing.vllm_queue_driver import Block, ids


class Pool:
    """What :func:`end_session` reads of vLLM's ``BlockPool``."""

    def __init__(self, queue: Any, enable_caching: bool = True) -> None:
        self.free_block_queue, self.enable_caching = queue, enable_caching
        self.evicted: list[int] = []

    def _maybe_evict_cached_block(self, block: Any) -> bool:
        if block.block_hash is None:
            return False
        block.block_hash = None
        self.free_block_queue.note_hash_removed(block)
        self.evicted.append(block.block_id)
        return True


def chain_queue(kind: str, name: str, num_blocks: int) -> tuple[Any, list[Block]]:
    """A queue of ``num_blocks`` free blocks; blocks 0-5 then hold one chain (0 the root,
    a shared prefix; 1-5 a session's), block 6 a second chain hung off block 2."""
    blocks = [Block(i) for i in range(num_blocks)]
    sample = policies.get(name)
    if kind == "python":
        queue: Any = PolicyFreeBlockQueue(blocks, sample)
    else:
        queue = native_queue(blocks, name, {}, on_register=policies.has_hook(sample, "on_register"))
    taken = queue.popleft_n(7)
    assert ids(taken) == list(range(7))
    for block in taken:
        block.block_hash = bytes([block.block_id + 1]) * 12
        block.ref_cnt = 0
    queue.note_registered(taken[:6], 0, 6)
    queue.note_registered([*taken[:3], taken[6]], 3, 4)
    return queue, blocks


@pytest.mark.parametrize("name", ["lru", "s3fifo"])
@pytest.mark.parametrize("kind", ["python", "native"])
def test_an_end_frees_the_sessions_own_leaves_from_the_end(kind: str, name: str) -> None:
    if kind == "native" and not native_available():
        pytest.skip("the native engine is not built")
    queue, blocks = chain_queue(kind, name, 10)
    queue.append_n([blocks[i] for i in (5, 4, 3, 2, 1, 0)])  # vLLM frees a session tail first
    blocks[6].ref_cnt = 1  # another request still uses the chain off block 2
    pool = Pool(queue)
    assert end_session(pool, [blocks[:6]], (1,)) == 3
    assert pool.evicted == [5, 4, 3]  # block 2 holds a child in use; block 0 was a first hit
    assert [blocks[i].block_hash is None for i in range(7)] == [False] * 3 + [True] * 3 + [False]
    queue.check_invariants()
    hand_out = ids(queue.get_all_free_blocks())
    assert hand_out.index(5) < hand_out.index(1) and hand_out.index(3) < hand_out.index(0)


def test_an_end_changes_nothing_where_caching_is_off_or_the_queue_is_vllms() -> None:
    queue, blocks = chain_queue("python", "lru", 8)
    queue.append_n(blocks[:6][::-1])
    before = ids(queue.get_all_free_blocks())
    assert end_session(Pool(queue, enable_caching=False), [blocks[:6]], (0,)) == 0
    assert end_session(Pool(object()), [blocks[:6]], (0,)) == 0
    assert ids(queue.get_all_free_blocks()) == before
    assert all(block.block_hash is not None for block in blocks[:6])


@pytest.mark.parametrize("kind", ["python", "native"])
def test_held_and_inner_blocks_stop_nothing_but_themselves(kind: str) -> None:
    if kind == "native" and not native_available():
        pytest.skip("the native engine is not built")
    queue, blocks = chain_queue(kind, "lru", 8)
    blocks[4].ref_cnt = 1  # still held by another request: not free
    queue.append_n([blocks[i] for i in (5, 3, 2, 1, 0)])
    pool = Pool(queue)
    assert end_session(pool, [blocks[:6]], (0,)) == 1
    assert pool.evicted == [5]  # 4 is in use, so 3 has a cached child and is no leaf
    queue.check_invariants()
