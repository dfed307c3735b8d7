"""What a :class:`~prefixcache.tiers.tiered.TieredCache` remembers, kept true when blocks move.

The tier remembers, per device block, the hash whose K/V the block's bytes hold, and demotes
those bytes when the block is handed out again. Defragmentation copies a block's bytes to
another ID and moves its state there: a record left at the old IDs would then demote the
wrong bytes under a hash (the destination's record names what it held before the copy).
:meth:`TieredCache.apply_defragment` moves the records with the blocks
(:func:`move_records`); when the allocator's layout changed behind the tier (its own
``apply_defragment`` or ``reset``), the tier's next call forgets every record whose block
no longer carries the remembered hash (:func:`forget_unheld`): it loses those demotions,
never demotes the wrong bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prefixcache.engine.allocator import KVBlockAllocator
from prefixcache.engine.defragment import DefragmentPlan
from prefixcache.engine.defragment_methods import CopyCallback


class TieredLayout:
    """:meth:`apply_defragment` and the layout check of :class:`TieredCache` (mixed in)."""

    allocator: KVBlockAllocator
    _held: dict[int, Any]
    _held_block: dict[int, int]
    _layout: int  # the allocator's layout epoch the records are true for

    def apply_defragment(self, plan: DefragmentPlan, copy: CopyCallback | None = None) -> int:
        """:meth:`KVBlockAllocator.apply_defragment` through the tier; what it remembers
        moves with the blocks. Returns the moves.

        Raises:
            As the allocator's method (nothing changes).

        Complexity: the allocator's, plus O(moves).
        """
        self._follow_layout()
        moved = self.allocator.apply_defragment(plan, copy)
        move_records(
            self._held, self._held_block, plan.sources.tolist(), plan.destinations.tolist()
        )
        self._layout = self.allocator._layout_epoch
        return moved

    def _follow_layout(self) -> None:
        """Before a call that may hand blocks out: if the allocator's layout changed behind
        the tier, forget the records it may have made false. O(1) unless it changed."""
        epoch = self.allocator._layout_epoch
        if epoch != self._layout:
            forget_unheld(self._held, self._held_block, self.allocator._engine.hash_of)
            self._layout = epoch


def move_records(
    held: dict[int, Any], index: dict[int, int], sources: list[int], destinations: list[int]
) -> None:
    """Move each source's record to its destination (all moves at once, as the plan applies).

    A destination's own record goes: its bytes are the source's now. ``held`` maps a block
    to its record (with ``block_hash``), ``index`` a hash to its block. Complexity: O(moves).
    """
    moving = {source: held.pop(source) for source in sources if source in held}
    for destination in destinations:
        forget_record(held, index, destination)
    for source, destination in zip(sources, destinations, strict=True):
        record = moving.get(source)
        if record is not None:
            held[destination] = record
            index[record.block_hash] = destination


def forget_unheld(
    held: dict[int, Any], index: dict[int, int], hash_of: Callable[[int], int | None]
) -> int:
    """Forget every record whose block does not carry its hash now; return how many.

    Complexity: O(records).
    """
    stale = [
        block_id for block_id, record in held.items() if hash_of(block_id) != record.block_hash
    ]
    for block_id in stale:
        forget_record(held, index, block_id)
    return len(stale)


def forget_record(held: dict[int, Any], index: dict[int, int], block_id: int) -> Any:
    """Drop ``block_id``'s record and its index entry (if the index still points there);
    return the record, or None when there was none. Complexity: O(1)."""
    record = held.pop(block_id, None)
    if record is not None and index.get(record.block_hash) == block_id:
        del index[record.block_hash]
    return record
