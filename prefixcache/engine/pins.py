"""Chain pins: a session turn references its chain's tail, not every context block.

A session turn (``engine/python_session.py``) whose hits form a clean chain (each
hit the registered parent of the next, which every lookup returns) takes one
reference on the chain's last hit block, its *tail*, instead of one on each
block: the ancestors stay cached, and the leaf rule keeps them (a block with a
registered child is no leaf, so no policy sees it). What the engine must add
so that the result equals full references (DESIGN.md, "Sessions"):

- the capacity check and :meth:`evict`'s count leave out the cached ancestors
  of pinned tails (:meth:`PinnedChains.num_reserved`), and the last resort
  (the planner's pinned-subtree drop) never takes one: an O(1) upper bound
  (:attr:`ReferenceTable.pin_bound`, the pinned chains' lengths) first, the
  exact walk only when the bound refuses;
- full references stamp every ancestor: a pin stamps the tail and notes the
  stamp and a pending access on it (``pin_stamp``, ``pin_pending``), handed to
  the parent when the block leaves the registry by eviction (max, sum), so a
  parent that becomes a leaf is told what full references would have written;
- the counters count a pin as the references it stands for.

The pin is used where nothing else reads an ancestor's counts: a policy that
caches (not ref-zero), hears of no hit (no ``on_hit``) and reads no held
counts (no ``bind_free_counts``); elsewhere :attr:`can_pin` is False and a
turn takes full references.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from prefixcache.engine.free_list import SortedFreeList
from prefixcache.engine.partitions import PartitionLedger
from prefixcache.engine.pool import BlockPool
from prefixcache.engine.references import ReferenceTable
from prefixcache.engine.registry import ROOT, HashRegistry
from prefixcache.errors import BlockStateError
from prefixcache.policies import EvictionPolicy

__all__ = ["PinnedChains", "PythonPinSteps"]


class PinnedChains:
    """Reads of the pin state the Python engine keeps in its :class:`ReferenceTable`."""

    def __init__(self, registry: HashRegistry, refs: ReferenceTable) -> None:
        self._registry = registry
        self._refs = refs

    def ancestors(self) -> set[int]:
        """The strict ancestors of every pinned tail. Complexity: O(pinned chains)."""
        parent_of = self._registry.parent_of
        seen: set[int] = set()
        for tail in np.flatnonzero(self._refs.pins).tolist():
            block_id = int(parent_of[tail])
            while block_id != ROOT and block_id not in seen:
                seen.add(block_id)
                block_id = int(parent_of[block_id])
        return seen

    def num_reserved(self, extra: np.ndarray | None = None) -> int:
        """Cached blocks among the pinned tails' ancestors and ``extra`` (distinct)."""
        blocks = self.ancestors() if self._refs.pin_bound else set()
        if extra is not None and len(extra):
            blocks.update(extra.tolist())
        if not blocks:
            return 0
        ids = np.fromiter(blocks, dtype=np.intp, count=len(blocks))
        return int(np.count_nonzero(self._refs.is_unreferenced(ids)))

    def effective_access(self) -> tuple[np.ndarray, np.ndarray]:
        """Last access and hand-outs per block as full references would have written them.

        A registered block's values plus what its registered descendants' pins
        would have stamped on it (the max of their ``pin_stamp``, the sum of
        their ``pin_pending``). Complexity: O(registered blocks · depth); for tests.
        """
        refs, registry = self._refs, self._registry
        last, counts = refs.last_access.copy(), refs.num_accesses.copy()
        parent_of = registry.parent_of
        for block_id in np.flatnonzero(refs.pin_pending).tolist():
            if not registry.is_registered[block_id]:
                continue
            stamp, pending = refs.pin_stamp.item(block_id), refs.pin_pending.item(block_id)
            ancestor = int(parent_of[block_id])
            while ancestor != ROOT:
                last[ancestor] = max(last.item(ancestor), stamp)
                counts[ancestor] += pending
                ancestor = int(parent_of[ancestor])
        return last, counts


