"""SharedTails: copy-on-write of partly filled last blocks in every layer group.

A fork of a running request (parallel sampling, beam search) shares all its blocks,
the partly filled last one included. :class:`~prefixcache.serving.cow.PartialBlockTable`
keeps one group's sharers and decides who copies; this class runs it for each group
of a :class:`~prefixcache.serving.layer_groups.LayerGroups`: the writer's row gets the
fresh block (``BlockTable.set_block``) and the shared tokens are copied into it in the
group's KV storage (``KVCache.copy_tokens``) before the writer's own tokens land there.
See DESIGN.md, "Hybrid models".
"""

from __future__ import annotations

from prefixcache.engine.block_ids import BlockIdsLike
from prefixcache.errors import InvariantError
from prefixcache.serving.cow import CopyInstruction, PartialBlockTable
from prefixcache.serving.layer_groups import LayerGroups


class SharedTails:
    """Per layer group, the partial last blocks that forked requests share.

    Requests are keyed by their slot (the same row in every group). A slot
    is tracked from :meth:`share` until its tail fills up or it ends
    (:meth:`drop`). Not thread-safe.

    Args:
        groups: the layer groups whose tables, allocators and KV storage the
            copies go through.
    """

    def __init__(self, groups: LayerGroups) -> None:
        self.groups = groups
        self.block_size = groups.block_size
        self._tables = [PartialBlockTable(groups.allocators[s.pool_name]) for s in groups.specs]
        self._column: dict[int, int] = {}  # slot -> column of its tracked tail
        self.num_copies = 0  # copy-on-write copies run so far

    def share(self, slot: int, new_slot: int) -> None:
        """``new_slot`` (a fork of ``slot`` holding references on all its blocks) shares its tail.

        Nothing to track when ``slot``'s written tokens end on a block boundary.

        Complexity: O(groups).
        """
        num_tokens = self.groups.num_tokens(slot)
        column, fill = divmod(num_tokens, self.block_size)
        if not fill:
            return
        for spec, table in zip(self.groups.specs, self._tables, strict=True):
            if table.tail_of(slot) is None:
                block = int(self.groups.tables[spec.name].blocks_of(slot)[column])
                table.track(slot, block, fill)
            table.share(slot, new_slot, take_reference=False)
        self._column[slot] = self._column[new_slot] = column

    def fresh_blocks_needed(self, slot: int, num_tokens: int) -> dict[str, int]:
        """Fresh blocks per pool a :meth:`write` up to ``num_tokens`` copies into. O(groups)."""
        needed = dict.fromkeys(self.groups.allocators, 0)
        for spec, table in zip(self.groups.specs, self._tables, strict=True):
            tail = table.tail_of(slot)
            if (
                tail is not None
                and self._count(slot, tail[1], num_tokens)
                and (len(table.holders_of(tail[0])) > 1)
            ):
                needed[spec.pool_name] += 1
        return needed

    def write(self, slot: int, num_tokens: int) -> list[CopyInstruction]:
        """``slot`` is about to write its tokens up to ``num_tokens``: copy shared tails first.

        Call after the pools were checked for :meth:`fresh_blocks_needed`;
        calling again with the same count changes nothing.

        Returns:
            The copies run (one per group whose tail was shared).

        Raises:
            InvariantError: a pool ran short after all.

        Complexity: O(groups), plus one block copy per shared tail.
        """
        copies = []
        for spec, table in zip(self.groups.specs, self._tables, strict=True):
            tail = table.tail_of(slot)
            count = 0 if tail is None else self._count(slot, tail[1], num_tokens)
            if not count:
                continue
            done = table.write(slot, count)
            if done is None:
                raise InvariantError(f"group {spec.name!r}: no block for a copy-on-write")
            if done.copy is not None:
                cache = self.groups.kv_caches.get(spec.pool_name)
                if cache is not None:
                    cache.copy_tokens(done.copy.src, done.copy.dst, done.copy.num_tokens)
                self.groups.tables[spec.name].set_block(slot, self._column[slot], done.block_id)
                copies.append(done.copy)
        if not self.is_tracked(slot):
            self._column.pop(slot, None)
        self.num_copies += len(copies)
        return copies

    def apply_moves(self, pool: str, sources: BlockIdsLike, destinations: BlockIdsLike) -> int:
        """Follow a defragmentation of ``pool``: rename the tracked tails it moved.

        Returns:
            How many tracked blocks were renamed, over the pool's groups.

        Complexity: O(groups * len(sources)).
        """
        return sum(
            table.apply_moves(sources, destinations)
            for spec, table in zip(self.groups.specs, self._tables, strict=True)
            if spec.pool_name == pool
        )

    def drop(self, slot: int) -> None:
        """Stop tracking ``slot`` (it ends; its row still holds the references). O(groups)."""
        for table in self._tables:
            if table.tail_of(slot) is not None:
                table.drop(slot)
        self._column.pop(slot, None)

    def is_tracked(self, slot: int) -> bool:
        """Whether ``slot`` shares (or shared and has not filled) a partial tail. O(groups)."""
        return any(table.tail_of(slot) is not None for table in self._tables)

    def check_invariants(self) -> None:
        """Each group's table invariants, and every tracked tail sitting in its row's column.

        Raises:
            InvariantError: the first problem found.

        Complexity: O(tracked slots * groups).
        """
        for spec, table in zip(self.groups.specs, self._tables, strict=True):
            table.check_invariants()
            for slot, column in self._column.items():
                tail = table.tail_of(slot)
                row = self.groups.tables[spec.name].blocks_of(slot)
                if tail is not None and int(row[column]) != tail[0]:
                    raise InvariantError(f"slot {slot}'s tail in {spec.name!r} left its column")

    def _count(self, slot: int, fill: int, num_tokens: int) -> int:
        """Tokens up to ``num_tokens`` that land in ``slot``'s tail after its ``fill``."""
        start = self._column[slot] * self.block_size
        return max(0, min(num_tokens, start + self.block_size) - start - fill)
