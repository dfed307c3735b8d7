"""What :class:`~prefixcache.serving.layer_groups.LayerGroups` knows of each request, and its reads.

``_Row`` is one request's state across the groups (tokens written, blocks
registered and given back per group, each group's chain hashes);
:class:`GroupHit` is a prefix hit over every group, not yet taken. ``_GroupRows``,
the base of :class:`~prefixcache.serving.layer_groups.LayerGroups`, holds what
reads that state without changing a block: the per-group hash tags
(:meth:`~_GroupRows.group_hashes`), the queries (:meth:`~_GroupRows.blocks_of`,
:meth:`~_GroupRows.num_tokens`, :meth:`~_GroupRows.num_held_blocks`) and
:meth:`~_GroupRows.check_invariants`. Apart from ``layer_groups.py`` so that module
holds only what takes and gives blocks; every public name is importable from there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import xxhash

from prefixcache.engine.allocator import KVBlockAllocator
from prefixcache.engine.validation import is_int
from prefixcache.errors import InvalidArgumentError, InvariantError
from prefixcache.serving.block_table import BlockTable
from prefixcache.serving.layer_group_spec import LayerGroupSpec

_MASK63 = (1 << 63) - 1


@dataclass(slots=True)
class _Row:
    """What the groups know of one request; changed only by :class:`LayerGroups`."""

    num_tokens: int  # tokens whose KV is written
    num_registered: list[int]  # per group: leading full blocks registered (or hit)
    num_released: list[int]  # per group: leading blocks given back (sliding window)
    hashes: list[list[int]] = field(default_factory=list)  # per group: its chain hashes so far


@dataclass(frozen=True, slots=True)
class GroupHit:
    """A prefix hit over every group, not yet taken.

    Attributes:
        num_blocks: full blocks of the prompt the hit covers.
        block_ids: per group, the blocks it must hold: all ``num_blocks`` of
            a full or indexer group, those inside the window of a sliding one.
        first_block: per group, the prompt position of ``block_ids[g][0]``.
    """

    num_blocks: int
    block_ids: tuple[np.ndarray, ...]
    first_block: tuple[int, ...]


class _GroupRows:
    """The rows of :class:`~prefixcache.serving.layer_groups.LayerGroups` and their reads."""

    # Set by LayerGroups.__init__.
    specs: tuple[LayerGroupSpec, ...]
    allocators: dict[str, KVBlockAllocator]
    tables: dict[str, BlockTable]
    _allocator: list[KVBlockAllocator]
    _tag: list[int]
    _table: list[BlockTable]
    _rows: dict[int, _Row]

    # ------------------------------------------------------------------ hashing

    def group_hashes(self, group: int, base_hashes: Sequence[int]) -> list[int]:
        """Group ``group``'s hashes of a chain: the first group of a pool uses them as is.

        Later groups of a shared pool mix each hash with their tag (XXH3-64 of
        its bytes, seeded with the tag, folded to a positive 63-bit int), so
        two groups never register the same hash in one registry.

        Complexity: O(len(base_hashes)).
        """
        tag = self._tag[group]
        if tag == 0:
            return list(base_hashes)
        mixed = []
        for value in base_hashes:
            raw = int(value).to_bytes(33, "little", signed=True)
            mixed.append((xxhash.xxh3_64_intdigest(raw, seed=tag) & _MASK63) or 1)
        return mixed

    # ------------------------------------------------------------------ queries

    def blocks_of(self, group: str, slot: int) -> torch.Tensor:
        """Group ``group``'s row of ``slot`` (the dummy block where given back).

        Raises:
            InvalidArgumentError: unknown group or no such request.

        Complexity: O(blocks of the request).
        """
        if group not in self.tables:
            raise InvalidArgumentError(f"unknown layer group {group!r}")
        self._row(slot)
        return self.tables[group].blocks_of(slot)

    def num_tokens(self, slot: int) -> int:
        """Tokens whose KV the request in ``slot`` has written. O(1)."""
        return self._row(slot).num_tokens

    def num_held_blocks(self) -> dict[str, int]:
        """Blocks held by requests now, per group (sliding windows hold fewer). O(requests)."""
        counts = {}
        for group, spec in enumerate(self.specs):
            table = self._table[group]
            counts[spec.name] = sum(
                table.num_blocks(slot) - row.num_released[group] for slot, row in self._rows.items()
            )
        return counts

    def check_invariants(self) -> None:
        """Each allocator's invariants, and every held block holding a reference.

        Raises:
            InvariantError: the first problem found.

        Complexity: O(total blocks + blocks held).
        """
        for allocator in self.allocators.values():
            allocator.check_invariants()
        for slot, row in self._rows.items():
            for group, table in enumerate(self._table):
                held = table.blocks_of(slot)[row.num_released[group] :]
                dummy = table.dummy_block_id
                if len(held) and bool((held == dummy).any()):
                    raise InvariantError(f"slot {slot} holds the dummy block in group {group}")
                if len(held):
                    active, _ = self._allocator[group].reference_counts(held)
                    if bool((active < 1).any()):
                        raise InvariantError(f"slot {slot} holds an unreferenced block")

    def _row(self, slot: object) -> _Row:
        if not is_int(slot):
            raise InvalidArgumentError(f"slot must be an int, got {slot!r}")
        row = self._rows.get(int(slot))
        if row is None:
            raise InvalidArgumentError(f"slot {slot} holds no request")
        return row
