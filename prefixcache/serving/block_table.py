"""BlockTable: which blocks each request slot holds, on the host and mirrored on the device."""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

import numpy as np
import torch

from prefixcache.engine.block_ids import BlockIdsLike, to_block_ids, to_tensor
from prefixcache.engine.pool import resolve_device
from prefixcache.engine.validation import is_int, require_int
from prefixcache.errors import CapacityError, ConfigError, InvalidArgumentError

if TYPE_CHECKING:
    from prefixcache.engine.allocator import KVBlockAllocator


class BlockTable:
    """Maps request slots to the block IDs of their KV cache, row by row.

    Attention kernels index KV blocks through a ``[max_requests,
    max_blocks_per_request]`` int32 table (SGLang's ``req_to_token_pool``,
    Megatron-core's ``request_to_kv_block_ids``). Every entry a request does
    not use points at the allocator's dummy block, so a kernel reading a
    padded position reads harmless memory instead of another request's KV.

    The host copy (a numpy view of an int32 tensor, pinned when CUDA is
    present) is the source of truth: every answer comes from it. Each change
    is pushed to :attr:`device_table` with a ``non_blocking=True`` copy of
    the changed entries, and the device table is never read back, so no call
    waits for the device. On the CPU the device table *is* the host tensor (a
    second copy would buy nothing). The mirror is exact once the copy stream
    has drained; as with any asynchronous upload, do not rewrite a row that a
    queued kernel still reads until that kernel has run.

    Free slots are handed out lowest first (a heap), so the rows in use stay
    packed at the top of the table and a batch can cover a short prefix of it.

    Methods:

    - Requests: :meth:`add_request`, :meth:`append_blocks`, :meth:`remove_request`.
    - Queries: :meth:`blocks_of`, :meth:`num_blocks`, :meth:`is_active`,
      :attr:`num_requests`, :attr:`num_free_slots`, :attr:`device_table`.

    Block IDs are validated against the pool (``0 <= id < dummy_block_id``)
    but not against the allocator's reference counts: the table stores what
    the caller owns and never changes a count. Not thread-safe.

    Args:
        max_requests: rows (request slots), >= 1.
        max_blocks_per_request: columns, >= 1.
        dummy_block_id: the allocator's ``dummy_block_id`` (its ``total_count - 1``).
        device: where :attr:`device_table` lives; ``None`` picks CUDA when available.

    >>> table = BlockTable(max_requests=2, max_blocks_per_request=4, dummy_block_id=9, device="cpu")
    >>> slot = table.add_request([3, 5])
    >>> table.append_blocks(slot, [7])
    >>> table.device_table[slot].tolist()
    [3, 5, 7, 9]
    >>> table.remove_request(slot).tolist()
    [3, 5, 7]
    """

    def __init__(
        self,
        max_requests: int,
        max_blocks_per_request: int,
        dummy_block_id: int,
        device: str | torch.device | None = None,
    ) -> None:
        self.max_requests = require_int(max_requests, "max_requests", minimum=1, error=ConfigError)
        self.max_blocks_per_request = require_int(
            max_blocks_per_request, "max_blocks_per_request", minimum=1, error=ConfigError
        )
        self.dummy_block_id = require_int(
            dummy_block_id, "dummy_block_id", minimum=1, error=ConfigError
        )
        self.device = resolve_device(device)
        shape = (self.max_requests, self.max_blocks_per_request)
        pin = self.device.type == "cuda" and torch.cuda.is_available()
        # int32 host table, the source of truth; pinned so uploads can run asynchronously.
        self._host = torch.full(shape, self.dummy_block_id, dtype=torch.int32, pin_memory=pin)
        self._rows = self._host.numpy()
        # int32 blocks in use per slot, and whether the slot holds a request.
        self._lengths = np.zeros(self.max_requests, dtype=np.int32)
        self._in_use = np.zeros(self.max_requests, dtype=bool)
        self._free_slots = list(range(self.max_requests))  # a heap: lowest slot first
        if self.device.type == "cpu":
            self._device = self._host
        else:
            self._device = torch.full(
                shape, self.dummy_block_id, dtype=torch.int32, device=self.device
            )

    @classmethod
    def for_allocator(
        cls, allocator: KVBlockAllocator, max_requests: int, max_blocks_per_request: int
    ) -> BlockTable:
        """A table padded with ``allocator``'s dummy block, on the allocator's device.

        Args:
            allocator: the allocator whose IDs the table holds (read only:
                ``dummy_block_id`` and ``device``).
            max_requests: rows, >= 1.
            max_blocks_per_request: columns, >= 1.

        Complexity: O(max_requests * max_blocks_per_request).
        """
        return cls(
            max_requests,
            max_blocks_per_request,
            allocator.dummy_block_id,
            allocator.device,
        )

    # ------------------------------------------------------------------ queries

    @property
    def device_table(self) -> torch.Tensor:
        """The ``[max_requests, max_blocks_per_request]`` int32 table kernels read.

        Lives on :attr:`device`; write it only through this class.
        """
        return self._device

    @property
    def num_requests(self) -> int:
        """Slots holding a request. O(1)."""
        return self.max_requests - len(self._free_slots)

    @property
    def num_free_slots(self) -> int:
        """Slots :meth:`add_request` can still hand out. O(1)."""
        return len(self._free_slots)

    def is_active(self, slot: int) -> bool:
        """Whether ``slot`` holds a request (False for any out-of-range value). O(1)."""
        if not is_int(slot):
            return False
        return 0 <= slot < self.max_requests and bool(self._in_use[slot])

    def num_blocks(self, slot: int) -> int:
        """Blocks held by the request in ``slot``.

        Raises:
            InvalidArgumentError: ``slot`` holds no request.

        Complexity: O(1).
        """
        return int(self._lengths[self._check_slot(slot)])

    def blocks_of(self, slot: int) -> torch.Tensor:
        """The block IDs of the request in ``slot``, in order, from the host copy.

        Returns:
            A fresh CPU int32 tensor (never a view of the table).

        Raises:
            InvalidArgumentError: ``slot`` holds no request.

        Complexity: O(blocks of the request).
        """
        slot = self._check_slot(slot)
        return to_tensor(self._rows[slot, : self._lengths[slot]].copy())

    # ------------------------------------------------------------------ requests

    def add_request(self, block_ids: BlockIdsLike) -> int:
        """Give a new request the lowest free slot and its first blocks.

        Args:
            block_ids: its blocks in order (possibly none), host IDs below
                ``dummy_block_id``.

        Returns:
            The slot.

        Raises:
            InvalidTensorError, InvalidBlockIdError: malformed IDs or the dummy block.
            CapacityError: no free slot, or more blocks than a row holds.

        Complexity: O(len(block_ids) + log max_requests).
        """
        ids = to_block_ids(block_ids, self.dummy_block_id)
        if not self._free_slots:
            raise CapacityError(f"all {self.max_requests} request slots are in use")
        self._check_room(len(ids), 0, "a new request")
        slot = heapq.heappop(self._free_slots)
        self._in_use[slot] = True
        self._write(slot, 0, ids)
        return slot

    def append_blocks(self, slot: int, block_ids: BlockIdsLike) -> None:
        """Add blocks at the end of the request in ``slot`` (a decode step crossed a block).

        Raises:
            InvalidArgumentError: ``slot`` holds no request.
            InvalidTensorError, InvalidBlockIdError: malformed IDs or the dummy block.
            CapacityError: the row would overflow ``max_blocks_per_request``.

        Complexity: O(len(block_ids)).
        """
        slot = self._check_slot(slot)
        ids = to_block_ids(block_ids, self.dummy_block_id)
        start = int(self._lengths[slot])
        self._check_room(len(ids), start, f"slot {slot}")
        self._write(slot, start, ids)

    def remove_request(self, slot: int) -> torch.Tensor:
        """Free ``slot``, point its row back at the dummy block, and return its blocks.

        The caller releases the returned IDs to the allocator (the table
        holds no references of its own).

        Returns:
            A fresh CPU int32 tensor of the request's blocks, in order.

        Raises:
            InvalidArgumentError: ``slot`` holds no request.

        Complexity: O(blocks of the request + log max_requests).
        """
        slot = self._check_slot(slot)
        length = int(self._lengths[slot])
        block_ids = self._rows[slot, :length].copy()
        self._rows[slot, :length] = self.dummy_block_id
        self._upload(slot, 0, length)
        self._lengths[slot] = 0
        self._in_use[slot] = False
        heapq.heappush(self._free_slots, slot)
        return to_tensor(block_ids)

    # ------------------------------------------------------------------ internals

    def _check_slot(self, slot: int) -> int:
        slot = require_int(slot, "slot")
        if not 0 <= slot < self.max_requests:
            raise InvalidArgumentError(f"slot {slot} is outside [0, {self.max_requests})")
        if not self._in_use[slot]:
            raise InvalidArgumentError(f"slot {slot} holds no request")
        return slot

    def _check_room(self, num_new: int, start: int, what: str) -> None:
        if start + num_new > self.max_blocks_per_request:
            raise CapacityError(
                f"{what} would hold {start + num_new} blocks; a row holds "
                f"{self.max_blocks_per_request} (it holds {start})"
            )

    def _write(self, slot: int, start: int, ids: np.ndarray) -> None:
        stop = start + len(ids)
        self._rows[slot, start:stop] = ids
        self._lengths[slot] = stop
        self._upload(slot, start, stop)

    def _upload(self, slot: int, start: int, stop: int) -> None:
        if self._device is not self._host and stop > start:
            self._device[slot, start:stop].copy_(self._host[slot, start:stop], non_blocking=True)

    # ------------------------------------------------------------------ hybrid-model rows

    def add_request_at(self, start: int, block_ids: BlockIdsLike) -> int:
        """A new request whose columns ``start ..`` hold ``block_ids``; earlier ones the dummy.

        A sliding-window prefix hit needs only the blocks inside the window,
        yet a kernel finds block ``i`` at column ``i``: the leading columns
        point at the dummy block and the row counts ``start + len(block_ids)``
        blocks.

        Raises:
            InvalidArgumentError: a negative ``start``.
            InvalidTensorError, InvalidBlockIdError: malformed IDs or the dummy block.
            CapacityError: no free slot, or the row would overflow.

        Complexity: O(start + len(block_ids) + log max_requests).
        """
        start = require_int(start, "start", minimum=0)
        ids = to_block_ids(block_ids, self.dummy_block_id)
        if not self._free_slots:
            raise CapacityError(f"all {self.max_requests} request slots are in use")
        self._check_room(len(ids), start, "a new request")
        slot = heapq.heappop(self._free_slots)
        self._in_use[slot] = True
        self._lengths[slot] = start
        self._write(slot, start, ids)
        return slot

    def clear_blocks(self, slot: int, start: int, stop: int) -> torch.Tensor:
        """Point columns ``start .. stop`` of ``slot`` back at the dummy block; return them.

        For blocks given back while the request runs (they fell out of a
        sliding window). The row keeps its length; the caller releases the
        returned IDs (dummy entries included where columns were cleared before).

        Raises:
            InvalidArgumentError: ``slot`` holds no request, or the range is
                not inside the row.

        Complexity: O(stop - start).
        """
        slot = self._check_slot(slot)
        start = require_int(start, "start", minimum=0)
        stop = require_int(stop, "stop", minimum=start, maximum=int(self._lengths[slot]))
        block_ids = self._rows[slot, start:stop].copy()
        self._rows[slot, start:stop] = self.dummy_block_id
        self._upload(slot, start, stop)
        return to_tensor(block_ids)

    def set_block(self, slot: int, index: int, block_id: int) -> int:
        """Replace column ``index`` of ``slot`` with ``block_id``; return the old ID.

        A copy-on-write gives the writer a fresh block in place of a shared one.

        Raises:
            InvalidArgumentError: ``slot`` holds no request, ``index`` is not
                a held column, or ``block_id`` is not a usable block.

        Complexity: O(1).
        """
        slot = self._check_slot(slot)
        index = require_int(index, "index", minimum=0, maximum=int(self._lengths[slot]) - 1)
        block_id = require_int(block_id, "block_id", minimum=0, maximum=self.dummy_block_id - 1)
        old = int(self._rows[slot, index])
        self._rows[slot, index] = block_id
        self._upload(slot, index, index + 1)
        return old

    # ------------------------------------------------------------------ defragmentation

    def apply_moves(self, sources: BlockIdsLike, destinations: BlockIdsLike) -> int:
        """Rename every held ``sources[i]`` to ``destinations[i]`` (a defragmentation's moves).

        Call it with the plan that :meth:`KVBlockAllocator.apply_defragment`
        applied (``table.apply_moves(plan.sources, plan.destinations)``), before
        the next kernel reads the table. Dummy entries stay; every row, active
        or not, is renamed through one lookup array and uploaded at once.

        Returns:
            How many table entries changed.

        Raises:
            InvalidTensorError, InvalidBlockIdError: malformed IDs or the dummy block.
            InvalidArgumentError: the lists differ in length or an ID appears
                twice among them (nothing changes).

        Complexity: O(max_requests * max_blocks_per_request), vectorised.
        """
        src = to_block_ids(sources, self.dummy_block_id)
        dst = to_block_ids(destinations, self.dummy_block_id)
        if len(src) != len(dst):
            raise InvalidArgumentError(f"{len(src)} sources but {len(dst)} destinations")
        both = np.concatenate((src, dst))
        if len(np.unique(both)) != len(both):
            raise InvalidArgumentError("an ID appears twice among the moves")
        rename = np.arange(self.dummy_block_id + 1, dtype=np.int32)
        rename[src] = dst
        renamed = rename[self._rows]
        changed = int(np.count_nonzero(renamed != self._rows))
        if changed:
            self._rows[:] = renamed
            if self._device is not self._host:
                self._device.copy_(self._host, non_blocking=True)
        return changed
