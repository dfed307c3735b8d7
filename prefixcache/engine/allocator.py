"""KVBlockAllocator: the facade over the engine, with Megatron-core's method names."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from prefixcache.engine.block_ids import (
    EMPTY_IDS,
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
from prefixcache.engine.pool import resolve_device
from prefixcache.engine.prefix_hashing import (
    PrefixHashingMethods,
    max_hash_of,
    to_hash,
    to_hash_list,
)
from prefixcache.engine.registration import new_runs
from prefixcache.engine.request_path import RequestPathMethods
from prefixcache.engine.routing import RoutingStore
from prefixcache.engine.selection import build_engine
from prefixcache.engine.sessions import SessionMethods
from prefixcache.engine.validation import require_flag, require_int
from prefixcache.errors import (
    BlockStateError,
    ConfigError,
    InvalidArgumentError,
)
from prefixcache.policies import EvictionPolicy

_SENTINEL_HASHES = (0, -1)


class KVBlockAllocator(
    HintMethods,  # first: its members override the other mixins' stubs
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
      :meth:`evict_cached_blocks`, :meth:`evict_lru_blocks`.
    - Scheduler hints: :meth:`hint_upcoming`, :meth:`withdraw_hint`,
      :meth:`set_hint_limit` (DESIGN.md, "Scheduler hints").
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
        room = engine.num_free + engine.num_cached
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

    # ------------------------------------------------------------------ prefix reuse

    def match_prefix(
        self,
        block_hashes: Any,
        *,
        acquire: bool = False,
        fingerprints: Any = None,
        num_tokens: int | None = None,
        resumed: bool = False,
    ) -> torch.Tensor:
        """IDs of the blocks holding the longest registered prefix of ``block_hashes``.

        Args:
            block_hashes: chained hashes of a prompt's full blocks, in order
                (a sequence of ints, or a 1-D integer tensor/array).
            acquire: also take one active reference on every matched block,
                atomically, so eviction cannot take them before the caller
                allocates the rest.
            fingerprints: in verify mode, the query's fingerprints
                (:meth:`fingerprint_tokens`); the match stops at the first
                block whose stored fingerprint differs. Ignored otherwise.
            num_tokens: the prompt's length in tokens, for the token hit
                counters (``stats().num_queried_tokens``, vLLM's
                ``prefix_cache_queries``): at least ``len(block_hashes) *
                block_size_tokens``; None counts the full blocks only.
            resumed: the request was preempted and comes back: its own blocks are
                no cache hit, so the tokens count in the preempted counters
                (``stats().num_preempted_queried_tokens`` / ``..._hit_tokens``).

        Returns:
            A fresh CPU int32 tensor, possibly empty.

        Raises:
            InvalidTensorError, InvalidArgumentError: malformed hashes or
                fingerprints, ``acquire`` not a bool, or ``num_tokens`` fewer
                than the hashed blocks' tokens.

        Complexity: O(matched blocks) dict lookups, plus vectorised reference updates.
        """
        is_acquire = require_flag(acquire, "acquire")
        is_resumed = require_flag(resumed, "resumed")
        hashes = to_hash_list(block_hashes, "block_hashes", self._max_hash)
        checks = self._fingerprint_list(fingerprints, len(hashes))
        full_tokens = len(hashes) * self.block_size_tokens
        if num_tokens is not None:
            full_tokens = require_int(num_tokens, "num_tokens", minimum=full_tokens)
        if not self.enable_prefix_caching:
            return to_tensor(EMPTY_IDS.copy())
        matched = self._engine.lookup(hashes)
        if checks is not None:
            matched = self._verified_prefix(matched, checks)
        self._engine.take_hit(matched, len(hashes), acquire=is_acquire)
        if is_resumed:
            self._num_preempted_queried_tokens += full_tokens
            self._num_preempted_hit_tokens += len(matched) * self.block_size_tokens
        else:
            self._count_prefix_tokens(full_tokens, len(matched))
        return to_tensor(matched.astype(np.int32))

    def _count_prefix_tokens(self, num_tokens: int, num_hit_blocks: int) -> None:
        """Count a prefix query of ``num_tokens`` prompt tokens that hit ``num_hit_blocks``."""
        self._num_queried_tokens += num_tokens
        self._num_hit_tokens += num_hit_blocks * self.block_size_tokens

    def is_hash_registered(self, block_hash: int) -> bool:
        """Whether some block holds ``block_hash`` now (a chain can continue from it).

        A registered hash can disappear while its request still runs: evicting
        a pinned cached ancestor, or a ref-zero release of a shared prefix,
        drops the hashes below it. A caller that continues a chain with
        ``parent_hash`` asks here first and re-registers from the root if not.

        Raises:
            InvalidArgumentError: ``block_hash`` is not an int, or outside the
                hash range (signed 64 bits; wider for ``xxh3_128``/``sha256``).

        Complexity: O(1).
        """
        return self._engine.block_of(to_hash(block_hash, "block_hash", self._max_hash)) is not None

    def acquire_blocks(self, block_ids: BlockIdsLike) -> None:
        """Take one active reference per occurrence on cached or referenced blocks.

        Raises:
            InvalidTensorError, InvalidBlockIdError: malformed IDs.
            BlockStateError: a block is free (neither cached nor referenced).

        Complexity: O(k log k) vectorised.
        """
        ids = to_block_ids(block_ids, self.num_usable)
        if ids.size:
            self._engine.acquire(ids)

    def register_kv_block_hashes(
        self,
        block_ids: BlockIdsLike,
        block_hashes: Any,
        *,
        parent_hash: int | None = None,
        token_ids: Any = None,
        lora_name: str | None = None,
        fingerprints: Any = None,
    ) -> torch.Tensor:
        """Register a chain of full blocks under their hashes so later prompts can hit them.

        ``block_hashes[i]`` is the hash of ``block_ids[i]``; the parent of
        ``block_hashes[0]`` is ``parent_hash`` (None: the chain starts at the
        root) and the parent of each later hash is the one before it.
        Idempotent: registering a block again under its own hash changes
        nothing. A hash already held by another block is refused (the block
        stays unhashed and is freed on release); the chain continues under the
        holder, so later blocks still register.

        Args:
            block_ids: referenced (active or paused) blocks, one per hash.
            block_hashes: their chained hashes (ints other than 0 and -1).
            parent_hash: registered hash the chain continues, or None.
            token_ids: the blocks' tokens, concatenated (``block_size_tokens``
                per block); only kept for KV cache events.
            lora_name: adapter the blocks belong to; only kept for events.
            fingerprints: in verify mode, the blocks' fingerprints
                (:meth:`fingerprint_tokens`), required; ignored otherwise.

        Returns:
            A CPU bool tensor: True where the block now carries its hash.

        Raises:
            InvalidTensorError, InvalidBlockIdError, InvalidArgumentError: malformed input.
            BlockStateError: a block is not referenced.
            HashConflictError: a block already carries another hash, or
                ``parent_hash`` is not registered.

        Complexity: O(k) dict operations.
        """
        ids = to_block_ids(block_ids, self.num_usable)
        hashes = to_hash_list(block_hashes, "block_hashes", self._max_hash)
        if parent_hash is not None:
            parent_hash = to_hash(parent_hash, "parent_hash", self._max_hash)
        if len(hashes) != len(ids):
            raise InvalidArgumentError(f"{len(ids)} block IDs but {len(hashes)} hashes")
        for sentinel in _SENTINEL_HASHES:
            if sentinel in hashes:
                raise InvalidArgumentError(f"hash {sentinel} is a reserved sentinel")
        tokens = self._event_tokens(token_ids, len(ids))
        checks = self._fingerprint_list(fingerprints, len(hashes))
        if lora_name is not None and not isinstance(lora_name, str):
            raise InvalidArgumentError(f"lora_name must be a string or None, got {lora_name!r}")
        if not self.enable_prefix_caching or not len(ids):
            return torch.zeros(len(ids), dtype=torch.bool)
        holds, new = self._engine.register(ids, hashes, parent_hash)
        if checks is not None:
            for index in np.flatnonzero(new).tolist():
                self._fingerprint_of_block[int(ids[index])] = checks[index]
        if self.events is not None:
            self._record_stored_runs(
                new_runs(new.tolist(), hashes), hashes, parent_hash, tokens, lora_name
            )
        return torch.from_numpy(holds)

    def _check_referenced(self, ids: np.ndarray, what: str) -> None:
        active, paused = self._engine.reference_counts(ids)
        unreferenced = (active + paused) == 0
        if unreferenced.any():
            block_id = int(ids[unreferenced][0])
            raise BlockStateError(
                f"{what}: block {block_id} ({self._engine.describe_state(block_id)}) "
                "is not referenced"
            )

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
