"""HostTier: which chain hashes the host pool holds, in which slots, and which to drop first.

The host tier is a second, larger pool of KV blocks in host memory (pinned on
CUDA) behind the device pool. This class is its bookkeeping only: hash ->
slot, parent links, the eviction order through a :mod:`prefixcache.policies`
policy, the weight epoch of each entry, counters and ``"CPU"`` KV events. The
K/V bytes live in :class:`~prefixcache.tiers.transfer.HostKVStore` and move
with :class:`~prefixcache.tiers.transfer.KVTransfer`; nothing here touches a
tensor. See DESIGN.md, "Tiers".

As on the device, only *leaves* are evicted (entries no other host entry
continues), so a chain held in host memory is eaten from its end and a match
that runs into the host tier never finds a hole in the middle of a chain.
Entries of retired weight epochs are dropped before any live entry.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from prefixcache.engine.events import KVCacheEvent, KVEventLog
from prefixcache.engine.validation import require_int, require_int_list, require_sequence
from prefixcache.errors import ConfigError, InvalidArgumentError, InvariantError
from prefixcache.policies import EvictionPolicy, UnknownPolicyError
from prefixcache.policies import get as get_policy

MEDIUM_CPU = "CPU"

UNUSABLE_POLICIES = ("belady", "ref_zero")
"""Policy names a host tier refuses: they cannot order host slots (belady needs the future)."""


@dataclass(slots=True)
class _Entry:
    """One occupied host slot. Only :class:`HostTier` changes it."""

    block_hash: int
    parent_hash: int | None
    depth: int  # 0-based position in the chain
    epoch: int  # weight epoch the K/V was computed under
    num_accesses: int  # demotion counts 1, each promotion 1 more
    last_access: int  # the tier's clock at the demotion or the last promotion


@dataclass(frozen=True, slots=True)
class HostTierStats:
    """A snapshot of the host tier's counts, all plain ints."""

    num_slots: int
    num_used: int
    num_stored: int  # hashes demoted into a slot, cumulative
    num_evicted: int  # live entries dropped by the policy to make room
    num_retired: int  # entries of retired weight epochs dropped
    num_queried_blocks: int  # hashes a match asked the host tier for
    num_hit_blocks: int  # of those, found (and promoted)

    def as_dict(self) -> dict[str, int]:
        """The fields as a plain dict (JSON-ready)."""
        return {name: getattr(self, name) for name in self.__slots__}


