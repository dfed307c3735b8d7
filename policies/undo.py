"""Exact undo of a policy's latest calls, for the allocator's rollback journal.

When an allocator call fails half-way, ``prefixcache.engine.journal.PolicyJournal``
takes back the policy calls already made, newest first, with inverse calls
of the public protocol: a leaf it inserted is discarded; a leaf it discarded
or that ``evict`` returned is inserted again with the arguments it had; a
touched leaf is discarded and inserted with its old arguments. An adaptive
policy that ran those inverse calls normally would keep a trace of the
aborted call (an age, a target share, a ghost list entry). :class:`UndoLog`
recognises the inverse calls and has the policy restore what the original
calls changed instead; :class:`LinkedMap` is an ordered map (for ghost lists
and histories) whose removals can be put back in place in O(1).

This module imports nothing from ``prefixcache``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

EVICTED, DISCARDED, INSERTED, TOUCHED = range(4)
"""Kinds of recorded calls, passed to the policy's restore function."""

InsertArgs = tuple[int, int, int, int]
"""The arguments of ``insert`` after the block ID: hash, last access, hand-outs, depth."""

Restore = Callable[[int, int, Any], None]
"""``restore(kind, block_id, data)``: undo one recorded call with the data the policy saved."""

_MIN_LIMIT = 64
_V = TypeVar("_V")


_Record = tuple[int, int, InsertArgs, Any]
"""One recorded call: (kind, block ID, insert arguments, restore data).

For EVICTED and DISCARDED the arguments are those that take the call back;
for INSERTED, those the block was inserted with; for TOUCHED, the block's
arguments before the touch. Tuples, not objects: one is made per policy call.
"""

_REMOVALS = (EVICTED, DISCARDED)
_OPENERS = (INSERTED, TOUCHED)
_AFTER_DISCARD_OR_TOUCH = (DISCARDED, TOUCHED)
_AFTER_ANY_BUT_DISCARD = (EVICTED, INSERTED, TOUCHED)
_AFTER_ANY_BUT_TOUCH = (EVICTED, DISCARDED, INSERTED)


