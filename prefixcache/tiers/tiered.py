"""TieredCache: a device allocator with a host tier behind it.

The device pool (:class:`~prefixcache.KVBlockAllocator`) forgets a block's
hash when it evicts it. Its K/V bytes stay in device memory until the block's
next owner writes them, so the moment to save them is the hand-out: this
class remembers which hash each block it registered held, and when the
allocator hands such a block out again, it queues a copy of the block to a
host slot (a *demotion*) before the caller gets the block. A prefix match
that runs past the device's blocks into hashes the host tier holds allocates
device blocks for them, registers them, and queues host -> device copies (a
*promotion*). Copies are only queued (:meth:`TieredCache.take_transfer`);
:class:`~prefixcache.tiers.transfer.KVTransfer` runs them off the scheduling
thread's critical path. The host tier is inclusive: a promoted hash stays in
host memory, so evicting it from the device again copies nothing.

Everything goes through the allocator's public API, so both engines serve
under it unchanged. The one rule: every block hand-out and registration of
this allocator goes through this class (a block handed out behind its back
could be demoted with another owner's K/V). See DESIGN.md, "Tiers".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from prefixcache.engine.allocator import KVBlockAllocator
from prefixcache.engine.block_ids import BlockIdsLike, to_block_ids
from prefixcache.engine.events import KVCacheEvent
from prefixcache.engine.prefix_hashing import max_hash_of, to_hash, to_hash_list
from prefixcache.engine.validation import require_int
from prefixcache.errors import ConfigError, InvalidArgumentError, InvariantError
from prefixcache.tiers.epochs import WeightEpochs
from prefixcache.tiers.host import HostTier
from prefixcache.tiers.remote import RemoteTier
from prefixcache.tiers.tiered_layout import TieredLayout, forget_record
from prefixcache.tiers.tiered_results import TieredMatch, TieredStats
from prefixcache.tiers.tiered_session import TieredSession
from prefixcache.tiers.transfer import DEMOTE, LOAD, PROMOTE, STORE, HostKVStore, TransferPlan


@dataclass(frozen=True, slots=True)
class _Held:
    """What a device block registered through the tier holds (while it may still hold it)."""

    block_hash: int
    parent_hash: int | None
    depth: int
    epoch: int


class TieredCache(TieredLayout):
    """Device blocks with a host tier behind them: demotion on eviction, promotion on match.

    Methods by purpose:

    - Allocation: :meth:`allocate`, :meth:`release`, :meth:`evict`, :meth:`apply_defragment`.
    - Prefix reuse: :meth:`match`, :meth:`register`; conversations: :meth:`open_session`.
    - Copies: :meth:`take_transfer` (the queued demotions and promotions, in order).
    - Weights: :meth:`begin_weight_epoch`, :attr:`epochs`.
    - Introspection: :meth:`stats`, :meth:`take_events`, :meth:`check`.

    Not thread-safe: one scheduler thread owns it, its allocator and its host tier.

    Args:
        allocator: the device pool; prefix caching on.
        host: the host tier's bookkeeping (its slots match a
            :class:`~prefixcache.tiers.transfer.HostKVStore`).
        epochs: weight epochs shared with whoever hashes prompts (default: a new one).
        reclaim_per_call: retired-epoch host entries dropped per :meth:`allocate`, >= 0.
        remote: a shared tier behind the host tier: live entries the host
            tier evicts are written there, and a match continues there.
        store: the host tier's storage; required with ``remote``, whose
            values must be exactly one slot's bytes.

    Raises:
        ConfigError: prefix caching is off, or a bad argument.
    """

    def __init__(
        self,
        allocator: KVBlockAllocator,
        host: HostTier,
        *,
        epochs: WeightEpochs | None = None,
        reclaim_per_call: int = 8,
        remote: RemoteTier | None = None,
        store: HostKVStore | None = None,
    ) -> None:
        if not isinstance(allocator, KVBlockAllocator):
            raise ConfigError(f"allocator must be a KVBlockAllocator, got {type(allocator)}")
        if not allocator.enable_prefix_caching:
            raise ConfigError("a host tier needs prefix caching on the device allocator")
        if not isinstance(host, HostTier):
            raise ConfigError(f"host must be a HostTier, got {type(host).__name__}")
        self.allocator = allocator
        self.host = host
        self.epochs = WeightEpochs() if epochs is None else epochs
        self.reclaim_per_call = require_int(
            reclaim_per_call, "reclaim_per_call", minimum=0, error=ConfigError
        )
        self._max_hash = max_hash_of(allocator.config.hash_algo)
        self._held: dict[int, _Held] = {}  # device block -> what it holds (may be evicted)
        self._held_block: dict[int, int] = {}  # hash -> device block, for the same entries
        self._queue: list[tuple[int, int, int]] = []  # copies not yet taken, in order
        self._payloads: list[bytes] = []  # remote values the queued loads write
        self.remote = remote
        self._slot_bytes = 0
        if remote is not None:
            if not isinstance(store, HostKVStore) or store.num_slots != host.num_slots:
                raise ConfigError("a remote tier needs the host tier's HostKVStore as store")
            self._slot_bytes = store.bytes_per_slot()
            host.on_evict = self._store_remote
        self._num_demoted = self._num_promoted = 0
        self._layout = allocator._layout_epoch

    # ------------------------------------------------------------------ allocation

    def allocate(self, num_blocks: int) -> np.ndarray | None:
        """Hand out ``num_blocks`` fresh device blocks, demoting the hashes they held.

        A block that held a hash of a live epoch which no other device block
        and no host slot holds gets a demotion queued before it is returned.

        Returns:
            int32 IDs with one active reference each, or None (nothing changes)
            when even eviction cannot free enough.

        Raises:
            InvalidArgumentError: ``num_blocks`` is not an int >= 0.

        Complexity: O(num_blocks) plus the allocator's and host policy's work.
        """
        self._follow_layout()
        ids = self.allocator.allocate_memory_blocks(num_blocks)
        if ids is None:
            return None
        block_ids = ids.numpy()
        self._demote_handed_out(block_ids)
        return block_ids

    def evict(self, num_blocks: int) -> int:
        """Evict up to ``num_blocks`` cached device blocks now, demoting their hashes.

        The allocator's own ``evict_cached_blocks`` would free the blocks
        without saying which hash each held, so the tier evicts by handing
        out every free block plus ``num_blocks`` (the allocator evicts
        through its policy), demoting what those held, and giving them back.
        For trimming a cache between requests (trace replay); a scheduler
        that allocates on demand demotes through :meth:`allocate` anyway.

        Returns:
            How many cached blocks were evicted.

        Raises:
            InvalidArgumentError: ``num_blocks`` is not an int >= 0.

        Complexity: O(free blocks + num_blocks).
        """
        num_blocks = require_int(num_blocks, "num_blocks", minimum=0)
        allocator = self.allocator
        num_evicted = min(num_blocks, allocator.get_evictable_block_count())
        if not num_evicted:
            return 0
        num_free = allocator.num_usable - allocator.get_total_used()
        ids = self.allocate(num_free + num_evicted)
        assert ids is not None  # free + evictable blocks are always there to take
        allocator.release_memory_blocks(ids)
        return num_evicted

    def release(self, block_ids: BlockIdsLike, *, paused: bool = False) -> None:
        """Drop one reference per occurrence, as :meth:`KVBlockAllocator.release_memory_blocks`.

        Complexity: as the allocator's.
        """
        self.allocator.release_memory_blocks(block_ids, paused=paused)

    # ------------------------------------------------------------------ prefix reuse

    def match(
        self, block_hashes: Any, *, num_tokens: int | None = None, resumed: bool = False
    ) -> TieredMatch:
        """Match ``block_hashes`` on the device, then continue into the host tier.

        Device hits are acquired (one active reference each); host hits get
        fresh device blocks, registered under their hashes at once, and
        promotions queued. When the device pool cannot take every host hit,
        as many as fit are promoted.

        Args:
            block_hashes: the prompt's chained block hashes, in order.
            num_tokens: the prompt's length, for the device's token counters.
            resumed: a preempted request comes back (the device counts it apart).

        Raises:
            InvalidTensorError, InvalidArgumentError: malformed hashes or count.

        Complexity: O(matched blocks) plus allocation of the promoted ones.
        """
        hashes = to_hash_list(block_hashes, "block_hashes", self._max_hash)
        self._follow_layout()
        device = self.allocator.match_prefix(
            hashes, acquire=True, num_tokens=num_tokens, resumed=resumed
        )
        device_ids = device.numpy()
        start = len(self._queue)
        rest = hashes[len(device_ids) :]
        slots = self.host.lookup(rest)
        free = self.allocator.get_evictable_block_count() + (
            self.allocator.num_usable - self.allocator.get_total_used()
        )
        slots = slots[: max(0, free)]
        promoted = np.empty(0, dtype=np.int32)
        self.host.pin(slots)
        num_host = len(slots)
        try:
            if self.remote is not None and num_host < free:
                first = len(device_ids) + num_host
                slots += self._load_remote(hashes, first, free - num_host)
            if slots:
                promoted = self._promote(hashes, len(device_ids), slots)
        finally:
            self.host.unpin(slots)
        self.host.count_query(len(rest), num_host)
        return TieredMatch(
            block_ids=np.concatenate([device_ids, promoted]).astype(np.int32),
            num_device_blocks=len(device_ids),
            num_host_blocks=num_host,
            plan=TransferPlan(tuple(self._queue[start:]), tuple(self._payloads)),
            num_remote_blocks=len(slots) - num_host,
        )

    def register(
        self,
        block_ids: BlockIdsLike,
        block_hashes: Any,
        *,
        parent_hash: int | None = None,
        token_ids: Any = None,
        lora_name: str | None = None,
        epoch: int | None = None,
    ) -> np.ndarray:
        """Register a chain as :meth:`KVBlockAllocator.register_kv_block_hashes` does.

        The tier remembers each block that now carries its hash, with the
        weight ``epoch`` its K/V was computed under (default: the current),
        so it can demote the block when it is evicted.

        Returns:
            A bool array: True where the block now carries its hash.

        Raises:
            As the allocator's method; InvalidArgumentError for a bad ``epoch``.

        Complexity: O(k) dict operations.
        """
        if epoch is None:
            epoch = self.epochs.current
        epoch = require_int(epoch, "epoch", minimum=0, maximum=self.epochs.current)
        ids = to_block_ids(block_ids, self.allocator.num_usable)
        hashes = to_hash_list(block_hashes, "block_hashes", self._max_hash)
        if parent_hash is not None:
            parent_hash = to_hash(parent_hash, "parent_hash", self._max_hash)
        holds = self.allocator.register_kv_block_hashes(
            ids, hashes, parent_hash=parent_hash, token_ids=token_ids, lora_name=lora_name
        ).numpy()
        self._remember(ids, hashes, parent_hash, holds, epoch)
        return holds

    def open_session(self) -> TieredSession:
        """A conversation handle whose turns go through this tier (see :class:`TieredSession`).

        Raises:
            ConfigError: a weight epoch has begun (sessions hash from the
                allocator's root, which carries no epoch), or the allocator
                refuses sessions (verify mode).

        Complexity: O(1).
        """
        return TieredSession(self)

    # ------------------------------------------------------------------ copies and weights

    def take_transfer(self) -> TransferPlan:
        """Every copy queued since the last call, in order; the queue is left empty.

        Run it (:meth:`KVTransfer.run`) before the next forward pass writes
        the blocks it demotes, and wait (:meth:`KVTransfer.wait`) before
        attention reads the blocks it promotes. Complexity: O(copies).
        """
        plan = TransferPlan(tuple(self._queue), tuple(self._payloads))
        self._queue.clear()
        self._payloads.clear()
        return plan

    def begin_weight_epoch(self, tag: str | int) -> int:
        """New weights: requests hashed from now on match only blocks of the new epoch.

        Requests running keep their blocks. The host tier's older entries
        are never matched again and are dropped first, a few per
        :meth:`allocate`; device blocks of older epochs are never demoted.
        Complexity: O(1), whatever the caches hold.

        Returns:
            The new epoch's number.
        """
        epoch = self.epochs.begin(tag)
        self.host.retire_epochs_before(epoch)
        return epoch

    # ------------------------------------------------------------------ introspection

    def stats(self) -> TieredStats:
        """Counts of both tiers. Complexity: O(1)."""
        return TieredStats(
            device=self.allocator.stats(),
            host=self.host.stats(),
            num_demoted_blocks=self._num_demoted,
            num_promoted_blocks=self._num_promoted,
            weight_epoch=self.epochs.current,
        )

    def take_events(self) -> list[KVCacheEvent]:
        """The device's events (medium ``"GPU"``), then the host tier's (``"CPU"``).

        Each tier's events keep their order; a router indexes the two media
        apart. Either tier may have events off. Complexity: O(events).
        """
        device = self.allocator.take_events() if self.allocator.events is not None else []
        return device + self.host.take_events()

    def check(self) -> None:
        """Check the allocator's and the host tier's invariants, and the tier's own: each
        block it remembers carries the remembered hash or none (a block registered anew
        behind its back breaks it), and its hash -> block index agrees. Tests and
        debugging; O(remembered blocks).

        Raises:
            InvariantError: the first broken invariant.
        """
        self.allocator.check_invariants()
        self.host.check()
        hash_of = self.allocator._engine.hash_of
        for block_id, held in self._held.items():
            carried = hash_of(block_id)
            if carried is not None and carried != held.block_hash:
                raise InvariantError(
                    f"block {block_id} carries hash {carried}; the tier remembers "
                    f"{held.block_hash} (registered behind the tier's back?)"
                )
        for block_hash, block_id in self._held_block.items():
            held_by = self._held.get(block_id)
            if held_by is None or held_by.block_hash != block_hash:
                raise InvariantError(f"the tier indexes hash {block_hash} at block {block_id}")

    # ------------------------------------------------------------------ internals

    def _demote_handed_out(self, block_ids: Any, fresh: frozenset[int] = frozenset()) -> None:
        """Queue demotions of what the handed-out ``block_ids`` held, then drop a few
        retired-epoch host entries (``reclaim_per_call``). ``fresh``: hashes the same step
        registered after the hand-out (a tiered session's step, checked after it returns),
        which count as not registered, as they were at the hand-out."""
        for block_id in block_ids.tolist():
            held = forget_record(self._held, self._held_block, block_id)
            if held is None:
                continue
            if (
                self.epochs.is_retired(held.epoch)
                or held.block_hash in self.host
                or (
                    self.allocator.is_hash_registered(held.block_hash)
                    and held.block_hash not in fresh
                )
            ):
                continue
            slot = self.host.put(
                held.block_hash, held.parent_hash, depth=held.depth, epoch=held.epoch
            )
            if slot is not None:
                self._queue.append((DEMOTE, block_id, slot))
                self._num_demoted += 1
        if self.reclaim_per_call:
            self.host.reclaim(self.reclaim_per_call)

    def _store_remote(self, block_hash: int, slot: int) -> None:
        """The host tier is about to reuse ``slot``: queue its bytes for the remote tier first."""
        self._queue.append((STORE, slot, block_hash))

    def _load_remote(self, hashes: list[int], first: int, room: int) -> list[int]:
        """Ask the remote tier for hashes from ``first`` on; load hits into pinned host slots."""
        assert self.remote is not None
        slots: list[int] = []
        for offset, payload in enumerate(self.remote.lookup(hashes[first : first + room])):
            if len(payload) != self._slot_bytes:
                break  # another layout's bytes: a miss
            index = first + offset
            parent = hashes[index - 1] if index else None
            slot = self.host.put(hashes[index], parent, depth=index, epoch=self.epochs.current)
            if slot is None:
                break
            self.host.pin([slot])
            self._queue.append((LOAD, len(self._payloads), slot))
            self._payloads.append(payload)
            slots.append(slot)
        return slots

    def _promote(self, hashes: list[int], num_device: int, slots: list[int]) -> np.ndarray:
        ids = self.allocate(len(slots))
        if ids is None:  # pragma: no cover - the count was checked against free + cached
            raise InvalidArgumentError("no device room for the promotion")
        chain = hashes[num_device : num_device + len(slots)]
        parent = hashes[num_device - 1] if num_device else None
        epoch = self.epochs.current
        holds = self.allocator.register_kv_block_hashes(ids, chain, parent_hash=parent).numpy()
        self._remember(ids, chain, parent, holds, epoch)
        self.host.touch(slots)
        self._queue.extend(
            (PROMOTE, slot, int(b)) for slot, b in zip(slots, ids.tolist(), strict=True)
        )
        self._num_promoted += len(slots)
        return ids

    def _remember(
        self,
        ids: np.ndarray,
        hashes: list[int],
        parent_hash: int | None,
        holds: np.ndarray,
        epoch: int,
    ) -> None:
        depth = self._depth_after(parent_hash)
        held, held_block = self._held, self._held_block
        parent = parent_hash
        for index, (block_id, block_hash, carries) in enumerate(
            zip(ids.tolist(), hashes, holds.tolist(), strict=True)
        ):
            if carries:
                forget_record(held, held_block, block_id)
                held[block_id] = _Held(block_hash, parent, depth + index, epoch)
                held_block[block_hash] = block_id
            parent = block_hash

    def _depth_after(self, parent_hash: int | None) -> int:
        """Chain position of the block after ``parent_hash``."""
        if parent_hash is None:
            return 0
        block_id = self._held_block.get(parent_hash)
        if block_id is not None:
            return self._held[block_id].depth + 1
        return 0


__all__ = ["TieredCache", "TieredMatch", "TieredStats"]
