"""The drop-in class: Megatron-core 0.19's ``KVBlockAllocator`` run by a prefixcache allocator."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from prefixcache.engine.allocator import KVBlockAllocator
from prefixcache.engine.block_ids import to_int_array
from prefixcache.engine.config import AllocatorConfig
from prefixcache.engine.events import KVCacheEvent
from prefixcache.engine.stats import AllocatorStats
from prefixcache.engine.validation import require_int
from prefixcache.errors import ConfigError, InvalidArgumentError, InvalidTensorError
from prefixcache.integrations.megatron.mirrors import (
    MirrorMethods,
    _as_array,
    _LiveRefCounts,
    _WatchedEventLog,
)
from prefixcache.integrations.megatron.options import (
    _LRU,
    _OPTION_KEYS,
    _REF_ZERO,
    _installed_options,
    _policy_of,
)
from prefixcache.integrations.megatron.routing import RoutingMethods


class MegatronKVBlockAllocator(MirrorMethods, RoutingMethods):
    """Megatron-core 0.19's ``KVBlockAllocator``, run by a prefixcache allocator.

    Same constructor, attributes (present and absent per mode as in
    Megatron), dtypes, return types and results as Megatron's class; block
    IDs may differ (another free order, another eviction order among equal
    timestamps). Megatron's policy values map as ``REF_ZERO`` -> ref-zero mode
    and ``LRU`` -> the ``cached_policy`` of :func:`install` (``"lru"`` by
    default); a :class:`PrefixCachePolicy` picks any prefixcache policy.

    Methods by purpose (Megatron's): allocation (:meth:`allocate_memory_blocks`,
    :meth:`release_memory_blocks`, :meth:`is_memory_available`, :meth:`reset`),
    partitions read from the context (:meth:`get_total_used`,
    :meth:`get_active_used`, :meth:`get_paused_used`, :meth:`get_active_avail`,
    :meth:`get_paused_avail`), prefix caching (:meth:`register_kv_block_hashes`,
    :meth:`update_timestamps`, :meth:`get_evictable_block_count`,
    :meth:`evict_lru_blocks`), MoE routing (:meth:`store_routing_per_block`,
    :meth:`store_block_routing`, :meth:`get_block_routing`,
    :meth:`reconstruct_routing_from_blocks`). prefixcache's: :attr:`allocator`,
    :meth:`stats`, :meth:`take_events`, :meth:`check_consistency`.

    Megatron's allocator accepts misuse silently (a double release corrupts
    its free stack); this one raises the library's errors
    (:mod:`prefixcache.errors`) and changes nothing. Not thread-safe, as
    Megatron's.

    Args:
        context: the ``DynamicInferenceContext`` (read for the clock, the block
            size and the request tables, as Megatron's allocator reads it).
        total_count: blocks in the pool, the dummy block included.
        paused_count: blocks reserved for paused requests.
        enable_prefix_caching: Megatron's flag.
        prefix_caching_eviction_policy: Megatron's enum value or a
            :class:`PrefixCachePolicy`.
        options: prefixcache options, usually from :func:`install`:
            ``cached_policy`` and the :class:`~prefixcache.AllocatorConfig`
            fields ``engine``, ``kv_events_capacity``, ``kv_events_medium``,
            ``device``, ``hash_algo``.
    """

    def __init__(
        self,
        context: Any,
        total_count: int,
        paused_count: int,
        enable_prefix_caching: bool = False,
        prefix_caching_eviction_policy: Any = _REF_ZERO,
        **options: Any,
    ) -> None:
        settings = {**_installed_options, **options}
        cached_policy = settings.pop("cached_policy", _LRU)
        unknown = sorted(set(settings) - set(_OPTION_KEYS))
        if unknown:
            raise ConfigError(
                f"unknown options {unknown}; valid: {['cached_policy', *_OPTION_KEYS]}"
            )
        spec, caches = _policy_of(prefix_caching_eviction_policy, cached_policy)
        total_count = require_int(total_count, "total_count", minimum=2)
        paused_count = require_int(paused_count, "paused_count", minimum=0)
        if total_count - paused_count - 1 < 1:  # Megatron asserts active_count >= 1
            raise ConfigError(
                f"total_count {total_count} with paused_count {paused_count} leaves "
                f"active_count {total_count - paused_count - 1}; Megatron needs at least 1"
            )
        self.context = context
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_caching_eviction_policy = prefix_caching_eviction_policy
        self.on_blocks_deregistered: Callable[[list[int], set[int]], Any] | None = None
        self.total_count = total_count
        self.paused_count = paused_count
        self.active_count = total_count - paused_count - 1
        self.dummy_block_idx = total_count - 1
        keep_events = settings.get("kv_events_capacity", 0) > 0
        # The mirrors learn deregistrations from the event log; without prefix caching
        # nothing is registered, so no log (and no change tracking) unless events are asked.
        watch = enable_prefix_caching or keep_events
        settings.setdefault("device", "cpu")
        settings["kv_events_capacity"] = max(int(watch), settings.get("kv_events_capacity", 0))
        # Megatron bounds allocation by the whole pool and counts paused blocks from the
        # context's tables, so the backing allocator keeps every reference active.
        self.allocator = KVBlockAllocator(
            AllocatorConfig(
                total_count=total_count,
                block_size_tokens=int(getattr(context, "block_size_tokens", 16)),
                enable_prefix_caching=enable_prefix_caching,
                eviction_policy=self._eviction_policy(spec) if caches else _REF_ZERO,
                **settings,
            )
        )
        if watch:
            assert self.allocator.events is not None  # kv_events_capacity >= 1 above
            self.allocator.events = _WatchedEventLog(
                self.allocator.events, self._removed, keep_events
            )
        self._keep_events = keep_events
        self._watch = watch
        # The native engine's calls validate their arguments in C++ and raise the
        # library's errors before any change, so the hot methods call them directly
        # (the facade's checks, conversions and change hand-off cost 2-10 us a call).
        # Kept events need the facade (it records them), as does the Python engine.
        self._core: Any = None if keep_events else getattr(self.allocator._engine, "core", None)
        self._caches = enable_prefix_caching and caches
        self._is_lru = enable_prefix_caching and prefix_caching_eviction_policy == _LRU
        self._pending_removed: list[int] = []
        self._positions = torch.arange(total_count, dtype=torch.int64)
        if enable_prefix_caching:
            self._ref_counts = torch.zeros(total_count, dtype=torch.int32)  # the plain view
            self.block_ref_counts = self._ref_counts.as_subclass(_LiveRefCounts)
            self.block_ref_counts._owner = self
            self.block_hashes = torch.full((total_count,), -1, dtype=torch.int64)
            self.kv_hash_to_block_id: dict[int, int] = {}
            if self._is_lru:
                self.block_timestamps = torch.zeros(total_count, dtype=torch.int64)
                self.block_parent_id = torch.full((total_count,), -1, dtype=torch.int64)
                self.block_child_count = torch.zeros(total_count, dtype=torch.int64)
            # NumPy views sharing the mirrors' memory: this class writes through them
            # (an indexed NumPy write costs ~1 us, a torch one ~5-15 us on CPU).
            self._refs = self._ref_counts.numpy()
            self._hashes = self.block_hashes.numpy()
            if self._is_lru:
                self._stamps = self.block_timestamps.numpy()
                self._parents = self.block_parent_id.numpy()
                self._children = self.block_child_count.numpy()
        self.block_routing: dict[int, np.ndarray] = {}

    def _eviction_policy(self, spec: Any) -> Any:
        """The backing allocator's policy for a caching spec (compat mode swaps LRU's)."""
        return spec

    # ------------------------------------------------------------------ counts

    @property
    def total_avail(self) -> int:
        """Blocks on the free stack (cached blocks are not counted). O(1)."""
        return self.total_count - 1 - self.allocator.get_total_used()

    @property
    def block_bag(self) -> torch.Tensor:
        """A snapshot of Megatron's free stack: the free IDs first, ``total_avail`` of them.

        Read-only: a fresh int32 tensor (writes to it change nothing).
        Complexity: O(total_count).
        """
        ids = np.arange(self.total_count - 1)
        active, paused = self.allocator.reference_counts(ids)
        free = ((active + paused) == 0).numpy()
        if self.enable_prefix_caching:
            free &= self.block_hashes[:-1].numpy() == -1
        order = np.concatenate([ids[free], ids[~free], [self.dummy_block_idx]])
        return torch.from_numpy(order.astype(np.int32))

    def __str__(self) -> str:
        return (
            f"using: total {self.get_total_used()}/{self.total_count - 1}"
            f"; active {self.get_active_used()}/{self.active_count}"
            f"; paused {self.get_paused_used()}/{self.paused_count}"
        )

    def get_total_used(self) -> int:
        """Blocks not on the free stack (referenced or cached). O(1)."""
        return self.allocator.get_total_used()

    def _used_by_rows(self, start: int, end: int) -> int:
        context = self.context
        if not self.enable_prefix_caching:
            return int(context.request_kv_block_counts[start:end].sum().item())
        if end <= start:
            return 0
        rows = context.request_to_kv_block_ids[start:end]
        return int(torch.unique(rows[rows >= 0]).numel())

    def get_active_used(self) -> int:
        """Distinct blocks in the context's active request rows (Megatron's count)."""
        return self._used_by_rows(
            self.context.paused_request_count, self.context.total_request_count
        )

    def get_paused_used(self) -> int:
        """Distinct blocks in the context's paused request rows (Megatron's count)."""
        return self._used_by_rows(0, self.context.paused_request_count)

    def get_active_avail(self) -> int:
        """``active_count`` minus :meth:`get_active_used` (may be negative, as Megatron's)."""
        return self.active_count - self.get_active_used()

    def get_paused_avail(self) -> int:
        """``paused_count`` minus :meth:`get_paused_used`."""
        return self.paused_count - self.get_paused_used()

    # ------------------------------------------------------------------ allocation

    def is_memory_available(self, num_blocks: int, potential_matched_count: int = 0) -> bool:
        """Whether ``num_blocks`` can be allocated, free plus evictable cached blocks.

        ``potential_matched_count`` cached blocks are not counted: the caller
        pins them before allocating. Complexity: O(1).
        """
        num_blocks = require_int(num_blocks, "num_blocks")
        potential_matched_count = require_int(potential_matched_count, "potential_matched_count")
        if self.total_avail >= num_blocks:
            return True
        if not self._caches:
            return False
        evictable = self.allocator.get_evictable_block_count() - potential_matched_count
        return self.total_avail + evictable >= num_blocks

    def allocate_memory_blocks(self, num_blocks: int) -> torch.Tensor | None:
        """Hand out ``num_blocks`` blocks (reference count 1), evicting through the policy.

        Returns:
            A fresh CPU int32 tensor, or None (nothing changes) when even
            eviction cannot free enough.

        Complexity: O(num_blocks) vectorised, plus O(log n) per evicted block.
        """
        core = self._core
        if core is None:
            block_ids = self._run(self.allocator.allocate_memory_blocks, num_blocks)
            if block_ids is None:
                return None
        else:
            buffer = core.allocate(num_blocks)  # None before any change when short
            if buffer is None:
                return None
            if self._watch:
                self._drain()  # what the allocation evicted
            block_ids = (
                torch.frombuffer(buffer, dtype=torch.int32)
                if len(buffer)
                else torch.empty(0, dtype=torch.int32)
            )
        if self.enable_prefix_caching and len(block_ids):
            ids = _as_array(block_ids)
            self._refs[ids] = 1
            if self._is_lru:
                self._stamps[ids] = self.context.prefix_cache_lru_clock
        if self.block_routing:
            for block_id in block_ids.tolist():
                self.block_routing.pop(block_id, None)
        return block_ids

    def release_memory_blocks(self, blocks: torch.Tensor) -> None:
        """Drop one reference per occurrence; unreferenced hashed blocks stay cached.

        In ref-zero mode they are deregistered at once; unhashed ones go back
        to the free stack. Complexity: O(k log k) vectorised.
        """
        _require_tensor(blocks, "blocks")
        if blocks.numel() == 0:
            return
        core = self._core
        if core is None:
            self.allocator.release_memory_blocks(blocks)  # removals wait in _pending_removed
        else:
            core.release_request(blocks)
        if self.enable_prefix_caching:
            ids = _as_array(blocks)
            if self._has_duplicates(ids):  # shared prefixes freed together
                np.subtract.at(self._refs, ids, 1)
            else:
                self._refs[ids] -= 1  # ~4 us instead of ~20 us for np.subtract.at
        # Deregister after the counts drop, in the order Megatron's release does it.
        if core is not None and self._watch:
            self._drain()
        elif self._pending_removed:
            self._deregister(self._pending_removed)
            self._pending_removed = []

    def reset(self) -> None:
        """Every block free, nothing cached, routing cleared. O(total_count)."""
        self.allocator.reset()
        self._pending_removed.clear()
        if self.enable_prefix_caching:
            self._ref_counts.fill_(0)
            self.block_hashes.fill_(-1)
            self.kv_hash_to_block_id.clear()
            if self._is_lru:
                self.block_timestamps.fill_(0)
                self.block_parent_id.fill_(-1)
                self.block_child_count.fill_(0)
        self.block_routing.clear()

    # ------------------------------------------------------------------ prefix caching

    def register_kv_block_hashes(
        self,
        block_ids: list[int],
        block_hashes: list[int],
        parent_hashes: list[int] | None = None,
    ) -> None:
        """Register blocks under their hashes; ``parent_hashes[i]`` is 0 for a root.

        A run whose parents chain (each parent the hash before it) is one
        registration; a parent that is not registered starts a root, as in
        Megatron. A hash another block holds stays with that block.

        Raises:
            InvalidArgumentError: the lists differ in length.
            BlockStateError, HashConflictError: as
                :meth:`prefixcache.KVBlockAllocator.register_kv_block_hashes`.

        Complexity: O(k).
        """
        ids: list[int] = to_int_array(block_ids, "block_ids").tolist()
        hashes: list[int] = to_int_array(block_hashes, "block_hashes").tolist()
        parents: list[int] = (
            [0] * len(ids)
            if parent_hashes is None
            else to_int_array(parent_hashes, "parent_hashes").tolist()
        )
        if not self.enable_prefix_caching or not ids:
            return
        if not len(ids) == len(hashes) == len(parents):
            raise InvalidArgumentError(
                f"{len(ids)} block IDs, {len(hashes)} hashes, {len(parents)} parent hashes"
            )
        if parents[1:] == hashes[:-1]:  # one chain (what Megatron's context passes)
            self._register_run(ids, hashes, parents[0])
            return
        start = 0
        for end in range(1, len(ids) + 1):
            if end == len(ids) or parents[end] != hashes[end - 1]:
                self._register_run(ids[start:end], hashes[start:end], parents[start])
                start = end

    def _register_run(self, ids: list[int], hashes: list[int], parent: int) -> None:
        table = self.kv_hash_to_block_id
        known = parent != 0 and parent in table
        parent_id = table[parent] if known else -1
        if self._core is not None:
            holds_buffer, new_buffer = self._core.register(ids, hashes, parent if known else None)
            if np.frombuffer(new_buffer, dtype=np.bool_).all():
                self._mirror_new_chain(ids, hashes, parent_id)
                return
            holds = np.frombuffer(holds_buffer, dtype=np.bool_).tolist()
        else:
            holds = self._run(
                self.allocator.register_kv_block_hashes,
                self._to_engine(ids),
                hashes,
                parent_hash=parent if known else None,
            ).tolist()
        new_ids, new_hashes, new_parents = [], [], []
        for block_id, block_hash, held in zip(ids, hashes, holds, strict=True):
            if held and table.get(block_hash) != block_id:
                table[block_hash] = block_id
                new_ids.append(block_id)
                new_hashes.append(block_hash)
                new_parents.append(parent_id)
            parent_id = table.get(block_hash, -1)
        if not new_ids:
            return
        self._hashes[new_ids] = new_hashes
        if self._is_lru:
            self._parents[new_ids] = new_parents
            np.add.at(self._children, [p for p in new_parents if p >= 0], 1)

    def _mirror_new_chain(self, ids: list[int], hashes: list[int], parent_id: int) -> None:
        """Mirror a run that the engine registered whole: block ``i``'s parent is block ``i-1``."""
        self.kv_hash_to_block_id.update(zip(hashes, ids, strict=True))
        self._hashes[ids] = hashes
        if self._is_lru:
            parents = [parent_id, *ids[:-1]]
            self._parents[ids] = parents
            # Distinct parents (fresh blocks and the run's parent): a plain indexed add.
            with_parent = parents if parent_id >= 0 else parents[1:]
            self._children[with_parent] += 1

    def update_timestamps(self, block_ids: torch.Tensor) -> None:
        """Mark blocks used at the context's clock (LRU mode; a no-op otherwise).

        Complexity: O(k) vectorised, plus O(log n) per touched cached leaf.
        """
        _require_tensor(block_ids, "block_ids")
        if not self._is_lru or block_ids.numel() == 0:
            return
        if self._core is None:
            self._run(self.allocator.update_timestamps, block_ids)
        else:
            self._core.touch(block_ids)  # deregisters nothing
        self._stamps[_as_array(block_ids)] = self.context.prefix_cache_lru_clock

    def get_evictable_block_count(self) -> torch.Tensor:
        """Cached blocks (reference count 0, hash set), as a 0-d int64 tensor. O(1)."""
        return torch.tensor(self.allocator.get_evictable_block_count(), dtype=torch.int64)

    def evict_lru_blocks(self, num_blocks_needed: int) -> bool:
        """Evict ``num_blocks_needed`` cached blocks through the policy, all or none.

        Leaves only, so a cached child never outlives its parent.
        Complexity: O(log n) per evicted block (Megatron's scans the pool).
        """
        if require_int(num_blocks_needed, "num_blocks_needed") <= 0:
            return True
        return bool(self._run(self.allocator.evict_lru_blocks, num_blocks_needed))

    # ------------------------------------------------------------------ prefixcache extras

    def stats(self) -> AllocatorStats:
        """The backing allocator's statistics (evictions, hits by acquire, clock). O(1)."""
        return self.allocator.stats()

    def take_events(self) -> list[KVCacheEvent]:
        """Drain the KV cache events (vLLM's format); needs ``kv_events_capacity`` > 0.

        Raises:
            ConfigError: events were not enabled.
        """
        if not self._keep_events:
            raise ConfigError("KV cache events are off; install(kv_events_capacity=N) with N > 0")
        return self.allocator.take_events()


def _require_tensor(value: object, name: str) -> None:
    """Megatron passes block IDs as tensors; anything else is refused before any change."""
    if not isinstance(value, torch.Tensor):
        raise InvalidTensorError(
            f"{name} must be a tensor of block IDs, got {type(value).__name__}"
        )
