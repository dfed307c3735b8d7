"""The references a caller holds: the simple model a stateful test checks the allocator against."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prefixcache.engine.allocator import KVBlockAllocator

__all__ = ["ReferenceModel"]


@dataclass
class ReferenceModel:
    """Who holds which reference, and what was registered: the stateful tests' model.

    Much simpler than the allocator, as hypothesis.stateful recommends: a list
    with one entry per reference held (active or paused) and a hash -> block
    map of what the caller saw registered. The allocator's reference counts,
    used counts and budget checks must agree with it after every step.

    Attributes:
        active: one block ID per active reference held.
        paused: one block ID per paused reference held.
        block_of_hash: hash -> block the caller saw registered and still cached.
    """

    active: list[int] = field(default_factory=list)
    paused: list[int] = field(default_factory=list)
    block_of_hash: dict[int, int] = field(default_factory=dict)

    def held(self) -> set[int]:
        """Every block with at least one reference held."""
        return set(self.active) | set(self.paused)

    def handed_out(self, block_ids: list[int]) -> None:
        """Fresh blocks came back active: their old hashes are gone.

        Raises:
            AssertionError: a block handed out while the model holds it.
        """
        held = self.held()
        for block_id in block_ids:
            assert block_id not in held, f"block {block_id} handed out while held"
            self.forget_block(block_id)
        self.active.extend(block_ids)

    def forget_block(self, block_id: int) -> None:
        """A block came back fresh: whatever hash it carried is gone."""
        self.block_of_hash = {h: b for h, b in self.block_of_hash.items() if b != block_id}

    def take(self, pool: list[int], picks: list[int]) -> list[int]:
        """Remove the references at indexes ``picks`` (distinct) of ``pool`` and return them."""
        taken = [pool[i] for i in picks]
        for i in sorted(picks, reverse=True):
            pool.pop(i)
        return taken

    def reset(self) -> None:
        """The allocator was reset: nothing is held or registered."""
        self.active.clear()
        self.paused.clear()
        self.block_of_hash.clear()

    def pause_exceeds(self, taken: list[int], paused_count: int) -> bool:
        """Whether pausing ``taken`` (already out of :attr:`active`) breaks the paused budget.

        The budget bounds the blocks holding any paused reference: the pause is
        refused when more blocks would take their first paused reference than
        ``paused_count`` minus the blocks already holding one. A pause that
        gives no block its first paused reference always passes.
        """
        holding = set(self.paused)
        return len(set(taken) - holding) > paused_count - len(holding)

    def resume_exceeds(self, taken: list[int], active_count: int) -> bool:
        """Whether resuming ``taken`` (already out of :attr:`paused`) breaks the active budget."""
        newly_active = set(taken) - set(self.active)
        return bool(newly_active) and len(set(self.active) | newly_active) > active_count

    def check(self, allocator: KVBlockAllocator) -> None:
        """Assert the allocator's reference counts and used counts match the model.

        Raises:
            AssertionError: naming the first disagreement.
        """
        ids = list(range(allocator.num_usable))
        active, paused = allocator.reference_counts(ids)
        held_active, held_paused = Counter(self.active), Counter(self.paused)
        assert active.tolist() == [held_active[b] for b in ids], "active reference counts"
        assert paused.tolist() == [held_paused[b] for b in ids], "paused reference counts"
        assert allocator.get_active_used() == len(held_active), "active blocks used"
        assert allocator.get_paused_used() == len(set(held_paused) - set(held_active)), (
            "paused blocks used"
        )
        assert allocator.get_paused_avail() == allocator.paused_count - len(held_paused), (
            "paused budget available"
        )
        assert len(held_paused) <= allocator.paused_count, "paused holders over the budget"
