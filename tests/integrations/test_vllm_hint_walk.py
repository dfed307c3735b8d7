"""The queue hints' incremental walk (:mod:`prefixcache.integrations.vllm_hint_walk`)
against the full walk, without vLLM: a stand-in pool whose hash map behaves as vLLM 0.33's
``BlockHashToBlockMap`` (one block or a dict of duplicates per key, the first one answered)
and random programs of map changes and queue changes; at every step the two must list the
same blocks in the same order. ``test_vllm_scheduler_hints.py`` checks the same through
vLLM's real scheduler.
"""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

import pytest

from prefixcache.integrations.vllm_hint_walk import PrefixWalk, close_all, full_walk, prefix_walk


class HashMap:
    """vLLM 0.33's ``BlockHashToBlockMap``: key -> a block, or a dict of duplicates."""

    def __init__(self) -> None:
        self._cache: dict[bytes, Any] = {}

    def get_one_block(self, key: bytes) -> Any:
        blocks = self._cache.get(key)
        if isinstance(blocks, dict):
            return next(iter(blocks.values()))
        return blocks

    def insert(self, key: bytes, block: Any) -> None:
        blocks = self._cache.get(key)
        if blocks is None:
            self._cache[key] = block
        elif isinstance(blocks, dict):
            blocks[block.block_id] = block
        else:
            self._cache[key] = {blocks.block_id: blocks, block.block_id: block}

    def pop(self, key: bytes, block_id: int) -> Any:
        blocks = self._cache.pop(key, None)
        if blocks is None:
            return None
        if not isinstance(blocks, dict):
            if blocks.block_id == block_id:
                return blocks
            self._cache[key] = blocks
            return None
        block = blocks.pop(block_id, None)
        if blocks:
            self._cache[key] = blocks
        return block

    def keys(self) -> list[tuple[bytes, int]]:
        """Every (key, block ID) held."""
        held: list[tuple[bytes, int]] = []
        for key, blocks in self._cache.items():
            for block in blocks.values() if isinstance(blocks, dict) else (blocks,):
                held.append((key, block.block_id))
        return held


class Pool:
    """What the walk reads of vLLM's ``BlockPool``: its map and ``get_cached_block``."""

    def __init__(self) -> None:
        self.cached_block_hash_to_block = HashMap()
        self.lookups = 0

    def get_cached_block(self, block_hash: bytes, group_ids: list[int]) -> list[Any] | None:
        self.lookups += 1
        found = []
        for group in group_ids:
            key = block_hash + group.to_bytes(4, "big")
            block = self.cached_block_hash_to_block.get_one_block(key)
            if block is None:
                return None
            found.append(block)
        return found


def chain(root: int, length: int) -> list[bytes]:
    """A request's hashes: chain ``root``'s first ``length``."""
    return [bytes([root, position]) * 4 for position in range(length)]


def run(seed: int, steps: int = 120, changes: int = 12) -> tuple[int, int]:
    """A random program (up to ``changes`` map changes a step); at each step the
    incremental and the full walk compared. Returns the lookups of both."""
    rng = random.Random(seed)
    groups = [0] if seed % 3 else [0, 1]
    pool, reference = Pool(), Pool()
    blocks = [SimpleNamespace(block_id=i) for i in range(64)]
    queue: list[Any] = []
    walk = prefix_walk(pool, groups)
    assert walk is not None
    full_lookups = 0
    for _ in range(steps):
        for _ in range(rng.randint(0, changes)):  # the step's map changes
            held = pool.cached_block_hash_to_block.keys()
            if held and rng.random() < 0.45:
                key, block_id = rng.choice(held)
                pool.cached_block_hash_to_block.pop(key, block_id)
            else:
                key = chain(rng.randrange(4), rng.randint(1, 8))[-1] + rng.choice(groups).to_bytes(
                    4, "big"
                )
                pool.cached_block_hash_to_block.insert(key, rng.choice(blocks))
        if rng.random() < 0.03:  # reset_prefix_cache: a new map, every key gone
            pool.cached_block_hash_to_block = HashMap()
        for _ in range(rng.randint(0, 3)):  # the step's queue changes
            roll = rng.random()
            if roll < 0.35 or not queue:
                queue.append(
                    SimpleNamespace(block_hashes=chain(rng.randrange(4), rng.randint(0, 8)))
                )
            elif roll < 0.6:  # admitted: mostly the head (first come, first served)
                queue.pop(0 if rng.random() < 0.7 else rng.randrange(len(queue)))
            elif roll < 0.7:
                queue.insert(0, queue.pop(rng.randrange(len(queue))))  # preempted: first again
            elif roll < 0.9:  # more hashes (a preempted request's output)
                request = rng.choice(queue)
                root = request.block_hashes[0][0] if request.block_hashes else 0
                request.block_hashes.extend(chain(root, len(request.block_hashes) + 2)[-2:])
            else:  # a new list (not vLLM's way): walked again from its start
                request = rng.choice(queue)
                request.block_hashes = list(request.block_hashes)
        max_blocks = rng.choice((0, 4, 16, 1000, 1000, 1000))
        walk = prefix_walk(pool, groups)
        assert walk is not None
        before = pool.lookups
        listed = walk.blocks(iter(queue), max_blocks)
        assert pool.lookups - before <= sum(len(r.block_hashes) for r in queue)
        reference.cached_block_hash_to_block = pool.cached_block_hash_to_block
        expected = full_walk(reference, queue, groups, max_blocks)
        assert [b.block_id for b in listed] == [b.block_id for b in expected]
        assert all(a is b for a, b in zip(listed, expected, strict=True))
        full_lookups = reference.lookups
    walk.close()
    return pool.lookups, full_lookups


@pytest.mark.parametrize("seed", range(40))
def test_the_incremental_walk_lists_what_the_full_walk_lists(seed: int) -> None:
    run(seed)


def test_the_incremental_walk_looks_up_less() -> None:
    incremental = full = 0
    for seed in range(5):
        mine, theirs = run(seed, steps=200, changes=3)
        incremental, full = incremental + mine, full + theirs
    assert incremental < full / 2


def test_an_unchanged_queue_and_map_look_nothing_up_and_closing_stops_recording() -> None:
    pool = Pool()
    hashes = chain(1, 5)
    for block_id, block_hash in enumerate(hashes[:3]):
        pool.cached_block_hash_to_block.insert(
            block_hash + bytes(4), SimpleNamespace(block_id=block_id)
        )
    walk = prefix_walk(pool, [0])
    assert isinstance(walk, PrefixWalk)
    queue = [SimpleNamespace(block_hashes=hashes), SimpleNamespace(block_hashes=chain(2, 2))]
    assert [b.block_id for b in walk.blocks(queue, 100)] == [0, 1, 2]
    lookups = pool.lookups
    assert [b.block_id for b in walk.blocks(queue, 100)] == [0, 1, 2]
    assert pool.lookups == lookups  # nothing changed: nothing looked up
    pool.cached_block_hash_to_block.insert(hashes[3] + bytes(4), SimpleNamespace(block_id=9))
    assert [b.block_id for b in walk.blocks(queue, 100)] == [0, 1, 2, 9]
    assert pool.lookups == lookups + 2  # the first request from its miss on: hit, miss
    close_all()
    assert "insert" not in vars(pool.cached_block_hash_to_block) and not walk.recording
    again = prefix_walk(pool, [0])
    assert again is not None and again is not walk and again.recording
    assert prefix_walk(SimpleNamespace(cached_block_hash_to_block=None), [0]) is None
    again.close()
