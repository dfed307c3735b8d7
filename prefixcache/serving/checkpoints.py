"""StateCheckpoints: recurrent states kept at block boundaries, so hybrid models can hit prefixes.

A prefix hit on an attention layer needs the prefix's KV blocks; on a linear-attention
layer it needs the recurrent state *at the end of the prefix*, and that state cannot be
rebuilt from anything smaller than the whole prefix. So a hybrid model can only reuse a
prefix whose end has a saved state. This module keeps such checkpoints in a bounded set
of :class:`~prefixcache.serving.state_pool.StatePool` slots, keyed by the chain hash of
the block the prefix ends at, and evicts them under an eviction policy of their own. See
DESIGN.md, "Hybrid models".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from prefixcache.engine.config import PolicySpec, build_policy
from prefixcache.engine.validation import is_int, require_int
from prefixcache.errors import ConfigError, InvalidArgumentError, InvariantError
from prefixcache.serving.state_pool import StatePool

_SENTINEL_HASHES = (0, -1)


def _check_hash(block_hash: object) -> int:
    if not is_int(block_hash):
        raise InvalidArgumentError(f"block_hash must be a signed 64-bit int, got {block_hash!r}")
    if block_hash in _SENTINEL_HASHES:
        raise InvalidArgumentError(f"hash {block_hash} is a reserved sentinel")
    return int(block_hash)


@dataclass(frozen=True, slots=True)
class CheckpointStats:
    """Counts of a :class:`StateCheckpoints` since construction.

    Attributes:
        capacity: checkpoint slots reserved.
        num_checkpoints: checkpoints held now.
        num_saved: states copied into a checkpoint slot.
        num_refreshed: saves of a hash already held (no copy, a touch).
        num_restored: checkpoints copied into a request slot.
        num_evicted: checkpoints evicted to make room.
        num_dropped: checkpoints dropped by :meth:`StateCheckpoints.discard`
            or :meth:`StateCheckpoints.prune`.
    """

    capacity: int
    num_checkpoints: int
    num_saved: int
    num_refreshed: int
    num_restored: int
    num_evicted: int
    num_dropped: int


class StateCheckpoints:
    """A bounded set of state checkpoints, keyed by block chain hash, with their own eviction.

    At construction it reserves ``capacity`` slots of ``pool`` for good, so
    requests can never starve checkpoints of slots nor checkpoints starve
    requests. :meth:`save` copies a request's state into a free reserved
    slot, or into the slot of the policy's victim when all are in use.
    Every checkpoint is an independent evictable entry for the policy (a
    checkpoint has no children: dropping one never invalidates another);
    the policy sees the slot as the block ID, the hash, a logical clock of
    this set and the block's position in its chain as the depth.

    Which boundaries deserve a checkpoint is :meth:`is_boundary`: every
    ``every``-th block, and the last full block of each prompt (where the
    next request with the same prompt, or with the prompt plus an answer,
    will resume). A checkpoint does not hold the KV blocks of its prefix: a
    hit needs both, and :meth:`prune` drops checkpoints whose KV is gone.

    Methods:

    - Policy of boundaries: :meth:`is_boundary`, :meth:`boundaries`.
    - Checkpoints: :meth:`save`, :meth:`lookup`, :meth:`restore`,
      :meth:`discard`, :meth:`prune`, ``len()`` and ``in``.
    - Introspection: :meth:`stats`, :meth:`check_invariants`.

    Every method either completes or raises a
    :class:`~prefixcache.errors.PrefixCacheError` and changes nothing. Not
    thread-safe.

    Args:
        pool: the state pool whose slots hold the checkpoints.
        capacity: checkpoint slots to reserve, >= 0 (0 keeps none).
        every: checkpoint every ``every``-th block boundary, >= 1.
        policy: eviction policy name, ``{"name": ..., **kwargs}`` or object
            (:func:`~prefixcache.engine.config.build_policy`); it must
            retain unreferenced entries (``"ref_zero"`` keeps nothing).

    Raises:
        ConfigError: a bad capacity, interval or policy, or ``pool`` has
            fewer free slots than ``capacity``.
    """

    def __init__(
        self, pool: StatePool, capacity: int, *, every: int = 4, policy: PolicySpec = "lru"
    ) -> None:
        if not isinstance(pool, StatePool):
            raise ConfigError(f"pool must be a StatePool, got {type(pool).__name__}")
        capacity = require_int(capacity, "capacity", minimum=0, error=ConfigError)
        every = require_int(every, "every", minimum=1, error=ConfigError)
        if capacity > pool.num_free:
            raise ConfigError(f"capacity {capacity} exceeds the pool's {pool.num_free} free slots")
        self._policy = build_policy(policy)
        # ref_zero keeps nothing unreferenced: as a policy flag or, by name, as a mode.
        if policy == "ref_zero" or not getattr(self._policy, "retains_unreferenced", True):
            raise ConfigError(f"policy {policy!r} keeps nothing; checkpoints need one that does")
        self.pool = pool
        self.capacity = capacity
        self.every = every
        # Reserved slots not holding a checkpoint; and the two maps of those that do.
        self._free_slots = [pool.allocate() for _ in range(capacity)]
        self._reserved = frozenset(self._free_slots)
        self._slot_of: dict[int, int] = {}  # block hash -> slot
        self._hash_of: dict[int, int] = {}  # slot -> block hash
        self._clock = 0
        self._num_saved = self._num_refreshed = self._num_restored = 0
        self._num_evicted = self._num_dropped = 0

    # ------------------------------------------------------------------ boundaries

    def is_boundary(self, num_blocks: int, num_prompt_blocks: int | None = None) -> bool:
        """Whether the state after ``num_blocks`` full blocks deserves a checkpoint.

        Args:
            num_blocks: full blocks the state covers, >= 0.
            num_prompt_blocks: full blocks of the request's prompt, or None.

        Returns:
            True for a positive multiple of ``every`` or ``num_prompt_blocks``.

        Raises:
            InvalidArgumentError: a count that is not an int >= 0.

        Complexity: O(1).
        """
        num_blocks = require_int(num_blocks, "num_blocks", minimum=0)
        if num_prompt_blocks is not None:
            require_int(num_prompt_blocks, "num_prompt_blocks", minimum=0)
        if num_blocks == 0:
            return False
        return num_blocks % self.every == 0 or num_blocks == num_prompt_blocks

    def boundaries(self, num_prompt_blocks: int) -> list[int]:
        """Block counts inside a prompt of ``num_prompt_blocks`` full blocks that are boundaries.

        A scheduler ends prefill chunks there, so the live state can be copied out.

        Raises:
            InvalidArgumentError: not an int >= 0.

        Complexity: O(num_prompt_blocks / every).
        """
        num_prompt_blocks = require_int(num_prompt_blocks, "num_prompt_blocks", minimum=0)
        points = list(range(self.every, num_prompt_blocks + 1, self.every))
        if num_prompt_blocks and (not points or points[-1] != num_prompt_blocks):
            points.append(num_prompt_blocks)
        return points

    # ------------------------------------------------------------------ checkpoints

    def save(self, block_hash: int, src_slot: int, *, depth: int = 0) -> int | None:
        """Checkpoint the state in ``src_slot`` as the state at the end of block ``block_hash``.

        A hash already held is only touched: equal chain hashes mean equal
        prefixes, hence equal states. Otherwise a free reserved slot, or the
        policy's victim's, receives a copy of ``src_slot``.

        Args:
            block_hash: chain hash of the last block the state covers.
            src_slot: a held pool slot holding that state.
            depth: the block's 0-based position in its chain, for the policy.

        Returns:
            The checkpoint's slot, or None when ``capacity`` is 0.

        Raises:
            InvalidArgumentError: a bad hash, depth or slot, or ``src_slot``
                is one of this set's own slots.
            ReferenceCountError: ``src_slot`` is not held.

        Complexity: O(1) maps, one copy of a slot's state, O(log n) policy work.
        """
        block_hash = _check_hash(block_hash)
        depth = require_int(depth, "depth", minimum=0)
        self._check_request_slot(src_slot)
        if self.capacity == 0:
            return None
        self._clock += 1
        held = self._slot_of.get(block_hash)
        if held is not None:
            self._policy.touch(held, self._clock)
            self._num_refreshed += 1
            return held
        slot = self._free_slots.pop() if self._free_slots else self._evict_one()
        self.pool.copy_states(src_slot, slot)
        self._slot_of[block_hash] = slot
        self._hash_of[slot] = block_hash
        self._policy.insert(slot, block_hash, self._clock, 1, depth)
        self._num_saved += 1
        return slot

    def lookup(self, block_hash: int) -> int | None:
        """The slot of ``block_hash``'s checkpoint, or None; changes nothing.

        Raises:
            InvalidArgumentError: a bad hash.

        Complexity: O(1).
        """
        return self._slot_of.get(_check_hash(block_hash))

    def restore(self, block_hash: int, dst_slot: int) -> int:
        """Copy ``block_hash``'s checkpoint into ``dst_slot`` and mark it used.

        Returns:
            The checkpoint slot copied from.

        Raises:
            InvalidArgumentError: a bad hash, no checkpoint under it, a bad
                slot, or one of this set's own slots.
            ReferenceCountError: ``dst_slot`` is not held.

        Complexity: O(1) maps, one copy of a slot's state, O(log n) policy work.
        """
        block_hash = _check_hash(block_hash)
        slot = self._slot_of.get(block_hash)
        if slot is None:
            raise InvalidArgumentError(f"no checkpoint for hash {block_hash}")
        self._check_request_slot(dst_slot)
        self.pool.copy_states(slot, dst_slot)
        self._clock += 1
        self._policy.touch(slot, self._clock)
        self._num_restored += 1
        return slot

    def discard(self, block_hash: int) -> bool:
        """Drop ``block_hash``'s checkpoint if there is one; return whether there was.

        Raises:
            InvalidArgumentError: a bad hash.

        Complexity: O(1) plus the policy's discard.
        """
        slot = self._slot_of.get(_check_hash(block_hash))
        if slot is None:
            return False
        self._policy.discard(slot)
        self._forget(slot)
        self._num_dropped += 1
        return True

    def prune(self, keep: Callable[[int], bool]) -> int:
        """Drop every checkpoint whose hash ``keep`` rejects; return how many.

        Pass ``allocator.is_hash_registered`` to drop checkpoints whose KV
        block was evicted (a hit needs both, so they are dead weight).

        Complexity: O(checkpoints) calls of ``keep``.
        """
        doomed = [block_hash for block_hash in self._slot_of if not keep(block_hash)]
        for block_hash in doomed:
            self.discard(block_hash)
        return len(doomed)

    def __len__(self) -> int:
        return len(self._slot_of)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._slot_of

    # ------------------------------------------------------------------ introspection

    def stats(self) -> CheckpointStats:
        """The counts so far. O(1)."""
        return CheckpointStats(
            capacity=self.capacity,
            num_checkpoints=len(self._slot_of),
            num_saved=self._num_saved,
            num_refreshed=self._num_refreshed,
            num_restored=self._num_restored,
            num_evicted=self._num_evicted,
            num_dropped=self._num_dropped,
        )

    def check_invariants(self) -> None:
        """Raise InvariantError unless slots, maps and the policy agree.

        The two maps are inverse; held and free reserved slots are disjoint
        and number ``capacity``, all held in the pool; the policy tracks
        exactly the held checkpoints. Complexity: O(capacity).
        """
        if any(self._hash_of.get(slot) != block_hash for block_hash, slot in self._slot_of.items()):
            raise InvariantError("checkpoint maps are not inverse")
        if len(self._hash_of) != len(self._slot_of):
            raise InvariantError("a slot maps to a hash that does not map back")
        slots = set(self._free_slots) | set(self._hash_of)
        if slots != self._reserved or len(self._free_slots) + len(self._hash_of) != (self.capacity):
            raise InvariantError(f"{len(slots)} distinct reserved slots; capacity {self.capacity}")
        unheld = [slot for slot in slots if not self.pool.is_allocated(slot)]
        if unheld:
            raise InvariantError(f"reserved slot {unheld[0]} is not held in the pool")
        if len(self._policy) != len(self._hash_of) or any(
            slot not in self._policy for slot in self._hash_of
        ):
            raise InvariantError("the policy does not track exactly the checkpoints")

    def __repr__(self) -> str:
        return (
            f"StateCheckpoints(capacity={self.capacity}, held={len(self._slot_of)}, "
            f"every={self.every}, policy={type(self._policy).__name__})"
        )

    # ------------------------------------------------------------------ internals

    def _check_request_slot(self, slot: int) -> None:
        """Refuse a slot the pool does not hold, or one of the checkpoint slots."""
        if not self.pool.is_allocated(slot):  # the pool raises the precise error
            self.pool.read_states(slot)
        if slot in self._reserved:
            raise InvalidArgumentError(f"slot {slot} is a checkpoint slot, not a request's")

    def _evict_one(self) -> int:
        victims = self._policy.evict(1)
        if len(victims) != 1 or victims[0] not in self._hash_of:
            raise InvariantError(f"policy returned {victims} with {len(self._hash_of)} tracked")
        slot = victims[0]
        self._forget(slot)
        self._free_slots.pop()  # _forget pushed it; the caller takes it now
        self._num_evicted += 1
        return slot

    def _forget(self, slot: int) -> None:
        del self._slot_of[self._hash_of.pop(slot)]
        self._free_slots.append(slot)
