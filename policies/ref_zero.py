"""The policy object of ref-zero mode: it tracks nothing."""

from __future__ import annotations

from prefixcache.policies.base import EvictionPolicy


class RefZeroPolicy(EvictionPolicy):
    """The policy of ref-zero mode, where nothing unreferenced stays cached.

    Ref-zero is a mode of the engine, not an ordering: with
    ``AllocatorConfig(cache_unreferenced=False)`` a hashed block is dropped
    the moment its last reference is released, as in Megatron-core's
    ``REF_ZERO`` mode (the cheapest in memory and time, and the right one
    when requests rarely repeat a prefix after the first finishes).
    ``eviction_policy="ref_zero"`` is an alias that sets that mode; this
    object is then the policy, and the engine never hands it a leaf. It
    tracks nothing, so :meth:`evict` always returns an empty list and a
    transaction has nothing to undo.

    Complexity: every method O(1).
    """

    retains_unreferenced = False  # deprecated: the mode lives in the config

    def insert(
        self, block_id: int, block_hash: int, last_access: int, num_accesses: int, depth: int
    ) -> None:
        """Refused: in ref-zero mode the engine keeps no leaves.

        Raises:
            RuntimeError: always.
        """
        raise RuntimeError("RefZeroPolicy retains nothing; the engine must not insert blocks")

    def discard(self, block_id: int) -> None:
        """Raises KeyError: nothing is tracked."""
        raise KeyError(block_id)

    def touch(self, block_id: int, now: int) -> None:
        """Raises KeyError: nothing is tracked."""
        raise KeyError(block_id)

    def evict(self, num_blocks: int) -> list[int]:
        """Nothing to evict: ``[]``."""
        return []

    def clear(self) -> None:
        """Nothing to forget."""
        self._txn_undo = None

    def __len__(self) -> int:
        return 0

    def __contains__(self, block_id: object) -> bool:
        return False
