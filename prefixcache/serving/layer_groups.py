"""LayerGroups: a model's attention layers in groups, each with its own kind of KV cache.

Models mix attention kinds: full attention on some layers, sliding-window attention on
others, and beside the main cache the small per-token key cache of a sparse-attention
indexer (as DeepSeek's sparse attention keeps). Each group here has its own block table
row per request, and takes blocks from its own allocator or from one it shares with
other groups (vLLM's hybrid KV-cache manager keeps one table per group the same way).
Sliding-window groups give back blocks that fell out of the window while the request
runs, and a prefix hit on them needs only the blocks inside the window. A group's spec
lives in ``layer_group_spec.py``, the per-request rows and their read-only queries in
``layer_group_rows.py``; their public names are importable from here. See DESIGN.md,
"Hybrid models".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from prefixcache.engine.allocator import KVBlockAllocator
from prefixcache.engine.config import AllocatorConfig, PolicySpec
from prefixcache.engine.defragment import DefragmentPlan
from prefixcache.engine.pool import resolve_device
from prefixcache.engine.validation import require_int
from prefixcache.errors import CapacityError, ConfigError, InvalidArgumentError, InvariantError
from prefixcache.serving.block_table import BlockTable
from prefixcache.serving.kv_cache import KVCache
from prefixcache.serving.layer_group_rows import GroupHit, _GroupRows, _Row
from prefixcache.serving.layer_group_spec import GROUP_KINDS, LayerGroupSpec, first_needed_block


class LayerGroups(_GroupRows):
    """Per-group allocators, KV storage and block tables, driven one request at a time.

    Groups naming the same pool share one :class:`KVBlockAllocator` and one
    :class:`KVCache` with as many layers as the largest of them: group layer
    ``l`` is storage layer ``l``. Sharing is safe because a block belongs to
    one group's request at a time; the groups' hashes differ (a group's
    hashes are the request's chain hashes mixed with the group's position in
    its pool), so one registry holds them all. Sliding-window groups register
    each block as its own root (not chained), so a block out of the window
    is an evictable leaf at once.

    Methods: :meth:`longest_hit`, :meth:`admit`, :meth:`reserve`
    (:meth:`blocks_needed`), :meth:`commit`, :meth:`fork`, :meth:`finish`,
    :meth:`defragment`, :meth:`blocks_of`; attributes
    :attr:`allocators`, :attr:`kv_caches`, :attr:`tables` by group or pool name.

    Not thread-safe.

    Args:
        specs: the groups, at least one, names unique.
        num_blocks: blocks per pool (the dummy included), one int for all
            pools or a mapping by pool name.
        block_size: tokens per block, >= 1 (the same in every group).
        max_requests, max_blocks_per_request: the block tables' size.
        eviction_policy: the allocators' policy.
        dtype, device: KV storage dtype and where everything lives.
        kv_storage: build the KV tensors (False: bookkeeping only).
    """

    def __init__(
        self,
        specs: Sequence[LayerGroupSpec],
        *,
        num_blocks: int | dict[str, int],
        block_size: int,
        max_requests: int,
        max_blocks_per_request: int,
        eviction_policy: PolicySpec = "lru",
        dtype: torch.dtype = torch.float16,
        device: str | torch.device | None = None,
        kv_storage: bool = True,
    ) -> None:
        self.specs = tuple(specs)
        if not self.specs or not all(isinstance(spec, LayerGroupSpec) for spec in self.specs):
            raise ConfigError("specs must be a non-empty sequence of LayerGroupSpec")
        if len({spec.name for spec in self.specs}) != len(self.specs):
            raise ConfigError("layer group names must be unique")
        self.block_size = require_int(block_size, "block_size", minimum=1, error=ConfigError)
        self.device = resolve_device(device)
        members: dict[str, list[LayerGroupSpec]] = {}
        for spec in self.specs:
            members.setdefault(spec.pool_name, []).append(spec)
        for pool, groups in members.items():
            if len({spec.kv_shape for spec in groups}) > 1:
                raise ConfigError(f"groups sharing pool {pool!r} must have one KV shape")
        self.allocators: dict[str, KVBlockAllocator] = {}
        self.kv_caches: dict[str, KVCache] = {}
        for pool, groups in members.items():
            count = num_blocks.get(pool) if isinstance(num_blocks, dict) else num_blocks
            allocator = KVBlockAllocator(
                AllocatorConfig(
                    total_count=require_int(
                        count, f"num_blocks[{pool!r}]", minimum=2, error=ConfigError
                    ),
                    block_size_tokens=self.block_size,
                    eviction_policy=eviction_policy,
                    device=str(self.device),
                )
            )
            self.allocators[pool] = allocator
            if kv_storage:
                k_heads, k_dim, v_heads, v_dim = groups[0].kv_shape
                layers = max(spec.num_layers for spec in groups)
                self.kv_caches[pool] = KVCache(
                    layers, allocator.total_count, self.block_size, k_heads, k_dim,
                    v_heads=v_heads, v_head_dim=v_dim, dtype=dtype, device=self.device,
                )  # fmt: skip
        # Per group: its allocator, its table, and its position in its pool (the hash tag).
        self._allocator = [self.allocators[spec.pool_name] for spec in self.specs]
        self._tag = [members[spec.pool_name].index(spec) for spec in self.specs]
        self._table = [
            BlockTable(max_requests, max_blocks_per_request, allocator.dummy_block_id, self.device)
            for allocator in self._allocator
        ]
        self.tables = {spec.name: self._table[g] for g, spec in enumerate(self.specs)}
        self._rows: dict[int, _Row] = {}

    # ------------------------------------------------------------------ matching

    def longest_hit(
        self, base_hashes: Sequence[int], accept: Callable[[int], bool] | None = None
    ) -> GroupHit:
        """The longest prefix of ``base_hashes`` every group can serve (and ``accept`` allows).

        Full and indexer groups need every block of the prefix registered;
        sliding-window groups only the blocks inside the window at its end.
        Takes no reference (:meth:`admit` does).

        Args:
            base_hashes: chain hashes of the prompt's full blocks.
            accept: ``accept(j)`` says whether a hit of ``j`` blocks suits the
                caller (a hybrid model: a state checkpoint ends there).

        Complexity: O(matched blocks * groups), plus O(window blocks) per
        candidate length tried.
        """
        hashes = [self.group_hashes(group, base_hashes) for group in range(len(self.specs))]
        chains: dict[int, list[int]] = {}
        longest = len(base_hashes)
        for group, spec in enumerate(self.specs):
            if spec.kind != "sliding_window":
                matched = self._allocator[group].match_prefix(hashes[group]).tolist()
                chains[group] = matched
                longest = min(longest, len(matched))
        for num_blocks in range(longest, 0, -1):
            if accept is not None and not accept(num_blocks):
                continue
            hit = self._window_hit(num_blocks, hashes, chains)
            if hit is not None:
                return hit
        empty = tuple(np.empty(0, dtype=np.int32) for _ in self.specs)
        return GroupHit(0, empty, (0,) * len(self.specs))

    def _window_hit(
        self, num_blocks: int, hashes: list[list[int]], chains: dict[int, list[int]]
    ) -> GroupHit | None:
        block_ids: list[np.ndarray] = []
        firsts: list[int] = []
        for group, spec in enumerate(self.specs):
            if spec.window is None:
                block_ids.append(np.asarray(chains[group][:num_blocks], dtype=np.int32))
                firsts.append(0)
                continue
            first = first_needed_block(num_blocks * self.block_size, spec.window, self.block_size)
            allocator = self._allocator[group]
            found = []
            for block_hash in hashes[group][first:num_blocks]:
                ids = allocator.match_prefix([block_hash])  # roots: one block each
                if not len(ids):
                    return None
                found.append(int(ids[0]))
            block_ids.append(np.asarray(found, dtype=np.int32))
            firsts.append(first)
        return GroupHit(num_blocks, tuple(block_ids), tuple(firsts))

    # ------------------------------------------------------------------ requests

    def admit(self, hit: GroupHit, base_hashes: Sequence[int]) -> int:
        """Take ``hit``'s blocks for a new request and give it a row in every group's table.

        Returns:
            The request's slot (the same row in every table).

        Raises:
            CapacityError: no free row, or the hit overflows one.
            InvalidArgumentError: ``hit`` covers more blocks than ``base_hashes``.

        Complexity: O(hit blocks) per group.
        """
        if hit.num_blocks > len(base_hashes):
            raise InvalidArgumentError(f"hit of {hit.num_blocks} blocks; {len(base_hashes)} hashes")
        if not self._table[0].num_free_slots:
            raise CapacityError(f"all {self._table[0].max_requests} request slots are in use")
        if hit.num_blocks > self._table[0].max_blocks_per_request:
            raise CapacityError(f"a hit of {hit.num_blocks} blocks overflows a table row")
        slots = set()
        for group, table in enumerate(self._table):
            self._allocator[group].acquire_blocks(hit.block_ids[group])
            slots.add(table.add_request_at(hit.first_block[group], hit.block_ids[group]))
        if len(slots) != 1:
            raise InvariantError(f"group tables handed out different rows {sorted(slots)}")
        slot = slots.pop()
        num = len(self.specs)
        self._rows[slot] = _Row(
            num_tokens=hit.num_blocks * self.block_size,
            num_registered=[hit.num_blocks] * num,
            num_released=list(hit.first_block),
            hashes=[self.group_hashes(g, base_hashes[: hit.num_blocks]) for g in range(num)],
        )
        return slot

    def reserve(self, slot: int, num_tokens: int) -> bool:
        """Give the request in ``slot`` blocks for its first ``num_tokens`` tokens in every group.

        All or nothing across pools: returns False, and nothing changes, when
        some pool cannot supply its groups' blocks even by eviction.

        Raises:
            InvalidArgumentError: no such request, or a bad count.
            CapacityError: a row would overflow ``max_blocks_per_request``.

        Complexity: O(new blocks), plus O(log n) per evicted block.
        """
        needs = self._needs(slot, num_tokens)
        per_pool: dict[str, int] = {}
        for spec, need in zip(self.specs, needs, strict=True):
            per_pool[spec.pool_name] = per_pool.get(spec.pool_name, 0) + need
        if not all(self.allocators[pool].is_memory_available(n) for pool, n in per_pool.items()):
            return False
        for group, need in enumerate(needs):
            if need:
                block_ids = self._allocator[group].allocate_memory_blocks(need)
                if block_ids is None:  # counted above: cannot happen
                    raise InvariantError(f"pool of group {self.specs[group].name!r} ran short")
                self._table[group].append_blocks(slot, block_ids)
        return True

    def blocks_needed(self, slot: int, num_tokens: int) -> dict[str, int]:
        """Fresh blocks per pool that :meth:`reserve` would take for ``num_tokens`` tokens.

        Raises:
            InvalidArgumentError, CapacityError: as :meth:`reserve`.

        Complexity: O(groups).
        """
        per_pool = dict.fromkeys(self.allocators, 0)
        for spec, need in zip(self.specs, self._needs(slot, num_tokens), strict=True):
            per_pool[spec.pool_name] += need
        return per_pool

    def _needs(self, slot: int, num_tokens: int) -> list[int]:
        """Per group, the blocks the row of ``slot`` lacks for ``num_tokens`` tokens."""
        self._row(slot)
        num_tokens = require_int(num_tokens, "num_tokens", minimum=0)
        wanted = -(-num_tokens // self.block_size)
        needs = [max(0, wanted - table.num_blocks(slot)) for table in self._table]
        for group, table in enumerate(self._table):
            if needs[group] and table.num_blocks(slot) + needs[group] > (
                table.max_blocks_per_request
            ):
                raise CapacityError(f"slot {slot} would need {wanted} blocks in a row")
        return needs

    def fork(self, slot: int) -> int:
        """A new request sharing every block ``slot``'s written tokens are in, in every group.

        The fork (parallel sampling, beam search) takes a reference on each
        shared block and continues from the same token count. Blocks reserved
        past the written tokens stay with ``slot``. A partly filled last block
        is shared too: the caller must copy it before either request writes
        there (:class:`~prefixcache.serving.cow.PartialBlockTable`).

        Returns:
            The fork's slot.

        Raises:
            InvalidArgumentError: no such request.
            CapacityError: no free row.

        Complexity: O(blocks held) per group.
        """
        row = self._row(slot)
        if not self._table[0].num_free_slots:
            raise CapacityError(f"all {self._table[0].max_requests} request slots are in use")
        num_written = -(-row.num_tokens // self.block_size)
        slots = set()
        for group, table in enumerate(self._table):
            first = min(row.num_released[group], num_written)
            shared = table.blocks_of(slot)[first:num_written]
            self._allocator[group].acquire_blocks(shared)
            slots.add(table.add_request_at(first, shared))
        if len(slots) != 1:
            raise InvariantError(f"group tables handed out different rows {sorted(slots)}")
        new_slot = slots.pop()
        self._rows[new_slot] = _Row(
            num_tokens=row.num_tokens,
            num_registered=list(row.num_registered),
            num_released=[min(released, num_written) for released in row.num_released],
            hashes=[list(hashes) for hashes in row.hashes],
        )
        return new_slot

    def commit(self, slot: int, num_tokens: int, base_hashes: Sequence[int]) -> None:
        """Record that the KV of the first ``num_tokens`` tokens is written in every group.

        Registers each newly full block under its hash (chained in full and
        indexer groups, one root per block in sliding-window groups), then
        gives back the sliding-window blocks now outside their window.

        Args:
            slot: the request.
            num_tokens: tokens written so far, not fewer than before and
                within the reserved blocks.
            base_hashes: chain hashes of the request's full blocks so far (at
                least ``num_tokens // block_size`` of them).

        Raises:
            InvalidArgumentError: no such request, a count out of range, or
                too few hashes.

        Complexity: O(new full blocks + released blocks) per group.
        """
        row = self._row(slot)
        num_tokens = require_int(num_tokens, "num_tokens", minimum=row.num_tokens)
        if -(-num_tokens // self.block_size) > self._table[0].num_blocks(slot):
            raise InvalidArgumentError(f"{num_tokens} tokens exceed slot {slot}'s reserved blocks")
        num_full = num_tokens // self.block_size
        if len(base_hashes) < num_full:
            raise InvalidArgumentError(f"{num_full} full blocks but {len(base_hashes)} hashes")
        for group, spec in enumerate(self.specs):
            start = row.num_registered[group]
            if num_full > start:
                row.hashes[group].extend(self.group_hashes(group, base_hashes[start:num_full]))
                self._register(group, slot, row, start, num_full)
                row.num_registered[group] = num_full
            if spec.window is not None:
                first = first_needed_block(num_tokens, spec.window, self.block_size)
                self._release_leading(group, slot, row, first)
        row.num_tokens = num_tokens

    def _register(self, group: int, slot: int, row: _Row, start: int, stop: int) -> None:
        allocator = self._allocator[group]
        blocks = self._table[group].blocks_of(slot)
        hashes = row.hashes[group]
        if self.specs[group].window is not None:
            for index in range(start, stop):
                allocator.register_kv_block_hashes(blocks[index : index + 1], [hashes[index]])
            return
        parent = hashes[start - 1] if start else None
        if parent is not None and not allocator.is_hash_registered(parent):
            start, parent = 0, None  # the parent was evicted: register from the root
        allocator.register_kv_block_hashes(
            blocks[start:stop], hashes[start:stop], parent_hash=parent
        )

    def _release_leading(self, group: int, slot: int, row: _Row, stop: int) -> None:
        start = row.num_released[group]
        if stop <= start:
            return
        blocks = self._table[group].blocks_of(slot)[start:stop]
        self._allocator[group].release_memory_blocks(blocks)
        self._table[group].clear_blocks(slot, start, stop)
        row.num_released[group] = stop

    def finish(self, slot: int) -> None:
        """Release every block the request in ``slot`` holds and free its rows.

        Raises:
            InvalidArgumentError: no such request.

        Complexity: O(blocks held).
        """
        row = self._row(slot)
        for group, table in enumerate(self._table):
            held = table.remove_request(slot)[row.num_released[group] :]
            self._allocator[group].release_memory_blocks(held)
        del self._rows[slot]

    def defragment(self, pool: str) -> DefragmentPlan:
        """Compact ``pool``'s live blocks into its lowest IDs, requests running or not.

        The allocator plans and applies the moves, copying the KV data with
        the pool's :meth:`KVCache.copy_blocks`; every table of the pool's
        groups follows (:meth:`BlockTable.apply_moves`). Rows keep their
        hashes and counts, which name no block.

        Returns:
            The plan applied (empty when the pool is compact).

        Raises:
            InvalidArgumentError: an unknown pool.
            BlockStateError: a free group is open on the allocator.

        Complexity: O(pool blocks + table size) plus the copy of the moved blocks.
        """
        if pool not in self.allocators:
            raise InvalidArgumentError(f"unknown pool {pool!r}")
        allocator = self.allocators[pool]
        plan = allocator.plan_defragment()
        cache = self.kv_caches.get(pool)
        if allocator.apply_defragment(plan, copy=None if cache is None else cache.copy_blocks):
            for group, spec in enumerate(self.specs):
                if spec.pool_name == pool:
                    self._table[group].apply_moves(plan.sources, plan.destinations)
        return plan


__all__ = [
    "GROUP_KINDS",
    "GroupHit",
    "LayerGroupSpec",
    "LayerGroups",
    "first_needed_block",
]
