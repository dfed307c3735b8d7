"""The policy that keeps nothing unreferenced."""

from __future__ import annotations


class RefZeroPolicy:
    """Drops a hashed block the moment its last reference is released.

    Blocks are shared only while some request holds them, as in Megatron-core's
    ``REF_ZERO`` mode: the cheapest policy in memory and time, and the right one
    when requests rarely repeat a prefix after the first finishes. It tracks
    nothing, so :meth:`evict` always returns an empty list.

    Complexity: every method O(1).
    """

    retains_unreferenced = False

    def insert(
        self, block_id: int, block_hash: int, last_access: int, num_accesses: int, depth: int
    ) -> None:
        raise RuntimeError("RefZeroPolicy retains nothing; the allocator must not insert blocks")

    def discard(self, block_id: int) -> None:
        raise KeyError(block_id)

    def touch(self, block_id: int, now: int) -> None:
        raise KeyError(block_id)

    def evict(self, num_blocks: int) -> list[int]:
        return []

    def clear(self) -> None:
        return None

    def __len__(self) -> int:
        return 0

    def __contains__(self, block_id: object) -> bool:
        return False
