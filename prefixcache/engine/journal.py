"""PolicyJournal: drives the policy's transaction for one engine operation."""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

from prefixcache.policies import EvictionPolicy, is_transactional

_INSERTED, _REMOVED, _TOUCHED = 0, 1, 2


class PolicyJournal:
    """The engine's side of the transaction rule (DESIGN.md, "The transaction rule").

    An engine operation makes its fallible calls (the policy's, then the
    pool's) before it writes any state of its own. It opens the journal
    (:meth:`begin`, which opens the policy's transaction), makes the policy
    calls through it, and ends with :meth:`commit` when the operation
    succeeds or :meth:`rollback` when anything raised: the policy's
    ``abort`` then restores its whole state as it was at ``begin``. The
    journal records nothing itself; what to undo is the policy's business.

    A *legacy* policy (one that follows the old protocol without subclassing
    :class:`~prefixcache.policies.EvictionPolicy`) has no transactions:
    constructing the journal for it gives a :class:`InverseCallJournal`,
    which takes its calls back with inverse calls instead.

    One journal serves every operation of an engine, one at a time. Not
    thread-safe.

    Args:
        policy: the engine's policy.
        insert_leaf: inserts a block into the policy with its current arguments.
    """

    __slots__ = ("_insert_leaf", "_policy")

    NOTES_VICTIMS: ClassVar[bool] = False
    """Whether the planner must report each victim with :meth:`evicted`."""

    def __new__(cls, policy: object = None, insert_leaf: object = None) -> PolicyJournal:
        # Both optional: copy and pickle call __new__ with no arguments.
        if cls is PolicyJournal and policy is not None and not is_transactional(policy):
            cls = InverseCallJournal
        return object.__new__(cls)

    def __init__(self, policy: EvictionPolicy, insert_leaf: Callable[[int], None]) -> None:
        self._policy = policy
        self._insert_leaf = insert_leaf

    def begin(self) -> None:
        """Open the policy's transaction. Complexity: O(1)."""
        self._policy.begin()

    def insert(self, block_id: int) -> None:
        """Insert ``block_id`` into the policy with its current arguments."""
        self._insert_leaf(block_id)

    def discard(self, block_id: int) -> None:
        """Discard ``block_id`` from the policy."""
        self._policy.discard(block_id)

    def evicted(self, block_id: int) -> None:
        """Note that the policy's ``evict`` returned ``block_id`` (the policy recorded it)."""

    def touch(self, block_id: int, now: int) -> None:
        """Touch ``block_id`` at clock ``now``."""
        self._policy.touch(block_id, now)

    def commit(self) -> None:
        """The operation succeeded: the policy keeps every change. Complexity: O(1)."""
        self._policy.commit()

    def rollback(self) -> None:
        """The operation failed: the policy aborts to its state at :meth:`begin`.

        Complexity: O(changes), in the policy.
        """
        self._policy.abort()


class InverseCallJournal(PolicyJournal):
    """The journal of a legacy policy: inverse calls take a failed operation back.

    The old protocol had no transactions. This journal records each call
    and, on :meth:`rollback`, replays the inverses newest first: an inserted
    leaf is discarded; a discarded or evicted one inserted again, and a
    touched one discarded and inserted again, with the arguments the engine's
    still unwritten state gives. That restores a policy whose order is a
    function of those arguments (LRU-like); a policy that learns from its
    calls keeps a trace of them, unless it has the old ``on_rollback()``
    signal, called after the inverses. Deprecated with the old protocol:
    subclass :class:`~prefixcache.policies.EvictionPolicy` instead.
    """

    __slots__ = ("_undo",)

    NOTES_VICTIMS = True

    def __init__(self, policy: EvictionPolicy, insert_leaf: Callable[[int], None]) -> None:
        super().__init__(policy, insert_leaf)
        self._undo: list[tuple[int, int]] = []  # (block ID, what happened to it)

    def begin(self) -> None:
        self._undo.clear()

    def insert(self, block_id: int) -> None:
        self._insert_leaf(block_id)
        self._undo.append((block_id, _INSERTED))

    def discard(self, block_id: int) -> None:
        self._policy.discard(block_id)
        self._undo.append((block_id, _REMOVED))

    def evicted(self, block_id: int) -> None:
        self._undo.append((block_id, _REMOVED))

    def touch(self, block_id: int, now: int) -> None:
        self._policy.touch(block_id, now)
        self._undo.append((block_id, _TOUCHED))

    def commit(self) -> None:
        self._undo.clear()

    def rollback(self) -> None:
        """Undo every recorded call, newest first. Complexity: O(calls) policy calls."""
        policy, insert_leaf, undo = self._policy, self._insert_leaf, self._undo
        if not undo:
            return
        while undo:
            block_id, what = undo.pop()
            if what != _REMOVED:
                policy.discard(block_id)
            if what != _INSERTED:
                insert_leaf(block_id)
        on_rollback = getattr(policy, "on_rollback", None)
        if callable(on_rollback):
            on_rollback()
