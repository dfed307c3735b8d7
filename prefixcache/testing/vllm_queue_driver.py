"""Driving the vLLM plugin's free-block queue alone, for tests: stand-in blocks and a
random program of vLLM's queue calls.

:func:`queue_run` makes the calls ``BlockPool`` makes (hand out, learn registrations and
hits, free in any order, remove on a prefix hit) and records every hand-out order, so two
queues (the Python one and the native one, or two policies that must agree) can be
compared call by call.
"""

from __future__ import annotations

import random
from typing import Any

__all__ = ["Block", "LookAlike", "ids", "look_alike", "queue_run"]


def ids(blocks: list[Any]) -> list[int]:
    """The blocks' IDs, in order."""
    return [block.block_id for block in blocks]


# vLLM 0.33's block type by name and module, its slots in another order (and one more):
# the native queue reads such a type at its own slots' offsets (engine/native/vllm_block.cpp).
LookAlike = type(
    "KVCacheBlock",
    (),
    {
        "__module__": "vllm.v1.core.look_alike",
        "__slots__": ("pad", "is_null", "_block_hash", "ref_cnt", "block_id"),
        "block_hash": property(lambda self: self._block_hash),
    },
)


def look_alike(block_id: int, ref_cnt: int, is_null: bool, block_hash: Any) -> Any:
    """A :data:`LookAlike` block holding these values."""
    block = LookAlike()
    block.pad, block.block_id, block.ref_cnt = "pad", block_id, ref_cnt
    block.is_null, block._block_hash = is_null, block_hash
    return block


class Block:
    """A stand-in ``KVCacheBlock``: what the queue reads and the two link fields."""

    def __init__(self, block_id: int, block_hash: bytes | None = None) -> None:
        self.block_id, self.block_hash, self.is_null = block_id, block_hash, False
        self.prev_free_block: Any = None
        self.next_free_block: Any = None


def queue_run(
    queue: Any, blocks: list[Block], seed: int, steps: int = 150, *, hints: bool = False
) -> list[Any]:
    """Random queue calls as vLLM makes them, frees in any order (so a free parent may
    have a child in use, and no leaf may be left); record every hand-out order.

    With ``hints``, a fifth of the steps instead replace the hinted section
    (``set_hinted``) with random blocks, free or held, cached or not, some listed twice,
    under a random limit, as the plugin's scheduler wrapper does once per step."""
    rng = random.Random(seed)
    held: list[Block] = []
    seen: list[Any] = []
    for _ in range(steps):
        if hints and rng.random() < 0.2:
            listed = [rng.choice(blocks) for _ in range(rng.randint(0, 2 * len(blocks)))]
            seen.append((queue.set_hinted(listed, rng.randint(0, len(blocks))), ids(listed)))
            queue.check_invariants()
            seen.append((queue.num_hinted_blocks, ids(queue.get_all_free_blocks())))
            continue
        roll = rng.random()
        if roll < 0.35 and queue.num_free_blocks:
            taken = queue.popleft_n(rng.randint(1, min(4, queue.num_free_blocks)))
            for block in taken:  # get_new_blocks: a victim loses its hash
                if block.block_hash is not None:
                    block.block_hash = None
                    queue.note_hash_removed(block)
            table = ([rng.choice(held)] if held and rng.random() < 0.6 else []) + taken
            for block in taken:
                block.block_hash = bytes([rng.randrange(256)]) * 12
            queue.note_registered(table, len(table) - len(taken), len(table))
            held += taken
            seen.append(ids(taken))
        elif roll < 0.8 and held:
            freed = rng.sample(held, rng.randint(1, len(held)))
            held = [block for block in held if block not in freed]
            queue.append_n(freed)
        elif roll < 0.9:
            cached = [b for b in queue.get_all_free_blocks() if b.block_hash is not None]
            if cached:  # a prefix hit on a free cached block
                block = rng.choice(cached)
                queue.remove(block)
                queue.note_hits([block])
                held.append(block)
        else:  # a conversation's end (vllm_ends): a free leaf loses its hash where it lies
            leaves = [b for b in blocks if queue.is_free_leaf(b.block_id) and b.block_hash]
            if leaves:
                block = rng.choice(leaves)
                block.block_hash = None
                queue.note_hash_removed(block)
        queue.check_invariants()
        seen.append(ids(queue.get_all_free_blocks()))
        seen.append([queue.is_free_leaf(block.block_id) for block in blocks])
    return seen
