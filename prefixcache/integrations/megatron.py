"""Megatron-core drop-in: prefixcache's allocator behind Megatron's ``KVBlockAllocator``.

Megatron-core 0.19's ``DynamicInferenceContext`` builds its allocator as
``KVBlockAllocator(context=..., total_count=..., paused_count=...,
enable_prefix_caching=..., prefix_caching_eviction_policy=...)`` and then
reads and writes the allocator's state directly: plain attributes
(``total_avail``, ``active_count``, ``paused_count``, ``dummy_block_idx``),
in prefix-caching modes the live CPU tensors ``block_ref_counts`` (int32),
``block_hashes`` (int64) and, in LRU mode, ``block_timestamps``,
``block_parent_id``, ``block_child_count`` (int64), the dict
``kv_hash_to_block_id`` and the ``on_blocks_deregistered`` callback that the
Mamba slot allocator sets. :class:`MegatronKVBlockAllocator` has that surface,
attribute by attribute and method by method (the table, and what is not
covered and why: DESIGN.md, "Megatron-core drop-in"), and runs every state change
through a :class:`~prefixcache.KVBlockAllocator` (O(log n) eviction instead
of Megatron's scan of the whole pool, every prefixcache policy, KV events,
statistics). :func:`install` makes Megatron's modules build it; :func:`attach`
switches one existing context.

Who owns what (DESIGN.md, "Megatron-core drop-in"): the prefixcache
allocator is authoritative. The tensors and the dict are mirrors that this
class updates after every call it makes, so Megatron reads exactly what it
would read from its own allocator. The one place Megatron's context writes
the allocator's state itself, ``block_ref_counts[ids] += 1`` when it pins
matched blocks (and ``-= 1`` when it rolls the pin back), goes through
``block_ref_counts.__setitem__``, which this class intercepts and turns into
``acquire_blocks`` / ``release_memory_blocks``; a write the allocator refuses
is undone on the tensor and raised. Other in-place tensor methods on these
mirrors (``fill_``, ``add_``, writes through a slice view) are not seen, and
Megatron's callers use none of them.

On the native engine the hot calls (allocate, release, touch, register, a pin
of distinct IDs) go to the compiled engine directly, which validates them and
raises the library's errors before any change; what it deregistered is read
back with its ``take_changes`` (DESIGN.md, "Megatron-core drop-in"). With KV
events on, or on the Python engine, every call goes through the facade.

Megatron is imported lazily (only :func:`install`, :func:`attach` and the
default policy names need it), so this module imports without it.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from prefixcache.engine.allocator import KVBlockAllocator
from prefixcache.engine.config import AllocatorConfig, PolicySpec
from prefixcache.engine.events import KVCacheEvent, KVEventLog
from prefixcache.engine.stats import AllocatorStats
from prefixcache.engine.validation import require_int
from prefixcache.errors import ConfigError, InvalidArgumentError, InvariantError

SUPPORTED_VERSIONS = ("0.19.",)
"""megatron-core versions (prefixes) whose allocator surface this module reproduces."""

_LRU, _REF_ZERO = "lru", "ref_zero"
_OPTION_KEYS = ("engine", "kv_events_capacity", "kv_events_medium", "device", "hash_algo")


class PrefixCachePolicy(str):
    """A Megatron ``prefix_caching_eviction_policy`` value that names a prefixcache policy.

    It equals ``"lru"`` as a string, so it equals Megatron's
    ``PrefixCachingEvictionPolicy.LRU`` (a ``str`` enum) and every check in
    Megatron's context takes its caching path; the drop-in reads
    :attr:`spec` and runs that policy instead of LRU.

    >>> choice = PrefixCachePolicy("s3fifo")
    >>> choice == "lru", choice.spec
    (True, 's3fifo')

    Args:
        spec: a prefixcache policy name, ``{"name": ..., **kwargs}`` or policy object.
    """

    spec: PolicySpec

    def __new__(cls, spec: PolicySpec) -> PrefixCachePolicy:
        if isinstance(spec, str) and spec == _REF_ZERO:
            raise ConfigError("use Megatron's PrefixCachingEvictionPolicy.REF_ZERO for ref-zero")
        choice = super().__new__(cls, _LRU)
        choice.spec = spec
        return choice

    def __repr__(self) -> str:
        return f"PrefixCachePolicy({self.spec!r})"


def _policy_of(value: object, default_cached: PolicySpec) -> tuple[PolicySpec, bool]:
    """``(prefixcache policy spec, caches unreferenced blocks)`` for a Megatron policy value."""
    if isinstance(value, PrefixCachePolicy):
        return value.spec, True
    if value == _REF_ZERO:
        return _REF_ZERO, False
    if value == _LRU:
        return default_cached, True
    raise ConfigError(
        f"prefix_caching_eviction_policy must be Megatron's REF_ZERO or LRU, or a "
        f"PrefixCachePolicy, got {value!r}"
    )


class _LiveRefCounts(torch.Tensor):
    """``block_ref_counts``: an int32 CPU tensor whose subscript writes reach the allocator."""

    # Results of operations are plain tensors, so only this tensor intercepts writes.
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]
    _owner: MegatronKVBlockAllocator

    def __getitem__(self, index: Any) -> torch.Tensor:
        # A copy: ``t[i] += k`` reads t[i], adds in place, then assigns. A view would take
        # the addition into the mirror before __setitem__ saw it (no delta, the allocator
        # never told); with a copy the assignment carries the change.
        return torch.Tensor.__getitem__(self, index).clone()

    def __setitem__(self, index: Any, value: Any) -> None:
        self._owner._write_ref_counts(index, value)


class _WatchedEventLog(KVEventLog):
    """The facade's event log, which also tells the drop-in which hashes lost their block."""

    def __init__(self, log: KVEventLog, on_removed: Callable[[list[int]], None], keep: bool):
        super().__init__(log.capacity, log.block_size, log.medium)
        self._on_removed = on_removed
        self._keep = keep

    def record_stored(self, *args: Any, **kwargs: Any) -> None:
        if self._keep:
            super().record_stored(*args, **kwargs)

    def record_removed(self, block_hashes: list[int]) -> None:
        self._on_removed(block_hashes)
        if self._keep:
            super().record_removed(block_hashes)

    def record_cleared(self) -> None:
        if self._keep:
            super().record_cleared()


