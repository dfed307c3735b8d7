"""``auto``'s chain shortcut: :meth:`evicts_first`, the exposed parent evicted in one step.

When a chain eviction exposes a parent, the engine asks whether the policy
would evict it next; a ``True`` answer spares the insert-and-evict round
trip (it took ``auto``'s replay from 4.0x to about 2.0x LRU's CPU time on the
Mooncake trace). So that the policy learns exactly what the round trip would
have taught it, the answer books that eviction's statistics (new uses, the
duel, the leader, the safety net's state and shadow size); replays with and
without the shortcut give the same hits, charges and metadata
(``tests/policies/test_auto_evicts_first.py``). A mixin of
:class:`~prefixcache.policies.auto.AutoPolicy`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

FREQUENCY_CAP = 3  # "frequent" ranks by min(uses, 3): more classes made it worse on chat


class ChainShortcut:
    """:meth:`evicts_first` for :class:`~prefixcache.policies.auto.AutoPolicy` (a mixin)."""

    _tracked: dict[int, tuple[Any, ...]]
    _stays: dict[int, tuple[int, int]]
    _pool: int
    _leader: int
    _txn_undo: list[Any] | None

    if TYPE_CHECKING:  # defined by the other mixins of AutoPolicy (stubs would shadow them)

        def _next_leader(self) -> int: ...
        def _next_fallback(self) -> bool: ...
        def _set_fallback(self, fallback: bool, undo: list[Any] | None) -> None: ...
        def _count(self, block_hash: int, num_uses: int, undo: list[Any] | None) -> int: ...
        def _uses_after(self, block_hash: int, new_uses: int) -> int: ...
        def _resize_shadow(self, change: int, undo: list[Any] | None) -> None: ...
        def _open(self, duel: tuple[int, int, int, int], undo: list[Any] | None) -> None: ...
        def _lru_top(self) -> tuple[int, ...]: ...
        def _frequent_top(self) -> tuple[int, ...]: ...

    def evicts_first(
        self, block_id: int, block_hash: int, last_access: int, num_accesses: int, depth: int
    ) -> bool:
        """Whether ``evict(1)`` would return ``block_id`` right after inserting it; if so, book it.

        The engine evicts a block this answers ``True`` for without the
        insert-and-evict round trip (the parent a chain eviction exposes).
        So that the policy learns exactly what the round trip would have
        taught it, a ``True`` answer also books that eviction's statistics:
        the block's new uses in the sketch and the duel against the other
        expert's candidate. It never changes the tracked leaves or their
        order (the contract of the hook); the bookkeeping is in the undo log
        like every change. ``False`` where the pool estimate would grow.
        Complexity: O(1) amortised.
        """
        tracked, stays = self._tracked, self._stays
        if block_id >= self._pool:
            return False
        stay = stays.get(block_id)
        if stay is not None and stay[0] == block_hash and stay[1] <= num_accesses:
            new_uses = num_accesses - stay[1]  # as in _new_uses, inlined
        else:
            new_uses = num_accesses - 1
        undo = self._txn_undo
        if not tracked:
            if new_uses > 0:
                self._count(block_hash, new_uses, undo)
            self._resize_shadow(-1, undo)
            return True
        lead, fallback = self._next_leader(), self._next_fallback()
        leader = 0 if fallback else lead  # the expert that evicts (see evict)
        lru_key = self._lru_top()
        lru_first = last_access < lru_key[0] or (
            last_access == lru_key[0] and block_id < lru_key[1]
        )
        if not lru_first and leader == 0:
            return False
        frequent_key = self._frequent_top()
        uses = self._uses_after(block_hash, new_uses)
        if uses > FREQUENCY_CAP:
            uses = FREQUENCY_CAP
        frequent_first = uses < frequent_key[0] or (
            uses == frequent_key[0]
            and (
                last_access < frequent_key[1]
                or (last_access == frequent_key[1] and block_id < frequent_key[2])
            )
        )
        if not frequent_first and leader == 1:
            return False
        # Booked as evict(1) would: the leader, the new uses, the stay, the duel.
        if lead != self._leader:
            if undo is not None:
                undo.append((setattr, self, "_leader", self._leader))
            self._leader = lead
        self._set_fallback(fallback, undo)
        if new_uses > 0:
            self._count(block_hash, new_uses, undo)
        if stay is not None:
            del stays[block_id]
            if undo is not None:
                undo.append((stays.__setitem__, block_id, stay))
        if not (lru_first and frequent_first):
            kept = frequent_key[2] if leader == 0 else lru_key[1]
            kept_hash = stays[kept][0]
            if kept_hash != block_hash:
                self._open((block_hash, 1 << leader, kept_hash, 2 >> leader), undo)
        self._resize_shadow(-1, undo)
        return True
