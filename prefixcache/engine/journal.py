"""PolicyJournal: the inverse calls that take back a failed allocator call's policy changes."""

from __future__ import annotations

from collections.abc import Callable

from prefixcache.policies import EvictionPolicy, ObservesRollbacks

_INSERTED, _REMOVED, _TOUCHED = 0, 1, 2


class PolicyJournal:
    """Records the policy calls of one allocator call so that a failure can undo them.

    The allocator makes its fallible calls (the policy's, then the pool's)
    before it writes any state of its own. When one of them raises,
    :meth:`rollback` replays the inverse of every policy call already made,
    newest first: an inserted leaf is discarded; a leaf that was discarded or
    evicted is inserted again, and a touched one discarded and inserted
    again, with the arguments the allocator's still unwritten state gives.

    LRU, whose order is a function of those arguments, tracks the same
    leaves in the same order afterwards with nothing more. The other online
    built-in policies that track leaves keep an undo log
    (``policies/undo.py``; ``ref_zero`` tracks none): each recognises
    these inverse calls and restores its whole state, history included
    (ages, targets, ghost lists, clocks, expired retention). A failed release
    is undone by discards only, the same calls as a hit right after a
    release; the journal's closing ``on_rollback`` call
    (``policies.ObservesRollbacks``) tells them apart. The journal relies on
    a raising policy method having changed nothing itself.

    Args:
        policy: the allocator's policy.
        insert_leaf: inserts a block into the policy with its current arguments.
    """

    __slots__ = ("_insert_leaf", "_policy", "_undo")

    def __init__(self, policy: EvictionPolicy, insert_leaf: Callable[[int], None]) -> None:
        self._policy = policy
        self._insert_leaf = insert_leaf
        self._undo: list[tuple[int, int]] = []  # (block ID, what happened to it)

    def insert(self, block_id: int) -> None:
        """Insert ``block_id`` into the policy; undone by a discard."""
        self._insert_leaf(block_id)
        self._undo.append((block_id, _INSERTED))

    def discard(self, block_id: int) -> None:
        """Discard ``block_id`` from the policy; undone by inserting it again."""
        self._policy.discard(block_id)
        self._undo.append((block_id, _REMOVED))

    def evicted(self, block_id: int) -> None:
        """Note that the policy's ``evict`` returned ``block_id``; undone by inserting it again."""
        self._undo.append((block_id, _REMOVED))

    def touch(self, block_id: int, now: int) -> None:
        """Touch ``block_id``; undone by discarding it and inserting it with its old arguments."""
        self._policy.touch(block_id, now)
        self._undo.append((block_id, _TOUCHED))

    def rollback(self) -> None:
        """Undo every recorded call, newest first, then tell a policy that observes rollbacks.

        Complexity: O(calls) policy calls.
        """
        policy, insert_leaf = self._policy, self._insert_leaf
        if not self._undo:
            return
        while self._undo:
            block_id, what = self._undo.pop()
            if what != _REMOVED:
                policy.discard(block_id)
            if what != _INSERTED:
                insert_leaf(block_id)
        if isinstance(policy, ObservesRollbacks):
            policy.on_rollback()