class UndoLog:
    """The recent mutating calls of one policy, so that their exact inverses restore it.

    How a policy uses it: ``insert`` first asks :meth:`undo_insert`, which
    restores the policy and returns ``True`` when the insert takes back
    recorded calls; otherwise every mutating method runs its normal logic
    and then reports it (:meth:`inserted`, :meth:`discarded`,
    :meth:`touched`, :meth:`evicted` per victim, :meth:`evicted_nothing`)
    with the data its ``restore`` function needs to undo it.

    A discard always runs normally: a hit right after a release (insert,
    then discard of one block) is the same call sequence as a release taken
    back. When it follows an insert or a touch of its block, it opens a
    *pair* that the next calls of a rollback close: re-inserting the
    evicted or discarded block recorded below the pairs undoes them all
    with it (an evicted child put back after its exposed parent was
    discarded); re-inserting a touched block with its arguments before the
    touch undoes the touch. A call that does neither leaves the pairs as
    they are: the normal result.

    Why no legitimate sequence from the allocator is taken for an undo: an
    insert must repeat exactly the arguments of a recorded removal or of
    the block before a touch, and a block evicted and registered again,
    released after a hit, or touched, comes back with a later
    ``last_access`` or more hand-outs (the allocator's clock ticks on every
    allocation, hit and touch). Records are dropped where no allocator call
    continues: a discard after an insert, an eviction or another block's
    touch; an insert or eviction (even an empty one) after a discard or a
    touch; a touch after anything but a touch. So a leaf discarded because
    it gained a child is not matched when a later call re-inserts it after
    an empty ``evict`` (the child's subtree dropped). Runs of releases and
    evictions have no such boundary: the oldest records are trimmed once
    there are 1.5 x ``limit`` of them, ``limit`` being ``2 x (largest block
    ID + 1)``, more than one allocator call makes (it evicts or inserts each
    block at most once). Memory: O(pool size); every method O(1) amortised.

    A rollback that ends with discards of inserted blocks (a failed release)
    is the same call sequence as a hit after a release; the allocator's
    ``on_rollback`` signal tells them apart, and :meth:`rolled_back` then
    undoes the open pairs, inserts included. What stays inexact: a call that
    mixes discards or touches with inserts or evictions, which the allocator
    never makes.

    Not thread-safe, like the policies.
    """

    __slots__ = ("_args_of", "_limit", "_num_paired", "_records", "_trim_at")

    def __init__(self) -> None:
        self._records: list[_Record] = []
        # The newest _num_paired records are pairs: inserts or touches and the discards
        # that took them back, nested as a rollback makes them.
        self._num_paired = 0
        self._args_of: dict[int, InsertArgs] = {}  # tracked block ID -> its insert arguments
        self._limit = _MIN_LIMIT  # records one allocator call can make at most
        self._trim_at = _MIN_LIMIT + _MIN_LIMIT // 2

    def clear(self) -> None:
        """Forget every record and tracked block (the policy was cleared). Complexity: O(n)."""
        self.commit()
        self._args_of.clear()
        self._limit = _MIN_LIMIT
        self._trim_at = _MIN_LIMIT + _MIN_LIMIT // 2

    def commit(self) -> None:
        """Forget every record: no later call can take them back. O(records)."""
        self._records.clear()
        self._num_paired = 0

    # -- inverses --------------------------------------------------------------------

    def undo_insert(self, block_id: int, args: InsertArgs, restore: Restore) -> bool:
        """Whether ``insert(block_id, *args)`` takes back recorded calls; if so, undo them.

        Args:
            block_id: the block being inserted.
            args: its insert arguments after the ID.
            restore: the policy's function that undoes one record.

        Returns:
            ``True`` if the policy's state is now as before the calls taken
            back (the caller must then do nothing else); ``False`` if the
            insert is a new call, to be run normally and reported.

        Complexity: O(1) amortised, plus the policy's restores.
        """
        records = self._records
        num_paired = self._num_paired
        if num_paired:
            kind, closing_id, closing_args, data = records[-1]  # closes the outermost pair
            if closing_id == block_id and closing_args == args:
                records.pop()  # takes back that discard alone
                restore(kind, block_id, data)
                self._args_of[block_id] = args
                self._num_paired = num_paired - 2  # its opener is now unpaired
                return True
            kind, opening_id, opening_args, _ = records[-num_paired]
            if kind == TOUCHED and opening_id == block_id and opening_args == args:
                self._undo_newest(num_paired, restore)  # a touch, taken back
                return True
        if len(records) > num_paired:
            kind, below_id, below_args, _ = records[-num_paired - 1]
            if below_id == block_id and kind in _REMOVALS and below_args == args:
                self._undo_newest(num_paired + 1, restore)
                return True
        return False

    def rolled_back(self, restore: Restore) -> None:
        """The latest calls were a rollback's inverse calls: undo the pairs they left open.

        A failed release is taken back by discards of the blocks it inserted,
        which leave pairs that, without this signal, stand for a hit right
        after a release. Other rollbacks end with an insert, which closes or
        drops every pair, so this undoes nothing for them.
        Complexity: O(pairs), plus the policy's restores.
        """
        if self._num_paired:
            self._undo_newest(self._num_paired, restore)

    def _undo_newest(self, count: int, restore: Restore) -> None:
        records, args_of = self._records, self._args_of
        for _ in range(count):
            kind, block_id, args, data = records.pop()
            restore(kind, block_id, data)
            if kind == INSERTED:
                del args_of[block_id]
            else:
                args_of[block_id] = args
        self._num_paired = 0

    # -- new calls -------------------------------------------------------------------
    # Each starts a new call: pairs become history, and records after a boundary kind
    # (see the class docstring) are dropped, inline for speed.

    def args_of(self, block_id: int) -> InsertArgs:
        """The insert arguments of the tracked ``block_id``, touches applied. O(1)."""
        return self._args_of[block_id]

    def inserted(self, block_id: int, args: InsertArgs, data: Any) -> None:
        """Record a normal insert; ``data`` restores the state before it. O(1) amortised."""
        records = self._records
        self._num_paired = 0
        if records and records[-1][0] in _AFTER_DISCARD_OR_TOUCH:
            records.clear()
        self._args_of[block_id] = args
        records.append((INSERTED, block_id, args, data))
        if block_id >= self._limit >> 1 or len(records) > self._trim_at:
            self._bound(block_id)

    def discarded(self, block_id: int, data: Any) -> None:
        """Record a normal discard; ``data`` puts the block back. O(1) amortised."""
        args = self._args_of.pop(block_id)
        records = self._records
        num_paired = self._num_paired
        if len(records) > num_paired:
            kind, opening_id, _, _ = records[-num_paired - 1]
            if opening_id == block_id and kind in _OPENERS:
                records.append((DISCARDED, block_id, args, data))  # a pair, maybe around others
                self._num_paired = num_paired + 2
                return
        self._num_paired = 0
        if records and records[-1][0] in _AFTER_ANY_BUT_DISCARD:
            records.clear()
        records.append((DISCARDED, block_id, args, data))
        if block_id >= self._limit >> 1 or len(records) > self._trim_at:
            self._bound(block_id)

    def touched(self, block_id: int, now: int, data: Any) -> None:
        """Record a normal touch at ``now``; ``data`` restores the state before it. O(1)."""
        args_of, records = self._args_of, self._records
        block_hash, _, num_accesses, depth = old = args_of[block_id]
        self._num_paired = 0
        if records and records[-1][0] in _AFTER_ANY_BUT_TOUCH:
            records.clear()
        args_of[block_id] = (block_hash, now, num_accesses, depth)
        records.append((TOUCHED, block_id, old, data))
        if block_id >= self._limit >> 1 or len(records) > self._trim_at:
            self._bound(block_id)

    def evicted(self, block_id: int, data: Any) -> None:
        """Record that ``evict`` returned ``block_id``; ``data`` puts it back. O(1) amortised."""
        records = self._records
        self._num_paired = 0
        if records and records[-1][0] in _AFTER_DISCARD_OR_TOUCH:
            records.clear()
        records.append((EVICTED, block_id, self._args_of.pop(block_id), data))
        if block_id >= self._limit >> 1 or len(records) > self._trim_at:
            self._bound(block_id)

    def evicted_nothing(self) -> None:
        """Record an ``evict`` call that returned nothing. O(1)."""
        records = self._records
        self._num_paired = 0
        if records and records[-1][0] in _AFTER_DISCARD_OR_TOUCH:
            records.clear()

    def _bound(self, block_id: int) -> None:
        """Raise the limit to cover ``block_id``; drop the oldest records beyond it."""
        if block_id >= self._limit >> 1:
            self._limit = 2 * block_id + 2
            self._trim_at = self._limit + self._limit // 2
        records = self._records
        if len(records) > self._trim_at:
            del records[: len(records) - self._limit]


