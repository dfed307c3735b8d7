"""HybridMemory: a hybrid model's request life cycle across its KV groups, states and checkpoints.

A hybrid model interleaves attention layers (KV blocks, in layer groups) with
linear-attention layers (one fixed-size state per request, in a state pool). A prefix
hit must restore both: the KV blocks of the prefix and the recurrent state at its end,
which only exists where a checkpoint was taken. :class:`HybridMemory` admits, grows,
commits, forks and finishes requests across all of them; :class:`HybridPrefixMatch`
and :class:`HybridRequest` are what it hands out. Built by
:func:`~prefixcache.serving.hybrid.build_hybrid_memory`, which lives apart in
``hybrid.py`` (where every name here is importable too) so this module holds only the
life cycle. See DESIGN.md, "Hybrid models".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from prefixcache.engine.validation import is_int, require_int
from prefixcache.errors import ConfigError, InvalidArgumentError, InvariantError
from prefixcache.serving.checkpoints import StateCheckpoints
from prefixcache.serving.cow import CopyInstruction
from prefixcache.serving.layer_groups import GroupHit, LayerGroups
from prefixcache.serving.shared_tails import SharedTails
from prefixcache.serving.state_pool import StatePool


@dataclass(frozen=True, slots=True)
class HybridPrefixMatch:
    """The longest prefix a hybrid model can reuse: KV in every group and a state at its end.

    Attributes:
        num_blocks: full blocks of the prompt the hit covers (0: none).
        num_tokens: ``num_blocks * block_size``.
        checkpoint_slot: the state pool slot to copy the state from; None
            when the hit is empty or the model has no linear layers.
        block_ids: per layer group (in spec order), the blocks the hit needs.
    """

    num_blocks: int
    num_tokens: int
    checkpoint_slot: int | None
    block_ids: tuple[np.ndarray, ...]


@dataclass(slots=True)
class HybridRequest:
    """A request admitted by :class:`HybridMemory`; its fields are changed only by it.

    Attributes:
        slot: the request's row in every layer group's block table.
        state_slot: its slot in the state pool (None without linear layers).
        num_prompt_tokens: prompt length.
        num_computed_tokens: tokens whose KV and state are written.
        num_hit_tokens: tokens served from the prefix cache at admission.
        restored_from: the checkpoint slot its state was copied from, or None.
    """

    slot: int
    state_slot: int | None
    num_prompt_tokens: int
    num_computed_tokens: int
    num_hit_tokens: int
    restored_from: int | None


class HybridMemory:
    """Layer groups, a state pool and state checkpoints, served together.

    The life of a request: :meth:`admit` (prefix hit on KV and state, a table
    row, a state slot with the checkpoint copied in), then per chunk
    :meth:`reserve` (blocks for the tokens about to be computed) and
    :meth:`commit` (they are computed: register full blocks, give back
    sliding-window blocks, checkpoint the state at a boundary), and
    :meth:`finish`. A scheduler ends prefill chunks at
    :meth:`chunk_boundaries`, so the live state can be checkpointed there.
    :meth:`fork` starts a second request from a running one (its partly
    filled last block copied on write, :attr:`tails`), and
    :meth:`defragment` compacts the KV pools under running requests.

    Not thread-safe.

    Args:
        groups: the attention layer groups (:class:`LayerGroups`).
        state_pool: the linear layers' states, or None for a pure attention model.
        checkpoints: the checkpoint set over ``state_pool``, or None.
    """

    def __init__(
        self,
        groups: LayerGroups,
        state_pool: StatePool | None = None,
        checkpoints: StateCheckpoints | None = None,
    ) -> None:
        if checkpoints is not None and checkpoints.pool is not state_pool:
            raise ConfigError("checkpoints must live in the given state pool")
        self.groups = groups
        self.state_pool = state_pool
        self.checkpoints = checkpoints
        self.block_size = groups.block_size
        self.tails = SharedTails(groups)
        self.last_copies: list[CopyInstruction] = []  # the copies of the last reserve()
        self._requests: dict[int, HybridRequest] = {}

    # ------------------------------------------------------------------ matching

    def match_prefix(self, block_hashes: Sequence[int]) -> HybridPrefixMatch:
        """The longest prefix of ``block_hashes`` with KV in every group and a state at its end.

        With linear layers, a prefix qualifies only if a checkpoint ends at
        its last block; without a checkpoint set, no prefix does. Takes
        nothing (:meth:`admit` does).

        Args:
            block_hashes: chain hashes of the prompt's full blocks. Leave out
                the block holding the last prompt token, so at least one token
                is computed (its logits start the answer).

        Raises:
            InvalidArgumentError: malformed hashes.

        Complexity: as :meth:`LayerGroups.longest_hit`, one dict lookup per candidate.
        """
        hit, slot = self._match(_hash_list(block_hashes))
        return HybridPrefixMatch(
            hit.num_blocks, hit.num_blocks * self.block_size, slot, hit.block_ids
        )

    def _match(self, hashes: list[int]) -> tuple[GroupHit, int | None]:
        """The groups' hit and the checkpoint slot at its end (None: none or not needed)."""
        checkpoints = self.checkpoints
        accept = None
        if self.state_pool is not None:
            if checkpoints is None:
                return self.groups.longest_hit(hashes, lambda _: False), None

            def accept(num_blocks: int) -> bool:
                return checkpoints.lookup(hashes[num_blocks - 1]) is not None

        hit = self.groups.longest_hit(hashes, accept)
        slot = None
        if hit.num_blocks and checkpoints is not None:
            slot = checkpoints.lookup(hashes[hit.num_blocks - 1])
        return hit, slot

    # ------------------------------------------------------------------ requests

    def admit(self, block_hashes: Sequence[int], num_prompt_tokens: int) -> HybridRequest | None:
        """Start a request: take its prefix hit, a table row and a state slot.

        Args:
            block_hashes: chain hashes of the prompt's full blocks (see
                :meth:`match_prefix` for the last block).
            num_prompt_tokens: prompt length, >= 1.

        Returns:
            The request, or None (nothing changes) when no table row or state
            slot is free.

        Raises:
            InvalidArgumentError: malformed hashes or length.

        Complexity: :meth:`match_prefix`, plus O(hit blocks) and one state copy.
        """
        hashes = _hash_list(block_hashes)
        num_prompt_tokens = require_int(num_prompt_tokens, "num_prompt_tokens", minimum=1)
        first_table = self.groups.tables[self.groups.specs[0].name]
        if not first_table.num_free_slots:
            return None
        if self.state_pool is not None and not self.state_pool.num_free:
            return None
        hit, checkpoint_slot = self._match(hashes)
        slot = self.groups.admit(hit, hashes)
        state_slot = None
        if self.state_pool is not None:
            state_slot = self.state_pool.allocate()
            if checkpoint_slot is not None and self.checkpoints is not None:
                self.checkpoints.restore(hashes[hit.num_blocks - 1], state_slot)
        num_hit_tokens = hit.num_blocks * self.block_size
        request = HybridRequest(
            slot=slot,
            state_slot=state_slot,
            num_prompt_tokens=num_prompt_tokens,
            num_computed_tokens=num_hit_tokens,
            num_hit_tokens=num_hit_tokens,
            restored_from=checkpoint_slot,
        )
        self._requests[slot] = request
        return request

    def fork(self, request: HybridRequest) -> HybridRequest | None:
        """A second request continuing from ``request``'s written tokens (parallel sampling).

        It shares every block in every group, the partly filled last one
        included (copied on the first write into it by either request,
        :class:`~prefixcache.serving.shared_tails.SharedTails`), and gets a
        state slot holding a copy of ``request``'s state.

        Returns:
            The fork, or None (nothing changes) when no table row or state
            slot is free.

        Raises:
            InvalidArgumentError: an unknown request.

        Complexity: O(blocks held) per group, plus one state copy.
        """
        self._check(request)
        if not self.groups.tables[self.groups.specs[0].name].num_free_slots:
            return None
        if self.state_pool is not None and not self.state_pool.num_free:
            return None
        slot = self.groups.fork(request.slot)
        self.tails.share(request.slot, slot)
        state_slot = None
        if self.state_pool is not None and request.state_slot is not None:
            state_slot = self.state_pool.allocate()
            self.state_pool.copy_states(request.state_slot, state_slot)
        fork = HybridRequest(
            slot=slot,
            state_slot=state_slot,
            num_prompt_tokens=request.num_prompt_tokens,
            num_computed_tokens=request.num_computed_tokens,
            num_hit_tokens=request.num_computed_tokens,
            restored_from=None,
        )
        self._requests[slot] = fork
        return fork

    def chunk_boundaries(self, request: HybridRequest) -> list[int]:
        """Token counts inside the prompt where the state should be checkpointed.

        Prefill chunks that end exactly there let :meth:`commit` copy the live
        state out. Empty without checkpoints.

        Complexity: O(prompt blocks / every).
        """
        self._check(request)
        if self.checkpoints is None:
            return []
        num_prompt_blocks = request.num_prompt_tokens // self.block_size
        points = self.checkpoints.boundaries(num_prompt_blocks)
        return [
            blocks * self.block_size
            for blocks in points
            if blocks * self.block_size > request.num_computed_tokens
        ]

    def reserve(self, request: HybridRequest, num_tokens: int) -> bool:
        """Blocks in every group for the request's first ``num_tokens`` tokens.

        A partly filled last block shared with a fork is copied first (the
        writer gets the fresh block; :attr:`last_copies` lists the copies).

        Returns:
            False, with nothing changed, when some pool cannot supply them.

        Raises:
            InvalidArgumentError: an unknown request or a bad count.
            CapacityError: a table row would overflow.

        Complexity: as :meth:`LayerGroups.reserve`, plus one block copy per shared tail.
        """
        self._check(request)
        self.last_copies = []
        needed = self.groups.blocks_needed(request.slot, num_tokens)
        copies = self.tails.fresh_blocks_needed(request.slot, num_tokens)
        for pool, allocator in self.groups.allocators.items():
            if not allocator.is_memory_available(needed[pool] + copies[pool]):
                return False
        if not self.groups.reserve(request.slot, num_tokens):  # counted above: cannot happen
            raise InvariantError("a pool ran short after the count")
        self.last_copies = self.tails.write(request.slot, num_tokens)
        return True

    def commit(
        self, request: HybridRequest, num_tokens: int, block_hashes: Sequence[int]
    ) -> int | None:
        """The KV and state of the request's first ``num_tokens`` tokens are written.

        Registers full blocks and gives back sliding-window blocks
        (:meth:`LayerGroups.commit`), then, when ``num_tokens`` ends a
        checkpoint boundary (every ``every``-th block or the prompt's last
        full block), checkpoints the state slot under that block's hash.

        Returns:
            The checkpoint slot written or refreshed, or None.

        Raises:
            InvalidArgumentError: an unknown request, a count out of range, or
                too few hashes.

        Complexity: as :meth:`LayerGroups.commit`, plus one state copy at a boundary.
        """
        self._check(request)
        hashes = _hash_list(block_hashes)
        self.groups.commit(request.slot, num_tokens, hashes)
        request.num_computed_tokens = num_tokens
        if self.checkpoints is None or request.state_slot is None or num_tokens % self.block_size:
            return None
        num_blocks = num_tokens // self.block_size
        if not self.checkpoints.is_boundary(
            num_blocks, request.num_prompt_tokens // self.block_size
        ):
            return None
        return self.checkpoints.save(
            hashes[num_blocks - 1], request.state_slot, depth=num_blocks - 1
        )

    def finish(self, request: HybridRequest) -> None:
        """Release the request's blocks in every group and its state slot.

        Raises:
            InvalidArgumentError: an unknown request (or one already finished).

        Complexity: O(blocks held).
        """
        self._check(request)
        self.tails.drop(request.slot)
        self.groups.finish(request.slot)
        if request.state_slot is not None and self.state_pool is not None:
            self.state_pool.free(request.state_slot)
        del self._requests[request.slot]

    def defragment(self) -> dict[str, int]:
        """Compact every KV pool into its lowest block IDs in the middle of a run.

        Per pool: :meth:`LayerGroups.defragment` (the allocator's plan and
        move, the KV copy, every table), then the shared partial tails follow.
        Checkpoints are keyed by hash and live in the state pool: nothing of
        theirs moves.

        Returns:
            Blocks moved per pool.

        Raises:
            BlockStateError: a free group is open on an allocator.

        Complexity: O(pool blocks + table size) per pool, plus the copies.
        """
        moved = {}
        for pool in self.groups.allocators:
            plan = self.groups.defragment(pool)
            self.tails.apply_moves(pool, plan.sources, plan.destinations)
            moved[pool] = len(plan)
        return moved

    # ------------------------------------------------------------------ memory

    @property
    def memory_bytes(self) -> dict[str, int]:
        """Bytes of KV storage per pool and of the state pool (``"states"``). O(pools)."""
        sizes = {
            pool: cache.num_blocks * cache.bytes_per_block()
            for pool, cache in self.groups.kv_caches.items()
        }
        if self.state_pool is not None:
            sizes["states"] = self.state_pool.memory_bytes
        return sizes

    def check_invariants(self) -> None:
        """The groups', the pool's and the checkpoints' invariants, and each request's slots.

        Raises:
            InvariantError: the first problem found.

        Complexity: O(total blocks + slots + checkpoints).
        """
        self.groups.check_invariants()
        if self.state_pool is not None:
            self.state_pool.check_invariants()
        if self.checkpoints is not None:
            self.checkpoints.check_invariants()
        self.tails.check_invariants()
        pool = self.state_pool
        for request in self._requests.values():
            slot = request.state_slot
            if slot is not None and (pool is None or not pool.is_allocated(slot)):
                raise InvariantError(f"request in slot {request.slot} lost its state slot")

    def _check(self, request: object) -> None:
        if (
            not isinstance(request, HybridRequest)
            or self._requests.get(request.slot) is not request
        ):
            raise InvalidArgumentError(f"{request!r} is not a running request of this memory")


def _hash_list(block_hashes: object) -> list[int]:
    if isinstance(block_hashes, torch.Tensor | np.ndarray):
        block_hashes = block_hashes.tolist()
    if not isinstance(block_hashes, list | tuple) or not all(map(is_int, block_hashes)):
        raise InvalidArgumentError("block_hashes must be a sequence of signed 64-bit ints")
    return [int(value) for value in block_hashes]