class MegatronKVBlockAllocator:
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
                eviction_policy=spec if caches else _REF_ZERO,
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
        if not self.enable_prefix_caching or not block_ids:
            return
        ids, hashes = list(map(int, block_ids)), list(map(int, block_hashes))
        parents = [0] * len(ids) if parent_hashes is None else list(map(int, parent_hashes))
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
                ids,
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
        if num_blocks_needed <= 0:
            return True
        return bool(self._run(self.allocator.evict_lru_blocks, num_blocks_needed))

    # ------------------------------------------------------------------ mirrors

    def _run(self, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Call the allocator, then drop what it deregistered from the mirrors."""
        try:
            return method(*args, **kwargs)
        finally:
            if self._pending_removed:
                self._deregister(self._pending_removed)
                self._pending_removed = []

    def _drain(self) -> None:
        """Mirror what the native engine deregistered since the last call (fast paths)."""
        removed = self._core.take_changes()[1]
        if removed:
            self._deregister(removed)

    def _removed(self, block_hashes: list[int]) -> None:
        self._pending_removed.extend(block_hashes)

    def _deregister(self, removed: list[int]) -> None:
        """Mirror the allocator's deregistration of ``removed`` hashes, as Megatron orders it."""
        block_ids = [self.kv_hash_to_block_id.pop(h) for h in removed]
        if self.on_blocks_deregistered is not None:
            self.on_blocks_deregistered(list(block_ids), set(removed))
        ids = np.array(block_ids, dtype=np.int64)
        if self._is_lru:
            parents = self._parents[ids]
            np.subtract.at(self._children, parents[parents >= 0], 1)
            self._parents[ids] = -1
            self._children[ids] = 0
            self._stamps[ids] = 0
        self._hashes[ids] = -1

    def _write_ref_counts(self, index: Any, value: Any) -> None:
        """Apply a caller's ``block_ref_counts[index] = value`` as references taken or dropped."""
        refs = self._refs
        if self._core is not None and self._pinned_by_one(index, value):
            return
        if isinstance(index, torch.Tensor) and index.dim() == 1 and not index.is_floating_point():
            touched = np.unique(_as_array(index))  # Megatron's case: a vector of block IDs
        else:
            touched = np.unique(self._positions[index].reshape(-1).numpy())
        before = refs[touched]  # a copy (fancy indexing)
        self._ref_counts[index] = value
        delta = refs[touched].astype(np.int64) - before
        # np.repeat: torch.repeat_interleave takes ~15 ms per call on CPU in torch 2.13.
        taken = np.repeat(touched, np.maximum(delta, 0))
        dropped = np.repeat(touched, np.maximum(-delta, 0))
        try:
            if taken.size:
                self._run(self.allocator.acquire_blocks, taken)
        except Exception:
            refs[touched] = before
            raise
        try:
            if dropped.size:
                self._run(self.allocator.release_memory_blocks, dropped)
        except Exception:
            refs[touched] = before
            if taken.size:
                self._run(self.allocator.release_memory_blocks, taken)
            raise

    def _pinned_by_one(self, index: Any, value: Any) -> bool:
        """Apply Megatron's ``refs[ids] += 1`` (or ``-= 1``) on distinct IDs; False if not that.

        The native engine validates the IDs and references before any change,
        so the mirror is written only after it accepted the pin or release.
        """
        if not (
            isinstance(index, torch.Tensor)
            and isinstance(value, torch.Tensor)
            and index.dim() == 1
            and index.is_cpu
            and value.is_cpu
            and value.shape == index.shape
            and not index.is_floating_point()
            and index.dtype != torch.bool
        ):
            return False
        ids, new = _as_array(index), value.numpy()
        if len(ids) == 0 or self._has_duplicates(ids):
            return False
        delta = new - self._refs[ids]
        if (delta == 1).all():
            self._core.acquire(ids)
            self._refs[ids] = new
        elif (delta == -1).all():
            self._core.release_request(ids)
            self._refs[ids] = new
            self._drain()  # ref-zero mode deregisters here; the counts are already down
        else:
            return False
        return True

    @staticmethod
    def _has_duplicates(ids: np.ndarray) -> bool:
        """Whether ``ids`` repeats an ID: a sorted copy, neighbours compared.

        ~3 us for 128 IDs; ``np.unique`` costs ~20 us, and marking a
        pool-sized scratch array costs cache misses at 65,536 blocks.
        """
        ordered = ids.copy()
        ordered.sort()
        return bool((ordered[1:] == ordered[:-1]).any())

    def check_consistency(self) -> None:
        """Raise InvariantError unless every mirror equals the allocator's state.

        For tests and debugging. Complexity: O(total_count).
        """
        self.allocator.check_invariants()
        if not self.enable_prefix_caching:
            return
        ids = np.arange(self.total_count - 1)
        active, paused = self.allocator.reference_counts(ids)
        problems = []
        if not torch.equal(self._ref_counts[:-1], active + paused):
            problems.append("block_ref_counts differ from the allocator's references")
        held = self.kv_hash_to_block_id
        if len(held) != self.allocator.stats().num_registered or not all(
            self.allocator.is_hash_registered(block_hash) for block_hash in held
        ):
            problems.append("kv_hash_to_block_id differs from the allocator's registry")
        hashes = torch.full((self.total_count,), -1, dtype=torch.int64)
        hashes[list(held.values())] = torch.tensor(list(held), dtype=torch.int64)
        if not torch.equal(hashes, self.block_hashes):
            problems.append("block_hashes differ from kv_hash_to_block_id")
        if problems:
            raise InvariantError("; ".join(problems))

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

    # ------------------------------------------------------------------ MoE routing

    def store_routing_per_block(self, flat_routing: np.ndarray | None) -> None:
        """Scatter ``[active_token_count, layers, top_k]`` routing into per-block storage."""
        context = self.context
        num_tokens = context.active_token_count
        if flat_routing is None or num_tokens == 0:
            return
        if flat_routing.shape[0] != num_tokens:
            raise InvalidArgumentError(
                f"routing has {flat_routing.shape[0]} tokens, the context {num_tokens}"
            )
        block_ids = context.token_to_block_idx[:num_tokens].cpu().numpy()
        positions = context.token_to_local_position_within_kv_block[:num_tokens].cpu().numpy()
        for block_id in np.unique(block_ids).tolist():
            if block_id != self.dummy_block_idx:
                rows = block_ids == block_id
                self.store_block_routing(block_id, positions[rows], flat_routing[rows])

    def store_block_routing(
        self, block_id: int, positions: np.ndarray, routing: np.ndarray
    ) -> None:
        """Store routing ``[len(positions), layers, top_k]`` at ``positions`` of ``block_id``."""
        if block_id not in self.block_routing:
            shape = (self.context.block_size_tokens, routing.shape[-2], routing.shape[-1])
            self.block_routing[block_id] = np.zeros(shape, dtype=routing.dtype)
        self.block_routing[block_id][positions] = routing

    def get_block_routing(self, block_id: int) -> np.ndarray | None:
        """The routing stored for ``block_id``, or None."""
        return self.block_routing.get(block_id)

    def reconstruct_routing_from_blocks(
        self, block_ids: list[int], total_routing_tokens: int
    ) -> np.ndarray | None:
        """The first ``total_routing_tokens`` routing rows of ``block_ids``, or None if missing."""
        parts, collected = [], 0
        for block_id in block_ids:
            routing = self.get_block_routing(block_id)
            if routing is None:
                return None
            if collected >= total_routing_tokens:
                break
            take = min(self.context.block_size_tokens, total_routing_tokens - collected)
            parts.append(routing[:take])
            collected += take
        if not parts or collected != total_routing_tokens:
            return None
        return np.concatenate(parts, axis=0)


def _as_array(block_ids: Any) -> np.ndarray:
    """Block IDs as an intp NumPy array, for indexing the mirrors.

    intp because NumPy converts any other index dtype on every fancy index
    (an int32 index costs ~3 us more per write). A CPU tensor of int64 IDs
    shares its memory.
    """
    if isinstance(block_ids, torch.Tensor):  # integer tensors never require grad
        block_ids = (block_ids if block_ids.is_cpu else block_ids.cpu()).numpy()
    return np.asarray(block_ids).astype(np.intp, copy=False)


# ---------------------------------------------------------------------- switching

_installed_options: dict[str, Any] = {}
_replaced: list[tuple[Any, Any]] = []


def check_version() -> str:
    """The installed megatron-core version; ConfigError unless this module supports it."""
    try:
        version = importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError as exc:
        raise ConfigError("megatron-core is not installed") from exc
    if not version.startswith(SUPPORTED_VERSIONS):
        supported = ", ".join(prefix + "x" for prefix in SUPPORTED_VERSIONS)
        raise ConfigError(
            f"prefixcache's Megatron drop-in supports megatron-core {supported}; found {version}"
        )
    return version


def install(**options: Any) -> None:
    """Make every loaded Megatron module that bound ``KVBlockAllocator`` build the drop-in.

    Call it before building a ``DynamicInferenceContext``. ``options`` become
    the drop-in's defaults (``cached_policy``, ``engine``,
    ``kv_events_capacity``, ``kv_events_medium``, ``device``, ``hash_algo``).
    Calling it again replaces the options. Undo with :func:`uninstall`.

    Raises:
        ConfigError: megatron-core is missing or not a supported version, or
            an option is unknown.
    """
    check_version()
    unknown = sorted(set(options) - {"cached_policy", *_OPTION_KEYS})
    if unknown:
        raise ConfigError(f"unknown options {unknown}; valid: {['cached_policy', *_OPTION_KEYS]}")
    _installed_options.clear()
    _installed_options.update(options)
    defining = importlib.import_module("megatron.core.inference.contexts.kv_block_allocator")
    original = defining.KVBlockAllocator
    if original is MegatronKVBlockAllocator:  # installed already: find what was replaced
        original = _replaced[0][1]
    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("megatron") and (
            getattr(module, "KVBlockAllocator", None) is original
        ):
            _replaced.append((module, original))
            setattr(module, "KVBlockAllocator", MegatronKVBlockAllocator)  # noqa: B010


def uninstall() -> None:
    """Put Megatron's own ``KVBlockAllocator`` back everywhere :func:`install` replaced it."""
    while _replaced:
        module, original = _replaced.pop()
        setattr(module, "KVBlockAllocator", original)  # noqa: B010
    _installed_options.clear()


@contextmanager
def installed(**options: Any) -> Iterator[None]:
    """:func:`install` for the ``with`` block, then :func:`uninstall`."""
    install(**options)
    try:
        yield
    finally:
        uninstall()


def attach(context: Any, **options: Any) -> MegatronKVBlockAllocator:
    """Switch one existing context to the drop-in, keeping its sizes, mode and callback.

    Raises:
        ConfigError: the context's allocator holds blocks (switch before serving).
    """
    old = context.kv_block_allocator
    if old.get_total_used():
        raise ConfigError(f"the context's allocator holds {old.get_total_used()} blocks")
    new = MegatronKVBlockAllocator(
        context,
        total_count=old.total_count,
        paused_count=old.paused_count,
        enable_prefix_caching=old.enable_prefix_caching,
        prefix_caching_eviction_policy=old.prefix_caching_eviction_policy,
        **options,
    )
    new.on_blocks_deregistered = old.on_blocks_deregistered
    context.kv_block_allocator = new
    return new