class HostTier:
    """Host-slot bookkeeping for demoted blocks: lookup, insert, leaf-only eviction.

    Methods: :meth:`lookup` (longest run of present hashes, no change),
    :meth:`put` (store a hash, evicting when full), :meth:`touch`,
    :meth:`pin` / :meth:`unpin` (slots a promotion is reading), :meth:`retire_epochs_before`
    and :meth:`reclaim` (retired weight epochs), :meth:`take_events`,
    :meth:`stats`, :meth:`find_problems`.

    Not thread-safe: the scheduler thread that owns the device allocator owns this.

    Args:
        num_slots: host blocks, >= 1.
        policy: name of a :mod:`prefixcache.policies` policy (``"lru"`` by default;
            ``"belady"`` and ``"ref_zero"`` are refused) or a policy object.
        block_size: tokens per block, for events.
        events_capacity: 0 records no events; else the bound of the event queue.

    Raises:
        ConfigError: a bad count or an unknown or unusable policy.
    """

    def __init__(
        self,
        num_slots: int,
        *,
        policy: str | EvictionPolicy = "lru",
        block_size: int = 16,
        events_capacity: int = 0,
    ) -> None:
        self.num_slots = require_int(num_slots, "num_slots", minimum=1, error=ConfigError)
        block_size = require_int(block_size, "block_size", minimum=1, error=ConfigError)
        events_capacity = require_int(
            events_capacity, "events_capacity", minimum=0, error=ConfigError
        )
        self.policy = _build_policy(policy)
        self.events = (
            KVEventLog(events_capacity, block_size, MEDIUM_CPU) if events_capacity else None
        )
        self._entries: list[_Entry | None] = [None] * self.num_slots
        self._slot_of: dict[int, int] = {}
        self._free_slots = list(range(self.num_slots - 1, -1, -1))  # pop() gives slot 0 first
        self._num_children: dict[int, int] = {}  # parent hash -> host entries continuing it
        self._pinned: dict[int, int] = {}  # slot -> pin count; pinned slots are not tracked
        self._by_epoch: dict[int, dict[int, None]] = {}  # epoch -> its slots, oldest first
        self._live_from = 0  # entries of epochs below this are retired
        self._clock = 0
        self._num_stored = self._num_evicted = self._num_retired = 0
        self._num_queried = self._num_hit = 0
        self.on_evict: Callable[[int, int], None] | None = None
        """Called as ``on_evict(hash, slot)`` before a live entry's slot is taken (remote tier)."""

    # ------------------------------------------------------------------ queries

    def __len__(self) -> int:
        return len(self._slot_of)

    def __contains__(self, block_hash: object) -> bool:
        return _is_hash(block_hash) and block_hash in self._slot_of

    def slot_of(self, block_hash: int) -> int | None:
        """The slot holding ``block_hash``, or None. Complexity: O(1).

        Raises:
            InvalidArgumentError: ``block_hash`` is not an int.
        """
        return self._slot_of.get(_require_hash(block_hash, "block_hash"))

    def lookup(self, block_hashes: Iterable[int]) -> list[int]:
        """Slots of the longest leading run of ``block_hashes`` held here, live epochs only.

        Changes nothing (the counters move in :meth:`count_query`).
        Complexity: O(len(block_hashes)) checks, O(run length) dict lookups.

        Raises:
            InvalidArgumentError: not a sequence of int hashes.
        """
        items = require_sequence(block_hashes, "block_hashes")
        hashes = [_require_hash(h, "block_hashes item") for h in items]
        slots = []
        for block_hash in hashes:
            slot = self._slot_of.get(block_hash)
            if slot is None or self._entry(slot).epoch < self._live_from:
                break
            slots.append(slot)
        return slots

    def count_query(self, num_queried: int, num_hit: int) -> None:
        """Count a match that asked for ``num_queried`` hashes and promoted ``num_hit``.

        Raises:
            InvalidArgumentError: not ints with ``0 <= num_hit <= num_queried``.
        """
        num_queried = require_int(num_queried, "num_queried", minimum=0)
        num_hit = require_int(num_hit, "num_hit", minimum=0, maximum=num_queried)
        self._num_queried += num_queried
        self._num_hit += num_hit

    # ------------------------------------------------------------------ changes

    def put(
        self, block_hash: int, parent_hash: int | None, *, depth: int, epoch: int = 0
    ) -> int | None:
        """Store ``block_hash`` (a demotion) and return its slot; None when nothing can be freed.

        A hash already held keeps its slot (returned as is, nothing is
        copied again). When every slot is used, a retired epoch's entry is
        dropped first, then the policy's victim; pinned slots are never taken.

        Raises:
            InvalidArgumentError: a hash that is not an int (``parent_hash`` may be
                None), or ``depth`` or ``epoch`` not an int >= 0.

        Complexity: O(1) plus the policy's insert and, when full, its evict.
        """
        block_hash = _require_hash(block_hash, "block_hash")
        if parent_hash is not None:
            parent_hash = _require_hash(parent_hash, "parent_hash")
        depth = require_int(depth, "depth", minimum=0)
        epoch = require_int(epoch, "epoch", minimum=0)
        held = self._slot_of.get(block_hash)
        if held is not None:
            return held
        if not self._free_slots and not self.reclaim(1) and not self._evict_one():
            return None
        slot = self._free_slots.pop()
        self._clock += 1
        self._entries[slot] = _Entry(block_hash, parent_hash, depth, epoch, 1, self._clock)
        self._slot_of[block_hash] = slot
        self._by_epoch.setdefault(epoch, {})[slot] = None
        self._num_stored += 1
        if parent_hash is not None:
            count = self._num_children.get(parent_hash, 0)
            self._num_children[parent_hash] = count + 1
            parent_slot = self._slot_of.get(parent_hash)
            if count == 0 and parent_slot is not None and parent_slot in self.policy:
                self.policy.discard(parent_slot)  # no longer a leaf
        self._track_if_leaf(slot)
        if self.events is not None:
            self.events.record_stored([block_hash], parent_hash, None, None)
        return slot

    def touch(self, slots: Iterable[int]) -> None:
        """Mark ``slots`` used now (a promotion read them). Complexity: O(k log n).

        Raises:
            InvalidArgumentError: a slot holds nothing (checked first: nothing changes).
        """
        for slot in self._held_slots(slots):
            entry = self._entry(slot)
            entry.num_accesses += 1
            self._clock += 1
            entry.last_access = self._clock
            if slot in self.policy:
                self.policy.touch(slot, self._clock)

    def pin(self, slots: Iterable[int]) -> None:
        """Keep ``slots`` from eviction until :meth:`unpin` (a promotion is reading them).

        Raises:
            InvalidArgumentError: a slot holds nothing (checked first: nothing changes).
        """
        for slot in self._held_slots(slots):
            self._pinned[slot] = self._pinned.get(slot, 0) + 1
            if slot in self.policy:
                self.policy.discard(slot)

    def unpin(self, slots: Iterable[int]) -> None:
        """Undo one :meth:`pin` of each slot.

        Raises:
            InvalidArgumentError: a slot is not pinned as often as it is listed (checked
                first: nothing changes).
        """
        listed = require_int_list(slots, "slots")
        asked: dict[int, int] = {}
        for slot in listed:
            asked[slot] = asked.get(slot, 0) + 1
            if asked[slot] > self._pinned.get(slot, 0):
                raise InvalidArgumentError(f"host slot {slot} is not pinned")
        for slot in listed:
            count = self._pinned[slot]
            if count > 1:
                self._pinned[slot] = count - 1
                continue
            del self._pinned[slot]
            self._track_if_leaf(slot)

    def retire_epochs_before(self, epoch: int) -> None:
        """Entries of epochs below ``epoch`` are never matched again. Complexity: O(1).

        They are dropped by :meth:`reclaim` and before any live entry when
        room is needed, so a weight update costs nothing proportional to the cache.
        """
        self._live_from = max(self._live_from, require_int(epoch, "epoch", minimum=0))

    def reclaim(self, max_entries: int) -> int:
        """Drop up to ``max_entries`` entries of retired epochs, oldest epoch first.

        Returns how many were dropped. Complexity: O(max_entries) amortised.
        """
        max_entries = require_int(max_entries, "max_entries", minimum=0)
        dropped: list[int] = []
        for epoch in sorted(e for e in self._by_epoch if e < self._live_from):
            slots = self._by_epoch[epoch]
            while slots and len(dropped) < max_entries:
                slot = next(iter(slots))
                if slot in self._pinned:
                    break
                dropped.append(self._drop(slot))
            if len(dropped) >= max_entries:
                break
        self._num_retired += len(dropped)
        if dropped and self.events is not None:
            self.events.record_removed(dropped)
        return len(dropped)

    def take_events(self) -> list[KVCacheEvent]:
        """Drain the queued ``"CPU"`` events, oldest first (empty when events are off)."""
        return [] if self.events is None else self.events.take()

    def stats(self) -> HostTierStats:
        """Counts of the host tier. Complexity: O(1)."""
        return HostTierStats(
            num_slots=self.num_slots,
            num_used=len(self._slot_of),
            num_stored=self._num_stored,
            num_evicted=self._num_evicted,
            num_retired=self._num_retired,
            num_queried_blocks=self._num_queried,
            num_hit_blocks=self._num_hit,
        )

    def find_problems(self) -> list[str]:
        """Every broken invariant of the host tier, described; empty when all hold.

        Complexity: O(num_slots).
        """
        problems = []
        used = {slot for slot, entry in enumerate(self._entries) if entry is not None}
        if used & set(self._free_slots) or len(used) + len(self._free_slots) != self.num_slots:
            problems.append("host slots are not split exactly into used and free")
        held = {e.block_hash: slot for slot, e in enumerate(self._entries) if e is not None}
        if held != self._slot_of:
            problems.append("hash -> slot and slot -> hash are not inverse maps")
        children: dict[int, int] = {}
        for entry in self._live_entries():
            if entry.parent_hash is not None:
                children[entry.parent_hash] = children.get(entry.parent_hash, 0) + 1
        if children != {p: n for p, n in self._num_children.items() if n}:
            problems.append("child counts do not match the host entries' parents")
        leaves = {
            slot
            for slot in used
            if slot not in self._pinned and not self._num_children.get(self._entry(slot).block_hash)
        }
        if {slot for slot in used if slot in self.policy} != leaves or len(self.policy) != len(
            leaves
        ):
            problems.append("the host policy does not track exactly the unpinned leaves")
        return problems

    def check(self) -> None:
        """Raise InvariantError naming the first broken invariant (tests and debugging)."""
        problems = self.find_problems()
        if problems:
            raise InvariantError("; ".join(problems))

    # ------------------------------------------------------------------ internals

    def _held_slots(self, slots: Iterable[int]) -> list[int]:
        """``slots`` as a list, each checked to hold an entry, before anything changes."""
        checked = require_int_list(slots, "slots")
        for slot in checked:
            self._entry(slot)
        return checked

    def _entry(self, slot: int) -> _Entry:
        entry = self._entries[slot] if 0 <= slot < self.num_slots else None
        if entry is None:
            raise InvalidArgumentError(f"host slot {slot} holds nothing")
        return entry

    def _live_entries(self) -> Iterable[_Entry]:
        return (entry for entry in self._entries if entry is not None)

    def _track_if_leaf(self, slot: int) -> None:
        entry = self._entry(slot)
        if slot not in self._pinned and not self._num_children.get(entry.block_hash):
            self.policy.insert(
                slot, entry.block_hash, entry.last_access, entry.num_accesses, entry.depth
            )

    def _evict_one(self) -> bool:
        victims = self.policy.evict(1)
        if not victims:
            return False
        self._num_evicted += 1
        if self.on_evict is not None:
            self.on_evict(self._entry(victims[0]).block_hash, victims[0])
        removed = self._drop(victims[0], tracked=False)
        if self.events is not None:
            self.events.record_removed([removed])
        return True

    def _drop(self, slot: int, *, tracked: bool = True) -> int:
        """Free ``slot``; its parent may become a leaf. Returns the hash it held."""
        entry = self._entry(slot)
        if tracked and slot in self.policy:
            self.policy.discard(slot)
        self._entries[slot] = None
        del self._slot_of[entry.block_hash]
        epoch_slots = self._by_epoch[entry.epoch]
        del epoch_slots[slot]
        if not epoch_slots:
            del self._by_epoch[entry.epoch]
        self._free_slots.append(slot)
        parent = entry.parent_hash
        if parent is not None:
            count = self._num_children[parent] - 1
            if count:
                self._num_children[parent] = count
            else:
                del self._num_children[parent]
                parent_slot = self._slot_of.get(parent)
                if parent_slot is not None:
                    self._track_if_leaf(parent_slot)
        return entry.block_hash


def _build_policy(policy: str | EvictionPolicy) -> EvictionPolicy:
    if isinstance(policy, EvictionPolicy):
        return policy
    if not isinstance(policy, str):
        raise ConfigError(f"policy must be a policy name or object, got {type(policy).__name__}")
    if policy in UNUSABLE_POLICIES:
        raise ConfigError(f"policy {policy!r} cannot order a host tier")
    try:
        return get_policy(policy)
    except UnknownPolicyError as exc:
        raise ConfigError(str(exc)) from exc


__all__ = ["MEDIUM_CPU", "UNUSABLE_POLICIES", "HostTier", "HostTierStats"]


def _is_hash(value: object) -> bool:
    """An int (Python's or numpy's, never a bool) of any width: hashes may pass 64 bits."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _require_hash(value: object, name: str) -> int:
    """``value`` as a Python int if it is a hash (:func:`_is_hash`), else an error."""
    if not _is_hash(value):
        raise InvalidArgumentError(f"{name} must be an int, got {value!r}")
    return int(value)  # type: ignore[call-overload]
