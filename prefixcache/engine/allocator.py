"""KVBlockAllocator: the facade over the engine, with Megatron-core's method names."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from prefixcache.engine.block_ids import (
    BlockIdsLike,
    to_block_ids,
    to_tensor,
)
from prefixcache.engine.clock_methods import ClockMethods, check_count
from prefixcache.engine.config import AllocatorConfig, build_policy
from prefixcache.engine.core import EngineCore
from prefixcache.engine.defragment_methods import DefragmentMethods
from prefixcache.engine.device_mirror import DeviceMirrorMethods, FreeIdsMirror
from prefixcache.engine.events import KVEventLog
from prefixcache.engine.hint_methods import HintMethods
from prefixcache.engine.introspection_methods import IntrospectionMethods
from prefixcache.engine.kv_event_methods import KVEventMethods
from prefixcache.engine.moe_routing import MoERoutingMethods
from prefixcache.engine.partition_methods import PartitionMethods
from prefixcache.engine.pins import room_beside
from prefixcache.engine.pool import resolve_device
from prefixcache.engine.prefix_hashing import (
    PrefixHashingMethods,
    max_hash_of,
)
from prefixcache.engine.prefix_reuse_methods import PrefixReuseMethods
from prefixcache.engine.request_path import RequestPathMethods
from prefixcache.engine.routing import RoutingStore
from prefixcache.engine.selection import build_engine
from prefixcache.engine.sessions import SessionMethods
from prefixcache.engine.validation import require_flag
from prefixcache.errors import (
    ConfigError,
)
from prefixcache.policies import EvictionPolicy

_NO_PINNED_HITS = np.empty(0, dtype=np.int32)


class KVBlockAllocator(
    HintMethods,  # first: its members override the other mixins' stubs
    PrefixReuseMethods,
    PrefixHashingMethods,
    KVEventMethods,
    MoERoutingMethods,
    RequestPathMethods,
    DefragmentMethods,
    PartitionMethods,
    ClockMethods,
    SessionMethods,
    DeviceMirrorMethods,
    IntrospectionMethods,
):
    """Hands out KV-cache block IDs, counts references, and shares cached prefixes.

    Every usable block is in exactly one state: free (on the pool's stack),
    active (held by at least one running request), paused (held only by
    paused requests) or cached (held by nobody, registered under its hash,
    evictable). See DESIGN.md "Block life cycle".

    This class is a facade (DESIGN.md, "The engine seam"): it validates
    arguments, runs the features that are not hot (KV events, MoE routing,
    fingerprints, retention priorities) and delegates every state change to
    an engine (:class:`~prefixcache.engine.core.EngineCore`), the Python
    reference or the native one (:attr:`engine`).

    Methods by purpose:

    - Allocation: :meth:`allocate_memory_blocks`, :meth:`release_memory_blocks`,
      :meth:`is_memory_available`, :meth:`free_group`.
    - One call per request: :meth:`admit_request`, :meth:`release_request`.
    - Prefix reuse: :meth:`hash_tokens`, :meth:`match_prefix`,
      :meth:`acquire_blocks`, :meth:`register_kv_block_hashes`.
    - Partitions: :meth:`pause`, :meth:`resume`, :meth:`get_total_used`,
      :meth:`get_active_used`, :meth:`get_paused_used`, :meth:`get_active_avail`,
      :meth:`get_paused_avail`, :meth:`get_evictable_block_count`.
    - Eviction and time: :meth:`update_timestamps`, :meth:`advance_clock`,
      :meth:`evict_cached_blocks`, :meth:`evict_lru_blocks`, :meth:`evict_blocks`.
    - Scheduler hints: :meth:`hint_upcoming`, :meth:`withdraw_hint`,
      :meth:`set_hint_limit`, :meth:`end_conversation` (DESIGN.md, "Scheduler hints").
    - MoE routing: :meth:`store_routing_per_block`, :meth:`store_block_routing`,
      :meth:`get_block_routing`, :meth:`reconstruct_routing_from_blocks`.
    - Introspection: :meth:`stats`, :meth:`check_invariants`, :meth:`reset`,
      :attr:`engine` and :attr:`engine_reason`.
    - Device: :meth:`device_free_ids` (the free IDs mirrored on ``device``).

    Block IDs go in as a CPU integer tensor, numpy array or sequence of ints
    and come out as a fresh CPU int32 tensor; nothing waits for the device.
    Every method either completes or raises a
    :class:`~prefixcache.errors.PrefixCacheError` and leaves the allocator
    exactly as it was.

    Not thread-safe: one scheduler thread owns an allocator.

    Args:
        config: an :class:`AllocatorConfig`; or pass its fields as keywords.
    """

    def __init__(self, config: AllocatorConfig | None = None, **kwargs: Any) -> None:
        if config is None:
            config = AllocatorConfig(**kwargs)
        elif kwargs:
            raise ConfigError("pass either an AllocatorConfig or keyword arguments, not both")
        elif not isinstance(config, AllocatorConfig):
            raise ConfigError(f"config must be an AllocatorConfig, got {type(config).__name__}")
        self.config = config
        self.policy: EvictionPolicy = build_policy(config.eviction_policy)
        self.total_count = config.total_count
        # Where device mirrors and block tables live; resolved once (None: CUDA if available).
        self.device = resolve_device(config.device)
        self.num_usable = config.total_count - 1
        self.dummy_block_id = self.num_usable
        self.paused_count = config.paused_count
        self.active_count = self.num_usable - config.paused_count
        self.block_size_tokens = config.block_size_tokens
        self.enable_prefix_caching = config.enable_prefix_caching
        self.routing: RoutingStore | None = None
        if config.routing_num_layers is not None and config.routing_top_k is not None:
            self.routing = RoutingStore(
                config.total_count,
                config.block_size_tokens,
                config.routing_num_layers,
                config.routing_top_k,
                config.routing_num_experts,
            )
        self.events: KVEventLog | None = None
        if config.kv_events_capacity:
            self.events = KVEventLog(
                config.kv_events_capacity, config.block_size_tokens, config.kv_events_medium
            )
        self._track_changes = self.routing is not None or self.events is not None
        self._engine: EngineCore
        self._engine, self._engine_reason = build_engine(
            config, self.policy, track_changes=self._track_changes
        )
        self._free_ids_mirror = FreeIdsMirror(self.num_usable, self.device)
        self.verify_prefix_hits = config.verify_prefix_hits
        self._max_hash = max_hash_of(config.hash_algo)
        # Second fingerprint of each registered block (verify mode), by block ID.
        self._fingerprint_of_block: list[int] = [0] * config.total_count
        self._num_rejected = 0
        self._layout_epoch = 0  # bumped by reset and relocation (sessions check it)
        self._num_queried_tokens = 0  # vLLM's prefix_cache_queries, in tokens
        self._num_hit_tokens = 0  # vLLM's prefix_cache_hits, in tokens
        self._num_preempted_queried_tokens = 0  # vLLM's preempted_queries, in tokens
        self._num_preempted_hit_tokens = 0  # vLLM's preempted_hits, in tokens
        self._init_hints()
        self._bind_request_path()

    def _sync_collaborators(self) -> None:
        """Give the collaborators what the engine freed and deregistered in the last call."""
        freed, removed = self._engine.take_changes()
        if self.routing is not None and len(freed):
            self.routing.clear(freed.astype(np.intp))
        if self.events is not None and removed:
            self.events.record_removed(removed)

    # ------------------------------------------------------------------ allocation

    def is_memory_available(self, num_blocks: int) -> bool:
        """Whether :meth:`allocate_memory_blocks` can hand out ``num_blocks`` now.

        Counts free blocks plus cached ones (every cached block is evictable),
        and the blocks only scheduler hints hold (they would be yielded).
        Complexity: O(1); O(pool) when short and hints are held.

        Raises:
            InvalidArgumentError: ``num_blocks`` is not a non-negative int.
        """
        engine = self._engine
        needed = check_count(num_blocks)
        room = room_beside(engine, needed, _NO_PINNED_HITS, 0)
        return needed <= room or (needed <= room + self._hint_room() and not self._group_depth)

    def allocate_memory_blocks(self, num_blocks: int) -> torch.Tensor | None:
        """Hand out ``num_blocks`` fresh blocks, each with one active reference.

        Evicts cached blocks through the policy when the free stack is short.
        Fresh blocks carry no hash and no routing.

        Args:
            num_blocks: how many blocks, >= 0.

        Returns:
            A fresh CPU int32 tensor of distinct IDs, or ``None`` (and nothing
            changes) when even eviction cannot free enough. Scheduler hints
            are withdrawn, newest first, when that makes room.

        Raises:
            InvalidArgumentError: ``num_blocks`` is not a non-negative int.

        Complexity: O(num_blocks) vectorised, plus O(log n) per evicted block.
        """
        num_blocks = check_count(num_blocks)
        block_ids = self._engine.allocate(num_blocks)
        if block_ids is None and self._yield_hints(num_blocks):
            block_ids = self._engine.allocate(num_blocks)
        if block_ids is None:
            return None
        if self._track_changes:
            self._sync_collaborators()
            if self.routing is not None:
                self.routing.clear(block_ids.astype(np.intp))
        return to_tensor(block_ids)

    def release_memory_blocks(self, block_ids: BlockIdsLike, *, paused: bool = False) -> None:
        """Drop one reference per occurrence of each ID.

        An ID listed twice drops two references (batched frees of requests
        that share a prefix do this). A block left with no reference becomes
        cached if it carries a hash and unreferenced blocks are cached, else
        free. Inside :meth:`free_group` the release is checked now and
        applied when the group closes.

        Args:
            block_ids: the IDs, duplicates allowed.
            paused: drop references of the paused partition instead of active.

        Raises:
            InvalidTensorError, InvalidBlockIdError: malformed IDs, the dummy block.
            ReferenceCountError: a block holds fewer references than released
                (double free, or a free block).
            InvalidArgumentError: ``paused`` is not a bool.

        Complexity: O(k log k) vectorised, plus O(1) policy work per new cached leaf.
        """
        is_paused = require_flag(paused, "paused")
        ids = to_block_ids(block_ids, self.num_usable)
        if ids.size == 0:
            return
        self._engine.release(ids, paused=is_paused)
        if self._track_changes:
            self._sync_collaborators()

    @contextmanager
    def free_group(self) -> Iterator[None]:
        """Batch the active releases made inside the block into one release at exit.

        Each release is validated when it is called (so errors point at the
        bad call) and applied when the outermost group exits, also when the
        block raises, as SGLang's ``free_group_begin/end``. Groups nest.

        >>> allocator = KVBlockAllocator(total_count=8, device="cpu")
        >>> a, b = allocator.allocate_memory_blocks(2), allocator.allocate_memory_blocks(1)
        >>> with allocator.free_group():
        ...     allocator.release_memory_blocks(a)
        ...     allocator.release_memory_blocks(b)
        >>> allocator.get_total_used()
        0
        """
        self._engine.open_group()
        self._group_depth += 1
        try:
            yield
        finally:
            self._group_depth -= 1
            try:
                self._engine.close_group()
            finally:
                if self._track_changes:
                    self._sync_collaborators()

    # ------------------------------------------------------------------ introspection

    def reset(self) -> None:
        """Return to the state just after construction: every block free, nothing cached.

        Queued releases of an open free group and scheduler hints (keys too) are
        dropped. Statistics restart.
        Complexity: O(total_count).
        """
        self._engine.reset()
        self._clear_hints()
        self._layout_epoch += 1
        if self.routing is not None:
            self.routing.clear_all()
        self._num_rejected = 0
        self._num_queried_tokens = self._num_hit_tokens = 0
        self._num_preempted_queried_tokens = self._num_preempted_hit_tokens = 0
        if self.events is not None:
            self.events.record_cleared()

    def __str__(self) -> str:
        engine = self._engine
        return (
            f"using: total {self.get_total_used()}/{self.num_usable}"
            f"; active {engine.num_active}/{self.active_count}"
            f"; paused {engine.num_paused}/{self.paused_count}"
            f"; cached {engine.num_cached}"
        )

    def __repr__(self) -> str:
        return (
            f"KVBlockAllocator(total_count={self.total_count}, policy={type(self.policy).__name__})"
        )
