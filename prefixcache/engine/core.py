"""EngineCore: the seam between the allocator facade and the state it manages.

Every public call of :class:`~prefixcache.engine.allocator.KVBlockAllocator`
reads or writes the same few things: the free stack, the active and paused
reference counts and their partition counters, the hash registry with its
parent/child links, the cached leaves and their eviction order, the logical
clock and the cumulative counters. They sit behind this one interface. The
facade validates arguments (types, shapes, ID ranges), runs the features that
are not hot (KV events, MoE routing, fingerprints, retention, free-group
bookkeeping of the caller) and delegates every state change here.

Two implementations exist: :class:`~prefixcache.engine.python_engine.PythonEngine`,
the readable reference that drives any eviction policy object, and the native
engine (``prefixcache._native``), which owns the same state as flat arrays in
compiled code with the built-in policies inside. A stateful differential test
drives both with the same operations and compares every observable after each
step. See DESIGN.md, "The engine seam".

Conventions shared by both implementations:

- Block IDs come in already validated by the facade as 1-D ``np.ndarray``
  (any integer dtype) with every ID in ``[0, num_usable)``; duplicates allowed
  where a method says so. IDs go out as fresh int32 arrays.
- Hashes come in as ``list[int]`` of signed 64-bit values other than the
  sentinels 0 and -1 (the facade checks).
- Errors are the library's own (:mod:`prefixcache.errors`), raised before any
  state changes: a failed call leaves the engine exactly as it was.
- Nothing is read back from a device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np


@dataclass(frozen=True, slots=True)
class EngineCounters:
    """Cumulative counts since construction or the last reset, all plain ints."""

    num_allocated_blocks: int
    num_released_references: int
    num_queried_blocks: int
    num_hit_blocks: int
    num_evicted_blocks: int
    num_dropped_blocks: int
    clock: int


class EngineCore(Protocol):
    """The state every allocator call reads and writes, behind one small interface.

    Attributes:
        name: ``"python"`` or ``"native"``: which implementation runs.
        num_usable: usable blocks; the dummy block's ID.
        paused_count: budget of the paused partition.
        active_count: budget of the active partition.
        retains_unreferenced: False in ref-zero mode (an unreferenced hashed
            block is dropped at once instead of cached).
    """

    name: str
    num_usable: int
    paused_count: int
    active_count: int
    retains_unreferenced: bool

    # ---- O(1) counters

    @property
    def num_free(self) -> int:
        """Blocks on the free stack."""
        ...

    @property
    def num_active(self) -> int:
        """Blocks with at least one active reference."""
        ...

    @property
    def num_paused(self) -> int:
        """Blocks with paused references only."""
        ...

    @property
    def num_holding_paused(self) -> int:
        """Blocks holding any paused reference: what the paused budget bounds."""
        ...

    @property
    def num_cached(self) -> int:
        """Unreferenced registered blocks (all evictable)."""
        ...

    @property
    def num_registered(self) -> int:
        """Blocks carrying a hash."""
        ...

    @property
    def clock(self) -> int:
        """The logical clock: ticks once per hand-out, hit and touch."""
        ...

    def counters(self) -> EngineCounters:
        """Cumulative counters."""
        ...

    def advance_clock(self, ticks: int) -> int:
        """Add ``ticks`` (>= 0, checked by the facade) to the clock and return it."""
        ...

    # ---- allocation

    def allocate(self, num_blocks: int) -> np.ndarray | None:
        """Hand out ``num_blocks`` fresh blocks with one active reference each.

        Evicts cached blocks (policy order) when the free stack is short.
        Returns an int32 array, or None (nothing changes) if even eviction
        cannot free enough.
        """
        ...

    def release(self, block_ids: np.ndarray, *, paused: bool) -> None:
        """Drop one reference per occurrence in the given partition.

        Inside an open free group, active releases are validated now (against
        the references minus those already queued) and applied when the
        outermost group closes.

        Raises:
            ReferenceCountError: a block holds fewer references than released.
        """
        ...

    def open_group(self) -> None:
        """Open a (possibly nested) free group."""
        ...

    def close_group(self) -> None:
        """Close a free group; the outermost applies the queued releases."""
        ...

    # ---- prefix reuse

    def lookup(self, block_hashes: list[int]) -> np.ndarray:
        """IDs (int32) of the longest registered prefix of ``block_hashes``; changes nothing."""
        ...

    def take_hit(self, block_ids: np.ndarray, num_queried: int, *, acquire: bool) -> None:
        """Count a prefix query of ``num_queried`` hashes that hit ``block_ids`` (a chain).

        With ``acquire``, also take one active reference on each hit block,
        as :meth:`acquire` does.
        """
        ...

    @property
    def can_pin(self) -> bool:
        """Whether a session may pin its chain's tail instead of each block (pins.py)."""
        ...

    @property
    def pin_bound(self) -> int:
        """The pinned chains' ancestors, counted with repeats: at least the cached blocks
        pins keep. O(1)."""
        ...

    def pin_chain(self, tail: int, chain_length: int, num_queried: int) -> None:
        """``take_hit(chain, num_queried, acquire=True)`` on a cached chain of
        ``chain_length`` >= 2 blocks ending at ``tail``, referencing only the tail
        (engine/pins.py). O(1): the ancestors are never read."""
        ...

    def release_pinned(self, block_ids: np.ndarray, chain_length: int) -> None:
        """Release ``block_ids`` and the pin on ``block_ids[0]`` (a chain of ``chain_length``).

        Raises:
            BlockStateError: ``block_ids[0]`` is not pinned.
        """
        ...

    def reclaimable(self, block_ids: np.ndarray) -> int:
        """Free plus cached blocks less the cached ones among ``block_ids`` and those pinned
        chains keep. O(len(block_ids) + pinned chains)."""
        ...

    def num_evictable(self, num_blocks: int) -> int:
        """``num_blocks`` (at most the cached blocks), less what pinned chains keep."""
        ...

    def pinned_tails(self) -> list[tuple[int, int]]:
        """``(tail, pins)`` of every pinned tail by ID."""
        ...

    def acquire(self, block_ids: np.ndarray) -> None:
        """Take one active reference per occurrence on cached or referenced blocks.

        Raises:
            BlockStateError: a block is free.
        """
        ...

    def register(
        self, block_ids: np.ndarray, block_hashes: list[int], parent_hash: int | None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Register a chain; see :meth:`KVBlockAllocator.register_kv_block_hashes`.

        Returns:
            ``(holds, new)``, bool arrays per position: whether the block now
            carries its hash, and whether it took it in this call.

        Raises:
            BlockStateError: a block is not referenced.
            HashConflictError: a block carries another hash, appears twice with
                different hashes, or ``parent_hash`` is not registered.
        """
        ...

    def block_of(self, block_hash: int) -> int | None:
        """The block holding ``block_hash``, or None."""
        ...

    def hash_of(self, block_id: int) -> int | None:
        """The hash ``block_id`` carries, or None."""
        ...

    def registered_chains(self) -> list[tuple[int, int | None]]:
        """``(hash, parent hash or None)`` of every registered block, parents first."""
        ...

    def registrations(self, block_ids: np.ndarray) -> np.ndarray:
        """Each block's registration generation (int64; 0: unregistered). A generation
        is given once per registration, so an unchanged value means the block kept its
        hash and parent since it was read (relocation and reset excepted: the facade's
        layout epoch covers those). What sessions check their chains with. O(k)."""
        ...

    # ---- partitions and time

    def move(self, block_ids: np.ndarray, *, to_paused: bool) -> None:
        """Move one reference per occurrence between the active and paused partitions.

        Raises:
            ReferenceCountError: too few references in the source partition
                (active ones queued for release in a free group do not count).
            BudgetExceededError: the target partition's budget would overflow.
        """
        ...

    def touch(self, block_ids: np.ndarray) -> None:
        """Mark referenced or cached blocks used now (one clock tick for the call).

        Raises:
            BlockStateError: a block is free.
        """
        ...

    def evict(self, num_blocks: int) -> int:
        """Evict up to ``num_blocks`` cached blocks through the policy; how many were freed."""
        ...

    def evict_blocks(self, block_ids: np.ndarray) -> int:
        """Free the cached leaves among ``block_ids`` (valid IDs), tail-first; how many.

        Walks the IDs from the end: a cached leaf (registered, unreferenced,
        no registered child) leaves the policy (``discard``) and the registry
        and is freed, and its parent, left a cached leaf, joins the policy as
        after an eviction (pins' stamps handed down), unless it is the walk's
        next ID. Other blocks are skipped. Counted as evictions (the sessions'
        structure key sees them). DESIGN.md, "Scheduler hints".
        """
        ...

    def set_retention(self, block_hashes: list[int], priority: int, expires_at: int | None) -> None:
        """Give each hash retention ``priority`` until ``expires_at`` in the policy, all or none.

        Only for a policy with retention (the facade checks the hook first).
        """
        ...

    def reference_counts(self, block_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Active and paused reference counts (fresh int32 arrays)."""
        ...

    def describe_state(self, block_id: int) -> str:
        """``"free"``, ``"active"``, ``"paused"`` or ``"cached"``."""
        ...

    # ---- layout (DESIGN.md, "Defragmentation")

    def free_ids(self) -> np.ndarray:
        """The free IDs (int32), the next to go out last. Complexity: O(num_free)."""
        ...

    def relocate(self, sources: np.ndarray, destinations: np.ndarray, *, check_only: bool) -> None:
        """Move each source's whole state to its destination; the sources become free.

        Reference counts, access history, hash, parent/child links and the
        policy's entry move with the block; the free list is rebuilt so the
        lowest free ID goes out first. With ``check_only`` only the checks run.

        Raises:
            BlockStateError: a free group is open, a source is free or a
                destination is not.
            InvalidArgumentError: an ID appears twice among the moves.
        """
        ...

    # ---- collaborators above the engine

    def take_changes(self) -> tuple[np.ndarray, list[int]]:
        """Drain what changed since the last call: blocks that became free, hashes removed.

        Recorded only when the engine was built with ``track_changes=True``
        (events or routing on); otherwise both are always empty.
        """
        ...

    def reset(self) -> None:
        """Every block free, nothing registered, counters and clock zero."""
        ...

    def find_problems(self) -> list[str]:
        """Every broken invariant (DESIGN.md, "Invariants"), described; empty when all hold."""
        ...


def fused_core(engine: EngineCore) -> Any | None:
    """The native extension object behind ``engine`` when its chains are the facade's, else None.

    Set (``fused``) on the native engine under xxh3_64 from the facade's root, salt
    included: the request path, sessions and chain hashing may then call its fused
    C calls directly. None for the Python engine and for the native engine under
    wide hashes (``WideKeyEngine``), whose keys are not the facade's hashes.
    """
    return engine.core if getattr(engine, "fused", False) else None  # type: ignore[attr-defined]
