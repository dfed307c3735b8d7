"""KV cache events: what became resident and what stopped being resident.

Routers (NVIDIA Dynamo's KV router, llm-d) keep an index of which instance
holds which prefix, fed by events that engines publish. The allocator records
one event per *hash transition*, after its bookkeeping has committed: a hash
becoming registered (:class:`BlockStored`), a hash losing its block
(:class:`BlockRemoved`), and a reset (:class:`AllBlocksCleared`). A hash that
is registered again while it is resident is not announced twice, and a block
refused because another block holds its hash announces nothing.

Events queue in a bounded :class:`KVEventLog` and are drained with
:meth:`KVBlockAllocator.take_events`; nothing is published from the hot path.
Field names follow vLLM's ``vllm.distributed.kv_events`` so a publisher can map
them one to one. Block hashes are the chained content hashes, identical on
every instance for the same prefix and salt, folded into signed-64-bit-safe
ints by :func:`wire_hash` (a no-op for the default 63-bit hashes).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

_MASK_63 = (1 << 63) - 1
_MASK_64 = (1 << 64) - 1

MEDIUM_GPU = "GPU"


def wire_hash(block_hash: int) -> int:
    """A hash as a non-negative int that fits a signed 64-bit field.

    The default ``xxh3_64`` hashes already do and pass unchanged; wider
    ``xxh3_128``/``sha256`` hashes are folded by xor of their 64-bit words.
    A negative hash (from a custom ``hash_algo`` or another engine) is taken
    as two's complement over as many 64-bit words as it needs, then folded
    the same way, so every int maps in O(its words) steps.

    >>> wire_hash(12345), wire_hash(-5) == (1 << 63) - 5
    (12345, True)

    Complexity: O(bits of ``block_hash`` / 64).
    """
    if 0 <= block_hash <= _MASK_63:
        return block_hash
    if block_hash < 0:  # ">> 64" of a negative int never reaches 0: make it non-negative
        block_hash &= (1 << (64 * (block_hash.bit_length() // 64 + 1))) - 1
    folded = 0
    while block_hash:
        folded ^= block_hash & _MASK_64
        block_hash >>= 64
    return (folded & _MASK_63) or 1


@dataclass(frozen=True, slots=True)
class BlockStored:
    """A run of hashes became resident, each the child of the one before.

    Attributes:
        block_hashes: the chain's new hashes, parent first.
        parent_block_hash: hash the run continues (None: starts at the root).
        token_ids: tokens of those blocks, concatenated (empty if not given).
        block_size: tokens per block.
        lora_name: adapter the blocks belong to, if any.
        medium: where the blocks live (``"GPU"`` by default).
    """

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_name: str | None = None
    medium: str | None = MEDIUM_GPU


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Hashes that stopped being resident (evicted, dropped, or detached)."""

    block_hashes: tuple[int, ...]
    medium: str | None = MEDIUM_GPU


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Every hash stopped being resident (the allocator was reset)."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventLog:
    """A bounded queue of events, plus the tokens of resident hashes for snapshots.

    When the queue is full the oldest event is dropped and counted in
    :attr:`num_dropped`; a consumer that sees drops should resynchronise from
    :meth:`KVBlockAllocator.snapshot`. Not thread-safe (owned by one allocator).

    Args:
        capacity: most events kept before the oldest is dropped (>= 1).
        block_size: tokens per block, copied into every stored event.
        medium: storage tier named in every event.
    """

    def __init__(self, capacity: int, block_size: int, medium: str | None = MEDIUM_GPU) -> None:
        self.capacity = capacity
        self.block_size = block_size
        self.medium = medium
        self._queue: deque[KVCacheEvent] = deque()
        self._tokens_of_hash: dict[int, tuple[int, ...]] = {}
        self._lora_of_hash: dict[int, str] = {}
        self.num_recorded = 0
        self.num_dropped = 0

    def __len__(self) -> int:
        return len(self._queue)

    def _push(self, event: KVCacheEvent) -> None:
        if len(self._queue) >= self.capacity:
            self._queue.popleft()
            self.num_dropped += 1
        self._queue.append(event)
        self.num_recorded += 1

    def record_stored(
        self,
        block_hashes: list[int],
        parent_hash: int | None,
        token_ids: list[int] | None,
        lora_name: str | None,
    ) -> None:
        """Queue one BlockStored for a run of newly registered hashes."""
        tokens = tuple(token_ids) if token_ids else ()
        size = self.block_size
        for index, block_hash in enumerate(block_hashes):
            self._tokens_of_hash[block_hash] = tokens[index * size : (index + 1) * size]
            if lora_name is not None:
                self._lora_of_hash[block_hash] = lora_name
        self._push(
            BlockStored(
                block_hashes=tuple(wire_hash(h) for h in block_hashes),
                parent_block_hash=None if parent_hash is None else wire_hash(parent_hash),
                token_ids=tokens,
                block_size=size,
                lora_name=lora_name,
                medium=self.medium,
            )
        )

    def record_removed(self, block_hashes: list[int]) -> None:
        """Queue one BlockRemoved for hashes that lost their block."""
        for block_hash in block_hashes:
            self._tokens_of_hash.pop(block_hash, None)
            self._lora_of_hash.pop(block_hash, None)
        self._push(BlockRemoved(tuple(wire_hash(h) for h in block_hashes), self.medium))

    def record_cleared(self) -> None:
        """Queue AllBlocksCleared and forget every resident hash."""
        self._tokens_of_hash.clear()
        self._lora_of_hash.clear()
        self._push(AllBlocksCleared())

    def take(self) -> list[KVCacheEvent]:
        """Every queued event, oldest first; the queue is left empty."""
        events = list(self._queue)
        self._queue.clear()
        return events

    def stored_event_for(self, block_hash: int, parent_hash: int | None) -> BlockStored:
        """A BlockStored that re-announces one resident hash (for snapshots)."""
        return BlockStored(
            block_hashes=(wire_hash(block_hash),),
            parent_block_hash=None if parent_hash is None else wire_hash(parent_hash),
            token_ids=self._tokens_of_hash.get(block_hash, ()),
            block_size=self.block_size,
            lora_name=self._lora_of_hash.get(block_hash),
            medium=self.medium,
        )
