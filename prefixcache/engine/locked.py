"""ThreadSafeAllocator: an opt-in lock around a KVBlockAllocator.

:class:`~prefixcache.KVBlockAllocator` is not thread-safe, on purpose, as
``cachetools`` caches are not: one scheduler thread owns an allocator, and a
lock on every call would cost the common case for the rare one. A deployment
that does share an allocator between threads (a tokenizer thread registering
hashes while the scheduler allocates, a metrics thread reading counts) wraps
it here: every public method runs under one ``threading.RLock``.

Each call is atomic on its own. A sequence that must not interleave with
other threads (match, then allocate the rest, then register) holds
:attr:`ThreadSafeAllocator.lock` around the sequence; the lock is re-entrant,
so the wrapper's own methods can be called inside. :meth:`free_group` holds
the lock for the whole group, so the releases queued in it are applied
before any other thread sees the allocator.

>>> from prefixcache import KVBlockAllocator
>>> shared = ThreadSafeAllocator(KVBlockAllocator(total_count=8, device="cpu"))
>>> blocks = shared.allocate_memory_blocks(2)
>>> with shared.lock:  # a sequence no other thread may interleave with
...     shared.release_memory_blocks(blocks)
...     shared.get_total_used()
0
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from prefixcache.engine.allocator import KVBlockAllocator
from prefixcache.engine.block_ids import BlockIdsLike
from prefixcache.engine.events import BlockStored, KVCacheEvent
from prefixcache.engine.stats import AllocatorStats
from prefixcache.errors import ConfigError


class ThreadSafeAllocator:
    """Serialises every public method of a :class:`KVBlockAllocator` with one re-entrant lock.

    The methods are those of the wrapped allocator, with the same arguments,
    results and errors (see there); each holds :attr:`lock` while it runs.

    - Allocation: :meth:`allocate_memory_blocks`, :meth:`release_memory_blocks`,
      :meth:`is_memory_available`, :meth:`free_group`.
    - Prefix reuse: :meth:`hash_tokens`, :meth:`fingerprint_tokens`,
      :meth:`match_prefix`, :meth:`is_hash_registered`, :meth:`acquire_blocks`,
      :meth:`register_kv_block_hashes`.
    - Partitions: :meth:`pause`, :meth:`resume`, :meth:`reference_counts`,
      :meth:`get_total_used`, :meth:`get_active_used`, :meth:`get_paused_used`,
      :meth:`get_active_avail`, :meth:`get_paused_avail`,
      :meth:`get_evictable_block_count`.
    - Eviction and time: :meth:`update_timestamps`, :meth:`advance_clock`,
      :attr:`clock`, :meth:`set_retention_priority`, :meth:`evict_cached_blocks`,
      :meth:`evict_lru_blocks`.
    - MoE routing: :meth:`store_routing_per_block`, :meth:`store_block_routing`,
      :meth:`get_block_routing`, :meth:`reconstruct_routing_from_blocks`.
    - Introspection: :meth:`stats`, :meth:`check_invariants`, :meth:`reset`,
      :meth:`take_events`, :meth:`snapshot`.

    Complexity: each method as the wrapped one, plus one lock acquisition
    (about 0.1 us uncontended).

    Args:
        allocator: the allocator to guard. After wrapping, use it only
            through this object (or while holding :attr:`lock`).

    Raises:
        ConfigError: ``allocator`` is not a KVBlockAllocator.
    """

    def __init__(self, allocator: KVBlockAllocator) -> None:
        if not isinstance(allocator, KVBlockAllocator):
            raise ConfigError(
                f"ThreadSafeAllocator wraps a KVBlockAllocator, got {type(allocator).__name__}"
            )
        self._allocator = allocator
        self._lock = threading.RLock()

    @property
    def lock(self) -> threading.RLock:
        """The re-entrant lock every method holds; hold it to make a sequence atomic."""
        return self._lock

    @property
    def allocator(self) -> KVBlockAllocator:
        """The wrapped allocator; touch it only while holding :attr:`lock`."""
        return self._allocator

    # ------------------------------------------------------------------ allocation

    def is_memory_available(self, num_blocks: int) -> bool:
        """See :meth:`KVBlockAllocator.is_memory_available`."""
        with self._lock:
            return self._allocator.is_memory_available(num_blocks)

    def allocate_memory_blocks(self, num_blocks: int) -> torch.Tensor | None:
        """See :meth:`KVBlockAllocator.allocate_memory_blocks`."""
        with self._lock:
            return self._allocator.allocate_memory_blocks(num_blocks)

    def release_memory_blocks(self, block_ids: BlockIdsLike, *, paused: bool = False) -> None:
        """See :meth:`KVBlockAllocator.release_memory_blocks`."""
        with self._lock:
            self._allocator.release_memory_blocks(block_ids, paused=paused)

    @contextmanager
    def free_group(self) -> Iterator[None]:
        """See :meth:`KVBlockAllocator.free_group`; holds the lock for the whole group.

        Other threads wait until the group's releases are applied, so none
        sees (or pauses) a reference that is already queued for release.
        """
        with self._lock, self._allocator.free_group():
            yield

    # ------------------------------------------------------------------ prefix reuse

    def hash_tokens(
        self,
        tokens: Any,
        *,
        parent: int | None = None,
        salt: str | bytes | None = None,
        extra_keys: Sequence[object] | None = None,
    ) -> list[int]:
        """See :meth:`KVBlockAllocator.hash_tokens` (pure; locked for a custom hash function)."""
        with self._lock:
            return self._allocator.hash_tokens(
                tokens, parent=parent, salt=salt, extra_keys=extra_keys
            )

    def fingerprint_tokens(
        self,
        tokens: Any,
        *,
        parent: int | None = None,
        salt: str | bytes | None = None,
        extra_keys: Sequence[object] | None = None,
    ) -> list[int]:
        """See :meth:`KVBlockAllocator.fingerprint_tokens`."""
        with self._lock:
            return self._allocator.fingerprint_tokens(
                tokens, parent=parent, salt=salt, extra_keys=extra_keys
            )

    def match_prefix(
        self, block_hashes: Any, *, acquire: bool = False, fingerprints: Any = None
    ) -> torch.Tensor:
        """See :meth:`KVBlockAllocator.match_prefix`."""
        with self._lock:
            return self._allocator.match_prefix(
                block_hashes, acquire=acquire, fingerprints=fingerprints
            )

    def is_hash_registered(self, block_hash: int) -> bool:
        """See :meth:`KVBlockAllocator.is_hash_registered`."""
        with self._lock:
            return self._allocator.is_hash_registered(block_hash)

    def acquire_blocks(self, block_ids: BlockIdsLike) -> None:
        """See :meth:`KVBlockAllocator.acquire_blocks`."""
        with self._lock:
            self._allocator.acquire_blocks(block_ids)

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
        """See :meth:`KVBlockAllocator.register_kv_block_hashes`."""
        with self._lock:
            return self._allocator.register_kv_block_hashes(
                block_ids,
                block_hashes,
                parent_hash=parent_hash,
                token_ids=token_ids,
                lora_name=lora_name,
                fingerprints=fingerprints,
            )

    # ------------------------------------------------------------------ partitions

    def pause(self, block_ids: BlockIdsLike) -> None:
        """See :meth:`KVBlockAllocator.pause`."""
        with self._lock:
            self._allocator.pause(block_ids)

    def resume(self, block_ids: BlockIdsLike) -> None:
        """See :meth:`KVBlockAllocator.resume`."""
        with self._lock:
            self._allocator.resume(block_ids)

    def reference_counts(self, block_ids: BlockIdsLike) -> tuple[torch.Tensor, torch.Tensor]:
        """See :meth:`KVBlockAllocator.reference_counts`."""
        with self._lock:
            return self._allocator.reference_counts(block_ids)

    def get_total_used(self) -> int:
        """See :meth:`KVBlockAllocator.get_total_used`."""
        with self._lock:
            return self._allocator.get_total_used()

    def get_active_used(self) -> int:
        """See :meth:`KVBlockAllocator.get_active_used`."""
        with self._lock:
            return self._allocator.get_active_used()

    def get_paused_used(self) -> int:
        """See :meth:`KVBlockAllocator.get_paused_used`."""
        with self._lock:
            return self._allocator.get_paused_used()

    def get_active_avail(self) -> int:
        """See :meth:`KVBlockAllocator.get_active_avail`."""
        with self._lock:
            return self._allocator.get_active_avail()

    def get_paused_avail(self) -> int:
        """See :meth:`KVBlockAllocator.get_paused_avail`."""
        with self._lock:
            return self._allocator.get_paused_avail()

    def get_evictable_block_count(self) -> int:
        """See :meth:`KVBlockAllocator.get_evictable_block_count`."""
        with self._lock:
            return self._allocator.get_evictable_block_count()

    # ------------------------------------------------------------------ eviction and time

    def update_timestamps(self, block_ids: BlockIdsLike) -> None:
        """See :meth:`KVBlockAllocator.update_timestamps`."""
        with self._lock:
            self._allocator.update_timestamps(block_ids)

    def advance_clock(self, ticks: int = 1) -> int:
        """See :meth:`KVBlockAllocator.advance_clock`."""
        with self._lock:
            return self._allocator.advance_clock(ticks)

    @property
    def clock(self) -> int:
        """See :attr:`KVBlockAllocator.clock`."""
        with self._lock:
            return self._allocator.clock

    def set_retention_priority(
        self, block_hashes: Any, priority: int, *, duration: int | None = None
    ) -> None:
        """See :meth:`KVBlockAllocator.set_retention_priority`."""
        with self._lock:
            self._allocator.set_retention_priority(block_hashes, priority, duration=duration)

    def evict_cached_blocks(self, num_blocks: int) -> int:
        """See :meth:`KVBlockAllocator.evict_cached_blocks`."""
        with self._lock:
            return self._allocator.evict_cached_blocks(num_blocks)

    def evict_lru_blocks(self, num_blocks: int) -> bool:
        """See :meth:`KVBlockAllocator.evict_lru_blocks`."""
        with self._lock:
            return self._allocator.evict_lru_blocks(num_blocks)

    # ------------------------------------------------------------------ MoE routing

    def store_routing_per_block(
        self, flat_routing: Any, token_block_ids: BlockIdsLike, token_positions: BlockIdsLike
    ) -> None:
        """See :meth:`KVBlockAllocator.store_routing_per_block`."""
        with self._lock:
            self._allocator.store_routing_per_block(flat_routing, token_block_ids, token_positions)

    def store_block_routing(self, block_id: int, routing: Any) -> None:
        """See :meth:`KVBlockAllocator.store_block_routing`."""
        with self._lock:
            self._allocator.store_block_routing(block_id, routing)

    def get_block_routing(self, block_id: int) -> torch.Tensor | None:
        """See :meth:`KVBlockAllocator.get_block_routing`."""
        with self._lock:
            return self._allocator.get_block_routing(block_id)

    def reconstruct_routing_from_blocks(
        self, block_ids: BlockIdsLike, total_tokens: int
    ) -> torch.Tensor | None:
        """See :meth:`KVBlockAllocator.reconstruct_routing_from_blocks`."""
        with self._lock:
            return self._allocator.reconstruct_routing_from_blocks(block_ids, total_tokens)

    # ------------------------------------------------------------------ introspection

    def reset(self) -> None:
        """See :meth:`KVBlockAllocator.reset`."""
        with self._lock:
            self._allocator.reset()

    def take_events(self) -> list[KVCacheEvent]:
        """See :meth:`KVBlockAllocator.take_events`."""
        with self._lock:
            return self._allocator.take_events()

    def snapshot(self) -> list[BlockStored]:
        """See :meth:`KVBlockAllocator.snapshot`."""
        with self._lock:
            return self._allocator.snapshot()

    def stats(self) -> AllocatorStats:
        """See :meth:`KVBlockAllocator.stats`."""
        with self._lock:
            return self._allocator.stats()

    def check_invariants(self) -> None:
        """See :meth:`KVBlockAllocator.check_invariants`."""
        with self._lock:
            self._allocator.check_invariants()

    def __str__(self) -> str:
        with self._lock:
            return str(self._allocator)

    def __repr__(self) -> str:
        return f"ThreadSafeAllocator({self._allocator!r})"
