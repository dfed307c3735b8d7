"""Compat mode: the drop-in with Megatron-core 0.19.2's block IDs, free stack and counters.

:class:`MegatronCompatAllocator` is what :func:`~prefixcache.integrations.megatron.install`
and :func:`~prefixcache.integrations.megatron.attach` build unless ``strict=True``.
It keeps Megatron's own free stack (``block_bag`` and a writable
``total_avail``, pushed and popped exactly as Megatron's ``KVBlockAllocator``
does), so every returned block ID is the one Megatron's class returns, and
renames blocks between Megatron's IDs (the mirrors, the caller) and the
backing allocator's (``_m2e`` / ``_e2m``). In LRU mode the backing allocator
runs :class:`~prefixcache.integrations.megatron.compat_policy.MegatronOrderPolicy`,
Megatron's leaf peel keyed by its own timestamps and IDs.

Where Megatron's class would corrupt its state, compat mode does something
safe instead and says so (DESIGN.md, "Megatron-core drop-in"): a release of a
free block or one past its references raises; evicting a block that was
registered while free does not push it on the free stack a second time; a
``total_avail`` raise that would expose a used or duplicate ID is refused.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from prefixcache.engine.block_ids import to_int_array
from prefixcache.engine.validation import require_int
from prefixcache.errors import (
    BlockStateError,
    InvalidArgumentError,
    InvalidBlockIdError,
    InvariantError,
)
from prefixcache.integrations.megatron.allocator import MegatronKVBlockAllocator, _require_tensor
from prefixcache.integrations.megatron.compat_policy import MegatronOrderPolicy
from prefixcache.integrations.megatron.mirrors import _as_array
from prefixcache.integrations.megatron.options import _LRU, PrefixCachePolicy, _installed_options


class MegatronCompatAllocator(MegatronKVBlockAllocator):
    """The drop-in in compat mode: Megatron's IDs, order, counters and accepted calls.

    Same constructor as :class:`MegatronKVBlockAllocator`. Every call goes
    through the facade (the native fast paths would bypass the renaming); in
    LRU mode with the default ``cached_policy`` the Python engine runs
    Megatron's eviction order.
    """

    def __init__(
        self,
        context: Any,
        total_count: int,
        paused_count: int,
        enable_prefix_caching: bool = False,
        prefix_caching_eviction_policy: Any = "ref_zero",
        **options: Any,
    ) -> None:
        # Megatron's eviction order where Megatron's LRU runs (not for a chosen policy).
        self._megatron_order = bool(
            enable_prefix_caching
            and type(prefix_caching_eviction_policy) is not PrefixCachePolicy
            and prefix_caching_eviction_policy == _LRU
            and {**_installed_options, **options}.get("cached_policy", _LRU) == _LRU
        )
        if self._megatron_order:
            options.setdefault("engine", "python")  # a policy object: the Python engine runs it
        super().__init__(
            context,
            total_count,
            paused_count,
            enable_prefix_caching,
            prefix_caching_eviction_policy,
            **options,
        )
        self._core = None  # renaming: every call through the facade
        self._bag_tensor = torch.arange(self.total_count, dtype=torch.int32)
        self._bag = self._bag_tensor.numpy()
        self._total_avail = self.total_count - 1
        self._stacked = np.ones(self.total_count, dtype=np.bool_)  # in block_bag[:total_avail]
        self._stacked[-1] = False
        self._m2e = np.full(self.total_count, -1, dtype=np.int64)
        self._e2m = np.full(self.total_count, -1, dtype=np.int64)

    def _eviction_policy(self, spec: Any) -> Any:
        if self._megatron_order:
            return MegatronOrderPolicy(self._megatron_key)
        return spec

    def _megatron_key(self, engine_id: int) -> tuple[int, int]:
        megatron_id = int(self._e2m[engine_id])
        return int(self._stamps[megatron_id]), megatron_id

    # ------------------------------------------------------------------ the free stack

    @property
    def block_bag(self) -> torch.Tensor:
        """Megatron's free stack itself (int32, ``total_count`` long; the first
        ``total_avail`` entries are free). Live: allocations return views of it."""
        return self._bag_tensor

    @property
    def total_avail(self) -> int:
        """Megatron's stack pointer: ``block_bag[:total_avail]`` are free.

        Writable, as Megatron's plain attribute. Lowering it hides the free
        IDs above it (they are not handed out; a release overwrites them, as
        in Megatron). Raising it exposes ``block_bag[old:new]``, which must be
        distinct IDs no request holds.

        Raises:
            InvalidArgumentError: out of ``0 .. total_count - 1``, or the raise
                would expose an ID twice or one in use (Megatron would hand
                it out twice).
        """
        return self._total_avail

    @total_avail.setter
    def total_avail(self, value: int) -> None:
        value = require_int(value, "total_avail", minimum=0, maximum=self.total_count - 1)
        if value > self._total_avail:
            exposed = self._bag[:value].astype(np.int64)
            shown = exposed[self._total_avail :]
            used = (self._m2e[shown] >= 0) & (
                self._refs[shown] > 0 if self.enable_prefix_caching else True
            )
            if (
                np.unique(exposed).size != value
                or used.any()
                or (shown == self.dummy_block_idx).any()
            ):
                raise InvalidArgumentError(
                    f"total_avail {value} would expose block_bag[{self._total_avail}:{value}] "
                    f"= {shown.tolist()}: IDs in use or already free"
                )
        low, high = sorted((value, self._total_avail))
        self._stacked[self._bag[low:high]] = value > self._total_avail
        self._total_avail = value

    def _push(self, megatron_ids: np.ndarray) -> None:
        """Megatron's push: ``block_bag[total_avail:total_avail + k] = ids``."""
        start = self._total_avail
        self._bag[start : start + len(megatron_ids)] = megatron_ids
        self._stacked[megatron_ids] = True
        self._total_avail = start + len(megatron_ids)

    def _bind(self, megatron_ids: np.ndarray, engine_ids: np.ndarray) -> None:
        self._m2e[megatron_ids] = engine_ids
        self._e2m[engine_ids] = megatron_ids

    def _unbind(self, megatron_ids: np.ndarray) -> None:
        self._e2m[self._m2e[megatron_ids]] = -1
        self._m2e[megatron_ids] = -1

    def _to_engine(self, block_ids: Any) -> Any:
        """The backing allocator's IDs; InvalidBlockIdError / BlockStateError before any change."""
        ids = np.asarray(block_ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.dummy_block_idx):
            raise InvalidBlockIdError(f"block IDs must be in [0, {self.dummy_block_idx})")
        engine_ids = self._m2e[ids]
        if (engine_ids < 0).any():
            raise BlockStateError(f"blocks {ids[engine_ids < 0].tolist()} are free")
        return engine_ids if isinstance(block_ids, np.ndarray) else engine_ids.tolist()

    # ------------------------------------------------------------------ counts

    def get_total_used(self) -> int:
        """Megatron's ``total_count - total_avail - 1``. O(1)."""
        return self.total_count - self._total_avail - 1

    def is_memory_available(self, num_blocks: int, potential_matched_count: int = 0) -> bool:
        """Megatron's test: free stack, then (LRU only) plus evictable minus to-be-pinned."""
        num_blocks = require_int(num_blocks, "num_blocks")
        potential_matched_count = require_int(potential_matched_count, "potential_matched_count")
        if self._total_avail >= num_blocks:
            return True
        if not self._is_lru:
            return False
        evictable = int(self.get_evictable_block_count()) - potential_matched_count
        return self._total_avail + evictable >= num_blocks

    def get_evictable_block_count(self) -> torch.Tensor:
        """Megatron's count from the mirrors: reference count 0 and a hash. O(total_count)."""
        if not self.enable_prefix_caching:
            return super().get_evictable_block_count()
        return ((self._ref_counts == 0) & (self.block_hashes != -1)).sum()

    # ------------------------------------------------------------------ allocation

    def allocate_memory_blocks(self, num_blocks: int) -> torch.Tensor | None:
        """Pop ``num_blocks`` IDs off Megatron's stack (evicting first in LRU mode), or None.

        Returns a view into ``block_bag``, as Megatron's. Complexity: O(num_blocks)
        plus Megatron's eviction.
        """
        num_blocks = require_int(num_blocks, "num_blocks", minimum=0)
        if self._total_avail < num_blocks and (
            not self._is_lru or not self.evict_lru_blocks(num_blocks - self._total_avail)
        ):
            return None
        start = self._total_avail - num_blocks
        ids = self._bag[start : start + num_blocks].astype(np.int64)
        bound = self._m2e[ids] >= 0  # registered while free: cached in the backing allocator
        fresh = ids[~bound]
        if bound.any():
            self._run(self.allocator.acquire_blocks, self._m2e[ids[bound]])
        if fresh.size:
            engine_ids = self._run(self.allocator.allocate_memory_blocks, fresh.size)
            if engine_ids is None:  # the backing allocator has a free block per unbound ID
                raise InvariantError("the backing allocator is short of free blocks")
            self._bind(fresh, engine_ids.numpy().astype(np.int64))
        self._total_avail = start
        self._stacked[ids] = False
        if self.enable_prefix_caching and num_blocks:
            self._refs[ids] = 1
            if self._is_lru:
                self._stamps[ids] = self.context.prefix_cache_lru_clock
        for block_id in ids.tolist():
            self.block_routing.pop(block_id, None)
        return self._bag_tensor[start : start + num_blocks]

    def release_memory_blocks(self, blocks: torch.Tensor) -> None:
        """Megatron's release: the freed IDs go on the stack in Megatron's order.

        Without caching, as given; in ref-zero mode the blocks that reach
        zero, sorted, deregistered first; in LRU mode the unhashed ones that
        reach zero, sorted. Raises (nothing changes) for a free block or a
        release past the references, which corrupt Megatron's stack.
        """
        _require_tensor(blocks, "blocks")
        if blocks.numel() == 0:
            return
        ids = _as_array(blocks).astype(np.int64)
        self.allocator.release_memory_blocks(self._to_engine(ids))
        self._pending_removed = []  # deregistrations mirrored below, in Megatron's order
        if not self.enable_prefix_caching:
            self._unbind(ids)
            self._push(ids)
            return
        np.subtract.at(self._refs, ids, 1)
        zero = np.unique(ids[self._refs[ids] == 0])
        if self._is_lru:
            zero = zero[self._hashes[zero] == -1]
            self._unbind(zero)
            self._push(zero)
        elif zero.size:
            self._megatron_deregister(zero)

    def _megatron_deregister(self, ids: np.ndarray) -> None:
        """Megatron's ``_deregister_blocks``: dict, callback, mirrors, then push (unless free)."""
        keys = set(self._hashes[ids].tolist()) - {-1}
        table = self.kv_hash_to_block_id
        for key in keys & table.keys():
            del table[key]
        if self.on_blocks_deregistered is not None:
            self.on_blocks_deregistered(ids.tolist(), keys)
        self._clear_mirrors(ids)
        self._refs[ids] = 0
        on_stack = self._stacked[ids]
        self._unbind(ids)
        self._push(ids[~on_stack])

    def reset(self) -> None:
        """Megatron's reset: the stack back to ``arange``, everything free. O(total_count)."""
        super().reset()
        self._bag[:] = np.arange(self.total_count, dtype=np.int32)
        self._total_avail = self.total_count - 1
        self._stacked[:-1] = True
        self._m2e.fill(-1)
        self._e2m.fill(-1)

    # ------------------------------------------------------------------ prefix caching

    def register_kv_block_hashes(
        self,
        block_ids: list[int],
        block_hashes: list[int],
        parent_hashes: list[int] | None = None,
    ) -> None:
        """Register as Megatron does; in LRU mode a free block too (it becomes cached).

        A block registered while free stays on the free stack, counts as
        evictable (reference count 0, a hash) and keeps its hash when handed
        out, as in Megatron. Ref-zero mode refuses free blocks
        (BlockStateError): such a block could never be freed there.
        """
        if not self.enable_prefix_caching or not len(block_ids):
            return super().register_kv_block_hashes(block_ids, block_hashes, parent_hashes)
        ids = np.unique(to_int_array(block_ids, "block_ids").astype(np.int64))
        if ids.min() < 0 or ids.max() >= self.dummy_block_idx:
            raise InvalidBlockIdError(f"block IDs must be in [0, {self.dummy_block_idx})")
        free = ids[self._m2e[ids] < 0]
        if not free.size or not self._is_lru:
            return super().register_kv_block_hashes(block_ids, block_hashes, parent_hashes)
        engine_ids = self._run(self.allocator.allocate_memory_blocks, free.size)
        if engine_ids is None:
            raise InvariantError("the backing allocator is short of free blocks")
        engine_ids = engine_ids.numpy().astype(np.int64)
        self._bind(free, engine_ids)
        try:
            super().register_kv_block_hashes(block_ids, block_hashes, parent_hashes)
        finally:
            self._run(self.allocator.release_memory_blocks, engine_ids)  # now cached, or free
            self._unbind(free[self._hashes[free] == -1])

    def update_timestamps(self, block_ids: torch.Tensor) -> None:
        """Megatron's timestamps for any block, free ones included (LRU mode)."""
        _require_tensor(block_ids, "block_ids")
        if not self._is_lru or block_ids.numel() == 0:
            return
        ids = _as_array(block_ids).astype(np.int64)
        if ids.min() < 0 or ids.max() >= self.total_count:
            raise InvalidBlockIdError(f"block IDs must be in [0, {self.total_count})")
        before = self._stamps[ids]
        self._stamps[ids] = self.context.prefix_cache_lru_clock  # the policy reads it
        engine_ids = self._m2e[ids]
        try:
            self._run(self.allocator.update_timestamps, engine_ids[engine_ids >= 0])
        except Exception:
            self._stamps[ids] = before
            raise

    def evict_lru_blocks(self, num_blocks_needed: int) -> bool:
        """Megatron's eviction: its count, its order, its pushes. O(total_count) + the peel."""
        needed = require_int(num_blocks_needed, "num_blocks_needed")
        cached = int(self.get_evictable_block_count()) if self.enable_prefix_caching else 0
        if cached < needed:
            return False
        if needed <= 0:
            return True
        if not self.allocator.evict_lru_blocks(needed):
            raise InvariantError("the backing allocator could not evict what the mirrors hold")
        removed, self._pending_removed = self._pending_removed, []
        table = self.kv_hash_to_block_id
        self._megatron_deregister(np.array([table[h] for h in removed], dtype=np.int64))
        return True

    # ------------------------------------------------------------------ mirrors

    def _write_ref_counts(self, index: Any, value: Any) -> None:
        """The base class's pin; a block it freed goes back on the stack (Megatron leaks it)."""
        super()._write_ref_counts(index, value)
        touched = np.unique(self._positions[index].reshape(-1).numpy())
        freed = touched[(self._m2e[touched] >= 0) & (self._refs[touched] == 0)]
        freed = freed[self._hashes[freed] == -1]
        if freed.size:
            self._unbind(freed)
            self._push(freed)

    def check_consistency(self) -> None:
        """The base checks in Megatron's IDs, plus the stack's: distinct, free or cached IDs."""
        self.allocator.check_invariants()
        bag = self._bag[: self._total_avail].astype(np.int64)
        problems = []
        if np.unique(bag).size != bag.size or (bag == self.dummy_block_idx).any():
            problems.append("block_bag[:total_avail] repeats an ID or holds the dummy")
        if self._stacked.sum() != bag.size or not self._stacked[bag].all():
            problems.append("the on-stack marks differ from block_bag[:total_avail]")
        bound = np.flatnonzero(self._m2e[:-1] >= 0)
        if (self._e2m[self._m2e[bound]] != bound).any():
            problems.append("the renaming is not a bijection")
        if self.enable_prefix_caching:
            active, paused = self.allocator.reference_counts(self._m2e[bound])
            if not np.array_equal(self._refs[bound], (active + paused).numpy()):
                problems.append("block_ref_counts differ from the allocator's references")
            if (self._refs[:-1][self._m2e[:-1] < 0] != 0).any():
                problems.append("a free block has references")
            if (self._refs[bag] != 0).any():
                problems.append("a block on the free stack has references")
        if problems:
            raise InvariantError("; ".join(problems))
