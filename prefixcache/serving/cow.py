"""Copy-on-write partial blocks: requests share a partly filled last block until one writes.

Only full blocks get a hash and enter the prefix cache, so two requests with the same
prompt (parallel sampling, beam search, a fork) would each compute and store the
prompt's last, partly filled block. Sharing it is free until one of them appends a
token there: the writer then gets a fresh block and an instruction to copy the shared
tokens into it, and the others keep the original. See DESIGN.md, "Hybrid models".
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np

from prefixcache.engine.allocator import KVBlockAllocator
from prefixcache.engine.block_ids import BlockIdsLike, to_block_ids
from prefixcache.engine.validation import require_int
from prefixcache.errors import InvalidArgumentError, InvariantError


@dataclass(frozen=True, slots=True)
class CopyInstruction:
    """Copy the first ``num_tokens`` token slots of block ``src`` into block ``dst``.

    The caller runs it (``KVCache`` rows of every layer) before the write
    that caused it.
    """

    src: int
    dst: int
    num_tokens: int


@dataclass(frozen=True, slots=True)
class TailWrite:
    """Where a request's new tokens go.

    Attributes:
        block_id: the block to write into (a fresh one after a copy).
        offset: in-block position of the first new token.
        copy: the copy to run first, or None (written in place).
        is_full: the block is full after the write; the table stopped
            tracking it and it is an ordinary block of the request.
    """

    block_id: int
    offset: int
    copy: CopyInstruction | None
    is_full: bool


class PartialBlockTable:
    """Which requests share each partly filled last block; copy-on-write when one writes.

    Ownership: each tracked request holds exactly one active reference on
    its tail block, as on every other block of its row; the caller releases
    it with the rest when the request ends (:meth:`drop` first). The table
    only moves references: :meth:`share` takes one for the new sharer
    (``acquire_blocks``), and a copy-on-write releases the writer's
    reference on the shared block and allocates its fresh block
    (``release_memory_blocks``, ``allocate_memory_blocks``). Partial blocks
    carry no hash, so no prefix hit or KV event ever names them.

    Every sharer of a block has the same tokens in it (nobody writes a
    shared block), so the fill is kept per block.

    Methods: :meth:`track`, :meth:`share`, :meth:`write`, :meth:`drop`,
    :meth:`tail_of`, :meth:`holders_of`, :meth:`check_invariants`. Not
    thread-safe.

    Args:
        allocator: where the blocks come from; the table uses only its
            public methods.

    >>> from prefixcache import KVBlockAllocator
    >>> allocator = KVBlockAllocator(total_count=8, block_size_tokens=4, device="cpu")
    >>> table = PartialBlockTable(allocator)
    >>> tail = int(allocator.allocate_memory_blocks(1)[0])
    >>> table.track("a", tail, num_tokens=3)
    >>> table.share("a", "b") == tail
    True
    >>> write = table.write("b", 1)
    >>> write.copy.src == tail and write.copy.num_tokens == 3, write.offset, write.is_full
    (True, 3, True)
    >>> table.write("a", 1).copy is None
    True
    """

    def __init__(self, allocator: KVBlockAllocator) -> None:
        if not isinstance(allocator, KVBlockAllocator):
            raise InvalidArgumentError(f"allocator must be a KVBlockAllocator, got {allocator!r}")
        self.allocator = allocator
        self.block_size = allocator.block_size_tokens
        self._tail_of: dict[Hashable, int] = {}  # request -> its partial tail block
        self._holders: dict[int, set[Hashable]] = {}  # tail block -> requests sharing it
        self._fill: dict[int, int] = {}  # tail block -> tokens written in it
        self.num_copies = 0  # copy-on-write events so far

    # ------------------------------------------------------------------ changes

    def track(self, request: Hashable, block_id: int, num_tokens: int) -> None:
        """Start tracking ``request``'s partial last block, on which it holds a reference.

        Args:
            request: any hashable request key not tracked yet.
            block_id: the block, not tracked yet.
            num_tokens: tokens already in it, ``0 <= num_tokens < block_size``.

        Raises:
            InvalidArgumentError: a tracked request or block, or a bad count or ID.

        Complexity: O(1).
        """
        self._check_new(request)
        block_id = require_int(
            block_id, "block_id", minimum=0, maximum=self.allocator.num_usable - 1
        )
        if block_id in self._holders:
            raise InvalidArgumentError(f"block {block_id} is tracked already; use share()")
        num_tokens = require_int(num_tokens, "num_tokens", minimum=0, maximum=self.block_size - 1)
        self._tail_of[request] = block_id
        self._holders[block_id] = {request}
        self._fill[block_id] = num_tokens

    def share(
        self, request: Hashable, new_request: Hashable, *, take_reference: bool = True
    ) -> int:
        """Let ``new_request`` share ``request``'s tail block, taking a reference for it.

        Args:
            request: a tracked request.
            new_request: a request key not tracked yet.
            take_reference: False when the caller already took ``new_request``'s
                reference on the block (a fork that acquired the whole row,
                :meth:`~prefixcache.serving.layer_groups.LayerGroups.fork`).

        Returns:
            The shared block.

        Raises:
            InvalidArgumentError: ``request`` is not tracked or ``new_request`` is.

        Complexity: O(1) plus one ``acquire_blocks``.
        """
        block_id = self._tail(request)
        self._check_new(new_request)
        if take_reference:
            self.allocator.acquire_blocks([block_id])
        self._tail_of[new_request] = block_id
        self._holders[block_id].add(new_request)
        return block_id

    def write(self, request: Hashable, num_tokens: int) -> TailWrite | None:
        """``request`` appends ``num_tokens`` tokens to its tail block; copy it first if shared.

        Args:
            request: a tracked request.
            num_tokens: ``1 .. block_size - fill`` tokens (the caller starts a
                new block for the rest).

        Returns:
            Where to write, or None (nothing changes) when a copy needs a
            fresh block and the allocator has none even by eviction.

        Raises:
            InvalidArgumentError: an untracked request, or a count that does not fit.

        Complexity: O(1), plus one allocation and one release on a copy.
        """
        block_id = self._tail(request)
        fill = self._fill[block_id]
        num_tokens = require_int(
            num_tokens, "num_tokens", minimum=1, maximum=self.block_size - fill
        )
        copy = None
        if len(self._holders[block_id]) > 1:
            fresh = self.allocator.allocate_memory_blocks(1)
            if fresh is None:
                return None
            new_id = int(fresh[0])
            self.allocator.release_memory_blocks([block_id])
            self._holders[block_id].discard(request)
            self._tail_of[request] = new_id
            self._holders[new_id] = {request}
            self._fill[new_id] = fill
            copy = CopyInstruction(block_id, new_id, fill) if fill else None
            self.num_copies += 1
            block_id = new_id
        self._fill[block_id] = fill + num_tokens
        is_full = fill + num_tokens == self.block_size
        if is_full:
            self._untrack(request)
        return TailWrite(block_id, fill, copy, is_full)

    def drop(self, request: Hashable) -> int:
        """Stop tracking ``request`` (it finished or was preempted); return its tail block.

        The caller still holds the reference and releases it with the
        request's other blocks.

        Raises:
            InvalidArgumentError: ``request`` is not tracked.

        Complexity: O(1).
        """
        block_id = self._tail(request)
        self._untrack(request)
        return block_id

    def apply_moves(self, sources: BlockIdsLike, destinations: BlockIdsLike) -> int:
        """Follow a defragmentation: tracked block ``sources[i]`` is now ``destinations[i]``.

        Call it with the plan the allocator applied
        (:meth:`~prefixcache.engine.allocator.KVBlockAllocator.apply_defragment`).

        Returns:
            How many tracked blocks were renamed.

        Raises:
            InvalidBlockIdError, InvalidTensorError: malformed IDs.
            InvalidArgumentError: lists of different lengths (nothing changes).

        Complexity: O(len(sources)).
        """
        usable = self.allocator.num_usable
        src = to_block_ids(sources, usable, "sources").tolist()
        dst = to_block_ids(destinations, usable, "destinations").tolist()
        if len(src) != len(dst):
            raise InvalidArgumentError(f"{len(src)} sources but {len(dst)} destinations")
        moved = [(old, new) for old, new in zip(src, dst, strict=True) if old in self._holders]
        entries = [(new, self._holders.pop(old), self._fill.pop(old)) for old, new in moved]
        for new, holders, fill in entries:  # after every pop: a destination may be a source
            self._holders[new] = holders
            self._fill[new] = fill
            for request in holders:
                self._tail_of[request] = new
        return len(moved)

    # ------------------------------------------------------------------ queries

    def tail_of(self, request: Hashable) -> tuple[int, int] | None:
        """``(block_id, num_tokens)`` of ``request``'s tracked tail, or None. O(1)."""
        block_id = self._tail_of.get(request) if _is_hashable(request) else None
        return None if block_id is None else (block_id, self._fill[block_id])

    def holders_of(self, block_id: int) -> frozenset[Hashable]:
        """Requests sharing ``block_id`` (empty when untracked). O(holders)."""
        return frozenset(self._holders.get(block_id, ()))

    def __len__(self) -> int:
        """Tracked requests."""
        return len(self._tail_of)

    def check_invariants(self) -> None:
        """Raise InvariantError unless the maps agree and every tail holds its references.

        Each tracked block has at least one holder, each holder points back
        at it, its fill is below ``block_size``, and the allocator counts at
        least one active reference per holder. Complexity: O(tracked blocks).
        """
        for block_id, holders in self._holders.items():
            if not holders or any(self._tail_of.get(r) != block_id for r in holders):
                raise InvariantError(f"block {block_id}'s holders do not point back at it")
            if not 0 <= self._fill[block_id] < self.block_size:
                raise InvariantError(f"block {block_id} holds {self._fill[block_id]} tokens")
        if sum(len(holders) for holders in self._holders.values()) != len(self._tail_of):
            raise InvariantError("a request is tracked on a block that does not list it")
        if self._fill.keys() != self._holders.keys():
            raise InvariantError("fills and holders track different blocks")
        if self._holders:
            block_ids = np.fromiter(self._holders, dtype=np.int64)
            active, _ = self.allocator.reference_counts(block_ids)
            for block_id, count in zip(block_ids.tolist(), active.tolist(), strict=True):
                if count < len(self._holders[block_id]):
                    raise InvariantError(
                        f"block {block_id} has {count} active references for "
                        f"{len(self._holders[block_id])} sharers"
                    )

    # ------------------------------------------------------------------ internals

    def _tail(self, request: object) -> int:
        block_id = self._tail_of.get(request) if _is_hashable(request) else None
        if block_id is None:
            raise InvalidArgumentError(f"request {request!r} has no tracked partial block")
        return block_id

    def _check_new(self, request: object) -> None:
        if not _is_hashable(request):
            raise InvalidArgumentError(f"request key {request!r} is not hashable")
        if request in self._tail_of:
            raise InvalidArgumentError(f"request {request!r} already has a tracked partial block")

    def _untrack(self, request: Hashable) -> None:
        block_id = self._tail_of.pop(request)
        holders = self._holders[block_id]
        holders.discard(request)
        if not holders:
            del self._holders[block_id]
            del self._fill[block_id]


def _is_hashable(value: object) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True