class LinkedMap(Generic[_V]):
    """An insertion-ordered map whose removals can be put back in place, newest first.

    A dictionary of links (previous key, next key, value), as in Knuth's
    dancing links: a removed entry keeps its neighbours, so :meth:`relink`
    puts it back between them in O(1), provided every later change was
    undone first (which :class:`UndoLog` guarantees). Iteration and
    :meth:`oldest` go oldest first; assigning an existing key keeps its
    place, as with ``OrderedDict``. Keys are never ``None``.

    Complexity: every method O(1) but iteration. Not thread-safe.
    """

    __slots__ = ("_first", "_last", "_links")

    def __init__(self) -> None:
        self._links: dict[int, list[Any]] = {}  # key -> [previous key, next key, value]
        self._first: int | None = None
        self._last: int | None = None

    def __len__(self) -> int:
        return len(self._links)

    def __contains__(self, key: object) -> bool:
        return key in self._links

    def __iter__(self) -> Iterator[int]:
        key = self._first
        while key is not None:
            yield key
            key = self._links[key][1]

    def get(self, key: int) -> _V | None:
        """The value of ``key``, or ``None``."""
        link = self._links.get(key)
        return None if link is None else link[2]

    def put(self, key: int, value: _V) -> None:
        """Set ``key`` to ``value``; a new key goes last."""
        link = self._links.get(key)
        if link is not None:
            link[2] = value
            return
        self._links[key] = [self._last, None, value]
        if self._last is None:
            self._first = key
        else:
            self._links[self._last][1] = key
        self._last = key

    def unlink(self, key: int) -> list[Any] | None:
        """Remove ``key`` if present; return its link, for :meth:`relink` (value at ``[2]``)."""
        link = self._links.pop(key, None)
        if link is None:
            return None
        previous, following, _ = link
        if previous is None:
            self._first = following
        else:
            self._links[previous][1] = following
        if following is None:
            self._last = previous
        else:
            self._links[following][0] = previous
        return link

    def unlink_oldest(self) -> tuple[int, list[Any]]:
        """Remove the oldest entry; return its key and link. The map must not be empty."""
        key = self._first
        assert key is not None
        link = self.unlink(key)
        assert link is not None
        return key, link

    def relink(self, key: int, link: list[Any]) -> None:
        """Put back ``key`` as :meth:`unlink` returned it, between its old neighbours."""
        self._links[key] = link
        previous, following, _ = link
        if previous is None:
            self._first = key
        else:
            self._links[previous][1] = key
        if following is None:
            self._last = key
        else:
            self._links[following][0] = key

    def clear(self) -> None:
        """Remove every entry."""
        self._links.clear()
        self._first = self._last = None
