"""The contract between the allocator and an eviction policy.

A policy orders the *evictable leaves* of the prefix cache: blocks that no
request references, that carry a registered hash, and that have no registered
child. The allocator tells it when a block becomes such a leaf
(:meth:`EvictionPolicy.insert`), when it stops being one (:meth:`discard`: a
prefix hit took a reference, or a child was registered below it), and when a
tracked leaf is touched. Under memory pressure it asks for victims
(:meth:`evict`) and frees them. Evicting a leaf may turn its parent into a
leaf, which the allocator then inserts, so a cached chain is eaten from the
end and never cut in the middle.

A policy sees block IDs, clock values and the few facts passed to
:meth:`insert`, never the allocator. This package imports nothing from
``prefixcache``.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


class UnknownPolicyError(KeyError):
    """No policy is registered under the requested name."""

    def __init__(self, name: str, known: list[str]) -> None:
        super().__init__(name)
        self.name = name
        self.known = known

    def __str__(self) -> str:
        return f"unknown eviction policy {self.name!r}; known policies: {', '.join(self.known)}"


@runtime_checkable
class EvictionPolicy(Protocol):
    """What every eviction policy implements.

    Attributes:
        retains_unreferenced: ``True`` if blocks whose last reference is
            released stay cached until evicted. ``False`` (the ref-zero policy)
            tells the allocator to drop a hashed block as soon as no request
            references it.
    """

    retains_unreferenced: bool

    def insert(
        self, block_id: int, block_hash: int, last_access: int, num_accesses: int, depth: int
    ) -> None:
        """Start tracking ``block_id``, which just became an evictable leaf.

        Args:
            block_id: the block; not tracked yet.
            block_hash: the chained content hash it is registered under. Block
                IDs are recycled; a hash names the same prefix for good, so
                state that must outlive the block (ghost lists, retention
                priorities) is keyed by hash.
            last_access: clock value of the block's last access.
            num_accesses: how many times the block was handed to a request
                (1 for a block filled once and never hit again).
            depth: 0-based position of the block in its hash chain.
        """
        ...

    def discard(self, block_id: int) -> None:
        """Stop tracking ``block_id`` (it was hit or gained a child). Tracked IDs only."""
        ...

    def touch(self, block_id: int, now: int) -> None:
        """Record an access at clock ``now`` to the tracked leaf ``block_id``."""
        ...

    def evict(self, num_blocks: int) -> list[int]:
        """Choose up to ``num_blocks`` tracked leaves, stop tracking them, return them.

        Returns fewer than asked only when fewer are tracked. The allocator
        may call again after inserting the parents that the victims exposed.
        """
        ...

    def clear(self) -> None:
        """Forget every tracked block (allocator reset)."""
        ...

    def __len__(self) -> int:
        """Number of tracked leaves."""
        ...

    def __contains__(self, block_id: object) -> bool:
        """Whether ``block_id`` is tracked."""
        ...


@runtime_checkable
class SupportsRetention(Protocol):
    """A policy that honours per-prefix retention priorities (TensorRT-LLM style).

    The allocator forwards :meth:`KVBlockAllocator.set_retention_priority`
    calls here. Priorities are keyed by block hash, so they follow a prefix
    across evictions and block-ID reuse.
    """

    def set_retention(self, block_hash: int, priority: int, expires_at: int | None) -> None:
        """Give ``block_hash`` retention ``priority`` until clock ``expires_at`` (None: forever).

        Lower priorities are evicted first. After ``expires_at`` the hash falls
        back to the policy's default priority.
        """
        ...


@runtime_checkable
class ObservesRegistrations(Protocol):
    """A policy that wants to hear of every hash registered, not only of evictable leaves.

    A prefix that was evicted and is computed again inside a longer request
    comes back registered but, being an inner block, never becomes a leaf while
    that request runs: without this hook a policy keeping history by hash
    never learns of the return. The allocator calls :meth:`on_register` once
    per run of consecutive chain positions a registration adds, before it
    commits the registration.
    """

    def on_register(self, block_hashes: list[int], first_depth: int) -> None:
        """``block_hashes`` were just registered as one chain run, the first at ``first_depth``.

        The list belongs to the caller: copy what you keep. Keep it cheap: it
        is on the serving path. If it raises, the registration does not happen
        and the allocator is unchanged, but what the hook already recorded in
        the policy's history stays.
        """
        ...


@runtime_checkable
class ObservesRollbacks(Protocol):
    """A policy that wants to know when the allocator took back a failed call's policy calls.

    When an allocator call fails after some policy calls, the allocator
    replays their inverses, newest first (a discard for an insert, an insert
    for a discard or a victim, a discard and an insert for a touch), then
    calls :meth:`on_rollback`. A failed release is taken back by discards
    alone, the same calls as a hit right after a release: only this signal
    tells them apart, so a policy that learns on insert (a ghost hit, a
    remembered stay) can forget what the aborted inserts taught it.
    """

    def on_rollback(self) -> None:
        """The policy calls since the failed allocator call began were taken back.

        Called once per rollback that replayed at least one inverse call,
        right after the last one. Must not raise.
        """
        ...


@runtime_checkable
class PredictsNextVictim(Protocol):
    """A policy that can tell, without a change, whether a leaf would be its next victim.

    Evicting a chain from its end exposes the parent of each victim, which
    the allocator must insert before asking for the next victim; under LRU
    that parent, older than its child, is usually the next victim itself.
    With this method the allocator skips the insert-and-evict round trip in
    that case, and the order of victims is exactly as without it.
    """

    def evicts_first(
        self, block_id: int, block_hash: int, last_access: int, num_accesses: int, depth: int
    ) -> bool:
        """Whether ``evict(1)`` would return ``block_id`` right after inserting it with these.

        Must not change which leaves are tracked or their order (dropping stale
        internal entries is fine). Arguments as for :meth:`EvictionPolicy.insert`.
        """
        ...
