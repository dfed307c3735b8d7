"""KVBlockAllocator: reference-counted KV-cache blocks with prefix reuse."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from prefixcache.engine import hashing
from prefixcache.engine.block_ids import (
    EMPTY_IDS,
    BlockIdsLike,
    to_block_ids,
    to_int_array,
    to_tensor,
)
from prefixcache.engine.config import AllocatorConfig, build_policy
from prefixcache.engine.events import BlockStored, KVCacheEvent, KVEventLog
from prefixcache.engine.eviction import EvictionPlanner
from prefixcache.engine.invariants import find_invariant_problems
from prefixcache.engine.journal import PolicyJournal
from prefixcache.engine.pool import BlockPool
from prefixcache.engine.registry import ROOT, HashRegistry
from prefixcache.engine.routing import RoutingStore
from prefixcache.engine.stats import AllocatorStats
from prefixcache.engine.types import NO_HASH
from prefixcache.errors import (
    BlockStateError,
    BudgetExceededError,
    ConfigError,
    HashConflictError,
    InvalidArgumentError,
    InvalidTensorError,
    InvariantError,
    ReferenceCountError,
)
from prefixcache.policies import EvictionPolicy, ObservesRegistrations, SupportsRetention

_SENTINEL_HASHES = (0, -1)


_SMALL_BATCH = 256  # below this a Python set finds duplicates faster than a sort


def _count_occurrences(block_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """Distinct IDs and how often each occurs; counts are None when all are distinct.

    The common batch has no duplicates, and every caller has a cheaper path
    for "one each" than for an array of ones.
    """
    size = len(block_ids)
    if size < 2:
        return block_ids, None
    if size <= _SMALL_BATCH:
        if len(set(block_ids.tolist())) == size:
            return block_ids, None
    else:
        ordered = np.sort(block_ids)
        if not np.count_nonzero(ordered[1:] == ordered[:-1]):
            return block_ids, None
    unique, counts = np.unique(block_ids, return_counts=True)
    return unique, counts.astype(np.int32)


def _check_flag(value: object, name: str) -> None:
    """Refuse a flag that is not a bool: ``"no"`` or an array would pass as truthy."""
    if not isinstance(value, (bool, np.bool_)):
        raise InvalidArgumentError(f"{name} must be a bool, got {value!r}")


class KVBlockAllocator:
    """Hands out KV-cache block IDs, counts references, and shares cached prefixes.

    Every usable block is in exactly one state: free (on the pool's stack),
    active (held by at least one running request), paused (held only by
    paused requests) or cached (held by nobody, registered under its hash,
    evictable). See DESIGN.md "Block life cycle".

    Methods by purpose:

    - Allocation: :meth:`allocate_memory_blocks`, :meth:`release_memory_blocks`,
      :meth:`is_memory_available`, :meth:`free_group`.
    - Prefix reuse: :meth:`hash_tokens`, :meth:`match_prefix`,
      :meth:`acquire_blocks`, :meth:`register_kv_block_hashes`.
    - Partitions: :meth:`pause`, :meth:`resume`, :meth:`get_total_used`,
      :meth:`get_active_used`, :meth:`get_paused_used`, :meth:`get_active_avail`,
      :meth:`get_paused_avail`, :meth:`get_evictable_block_count`.
    - Eviction and time: :meth:`update_timestamps`, :meth:`advance_clock`,
      :meth:`evict_cached_blocks`, :meth:`evict_lru_blocks`.
    - MoE routing: :meth:`store_routing_per_block`, :meth:`store_block_routing`,
      :meth:`get_block_routing`, :meth:`reconstruct_routing_from_blocks`.
    - Introspection: :meth:`stats`, :meth:`check_invariants`, :meth:`reset`.

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
        # The policy's optional registration hook, looked up once (None: it has none).
        self._observe_registration = (
            self.policy.on_register if isinstance(self.policy, ObservesRegistrations) else None
        )
        self.pool = BlockPool(config.total_count, config.device)
        self.total_count = config.total_count
        self.num_usable = config.total_count - 1
        self.dummy_block_id = self.pool.dummy_block_id
        self.paused_count = config.paused_count
        self.active_count = self.num_usable - config.paused_count
        self.block_size_tokens = config.block_size_tokens
        self.enable_prefix_caching = config.enable_prefix_caching
        self.registry = HashRegistry(config.total_count)
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
        self.verify_prefix_hits = config.verify_prefix_hits
        # Second fingerprint of each registered block (verify mode), by block ID.
        self._fingerprint_of_block: list[int] = [0] * config.total_count
        size = config.total_count
        # Per-block host state, indexed by block ID, changed only by this class.
        self._active_refs = np.zeros(size, dtype=np.int32)  # references of running requests
        self._paused_refs = np.zeros(size, dtype=np.int32)  # references of paused requests
        # Of registered blocks: clock of the registration or last hit/touch, and hand-outs
        # since registration (stale on unregistered blocks: allocation skips them).
        self._last_access = np.zeros(size, dtype=np.int64)
        self._num_accesses = np.zeros(size, dtype=np.int32)
        # Pending releases of open free groups: references queued per block.
        self._pending_releases = np.zeros(size, dtype=np.int32)
        self._pending_chunks: list[np.ndarray] = []
        self._group_depth = 0
        self._planner = EvictionPlanner(
            self.policy,
            self.registry,
            self._active_refs,
            self._paused_refs,
            self._last_access,
            self.num_usable,
            self._leaf_args,
        )
        self._reset_counters()

    def _reset_counters(self) -> None:
        self._clock = 0
        self._num_active = 0
        self._num_paused = 0
        self._num_cached = 0
        self._num_allocated = 0
        self._num_released = 0
        self._num_queried = 0
        self._num_hits = 0
        self._num_evicted = 0
        self._num_dropped = 0
        self._num_rejected = 0

    # ------------------------------------------------------------------ allocation

    def is_memory_available(self, num_blocks: int) -> bool:
        """Whether :meth:`allocate_memory_blocks` can hand out ``num_blocks`` now.

        Counts free blocks plus cached ones (every cached block is evictable).
        Complexity: O(1).

        Raises:
            InvalidArgumentError: ``num_blocks`` is not a non-negative int.
        """
        return self._check_count(num_blocks) <= self.pool.num_free + self._num_cached

    @staticmethod
    def _check_count(num_blocks: object) -> int:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, (int, np.integer)):
            raise InvalidArgumentError(f"num_blocks must be an int, got {num_blocks!r}")
        if num_blocks < 0:
            raise InvalidArgumentError(f"num_blocks must be >= 0, got {num_blocks}")
        return int(num_blocks)

    def allocate_memory_blocks(self, num_blocks: int) -> torch.Tensor | None:
        """Hand out ``num_blocks`` fresh blocks, each with one active reference.

        Evicts cached blocks through the policy when the free stack is short.
        Fresh blocks carry no hash and no routing.

        Args:
            num_blocks: how many blocks, >= 0.

        Returns:
            A fresh CPU int32 tensor of distinct IDs, or ``None`` (and nothing
            changes) when even eviction cannot free enough.

        Raises:
            InvalidArgumentError: ``num_blocks`` is not a non-negative int.

        Complexity: O(num_blocks) vectorised, plus O(log n) per evicted block.
        """
        num_blocks = self._check_count(num_blocks)
        if num_blocks > self.pool.num_free + self._num_cached:
            return None
        shortfall = num_blocks - self.pool.num_free
        if shortfall > 0:
            block_ids = self._allocate_evicting(num_blocks, shortfall)
        else:
            block_ids = self.pool.acquire(num_blocks)
        index = block_ids.astype(np.intp)
        self._clock += 1
        self._active_refs[index] = 1
        if self.routing is not None:
            self.routing.clear(index)
        self._num_active += num_blocks
        self._num_allocated += num_blocks
        return to_tensor(block_ids)

    def release_memory_blocks(self, block_ids: BlockIdsLike, *, paused: bool = False) -> None:
        """Drop one reference per occurrence of each ID.

        An ID listed twice drops two references (batched frees of requests
        that share a prefix do this). A block left with no reference becomes
        cached if it carries a hash and the policy retains unreferenced
        blocks, else free. Inside :meth:`free_group` the release is checked
        now and applied when the group closes.

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
        _check_flag(paused, "paused")
        ids = to_block_ids(block_ids, self.num_usable)
        if ids.size == 0:
            return
        if self._group_depth and not paused:
            self._queue_release(ids)
            return
        unique, counts = _count_occurrences(ids)
        refs = self._paused_refs if paused else self._active_refs
        held = refs[unique]
        self._check_reference_counts(unique, counts, held, "paused" if paused else "active")
        self._drop_references(unique, counts, held, paused=paused)

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
        self._group_depth += 1
        try:
            yield
        finally:
            self._group_depth -= 1
            if self._group_depth == 0:
                self._flush_releases()

    def _queue_release(self, ids: np.ndarray) -> None:
        unique, counts = _count_occurrences(ids)
        available = self._active_refs[unique] - self._pending_releases[unique]
        self._check_reference_counts(unique, counts, available, "active (after queued releases)")
        self._pending_releases[unique] += 1 if counts is None else counts
        self._pending_chunks.append(unique.copy())  # the caller may reuse its tensor

    def _flush_releases(self) -> None:
        if not self._pending_chunks:
            return
        touched = np.unique(np.concatenate(self._pending_chunks))
        counts = self._pending_releases[touched].copy()
        try:  # if this raises, the group's releases are dropped with nothing applied
            self._drop_references(touched, counts, self._active_refs[touched], paused=False)
        finally:
            self._pending_releases[touched] = 0
            self._pending_chunks.clear()

    def _check_reference_counts(
        self, unique: np.ndarray, counts: np.ndarray | None, held: np.ndarray, partition: str
    ) -> None:
        """Refuse to drop more references than ``held`` (the counts of ``unique``)."""
        short = held == 0 if counts is None else held < counts
        if np.count_nonzero(short):
            position = int(np.flatnonzero(short)[0])
            block_id = int(unique[position])
            asked = 1 if counts is None else int(counts[position])
            raise ReferenceCountError(
                f"block {block_id} ({self._describe_state(block_id)}) holds "
                f"{int(held[position])} {partition} reference(s); asked to drop {asked}"
            )

    def _drop_references(
        self, unique: np.ndarray, counts: np.ndarray | None, held: np.ndarray, *, paused: bool
    ) -> None:
        """Commit a validated release of ``counts`` references of distinct ``unique``.

        ``held`` are the blocks' references in the released partition before
        the call. Only blocks whose count in that partition reaches zero can
        change state, so the rest costs nothing beyond the subtraction. If
        the pool or the policy raises, the counts are put back.
        """
        refs = self._paused_refs if paused else self._active_refs
        remaining = held - (1 if counts is None else counts)
        emptied = unique[remaining == 0]
        refs[unique] = remaining
        if not len(emptied):
            self._num_released += len(unique) if counts is None else int(counts.sum())
            return
        other = (self._active_refs if paused else self._paused_refs)[emptied]
        still_held = np.count_nonzero(other)
        unreferenced = emptied[other == 0] if still_held else emptied
        if len(unreferenced):
            try:
                self._on_unreferenced(unreferenced)
            except BaseException:
                refs[unique] = held
                raise
        self._num_released += len(unique) if counts is None else int(counts.sum())
        if paused:  # still-active blocks do not change state; the rest were paused
            self._num_paused -= len(emptied) - still_held
        else:  # blocks with paused references become paused
            self._num_active -= len(emptied)
            self._num_paused += still_held

    def _on_unreferenced(self, block_ids: np.ndarray) -> None:
        """Blocks that just lost their last reference become cached or free.

        All or nothing: the policy's and the pool's calls come first, and a
        failure undoes the policy's before anything of the allocator changes.
        """
        if not len(self.registry):  # always so with prefix caching off
            self.pool.release(block_ids)
            if self.routing is not None:
                self.routing.clear(block_ids)
            return
        hashed = self.registry.is_registered[block_ids]
        num_hashed = np.count_nonzero(hashed)
        unhashed = block_ids[~hashed] if num_hashed else block_ids
        if not num_hashed:
            self.pool.release(unhashed)
        elif self.policy.retains_unreferenced:
            self._cache_blocks(block_ids[hashed], unhashed)
        else:
            self._drop_blocks(block_ids[hashed], unhashed)
        if self.routing is not None:
            self.routing.clear(unhashed)

    def _cache_blocks(self, hashed: np.ndarray, unhashed: np.ndarray) -> None:
        """Keep the unreferenced ``hashed`` blocks cached, their leaves in the policy."""
        leaves = hashed[self.registry.num_children[hashed] == 0]
        journal = self._journal()
        try:
            for block_id in leaves.tolist():
                journal.insert(block_id)
            self.pool.release(unhashed)
        except BaseException:
            journal.rollback()
            raise
        self._num_cached += len(hashed)

    def _drop_blocks(self, hashed: np.ndarray, unhashed: np.ndarray) -> None:
        """Ref-zero: free the unreferenced ``hashed`` blocks with ``unhashed``.

        Each takes its registered descendants' hashes with it, which keeps
        the registry ancestor-closed (they are freed when released).
        """
        gone: set[int] = set()
        dropped: list[int] = []
        for block_id in hashed.tolist():
            if block_id not in gone:
                subtree = self._planner.subtree(block_id, gone)
                gone.update(subtree)
                dropped.extend(subtree)
        freed = [block_id for block_id in dropped if self._planner.is_unreferenced(block_id)]
        self.pool.release(np.concatenate((unhashed, np.asarray(freed, dtype=np.int32))))
        removed = self.registry.deregister_leaves(dropped)
        if self.routing is not None:
            self.routing.clear(np.asarray(freed, dtype=np.intp))
        self._num_dropped += len(freed)
        if self.events is not None and removed:
            self.events.record_removed(removed)

    def _insert_leaf(self, block_id: int) -> None:
        self.policy.insert(block_id, *self._leaf_args(block_id))

    def _leaf_args(self, block_id: int) -> tuple[int, int, int, int]:
        """What the policy is told of a leaf: hash, last access, hand-outs, depth."""
        return (
            self.registry.hash_of(block_id),
            self._last_access.item(block_id),
            self._num_accesses.item(block_id),
            self.registry.depth_of.item(block_id),
        )

    # ------------------------------------------------------------------ prefix reuse

    def hash_tokens(
        self,
        tokens: Any,
        *,
        parent: int | None = None,
        salt: str | bytes | None = None,
        extra_keys: Sequence[object] | None = None,
    ) -> list[int]:
        """Chained hashes of the full blocks of ``tokens`` with this allocator's settings.

        Uses ``block_size_tokens`` and ``hash_algo`` from the config; the
        config's ``hash_salt`` comes first among the extra keys, so a new
        weight version never shares blocks with the old one.

        Raises:
            InvalidArgumentError: ``extra_keys`` is not a list or tuple, or as
                :func:`~prefixcache.engine.hashing.compute_block_hashes` raises.

        Complexity: O(tokens), one hash call per block.
        """
        keys = self._chain_keys([], extra_keys)
        algo = self.config.hash_algo
        if callable(algo):
            return algo(tokens, self.block_size_tokens, parent=parent, salt=salt, extra_keys=keys)
        return hashing.compute_block_hashes(
            tokens,
            self.block_size_tokens,
            parent=parent,
            salt=salt,
            extra_keys=keys or None,
            algo=algo,
        )

    def _chain_keys(self, keys: list[object], extra_keys: Sequence[object] | None) -> list[object]:
        """``keys``, then the config's ``hash_salt``, then the caller's extra keys."""
        if extra_keys is not None and not isinstance(extra_keys, (list, tuple)):
            raise InvalidArgumentError(
                f"extra_keys must be a list or tuple of keys, got {type(extra_keys).__name__}"
            )
        if self.config.hash_salt is not None:
            keys.append(self.config.hash_salt)
        if extra_keys is not None:
            keys.extend(extra_keys)
        return keys

    def fingerprint_tokens(
        self,
        tokens: Any,
        *,
        parent: int | None = None,
        salt: str | bytes | None = None,
        extra_keys: Sequence[object] | None = None,
    ) -> list[int]:
        """Verification fingerprints of the full blocks of ``tokens`` (verify mode).

        A second chain, independent of :meth:`hash_tokens`: another algorithm
        (``xxh3_128``, or ``sha256`` when hashing with ``xxh3_128``) under its
        own root, so a collision of one chain is not a collision of the other.
        ``parent`` is the previous block's fingerprint when continuing a chain.

        Raises:
            InvalidArgumentError: ``extra_keys`` is not a list or tuple, or as
                :func:`~prefixcache.engine.hashing.compute_block_hashes` raises.

        Complexity: O(tokens).
        """
        algo = "sha256" if self.config.hash_algo == "xxh3_128" else "xxh3_128"
        keys = self._chain_keys(["prefixcache-fingerprint"], extra_keys)
        return hashing.compute_block_hashes(
            tokens, self.block_size_tokens, parent=parent, salt=salt, extra_keys=keys, algo=algo
        )

    def _fingerprint_list(self, fingerprints: Any, num_hashes: int) -> list[int] | None:
        """Validate ``fingerprints``; required in verify mode, ignored otherwise."""
        if not self.verify_prefix_hits:
            return None
        if fingerprints is None:
            raise InvalidArgumentError(
                "verify_prefix_hits is on: pass fingerprints (see fingerprint_tokens)"
            )
        values = self._hash_list(fingerprints, "fingerprints")
        if len(values) != num_hashes:
            raise InvalidArgumentError(f"{num_hashes} hashes but {len(values)} fingerprints")
        return values

    def match_prefix(
        self, block_hashes: Any, *, acquire: bool = False, fingerprints: Any = None
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

        Returns:
            A fresh CPU int32 tensor, possibly empty.

        Raises:
            InvalidTensorError, InvalidArgumentError: malformed hashes or
                fingerprints, or ``acquire`` not a bool.

        Complexity: O(matched blocks) dict lookups, plus vectorised reference updates.
        """
        _check_flag(acquire, "acquire")
        hashes = self._hash_list(block_hashes, "block_hashes")
        checks = self._fingerprint_list(fingerprints, len(hashes))
        if not self.enable_prefix_caching:
            return to_tensor(EMPTY_IDS.copy())
        matched_list = self.registry.match(hashes)
        if checks is not None:
            matched_list = self._verified_prefix(matched_list, checks)
        matched = np.array(matched_list, dtype=np.intp)  # intp: it indexes five arrays
        if acquire and len(matched):
            # A chain (each block the parent of the next) repeats no block.
            if len(matched) < 2 or np.array_equal(
                self.registry.parent_of[matched[1:]], matched[:-1]
            ):
                self._take_references(matched, None)
            else:
                self._take_references(*_count_occurrences(matched))
        self._num_queried += len(hashes)
        self._num_hits += len(matched)
        return to_tensor(matched.astype(np.int32))

    def _verified_prefix(self, matched: list[int], checks: list[int]) -> list[int]:
        stored = self._fingerprint_of_block
        for index, block_id in enumerate(matched):
            if stored[block_id] != checks[index]:
                self._num_rejected += 1
                return matched[:index]
        return matched

    def is_hash_registered(self, block_hash: int) -> bool:
        """Whether some block holds ``block_hash`` now (a chain can continue from it).

        A registered hash can disappear while its request still runs: evicting
        a pinned cached ancestor, or a ref-zero release of a shared prefix,
        drops the hashes below it. A caller that continues a chain with
        ``parent_hash`` asks here first and re-registers from the root if not.

        Raises:
            InvalidArgumentError: ``block_hash`` is not an int.

        Complexity: O(1).
        """
        if isinstance(block_hash, bool) or not isinstance(block_hash, (int, np.integer)):
            raise InvalidArgumentError(f"block_hash must be an int, got {block_hash!r}")
        return self.registry.block_of(int(block_hash)) is not None

    def acquire_blocks(self, block_ids: BlockIdsLike) -> None:
        """Take one active reference per occurrence on cached or referenced blocks.

        Raises:
            InvalidTensorError, InvalidBlockIdError: malformed IDs.
            BlockStateError: a block is free (neither cached nor referenced).

        Complexity: O(k log k) vectorised.
        """
        ids = to_block_ids(block_ids, self.num_usable)
        if ids.size == 0:
            return
        unique, counts = _count_occurrences(ids)
        free = ~self.registry.is_registered[unique] & (
            self._active_refs[unique] + self._paused_refs[unique] == 0
        )
        if free.any():
            raise BlockStateError(
                f"block {int(unique[free][0])} is free; only cached or referenced blocks "
                "can be acquired (allocate fresh blocks instead)"
            )
        self._take_references(unique, counts)

    def _take_references(self, unique: np.ndarray, counts: np.ndarray | None) -> None:
        """Commit new active references (one each if ``counts`` is None) on distinct blocks."""
        delta = 1 if counts is None else counts
        active = self._active_refs[unique]
        inactive = active == 0
        num_activated = np.count_nonzero(inactive)
        if num_activated:
            activated = unique if num_activated == len(unique) else unique[inactive]
            paused = self._paused_refs[activated]
            num_from_paused = np.count_nonzero(paused)
            cached = activated[paused == 0] if num_from_paused else activated
            if len(cached) and self.policy.retains_unreferenced:
                self._discard_leaves(cached[self.registry.num_children[cached] == 0].tolist())
            self._num_active += int(num_activated)
            self._num_paused -= int(num_from_paused)
            self._num_cached -= len(cached)
        self._active_refs[unique] = active + delta
        self._clock += 1
        self._last_access[unique] = self._clock
        self._num_accesses[unique] += delta

    def _discard_leaves(self, leaves: list[int]) -> None:
        """Take cached leaves out of the policy, all or none."""
        journal = self._journal()
        try:
            for block_id in leaves:
                journal.discard(block_id)
        except BaseException:
            journal.rollback()
            raise

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
        hashes = self._hash_list(block_hashes, "block_hashes")
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
        unreferenced = (self._active_refs[ids] + self._paused_refs[ids]) == 0
        if unreferenced.any():
            block_id = int(ids[unreferenced][0])
            raise BlockStateError(
                f"block {block_id} ({self._describe_state(block_id)}) is not referenced; "
                "register blocks while a request holds them"
            )
        id_list = ids.tolist()
        parent_id = ROOT
        if parent_hash is not None:
            holder = self.registry.block_of(parent_hash)
            if holder is None:
                raise HashConflictError(f"parent hash {parent_hash} is not registered")
            parent_id = holder
        # The common call: a matched prefix that holds its hashes, then fresh blocks.
        held = self._num_holding_own_hash(id_list, hashes)
        if held:
            parent_id = id_list[held - 1]
        if held == len(id_list) or self._is_fresh_chain(ids[held:], id_list[held:], hashes[held:]):
            if held < len(id_list):
                new_hashes = hashes[held:]
                if self._observe_registration is not None:
                    first_depth = 0 if parent_id == ROOT else self.registry.depth_of[parent_id] + 1
                    self._observe_registration(new_hashes, int(first_depth))
                self._register_fresh_chain(
                    ids[held:],
                    id_list[held:],
                    new_hashes,
                    parent_id,
                    None if checks is None else checks[held:],
                )
                if self.events is not None:
                    self._record_stored_runs(
                        [(held, new_hashes)], hashes, parent_hash, tokens, lora_name
                    )
            return torch.ones(len(id_list), dtype=torch.bool)
        self._check_hash_assignment(id_list, hashes)
        holders, new = self._plan_registration(id_list, hashes)
        parents = [parent_id, *holders[:-1]]
        gaining_child = dict.fromkeys(parents[i] for i in range(len(new)) if new[i])
        stored_runs: list[tuple[int, list[int]]] = []  # (first index, new hashes) per run
        for index, block_hash in enumerate(hashes):
            if new[index]:
                if stored_runs and stored_runs[-1][0] + len(stored_runs[-1][1]) == index:
                    stored_runs[-1][1].append(block_hash)
                else:
                    stored_runs.append((index, [block_hash]))
        if self._observe_registration is not None:
            depths = self._planned_depths(id_list, parents, new)
            for first, run in stored_runs:
                self._observe_registration(run, depths[id_list[first]])
        self._discard_leaves([p for p in gaining_child if self._is_tracked_leaf(p)])
        for index, (block_id, block_hash) in enumerate(zip(id_list, hashes, strict=True)):
            if not new[index]:
                continue
            self.registry.register(block_id, block_hash, parents[index])
            # A block's cache life starts here: allocation leaves these untouched.
            self._last_access[block_id] = self._clock
            self._num_accesses[block_id] = 1
            if checks is not None:
                self._fingerprint_of_block[block_id] = checks[index]
        if self.events is not None:
            self._record_stored_runs(stored_runs, hashes, parent_hash, tokens, lora_name)
        return torch.from_numpy(np.asarray(holders) == ids)

    def _event_tokens(self, token_ids: Any, num_blocks: int) -> list[int] | None:
        """Validate the optional token IDs of a registration (kept only for events)."""
        if token_ids is None:
            return None
        tokens = to_int_array(token_ids, "token_ids").tolist()
        expected = num_blocks * self.block_size_tokens
        if len(tokens) != expected:
            raise InvalidArgumentError(
                f"token_ids has {len(tokens)} tokens; {num_blocks} blocks of "
                f"{self.block_size_tokens} need {expected}"
            )
        return tokens

    def _record_stored_runs(
        self,
        stored_runs: list[tuple[int, list[int]]],
        hashes: list[int],
        parent_hash: int | None,
        tokens: list[int] | None,
        lora_name: str | None,
    ) -> None:
        assert self.events is not None
        size = self.block_size_tokens
        for first, run in stored_runs:
            parent = hashes[first - 1] if first else parent_hash
            run_tokens = None
            if tokens is not None:
                run_tokens = tokens[first * size : (first + len(run)) * size]
            self.events.record_stored(run, parent, run_tokens, lora_name)

    def _num_holding_own_hash(self, id_list: list[int], hashes: list[int]) -> int:
        """How many leading blocks already carry their hash (a matched prefix, registered again)."""
        hash_of = self.registry.hash_of
        held = 0
        for block_id, block_hash in zip(id_list, hashes, strict=True):
            if hash_of(block_id) != block_hash:
                break
            held += 1
        return held

    def _is_fresh_chain(self, ids: np.ndarray, id_list: list[int], hashes: list[int]) -> bool:
        """Distinct unregistered blocks, distinct hashes nobody holds: the common registration."""
        return (
            not np.count_nonzero(self.registry.is_registered[ids])
            and len(set(id_list)) == len(id_list)
            and len(set(hashes)) == len(hashes)
            and self.registry.holds_none(hashes)
        )

    def _register_fresh_chain(
        self,
        ids: np.ndarray,
        id_list: list[int],
        hashes: list[int],
        parent_id: int,
        checks: list[int] | None,
    ) -> None:
        if self._is_tracked_leaf(parent_id):
            self.policy.discard(parent_id)  # the only fallible call: before any change
        self.registry.register_chain(ids, id_list, hashes, parent_id)
        self._last_access[ids] = self._clock
        self._num_accesses[ids] = 1
        if checks is not None:
            for block_id, check in zip(id_list, checks, strict=True):
                self._fingerprint_of_block[block_id] = check

    def _is_tracked_leaf(self, block_id: int) -> bool:
        """Whether ``block_id`` is a cached leaf, i.e. tracked by the policy."""
        return (
            block_id != ROOT
            and self.policy.retains_unreferenced
            and self.registry.num_children[block_id] == 0
            and self._active_refs[block_id] == 0
            and self._paused_refs[block_id] == 0
        )

    def _check_hash_assignment(self, id_list: list[int], hashes: list[int]) -> None:
        assigned: dict[int, int] = {}
        for block_id, block_hash in zip(id_list, hashes, strict=True):
            current = self.registry.hash_of(block_id)
            if current != NO_HASH and current != block_hash:
                raise HashConflictError(
                    f"block {block_id} already carries hash {current}; cannot register {block_hash}"
                )
            if assigned.setdefault(block_id, block_hash) != block_hash:
                raise HashConflictError(
                    f"block {block_id} appears twice with different hashes "
                    f"({assigned[block_id]} and {block_hash})"
                )

    def _planned_depths(
        self, id_list: list[int], parents: list[int], new: list[bool]
    ) -> dict[int, int]:
        """Chain depth of each block a registration plan newly registers, before it commits."""
        depths: dict[int, int] = {}
        for block_id, parent_id, is_new in zip(id_list, parents, new, strict=True):
            if is_new:
                if parent_id == ROOT:
                    depths[block_id] = 0
                elif parent_id in depths:
                    depths[block_id] = depths[parent_id] + 1
                else:
                    depths[block_id] = int(self.registry.depth_of[parent_id]) + 1
        return depths

    def _plan_registration(
        self, id_list: list[int], hashes: list[int]
    ) -> tuple[list[int], list[bool]]:
        """Who holds each hash once the chain is registered, and which blocks newly take theirs.

        A hash already held (by another block, or by this block itself)
        keeps its holder, and the chain continues under it.
        """
        holder_in_call: dict[int, int] = {}
        holders: list[int] = []
        new: list[bool] = []
        for block_id, block_hash in zip(id_list, hashes, strict=True):
            holder = holder_in_call.get(block_hash)
            if holder is None:
                holder = self.registry.block_of(block_hash)
            new.append(holder is None)
            if holder is None:
                holder = holder_in_call[block_hash] = block_id
            holders.append(holder)
        return holders, new

    @staticmethod
    def _hash_list(block_hashes: Any, what: str) -> list[int]:
        if isinstance(block_hashes, (torch.Tensor, np.ndarray)):
            return to_int_array(block_hashes, what).tolist()
        if isinstance(block_hashes, (str, bytes)) or not isinstance(block_hashes, Sequence):
            raise InvalidTensorError(
                f"{what} must be a sequence of ints or a 1-D integer tensor, "
                f"got {type(block_hashes).__name__}"
            )
        hashes = list(block_hashes)
        if set(map(type, hashes)) <= {int}:  # the common case, checked at C speed
            return hashes
        for block_hash in hashes:
            if isinstance(block_hash, bool) or not isinstance(block_hash, (int, np.integer)):
                raise InvalidTensorError(f"{what} must contain only ints, got {block_hash!r}")
        return [int(block_hash) for block_hash in hashes]

    # ------------------------------------------------------------------ partitions

    def pause(self, block_ids: BlockIdsLike) -> None:
        """Move one reference per occurrence from the active to the paused partition.

        Raises:
            ReferenceCountError: a block holds fewer active references than asked.
            BudgetExceededError: more than ``paused_count`` blocks would be paused.

        Complexity: O(k log k) vectorised.
        """
        self._move_references(block_ids, to_paused=True)

    def resume(self, block_ids: BlockIdsLike) -> None:
        """Move one reference per occurrence from the paused to the active partition.

        Raises:
            ReferenceCountError: a block holds fewer paused references than asked.
            BudgetExceededError: more than ``active_count`` blocks would be active.

        Complexity: O(k log k) vectorised.
        """
        self._move_references(block_ids, to_paused=False)

    def _move_references(self, block_ids: BlockIdsLike, *, to_paused: bool) -> None:
        ids = to_block_ids(block_ids, self.num_usable)
        if ids.size == 0:
            return
        unique, counts = _count_occurrences(ids)
        delta = 1 if counts is None else counts
        active, paused = self._active_refs[unique], self._paused_refs[unique]
        # Inside a free group, queued releases are no longer the caller's to pause.
        held = active - self._pending_releases[unique] if to_paused else paused
        self._check_reference_counts(unique, counts, held, "active" if to_paused else "paused")
        num_active = int(np.count_nonzero(active))
        num_paused = int(np.count_nonzero((active == 0) & (paused > 0)))
        after_active = active - delta if to_paused else active + delta
        after_paused = paused + delta if to_paused else paused - delta
        new_active = int(np.count_nonzero(after_active))
        new_paused = int(np.count_nonzero((after_active == 0) & (after_paused > 0)))
        total_active = self._num_active + new_active - num_active
        total_paused = self._num_paused + new_paused - num_paused
        # A move that adds no block to the target partition never overflows it.
        if to_paused and new_paused > num_paused and total_paused > self.paused_count:
            raise BudgetExceededError(
                f"pausing would hold {total_paused} paused blocks; budget is {self.paused_count}"
            )
        if not to_paused and new_active > num_active and total_active > self.active_count:
            raise BudgetExceededError(
                f"resuming would hold {total_active} active blocks; budget is {self.active_count}"
            )
        self._active_refs[unique] = after_active
        self._paused_refs[unique] = after_paused
        self._num_active, self._num_paused = total_active, total_paused

    def reference_counts(self, block_ids: BlockIdsLike) -> tuple[torch.Tensor, torch.Tensor]:
        """Active and paused reference counts of ``block_ids`` (fresh int32 tensors).

        For debugging and tests; schedulers should not need it. Complexity: O(k).
        """
        ids = to_block_ids(block_ids, self.num_usable)
        return torch.from_numpy(self._active_refs[ids]), torch.from_numpy(self._paused_refs[ids])

    def get_total_used(self) -> int:
        """Blocks not on the free stack (active + paused + cached). O(1)."""
        return self.num_usable - self.pool.num_free

    def get_active_used(self) -> int:
        """Blocks held by at least one running request. O(1)."""
        return self._num_active

    def get_paused_used(self) -> int:
        """Blocks held only by paused requests. O(1)."""
        return self._num_paused

    def get_active_avail(self) -> int:
        """Room left in the active budget (never negative). O(1).

        Allocation is bounded by the whole pool, as in Megatron-core; the
        active budget binds :meth:`resume`.
        """
        return max(0, self.active_count - self._num_active)

    def get_paused_avail(self) -> int:
        """Room left in the paused budget. O(1)."""
        return max(0, self.paused_count - self._num_paused)

    def get_evictable_block_count(self) -> int:
        """Cached blocks, all of which eviction can reclaim. O(1)."""
        return self._num_cached

    # ------------------------------------------------------------------ eviction and time

    def advance_clock(self, ticks: int = 1) -> int:
        """Move the logical clock forward and return it.

        Every hand-out and touch already ticks the clock once, so recency
        works without calling this; call it to mark coarser boundaries.
        """
        if isinstance(ticks, bool) or not isinstance(ticks, int) or ticks < 0:
            raise InvalidArgumentError(f"ticks must be an int >= 0, got {ticks!r}")
        self._clock += ticks
        return self._clock

    @property
    def clock(self) -> int:
        """The current logical clock value."""
        return self._clock

    def update_timestamps(self, block_ids: BlockIdsLike) -> None:
        """Mark blocks as used now, so recency-based policies keep them longer.

        Raises:
            InvalidTensorError, InvalidBlockIdError: malformed IDs.
            BlockStateError: a block is free.

        Complexity: O(k) vectorised, plus O(log n) per touched cached leaf.
        """
        ids = to_block_ids(block_ids, self.num_usable)
        if ids.size == 0:
            return
        unreferenced = (self._active_refs[ids] + self._paused_refs[ids]) == 0
        free = unreferenced & ~self.registry.is_registered[ids]
        if free.any():
            raise BlockStateError(
                f"block {int(ids[free][0])} is free; it has no timestamp to update"
            )
        now = self._clock + 1
        if self.policy.retains_unreferenced:
            leaves = np.unique(ids[unreferenced & (self.registry.num_children[ids] == 0)])
            journal = self._journal()
            try:
                for block_id in leaves.tolist():
                    journal.touch(block_id, now)
            except BaseException:
                journal.rollback()
                raise
        self._clock = now
        self._last_access[ids] = now

    def set_retention_priority(
        self, block_hashes: Any, priority: int, *, duration: int | None = None
    ) -> None:
        """Ask the policy to keep the blocks of ``block_hashes`` longer (or shorter).

        For pinning a system prompt or an agent's paused context. Lower
        priorities are evicted first; after ``duration`` clock ticks the
        hashes fall back to the default priority. Hashes need not be
        registered yet: the priority applies whenever they are cached.

        Raises:
            ConfigError: the configured policy has no retention priorities.
            InvalidTensorError, InvalidArgumentError: malformed hashes,
                priority or duration.

        Complexity: O(k) policy calls.
        """
        if not isinstance(self.policy, SupportsRetention):
            raise ConfigError(
                f"policy {type(self.policy).__name__} does not support retention priorities; "
                "configure one that does (e.g. 'priority')"
            )
        hashes = self._hash_list(block_hashes, "block_hashes")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise InvalidArgumentError(f"priority must be an int, got {priority!r}")
        if duration is not None and (
            isinstance(duration, bool) or not isinstance(duration, int) or duration < 0
        ):
            raise InvalidArgumentError(f"duration must be an int >= 0 or None, got {duration!r}")
        expires_at = None if duration is None else self._clock + duration
        for block_hash in hashes:
            self.policy.set_retention(block_hash, priority, expires_at)

    def evict_cached_blocks(self, num_blocks: int) -> int:
        """Evict up to ``num_blocks`` cached blocks through the policy.

        Returns:
            How many blocks were freed.

        Complexity: O(log n) per evicted block.
        """
        num_blocks = min(self._check_count(num_blocks), self._num_cached)
        before = self.pool.num_free
        if num_blocks:
            self._evict(num_blocks)
        return self.pool.num_free - before

    def evict_lru_blocks(self, num_blocks: int) -> bool:
        """Megatron-core's name: evict ``num_blocks`` cached blocks, all or none.

        Delegates to the configured policy (LRU by default).

        Returns:
            True if that many blocks were evicted; False (nothing changes) if
            fewer are cached.
        """
        if self._check_count(num_blocks) > self._num_cached:
            return False
        if num_blocks:
            self._evict(num_blocks)
        return True

    def _evict(self, num_blocks: int) -> None:
        """Free ``num_blocks`` cached blocks to the pool (the caller checked there are enough)."""
        journal = self._journal()
        try:
            freed, dropped = self._planner.plan(num_blocks, journal)
            self.pool.release(np.asarray(freed, dtype=np.int32))
        except BaseException:
            journal.rollback()
            raise
        self._commit_eviction(freed, dropped)

    def _allocate_evicting(self, num_blocks: int, shortfall: int) -> np.ndarray:
        """Evict ``shortfall`` cached blocks and hand them out with every free block.

        The evicted blocks go straight to the caller, in the order that
        pushing them on the free stack and popping ``num_blocks`` would give,
        so the stack ends exactly as if they had passed through it.
        """
        journal = self._journal()
        try:
            freed, dropped = self._planner.plan(shortfall, journal)
            block_ids = np.concatenate(
                (np.asarray(freed[::-1], dtype=np.int32), self.pool.acquire(num_blocks - shortfall))
            )
        except BaseException:
            journal.rollback()
            raise
        self._commit_eviction(freed, dropped)
        return block_ids

    def _journal(self) -> PolicyJournal:
        return PolicyJournal(self.policy, self._insert_leaf)

    def _commit_eviction(self, freed: list[int], dropped: list[int]) -> None:
        """Apply a plan whose policy and pool calls succeeded: deregister, count, clear."""
        removed = self.registry.deregister_leaves(dropped)
        self._num_cached -= len(freed)
        self._num_evicted += len(freed)
        if self.routing is not None and freed:
            self.routing.clear(np.asarray(freed, dtype=np.intp))
        if self.events is not None and removed:
            self.events.record_removed(removed)

    # ------------------------------------------------------------------ MoE routing

    def _routing_store(self) -> RoutingStore:
        if self.routing is None:
            raise ConfigError(
                "MoE routing is not configured (set routing_num_layers and routing_top_k)"
            )
        return self.routing

    def _check_referenced(self, ids: np.ndarray, what: str) -> None:
        unreferenced = (self._active_refs[ids] + self._paused_refs[ids]) == 0
        if unreferenced.any():
            block_id = int(ids[unreferenced][0])
            raise BlockStateError(
                f"{what}: block {block_id} ({self._describe_state(block_id)}) is not referenced"
            )

    def store_routing_per_block(
        self, flat_routing: Any, token_block_ids: BlockIdsLike, token_positions: BlockIdsLike
    ) -> None:
        """Store each token's routed experts at its block and position.

        Tokens pointing at the dummy block (padding) are skipped.

        Args:
            flat_routing: ``[tokens, layers, top_k]`` integer CPU tensor or array.
            token_block_ids: ``[tokens]`` block of each token (dummy allowed).
            token_positions: ``[tokens]`` position of each token in its block.

        Raises:
            ConfigError: routing is not configured.
            InvalidTensorError, InvalidArgumentError, InvalidBlockIdError: bad input.
            BlockStateError: a target block is not referenced.

        Complexity: O(tokens) vectorised.
        """
        store = self._routing_store()
        routing = self._routing_array(flat_routing)
        store.validate_routing(routing)
        blocks = to_int_array(token_block_ids, "token_block_ids")
        positions = to_int_array(token_positions, "token_positions")
        if not (len(blocks) == len(positions) == routing.shape[0]):
            raise InvalidTensorError(
                f"lengths differ: {routing.shape[0]} routing rows, {len(blocks)} block IDs, "
                f"{len(positions)} positions"
            )
        keep = blocks != self.dummy_block_id
        blocks = to_block_ids(blocks[keep], self.num_usable, "token_block_ids")
        positions = positions[keep]
        if positions.size and (positions.min() < 0 or positions.max() >= self.block_size_tokens):
            raise InvalidArgumentError(
                f"token_positions must lie in [0, {self.block_size_tokens}), "
                f"got [{positions.min()}, {positions.max()}]"
            )
        if blocks.size:
            self._check_referenced(blocks, "store_routing_per_block")
            store.store_tokens(routing[keep], blocks, positions)

    def store_block_routing(self, block_id: int, routing: Any) -> None:
        """Store the routing of one block's first ``len(routing)`` tokens.

        Raises:
            ConfigError, InvalidTensorError, InvalidArgumentError,
            InvalidBlockIdError, BlockStateError: as for :meth:`store_routing_per_block`.
        """
        store = self._routing_store()
        ids = to_block_ids([block_id], self.num_usable, "block_id")
        array = self._routing_array(routing)
        store.validate_routing(array)
        if array.shape[0] > self.block_size_tokens:
            raise InvalidTensorError(
                f"routing has {array.shape[0]} rows; a block holds {self.block_size_tokens} tokens"
            )
        self._check_referenced(ids, "store_block_routing")
        store.store_block(int(ids[0]), array)

    def get_block_routing(self, block_id: int) -> torch.Tensor | None:
        """A copy of one block's routing ``[block_size, layers, top_k]``, or None if incomplete."""
        store = self._routing_store()
        ids = to_block_ids([block_id], self.num_usable, "block_id")
        routing = store.get_block(int(ids[0]))
        return None if routing is None else torch.from_numpy(routing)

    def reconstruct_routing_from_blocks(
        self, block_ids: BlockIdsLike, total_tokens: int
    ) -> torch.Tensor | None:
        """Routing ``[total_tokens, layers, top_k]`` of a request's blocks, in order.

        Returns None when any of the first ``total_tokens`` tokens has no routing.

        Complexity: O(total_tokens) vectorised.
        """
        store = self._routing_store()
        ids = to_block_ids(block_ids, self.num_usable)
        if isinstance(total_tokens, bool) or not isinstance(total_tokens, int):
            raise InvalidArgumentError(f"total_tokens must be an int, got {total_tokens!r}")
        if not 0 <= total_tokens <= len(ids) * self.block_size_tokens:
            raise InvalidArgumentError(
                f"total_tokens {total_tokens} outside [0, {len(ids) * self.block_size_tokens}] "
                f"for {len(ids)} blocks"
            )
        routing = store.reconstruct(ids, total_tokens)
        return None if routing is None else torch.from_numpy(routing)

    @staticmethod
    def _routing_array(routing: Any) -> np.ndarray:
        if isinstance(routing, torch.Tensor):
            if routing.device.type != "cpu":
                raise InvalidTensorError(
                    f"routing must be on the CPU (copy it off the device first), "
                    f"got {routing.device}"
                )
            return routing.detach().numpy()
        if isinstance(routing, np.ndarray):
            return routing
        raise InvalidTensorError(
            f"routing must be a tensor or an array, got {type(routing).__name__}"
        )

    # ------------------------------------------------------------------ introspection

    def reset(self) -> None:
        """Return to the state just after construction: every block free, nothing cached.

        Queued releases of an open free group are dropped. Statistics restart.
        Complexity: O(total_count).
        """
        leaves = self._cached_leaves() if self.policy.retains_unreferenced else []
        self.policy.clear()
        try:
            self.pool.reset()
        except BaseException:
            for block_id in leaves:
                self._insert_leaf(block_id)
            raise
        self.registry.clear()
        if self.routing is not None:
            self.routing.clear_all()
        for array in (
            self._active_refs,
            self._paused_refs,
            self._last_access,
            self._num_accesses,
            self._pending_releases,
        ):
            array[:] = 0
        self._pending_chunks.clear()
        self._reset_counters()
        if self.events is not None:
            self.events.record_cleared()

    def _cached_leaves(self) -> list[int]:
        """Every cached leaf (what the policy tracks). Complexity: O(total_count)."""
        usable = slice(0, self.num_usable)
        return np.flatnonzero(
            self.registry.is_registered[usable]
            & (self._active_refs[usable] == 0)
            & (self._paused_refs[usable] == 0)
            & (self.registry.num_children[usable] == 0)
        ).tolist()

    def _event_log(self) -> KVEventLog:
        if self.events is None:
            raise ConfigError("KV cache events are off; set kv_events_capacity > 0")
        return self.events

    def take_events(self) -> list[KVCacheEvent]:
        """Drain the queued KV cache events, oldest first.

        Raises:
            ConfigError: events are not enabled (``kv_events_capacity`` is 0).

        Complexity: O(queued events).
        """
        return self._event_log().take()

    def snapshot(self) -> list[BlockStored]:
        """BlockStored events for every resident hash, parents first, for a late router.

        Not queued: the caller sends them before the events it drains next.

        Raises:
            ConfigError: events are not enabled.

        Complexity: O(n log n) in registered blocks.
        """
        log = self._event_log()
        registry = self.registry
        pairs = sorted(registry.items(), key=lambda pair: int(registry.depth_of[pair[1]]))
        events = []
        for block_hash, block_id in pairs:
            parent_id = int(registry.parent_of[block_id])
            parent_hash = None if parent_id == ROOT else registry.hash_of(parent_id)
            events.append(log.stored_event_for(block_hash, parent_hash))
        return events

    def stats(self) -> AllocatorStats:
        """A snapshot of counts per state and cumulative events. O(1)."""
        return AllocatorStats(
            total_count=self.total_count,
            num_usable=self.num_usable,
            num_free=self.pool.num_free,
            num_active=self._num_active,
            num_paused=self._num_paused,
            num_cached=self._num_cached,
            num_registered=len(self.registry),
            num_allocated_blocks=self._num_allocated,
            num_released_references=self._num_released,
            num_queried_blocks=self._num_queried,
            num_hit_blocks=self._num_hits,
            num_evicted_blocks=self._num_evicted,
            num_dropped_blocks=self._num_dropped,
            num_rejected_hits=self._num_rejected,
            num_dropped_events=0 if self.events is None else self.events.num_dropped,
            clock=self._clock,
        )

    def __str__(self) -> str:
        return (
            f"using: total {self.get_total_used()}/{self.num_usable}"
            f"; active {self._num_active}/{self.active_count}"
            f"; paused {self._num_paused}/{self.paused_count}"
            f"; cached {self._num_cached}"
        )

    def __repr__(self) -> str:
        return (
            f"KVBlockAllocator(total_count={self.total_count}, policy={type(self.policy).__name__})"
        )

    def _describe_state(self, block_id: int) -> str:
        if self._active_refs[block_id] > 0:
            return "active"
        if self._paused_refs[block_id] > 0:
            return "paused"
        return "cached" if self.registry.is_registered[block_id] else "free"

    def check_invariants(self) -> None:
        """Check every invariant of DESIGN.md; raise InvariantError naming the first broken one.

        Meant for tests and debugging. Complexity: O(total_count).
        """
        problems = find_invariant_problems(self)
        if problems:
            raise InvariantError("; ".join(problems[:5]))