class PythonPinSteps:
    """The Python engine's pin calls (a mixin of ``PythonEngine``); see the module doc."""

    refs: ReferenceTable
    registry: HashRegistry
    pins: PinnedChains
    pool: BlockPool | SortedFreeList
    ledger: PartitionLedger
    policy: EvictionPolicy
    retains_unreferenced: bool
    _observe_hit: Callable[[list[int]], None] | None
    _num_queried: int
    _num_hits: int
    _num_released: int

    def take_hit(self, block_ids: np.ndarray, num_queried: int, *, acquire: bool) -> None:
        raise NotImplementedError  # the engine's

    def release(self, block_ids: np.ndarray, *, paused: bool) -> None:
        raise NotImplementedError  # the engine's

    @property
    def can_pin(self) -> bool:
        """Whether a session may pin its chain (see the module doc)."""
        return (
            self.retains_unreferenced
            and self._observe_hit is None
            and not callable(getattr(self.policy, "bind_free_counts", None))
        )

    @property
    def pin_bound(self) -> int:
        """An upper bound on the cached blocks pins keep: their chains' lengths. O(1)."""
        return self.refs.pin_bound

    def pin_chain(self, tail: int, chain_length: int, num_queried: int) -> None:
        """``take_hit(chain, num_queried, acquire=True)`` on a cached chain of
        ``chain_length`` (two or more) blocks ending at ``tail``, referencing only the tail.

        The counters and the tail's stamp are what ``take_hit`` writes, the
        ancestors' stamps are noted on the tail. O(1): the ancestors are
        never read (the caller found the chain cached).

        Raises:
            ReferenceCountError: the tail's count would pass its limit.
        """
        self.take_hit(np.array([tail], dtype=np.intp), 0, acquire=True)
        refs = self.refs
        refs.pins[tail] += 1
        refs.pin_bound += chain_length - 1
        refs.pin_pending[tail] += 1
        refs.pin_stamp[tail] = refs.last_access[tail]
        self._num_queried += num_queried
        self._num_hits += chain_length - 1

    def release_pinned(self, block_ids: np.ndarray, chain_length: int) -> None:
        """Release ``block_ids`` (``block_ids[0]`` a tail pinned with ``chain_length``) and
        the pin, counted as the ``chain_length - 1`` references it stood for.

        Raises:
            BlockStateError: ``block_ids[0]`` is not pinned.
            ReferenceCountError: as :meth:`release`; nothing changes.
        """
        tail = int(block_ids[0])
        if not self.refs.pins[tail]:
            raise BlockStateError(f"block {tail} is not a pinned chain's tail")
        self.release(block_ids, paused=False)
        self.refs.pins[tail] -= 1
        self.refs.pin_bound -= chain_length - 1
        self._num_released += chain_length - 1

    def reclaimable(self, block_ids: np.ndarray) -> int:
        """Free plus cached blocks, less the cached ones among ``block_ids`` (distinct) and
        the pinned tails' ancestors: what an allocation may take once ``block_ids`` are held.

        Complexity: O(len(block_ids) + pinned chains).
        """
        room: int = self.pool.num_free + self.ledger.num_cached
        return room - self.pins.num_reserved(block_ids)

    def num_evictable(self, num_blocks: int) -> int:
        """How many of ``num_blocks`` cached blocks eviction may take (pinned chains kept):
        O(1) when the bound leaves them, else the exact walk."""
        cached: int = self.ledger.num_cached
        if num_blocks <= cached - self.refs.pin_bound:
            return num_blocks
        return min(num_blocks, cached - self.pins.num_reserved())

    def pinned_tails(self) -> list[tuple[int, int]]:
        """``(tail, pins)`` of every pinned tail, by ID (tests compare against full references)."""
        pins = self.refs.pins
        return [(int(b), int(pins[b])) for b in np.flatnonzero(pins)]


def room_beside(engine: Any, needed: int, hit: np.ndarray, num_cached_hits: int) -> int:
    """Blocks an allocation may take beside ``hit`` (``num_cached_hits`` of them cached):
    free plus cached, less those hits and the cached blocks pinned chains keep.

    O(1) when the pinned chains' lengths leave ``needed`` blocks anyway (the value
    returned is then at least ``needed``, not exact); else exact, O(hits + pinned chains).
    """
    room: int = engine.num_free + engine.num_cached - num_cached_hits
    bound: int = engine.pin_bound
    if not bound or needed <= room - bound:
        return room
    exact: int = engine.reclaimable(hit)
    return exact
