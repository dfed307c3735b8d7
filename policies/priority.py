"""Retention priorities per prefix (TensorRT-LLM style), LRU within a priority."""

from __future__ import annotations

from collections.abc import Callable

from prefixcache.policies.base import EvictionPolicy
from sortedcontainers import SortedList

_Expired = list[tuple[int, tuple[int, int | None]]]
"""Retention entries an expiry dropped, in order: (hash, (priority, expires_at))."""


class PriorityPolicy(EvictionPolicy):
    """Evicts the lowest retention priority first, least recently used among equals.

    Priorities are set per block hash through :meth:`set_retention` (the
    allocator's ``set_retention_priority`` forwards here), so they follow a
    prefix across evictions and block-ID reuse and may be set before the
    prefix is cached. A priority may expire: at clock ``expires_at`` the hash
    falls back to ``default_priority``. Use it to pin a system prompt or an
    agent's paused context (high priority), or to let a one-off document go
    first (low priority).

    Guard: at most ``max_retained_fraction`` of the tracked leaves rank above
    the default. While more do, the lowest-ranked of them competes as a
    default block, so pinned prefixes can crowd out at most that share of
    the evictable leaves, and :meth:`evict` never refuses while it tracks
    anything: pinned blocks can never exhaust the pool.

    Time: expiry needs the current clock. Pass ``clock`` (a callable
    returning the allocator's clock, or a fake in tests); without it the
    policy uses the largest clock value it has seen in :meth:`insert` and
    :meth:`touch`, which lags the allocator by at most the calls since.

    Transactions: each change is recorded with what it replaced (a key, the
    clock seen, the retention entries it set or expired), so an abort
    restores all of it, :meth:`set_retention` and expiries included.

    >>> policy = PriorityPolicy()
    >>> policy.set_retention(10, priority=90, expires_at=None)
    >>> policy.insert(1, block_hash=10, last_access=1, num_accesses=1, depth=0)
    >>> policy.insert(2, block_hash=20, last_access=5, num_accesses=1, depth=0)
    >>> policy.evict(1)  # block 1 is older but pinned
    [2]

    Args:
        default_priority: priority of hashes without a retention entry
            (35 as in TensorRT-LLM's 0-100 scale; any int works).
        max_retained_fraction: share of the tracked leaves that may rank above
            the default, in ``[0, 1]``.
        clock: returns the current clock value; None: the largest seen.

    Raises:
        ValueError: ``max_retained_fraction`` is outside ``[0, 1]``.
        TypeError: ``default_priority`` is not an int or ``clock`` not callable.

    Complexity: ``insert``, ``discard``, ``touch`` and :meth:`set_retention`
    O(log n) plus O(log n) per expiry they process; ``evict(k)`` O(k log n)
    plus the same. Memory: O(n + hashes with a retention entry). Not
    thread-safe.
    """

    def __init__(
        self,
        default_priority: int = 35,
        max_retained_fraction: float = 0.5,
        clock: Callable[[], int] | None = None,
    ) -> None:
        if isinstance(default_priority, bool) or not isinstance(default_priority, int):
            raise TypeError(f"default_priority must be an int, got {default_priority!r}")
        if isinstance(max_retained_fraction, bool) or not (
            isinstance(max_retained_fraction, (int, float)) and 0 <= max_retained_fraction <= 1
        ):
            raise ValueError(
                f"max_retained_fraction must lie in [0, 1], got {max_retained_fraction!r}"
            )
        if clock is not None and not callable(clock):
            raise TypeError(f"clock must be callable or None, got {clock!r}")
        self._default = default_priority
        self._max_retained_fraction = float(max_retained_fraction)
        self._clock = clock
        self._now = 0  # the largest clock value seen
        self._retention: dict[int, tuple[int, int | None]] = {}  # hash -> (priority, expiry)
        self._expiries: SortedList = SortedList()  # (expires_at, hash) of entries that expire
        # Keys (priority, last access, block ID), one list for leaves above the default.
        self._retained: SortedList = SortedList()
        self._others: SortedList = SortedList()
        self._key_of: dict[int, tuple[int, int, int]] = {}
        self._hash_of: dict[int, int] = {}  # tracked block ID -> hash
        self._block_of: dict[int, int] = {}  # hash -> tracked block ID

    # ------------------------------------------------------------------ retention

    def set_retention(self, block_hash: int, priority: int, expires_at: int | None) -> None:
        """Give ``block_hash`` ``priority`` until clock ``expires_at`` (None: forever).

        Setting the default priority without expiry removes the entry. A
        tracked block with that hash is re-ranked now.

        Raises:
            TypeError: ``priority`` or ``expires_at`` is not an int.

        Complexity: O(log n).
        """
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise TypeError(f"priority must be an int, got {priority!r}")
        if expires_at is not None and (
            isinstance(expires_at, bool) or not isinstance(expires_at, int)
        ):
            raise TypeError(f"expires_at must be an int or None, got {expires_at!r}")
        old = self._retention.get(block_hash)
        self._drop_retention(block_hash)
        if priority != self._default:
            self._put_retention(block_hash, (priority, expires_at))
        self._rerank(block_hash)
        undo = self._txn_undo
        if undo is not None:
            undo.append((self._unset_retention, block_hash, old))
        self._expire()

    def _unset_retention(self, block_hash: int, old: tuple[int, int | None] | None) -> None:
        """Give ``block_hash`` its entry before :meth:`set_retention` back."""
        self._drop_retention(block_hash)
        if old is not None:
            self._put_retention(block_hash, old)
        self._rerank(block_hash)

    def priority_of(self, block_hash: int) -> int:
        """The priority ``block_hash`` has now (expired entries fall back). O(log n)."""
        self._expire()
        return self._retention.get(block_hash, (self._default, None))[0]

    def _put_retention(self, block_hash: int, entry: tuple[int, int | None]) -> None:
        self._retention[block_hash] = entry
        if entry[1] is not None:
            self._expiries.add((entry[1], block_hash))

    def _drop_retention(self, block_hash: int) -> None:
        entry = self._retention.pop(block_hash, None)
        if entry is not None and entry[1] is not None:
            self._expiries.remove((entry[1], block_hash))

    def _expire(self) -> None:
        """Drop the entries whose time has come and re-rank their tracked blocks."""
        now = self._clock() if self._clock is not None else self._now
        expiries = self._expiries
        if not expiries or expiries[0][0] > now:
            return
        expired: _Expired = []
        while expiries and expiries[0][0] <= now:
            _, block_hash = expiries.pop(0)
            expired.append((block_hash, self._retention.pop(block_hash)))
            self._rerank(block_hash)
        undo = self._txn_undo
        if undo is not None:
            undo.append((self._unexpire, expired))

    def _unexpire(self, expired: _Expired) -> None:
        """Put back the entries :meth:`_expire` dropped, newest first, and re-rank."""
        for block_hash, entry in reversed(expired):
            self._put_retention(block_hash, entry)
            self._rerank(block_hash)

    def _rerank(self, block_hash: int) -> None:
        block_id = self._block_of.get(block_hash)
        if block_id is not None:
            _, last_access, _ = self._key_of[block_id]
            self._remove(block_id)
            self._place(block_id, block_hash, last_access)

    # ------------------------------------------------------------------ protocol

    def _place(self, block_id: int, block_hash: int, last_access: int) -> None:
        priority = self._retention.get(block_hash, (self._default, None))[0]
        key = (priority, last_access, block_id)
        self._key_of[block_id] = key
        self._hash_of[block_id] = block_hash
        self._block_of[block_hash] = block_id  # the latest, when two leaves share a hash
        (self._retained if priority > self._default else self._others).add(key)

    def _remove(self, block_id: int) -> tuple[int, int]:
        """Untrack ``block_id``; return its hash and last access."""
        key = self._key_of.pop(block_id)
        (self._retained if key[0] > self._default else self._others).remove(key)
        block_hash = self._hash_of.pop(block_id)
        if self._block_of.get(block_hash) == block_id:  # vLLM may cache one hash twice
            del self._block_of[block_hash]
        return block_hash, key[1]

    def insert(
        self, block_id: int, block_hash: int, last_access: int, num_accesses: int, depth: int
    ) -> None:
        """Track ``block_id`` at its hash's priority and its last access. Complexity: O(log n)."""
        now = self._now
        if last_access > now:
            self._now = last_access
        self._expire()
        self._place(block_id, block_hash, last_access)
        undo = self._txn_undo
        if undo is not None:
            undo.append((self._uninsert, block_id, now))

    def _uninsert(self, block_id: int, now: int) -> None:
        self._remove(block_id)
        self._now = now

    def discard(self, block_id: int) -> None:
        """Stop tracking ``block_id``. Raises KeyError if untracked. Complexity: O(log n)."""
        block_hash, last_access = self._remove(block_id)
        undo = self._txn_undo
        if undo is not None:
            undo.append((self._place, block_id, block_hash, last_access))

    def touch(self, block_id: int, now: int) -> None:
        """Record an access at ``now``. Raises KeyError if untracked. Complexity: O(log n)."""
        block_hash = self._hash_of[block_id]
        old_now = self._now
        if now > old_now:
            self._now = now
        _, last_access = self._remove(block_id)
        self._place(block_id, block_hash, now)
        undo = self._txn_undo
        if undo is not None:
            undo.append((self._untouch, block_id, last_access, old_now))
        self._expire()

    def _untouch(self, block_id: int, last_access: int, now: int) -> None:
        block_hash, _ = self._remove(block_id)
        self._place(block_id, block_hash, last_access)
        self._now = now

    def evict(self, num_blocks: int) -> list[int]:
        """Remove up to ``num_blocks`` leaves, lowest priority first. Complexity: O(k log n)."""
        self._expire()  # nothing is due between calls without a clock
        victims: list[int] = []
        undo = self._txn_undo
        while len(victims) < num_blocks and self._key_of:
            block_id = self._next_victim()
            block_hash, last_access = self._remove(block_id)
            victims.append(block_id)
            if undo is not None:
                undo.append((self._place, block_id, block_hash, last_access))
        return victims

    def _next_victim(self) -> int:
        if not self._others:
            oldest: tuple[int, int, int] = self._retained[0]
            return oldest[2]
        candidate: tuple[int, int, int] = self._others[0]
        over_cap = len(self._retained) > self._max_retained_fraction * len(self._key_of)
        if over_cap:
            _, last_access, block_id = self._retained[0]
            candidate = min(candidate, (self._default, last_access, block_id))
        return candidate[2]

    def clear(self) -> None:
        """Forget every tracked leaf and retention entry (allocator reset). Complexity: O(n)."""
        self._retention.clear()
        self._expiries.clear()
        self._now = 0
        self._retained.clear()
        self._others.clear()
        self._key_of.clear()
        self._hash_of.clear()
        self._block_of.clear()
        self._txn_undo = None

    def __len__(self) -> int:
        return len(self._key_of)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._key_of
