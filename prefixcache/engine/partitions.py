"""PartitionLedger: how many blocks are active, paused and cached, and the budgets."""

from __future__ import annotations

import numpy as np

from prefixcache.errors import BudgetExceededError


class PartitionLedger:
    """O(1) counts of the blocks in each referenced or cached state, with the budgets.

    A block is *active* while it holds an active reference, *paused* while it
    holds paused references only, *cached* while unreferenced but registered.
    The paused partition may hold at most ``paused_count`` blocks and the
    active one at most ``active_count`` when :meth:`plan_move` moves
    references between them; allocation is bounded by the whole pool, as in
    Megatron-core. ``num_holding_paused`` counts the blocks holding *any*
    paused reference (paused-only or also active), the count the paused budget
    bounds (issue 15 item 3: releasing the running holder of a paused block
    makes it paused-only with no check, so the budget must already cover it).
    Its own invariants (``check``): no count is negative and
    ``num_paused <= num_holding_paused <= paused_count``.

    Args:
        num_usable: usable blocks (the dummy excluded).
        paused_count: budget of the paused partition.
    """

    __slots__ = (
        "active_count",
        "num_active",
        "num_cached",
        "num_holding_paused",
        "num_paused",
        "paused_count",
    )

    def __init__(self, num_usable: int, paused_count: int) -> None:
        self.paused_count = paused_count
        self.active_count = num_usable - paused_count
        self.num_active = 0
        self.num_paused = 0
        self.num_cached = 0
        self.num_holding_paused = 0

    def plan_move(
        self, active: np.ndarray, paused: np.ndarray, delta: int | np.ndarray, *, to_paused: bool
    ) -> tuple[np.ndarray, np.ndarray, int, int, int]:
        """The counts and partition totals after moving ``delta`` references per block.

        ``active`` and ``paused`` are the blocks' counts before the move.
        Changes nothing.

        The paused budget bounds the blocks holding *any* paused reference: a
        pause is refused when the blocks that would newly hold one exceed
        :attr:`paused_avail`, so releasing the running holders later can never
        leave more paused-only blocks than the budget. A pause that gives no
        block its first paused reference always passes. The active budget
        bounds :meth:`resume` alone (allocation may fill the whole pool, as in
        Megatron-core), so a resume that activates no block always passes.

        Returns:
            ``(active after, paused after, active total, paused total,
            holding-paused total)``.

        Raises:
            BudgetExceededError: the pause gives more blocks their first paused
                reference than the paused budget has room for, or the resume
                activates blocks beyond the active budget.
        """
        num_active = int(np.count_nonzero(active))
        num_paused = int(np.count_nonzero((active == 0) & (paused > 0)))
        after_active = active - delta if to_paused else active + delta
        after_paused = paused + delta if to_paused else paused - delta
        new_active = int(np.count_nonzero(after_active))
        new_paused = int(np.count_nonzero((after_active == 0) & (after_paused > 0)))
        total_active = self.num_active + new_active - num_active
        total_paused = self.num_paused + new_paused - num_paused
        num_holding = int(np.count_nonzero(paused))
        new_holding = int(np.count_nonzero(after_paused))
        total_holding = self.num_holding_paused + new_holding - num_holding
        if to_paused and new_holding - num_holding > self.paused_avail:
            raise BudgetExceededError(
                f"pausing would give {new_holding - num_holding} more block(s) paused references "
                f"({total_holding} in all); the paused budget is {self.paused_count}"
            )
        if not to_paused and new_active > num_active and total_active > self.active_count:
            raise BudgetExceededError(
                f"resuming would hold {total_active} active blocks; budget is {self.active_count}"
            )
        return after_active, after_paused, total_active, total_paused, total_holding

    @property
    def paused_avail(self) -> int:
        """Blocks that may still take their first paused reference (never negative)."""
        return self.paused_count - self.num_holding_paused

    def clear(self) -> None:
        """Every count zero (engine reset)."""
        self.num_active = self.num_paused = self.num_cached = self.num_holding_paused = 0

    def check(self) -> list[str]:
        """The ledger's own invariants, described; empty when all hold."""
        problems = []
        for name in ("num_active", "num_paused", "num_cached", "num_holding_paused"):
            if getattr(self, name) < 0:
                problems.append(f"partition ledger: {name} is negative ({getattr(self, name)})")
        if self.num_holding_paused > self.paused_count:
            problems.append(
                f"partition ledger: {self.num_holding_paused} blocks hold paused references "
                f"over a paused budget of {self.paused_count}"
            )
        if self.num_paused > self.num_holding_paused:
            problems.append(
                f"partition ledger: {self.num_paused} paused-only blocks but only "
                f"{self.num_holding_paused} hold paused references"
            )
        return problems
