"""Least-frequently-used eviction with dynamic ageing (LFU-DA) over the cached leaves."""

from __future__ import annotations

from prefixcache.policies.base import EvictionPolicy
from sortedcontainers import SortedList


class LFUPolicy(EvictionPolicy):
    """Evicts the leaf with the lowest aged frequency; LRU among equals.

    Plain LFU lets a block that was popular once stay forever. This is LFU
    with dynamic ageing (Arlitt et al., 2000): the cache keeps an age ``L``,
    the score of the last victim. A block's score is ``L + frequency`` as of
    its last insert or touch, so a block that stops being used is overtaken
    by the rising age and goes, however large its old count was.

    Frequency is ``num_accesses`` (hand-outs since the block was allocated,
    so a prefix hit counts) plus one per :meth:`touch` while cached, each
    multiplied by ``frequency_weight``: below 1 ages bursts out faster, above
    1 keeps frequent blocks longer. A block's history ends when it is evicted.

    Transactions: each change is recorded with the key, count and age it
    replaced, so an abort restores the exact keys and age instead of
    re-scoring at the raised age.

    >>> policy = LFUPolicy()
    >>> policy.insert(1, block_hash=10, last_access=1, num_accesses=5, depth=0)
    >>> policy.insert(2, block_hash=20, last_access=2, num_accesses=1, depth=0)
    >>> policy.evict(1)  # the one-hit block goes first
    [2]
    >>> policy.insert(3, block_hash=30, last_access=3, num_accesses=1, depth=0)
    >>> policy.evict(1)  # age is now 1: block 3 scores 2, block 1 still 5
    [3]

    Args:
        frequency_weight: score added per access (> 0).

    Raises:
        ValueError: ``frequency_weight`` is not a positive number.

    Complexity: ``insert``, ``discard`` and ``touch`` O(log n); ``evict(k)``
    O(k log n). Not thread-safe.
    """

    def __init__(self, frequency_weight: float = 1.0) -> None:
        if isinstance(frequency_weight, bool) or not (
            isinstance(frequency_weight, (int, float)) and frequency_weight > 0
        ):
            raise ValueError(f"frequency_weight must be a number > 0, got {frequency_weight!r}")
        self._weight = float(frequency_weight)
        self._age = 0.0  # score of the last victim
        # (score, last access, block ID): the smallest is the next victim.
        self._order: SortedList = SortedList()
        self._key_of: dict[int, tuple[float, int, int]] = {}
        self._accesses: dict[int, int] = {}  # block ID -> accesses counted so far

    def insert(
        self, block_id: int, block_hash: int, last_access: int, num_accesses: int, depth: int
    ) -> None:
        """Score ``block_id`` at the current age plus its accesses. Complexity: O(log n)."""
        self._accesses[block_id] = num_accesses
        self._place(block_id, last_access)
        undo = self._txn_undo
        if undo is not None:
            undo.append((self._unplace, block_id))

    def _place(self, block_id: int, last_access: int) -> None:
        key = (self._age + self._weight * self._accesses[block_id], last_access, block_id)
        self._key_of[block_id] = key
        self._order.add(key)

    def _unplace(self, block_id: int) -> None:
        """Untrack ``block_id`` (the inverse of an insert)."""
        self._order.remove(self._key_of.pop(block_id))
        del self._accesses[block_id]

    def _put_back(self, key: tuple[float, int, int], num_accesses: int, age: float) -> None:
        """Track ``key``'s block at ``key`` with ``num_accesses``, the age back at ``age``."""
        block_id = key[2]
        if block_id in self._key_of:  # a touch taken back: drop the key it placed
            self._order.remove(self._key_of[block_id])
        self._age = age
        self._key_of[block_id] = key
        self._accesses[block_id] = num_accesses
        self._order.add(key)

    def discard(self, block_id: int) -> None:
        """Stop tracking ``block_id``. Raises KeyError if untracked. Complexity: O(log n)."""
        key = self._key_of.pop(block_id)
        self._order.remove(key)
        num_accesses = self._accesses.pop(block_id)
        undo = self._txn_undo
        if undo is not None:
            undo.append((self._put_back, key, num_accesses, self._age))

    def touch(self, block_id: int, now: int) -> None:
        """Count one access and re-score at the current age. Complexity: O(log n)."""
        key = self._key_of[block_id]
        self._order.remove(key)
        num_accesses = self._accesses[block_id]
        self._accesses[block_id] = num_accesses + 1
        self._place(block_id, now)
        undo = self._txn_undo
        if undo is not None:
            undo.append((self._put_back, key, num_accesses, self._age))

    def evict(self, num_blocks: int) -> list[int]:
        """Remove up to ``num_blocks`` lowest-scored leaves, raising the age. O(k log n)."""
        victims: list[int] = []
        undo = self._txn_undo
        while len(victims) < num_blocks and self._order:
            key = self._order.pop(0)
            block_id, age = key[2], self._age
            self._age = max(age, key[0])
            del self._key_of[block_id]
            num_accesses = self._accesses.pop(block_id)
            victims.append(block_id)
            if undo is not None:
                undo.append((self._put_back, key, num_accesses, age))
        return victims

    def clear(self) -> None:
        """Forget every tracked leaf and reset the age. Complexity: O(n)."""
        self._order.clear()
        self._key_of.clear()
        self._accesses.clear()
        self._age = 0.0
        self._txn_undo = None

    def __len__(self) -> int:
        return len(self._key_of)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._key_of
