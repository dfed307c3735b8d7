"""Scheduler hints: the cached prefixes of queued requests stay cached while they wait.

A scheduler knows its waiting queue; the eviction policy does not. Between a
request's arrival and its admission its cached prefix can be evicted by the
traffic admitted before it, and then recomputed (vLLM RFC #48485, PCR's
look-ahead LRU). :meth:`HintMethods.hint_upcoming` protects that prefix and
:meth:`HintMethods.withdraw_hint` ends the protection (at admission, after the
request took its own references, or when it is dropped).

Built above the engine from its existing primitives, so it works with every
policy and both engines, and no engine or policy bookkeeping changes: a hint
is one active reference (``acquire``) on each block of the longest cached
prefix of the hinted hashes, and withdrawing it releases them. A referenced
block is never evicted, whatever the policy.

The rules that keep hints harmless (DESIGN.md, "Scheduler hints"):

- **Bound.** Hints hold at most :attr:`HintMethods.hint_limit` distinct blocks
  (the whole usable pool by default); a hint past the bound protects the
  longest head of its prefix that fits (the head is the part other requests
  share) and the rest is left to the policy. No static share can keep an
  allocation from failing (running requests may fill the rest of the pool):
  the yield below does that, so the bound only says how much of the cache the
  queue may take from the policy. Under first-come-first-served admission the
  whole pool is right: every hinted block is used before any block whose next
  use is a request that has not arrived, and the newest hint is the farthest
  use, so protecting hints and yielding the newest first is Belady's order
  over what the queue shows (measured: a bound of half the pool reached 0.55
  of the optimum where the whole pool reached 0.98, DESIGN.md). A scheduler
  that may keep a request waiting indefinitely (priorities) should set a
  lower bound with :meth:`HintMethods.set_hint_limit`.
- **Yield.** A hint never makes an allocation fail that would succeed with
  every hint withdrawn: when ``allocate_memory_blocks``, ``admit_request``, a
  session turn or ``resume`` is short of room and withdrawing hints would make
  it fit, hints are withdrawn, newest first (the request that will wait the
  longest), until it fits; when even withdrawing all of them would not help,
  none is touched and the call fails as it would have. A yielded hint keeps
  its key (holding nothing) until :meth:`withdraw_hint`. Inside an open
  ``free_group`` releases are deferred, so nothing is yielded there.
- **Cost of a hint.** The reference is a hand-out: the engine counts it as a
  use of the block (recency and use counts, as a hit would; the queued
  request will use the block). Hinted blocks count as active in ``stats()``
  and the partition counters; :meth:`is_memory_available` counts the blocks
  only hints hold as available, since they would be yielded.

Hit counters (``stats().num_queried_tokens`` and the hit tokens) do not see
hints: the lookup is the engine's, not ``match_prefix``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from prefixcache.engine.core import EngineCore
from prefixcache.engine.pins import room_beside
from prefixcache.engine.prefix_hashing import to_hash_list
from prefixcache.engine.validation import require_int
from prefixcache.errors import BudgetExceededError, InvalidArgumentError, ReferenceCountError

__all__ = ["DEFAULT_HINT_SHARE", "HintMethods"]

DEFAULT_HINT_SHARE = 1.0
"""Share of the usable pool hints may hold by default (:attr:`HintMethods.hint_limit`)."""

_NO_IDS = np.empty(0, dtype=np.intp)

HintKey = int | str


def _check_key(key: object) -> HintKey:
    """A hint key: an int (not a bool) in signed 64 bits, or a string."""
    if isinstance(key, str):
        return key
    return require_int(key, "key")


class HintMethods:
    """Adds :meth:`hint_upcoming`, :meth:`withdraw_hint` and the yield to the allocator facade."""

    _engine: EngineCore
    _max_hash: int
    num_usable: int
    total_count: int
    active_count: int
    enable_prefix_caching: bool
    _track_changes: bool
    _bind_request_path: Callable[[], None]  # request_path.py: binds the fused native calls

    def _sync_collaborators(self) -> None:
        raise NotImplementedError  # the facade's

    def _init_hints(self) -> None:
        # key -> the blocks it holds (a chain, so distinct), in hint order (newest last).
        self._hints: dict[HintKey, np.ndarray] = {}
        self._hint_refs = np.zeros(self.total_count, dtype=np.int64)  # hint references a block
        self._num_hinted = 0  # distinct blocks holding a hint reference
        self._hint_limit = int(self.num_usable * DEFAULT_HINT_SHARE)
        self._group_depth = 0  # open free groups (the facade's free_group counts)

    # ------------------------------------------------------------------ public

    def hint_upcoming(self, key: Any, block_hashes: Any) -> int:
        """Protect the cached prefix of a queued request until :meth:`withdraw_hint`.

        Takes one active reference on each block of the longest cached prefix
        of ``block_hashes`` (at most the blocks :attr:`hint_limit` leaves room
        for), so no policy evicts them while the request waits. Blocks not
        cached now are not protected later: hint the same key again to extend
        the hint over blocks cached since (a re-hint replaces the hint; blocks
        in both never lose their reference).

        Args:
            key: names the hint (a request ID: an int or a string).
            block_hashes: the chained hashes of the request's prompt blocks
                that admission will match (as for :meth:`match_prefix`).

        Returns:
            How many blocks the hint protects.

        Raises:
            InvalidArgumentError: a key that is neither an int nor a string, or
                malformed hashes. Nothing changes.
            ReferenceCountError: re-hinting a key whose references a caller
                released (``release_memory_blocks`` on blocks it did not hold).

        Complexity: O(len(block_hashes)) lookups, vectorised reference updates.
        """
        key = _check_key(key)
        hashes = to_hash_list(block_hashes, "block_hashes", self._max_hash)
        old = self._hints.get(key, _NO_IDS)
        if len(old) and not self._engine.reference_counts(old)[0].all():
            raise ReferenceCountError(
                f"hint {key!r}: a caller released the references it holds; it cannot be replaced"
            )
        matched = _NO_IDS
        if self.enable_prefix_caching and hashes:
            matched = self._engine.lookup(hashes).astype(np.intp)
        if len(matched):
            is_new = self._hint_refs[matched] == 0
            room = self._hint_limit - self._num_hinted
            matched = matched[: int(np.searchsorted(np.cumsum(is_new), room, side="right"))]
        if len(matched):
            self._engine.acquire(matched)  # a chain: distinct blocks, one reference each
            self._num_hinted += int(np.count_nonzero(self._hint_refs[matched] == 0))
            self._hint_refs[matched] += 1
        if not self._hints:
            self._unbind_fused()  # the fused native calls cannot yield hints
        if key in self._hints:  # a re-hint: the new references are taken, drop the old
            self._release_hint(key)
        self._hints[key] = matched
        return len(matched)

    def withdraw_hint(self, key: Any) -> int:
        """End the hint ``key``: release the references it still holds.

        Call it when the request is admitted (after it took its own
        references: its blocks never become evictable in between) or dropped.

        Returns:
            How many blocks the hint still held (0 if it was yielded).

        Raises:
            InvalidArgumentError: a malformed key, or no hint under it. Nothing changes.

        Complexity: O(blocks held), plus O(log n) policy work per block that becomes cached.
        """
        key = _check_key(key)
        if key not in self._hints:
            raise InvalidArgumentError(f"no hint {key!r} is held")
        held = self._hints[key]
        self._release_hint(key)
        del self._hints[key]
        if not self._hints:
            self._bind_request_path()
        return len(held)

    @property
    def num_hinted_blocks(self) -> int:
        """Distinct blocks holding a hint reference now. O(1)."""
        return self._num_hinted

    @property
    def num_hints(self) -> int:
        """Hints held (yielded ones included, until withdrawn). O(1)."""
        return len(self._hints)

    @property
    def hint_limit(self) -> int:
        """Most distinct blocks hints may hold (default: the whole usable pool). O(1)."""
        return self._hint_limit

    def set_hint_limit(self, num_blocks: int) -> None:
        """Bound the distinct blocks hints hold; hints held now keep theirs.

        Raises:
            InvalidArgumentError: not an int in ``[0, num_usable]``.
        """
        self._hint_limit = require_int(num_blocks, "num_blocks", minimum=0, maximum=self.num_usable)

    # ------------------------------------------------------------------ the facade's

    def _release_hint(self, key: HintKey) -> None:
        """Release what hint ``key`` holds and keep the key, holding nothing."""
        held = self._hints[key]
        if not len(held):
            return
        self._engine.release(held, paused=False)
        self._hint_refs[held] -= 1
        self._num_hinted -= int(np.count_nonzero(self._hint_refs[held] == 0))
        self._hints[key] = _NO_IDS
        if self._track_changes:
            self._sync_collaborators()

    def _hint_only_blocks(self) -> np.ndarray | None:
        """Blocks whose every reference is a hint's: withdrawing all hints frees or caches them.

        None when the engine holds fewer references than the hints (a caller released
        one of theirs): then no hint is yielded, as the release could fail midway.
        """
        hinted = np.flatnonzero(self._hint_refs)
        active, paused = self._engine.reference_counts(hinted)
        held = self._hint_refs[hinted]
        if (active < held).any():
            return None
        only: np.ndarray = hinted[(active == held) & (paused == 0)]
        return only

    def _room(self, hit: np.ndarray) -> int:
        """Blocks an allocation could get now, beside the distinct blocks ``hit`` will take."""
        engine = self._engine
        num_cached_hits = 0
        if len(hit):
            active, paused = engine.reference_counts(hit)
            num_cached_hits = len(np.unique(hit[(active + paused) == 0]))
        return room_beside(engine, engine.num_usable, hit, num_cached_hits)  # exact

    def _yield_hints(self, needed: int, hit: np.ndarray = _NO_IDS) -> bool:
        """Withdraw hints, newest first, until ``needed`` blocks fit beside ``hit``.

        Returns False, changing nothing, when no hint holds a block, a free
        group is open, or withdrawing every hint would not make room; True
        after withdrawing (the caller retries the call that was short).
        """
        if not self._num_hinted or self._group_depth:
            return False
        only = self._hint_only_blocks()
        if only is None:
            return False
        hit = hit.astype(np.intp, copy=False)
        freed = np.setdiff1d(only, hit)
        if needed > self._room(hit) + len(freed):
            return False
        for key in reversed(list(self._hints)):
            self._release_hint(key)
            if needed <= self._room(hit):
                break
        return True

    def _yield_for_resume(self, ids: np.ndarray) -> bool:
        """As :meth:`_yield_hints`, for a ``resume`` of ``ids`` the active budget refused."""
        if not self._num_hinted or self._group_depth or self._hint_only_blocks() is None:
            return False
        unique, counts = np.unique(ids.astype(np.intp), return_counts=True)
        if not self._resume_fits(unique, counts, without_hints=True):
            return False
        for key in reversed(list(self._hints)):
            self._release_hint(key)
            if self._resume_fits(unique, counts, without_hints=False):
                break
        return True

    def _resume_fits(self, unique: np.ndarray, counts: np.ndarray, *, without_hints: bool) -> bool:
        """The engine's active-budget rule for a resume (``plan_move``), optionally hint-free."""
        engine = self._engine
        active, _ = engine.reference_counts(unique)
        num_active = engine.num_active
        if without_hints:
            active = active - self._hint_refs[unique]
            num_active -= self._num_hint_only_active()
        before = int(np.count_nonzero(active))
        after = int(np.count_nonzero(active + counts))
        return not (after > before and num_active + after - before > self.active_count)

    def _num_hint_only_active(self) -> int:
        """Blocks whose every active reference is a hint's (paused ones allowed)."""
        hinted = np.flatnonzero(self._hint_refs)
        active, _ = self._engine.reference_counts(hinted)
        return int(np.count_nonzero(active == self._hint_refs[hinted]))

    def _hint_room(self) -> int:
        """Blocks that withdrawing every hint would make free or cached."""
        only = self._hint_only_blocks() if self._num_hinted else None
        return 0 if only is None else len(only)

    def _resume_with_hints(self, ids: np.ndarray) -> None:
        """``engine.move`` back to active, yielding hints when the budget refuses."""
        try:
            self._engine.move(ids, to_paused=False)
        except BudgetExceededError:
            if not self._yield_for_resume(ids):
                raise
            self._engine.move(ids, to_paused=False)

    def _unbind_fused(self) -> None:
        """Route the request path through Python (which yields) while hints are held."""
        for name in ("allocate_block_ids", "release_request", "admit_request"):
            self.__dict__.pop(name, None)

    def _clear_hints(self) -> None:
        """Forget every hint (the engine was reset: their references are gone)."""
        self._hints.clear()
        self._hint_refs[:] = 0
        self._num_hinted = 0
        self._bind_request_path()

    def _move_hints(self, sources: np.ndarray, destinations: np.ndarray) -> None:
        """Follow a relocation: blocks at ``sources`` now live at ``destinations`` (swapped)."""
        if not self._num_hinted:
            return
        mapping = np.arange(self.total_count, dtype=np.intp)
        mapping[sources] = destinations
        mapping[destinations] = sources
        moved = np.empty_like(self._hint_refs)
        moved[mapping] = self._hint_refs
        self._hint_refs = moved
        for key, held in self._hints.items():
            if len(held):
                self._hints[key] = mapping[held]
