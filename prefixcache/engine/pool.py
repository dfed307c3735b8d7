"""BlockPool: the stack of free block IDs, the dummy block and its device mirror."""

from __future__ import annotations

import numpy as np
import torch

from prefixcache.engine.validation import is_int
from prefixcache.errors import CapacityError, ConfigError, InvalidArgumentError


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``None`` means ``"cuda"`` when available, else ``"cpu"``.

    Raises:
        ConfigError: not a device, or a CUDA device where torch has no CUDA.
    """
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"invalid device {device!r}: {exc}") from exc
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"device {device!r} asks for CUDA, which this torch build or machine does not have "
            "(torch.cuda.is_available() is False); use device='cpu' or None"
        )
    return resolved


class BlockPool:
    """A LIFO stack of free block IDs with one reserved dummy block.

    The pool hands out IDs ``0 .. total_count - 2``; ID ``total_count - 1`` is
    the dummy block that padded tokens of a batch point at, never handed out.
    The stack lives on the host (an int32 array); :meth:`acquire` pops a slice
    and returns a copy, :meth:`release` pushes a slice, both with no Python
    loop per block. LIFO order hands recently freed (cache-warm) blocks out
    first.

    When ``device`` is not the CPU, a device tensor mirrors the stack for
    kernels that allocate on the device. Pushes are copied to it with
    ``non_blocking=True`` from pinned host memory (when CUDA is present) and
    it is never read back, so no call waits for the device. The mirror is
    exact once the copy stream has drained. A copy that raises leaves the host
    stack and ``num_free`` as they were, so the allocator's rollback holds; the
    mirror's entries in the copied range are then undefined until the next
    successful copy of that range.

    :meth:`release` does not validate IDs, on purpose: the pool cannot tell a
    held ID from a free one without a per-block flag that every push and pop
    would have to keep, and a range check is O(len(block_ids)) work that the
    caller has already done. :class:`~prefixcache.KVBlockAllocator` owns the
    reference counts and checks every ID before it reaches here (range, dummy
    block, double free); code that drives a pool directly takes on that job.
    What the pool does check is O(1): the type and sign of a count, and that
    a push fits on the stack.

    Methods: :meth:`acquire`, :meth:`release`, :meth:`reset`, :meth:`rebuild`,
    :meth:`free_ids`. Not thread-safe.

    Args:
        total_count: number of blocks including the dummy block (>= 2).
        device: where the mirror lives; ``None`` picks CUDA when available.
    """

    def __init__(self, total_count: int, device: str | torch.device | None = None) -> None:
        if not is_int(total_count) or total_count < 2:
            raise ConfigError(
                f"total_count must be an int >= 2 (one is the dummy), got {total_count!r}"
            )
        total_count = int(total_count)
        self.total_count = total_count
        self.num_usable = total_count - 1
        self.dummy_block_id = total_count - 1
        self.device = resolve_device(device)
        pin = self.device.type == "cuda" and torch.cuda.is_available()
        # int32 host stack; the top is at index num_free - 1. Pinned when a CUDA
        # mirror copies from it, so the copies can run asynchronously.
        self._stack_tensor = torch.empty(self.num_usable, dtype=torch.int32, pin_memory=pin)
        self._stack = self._stack_tensor.numpy()
        # int32 mirror of the stack on self.device, or None on the CPU.
        self._mirror: torch.Tensor | None = None
        if self.device.type != "cpu":
            self._mirror = torch.empty(self.num_usable, dtype=torch.int32, device=self.device)
        self.num_free = 0
        self.reset()

    def reset(self) -> None:
        """Put every usable block back on the stack, ID 0 on top.

        If the device copy raises, the host stack and ``num_free`` are as before.
        Complexity: O(total_count).
        """
        old_free = self._stack[: self.num_free].copy()
        self._stack[:] = np.arange(self.num_usable - 1, -1, -1, dtype=np.int32)
        try:
            self._mirror_range(0, self.num_usable)
        except BaseException:
            self._stack[: len(old_free)] = old_free  # the host stack as it was
            raise
        self.num_free = self.num_usable

    def acquire(self, num_blocks: int) -> np.ndarray:
        """Pop ``num_blocks`` IDs and return them as a fresh int32 array.

        Args:
            num_blocks: how many IDs, an int or numpy integer >= 0.

        Returns:
            The IDs, most recently freed first.

        Raises:
            InvalidArgumentError: ``num_blocks`` is negative, a bool or not
                an integer.
            CapacityError: fewer than ``num_blocks`` blocks are free.

        Complexity: O(num_blocks), no Python loop.
        """
        count = num_blocks
        if type(count) is not int:  # the allocator passes ints: one type test on its path
            if not is_int(count):
                raise InvalidArgumentError(f"num_blocks must be an int, got {type(count).__name__}")
            count = int(count)  # a numpy count would make num_free a numpy int
        if count < 0:
            raise InvalidArgumentError(f"num_blocks must be >= 0, got {count}")
        if count > self.num_free:
            raise CapacityError(f"asked for {count} blocks, {self.num_free} free")
        top = self.num_free
        self.num_free = top - count
        taken: np.ndarray = self._stack[top - count : top][::-1].copy()
        return taken

    def release(self, block_ids: np.ndarray) -> None:
        """Push ``block_ids``; the IDs are unchecked (see the class docstring).

        Args:
            block_ids: IDs the caller holds, each once, none the dummy block.

        Raises:
            InvalidArgumentError: more IDs than the stack has room for (some
                of them cannot have been handed out); nothing is pushed.

        Complexity: O(len(block_ids)), no Python loop.
        """
        count = len(block_ids)
        top = self.num_free
        if count > self.num_usable - top:
            raise InvalidArgumentError(
                f"releasing {count} blocks, but only {self.num_usable - top} are handed out"
            )
        self._stack[top : top + count] = block_ids  # above the top: not free until counted
        self._mirror_range(top, top + count)
        self.num_free = top + count

    def rebuild(self, free_ids: np.ndarray) -> None:
        """Make exactly ``free_ids`` (distinct, in range) the free blocks, the lowest on top.

        For defragmentation, which changes the free set at once: the stack
        ends as after :meth:`reset`, so the next hand-outs are the lowest free
        IDs, contiguous after a compaction. If the device copy raises, the
        stack is as before. Complexity: O(total_count).
        """
        old_free = self._stack[: self.num_free].copy()
        ids = np.sort(np.asarray(free_ids, dtype=np.int32))[::-1]
        self._stack[: len(ids)] = ids
        try:
            self._mirror_range(0, len(ids))
        except BaseException:
            self._stack[: len(old_free)] = old_free
            raise
        self.num_free = len(ids)

    def free_ids(self) -> np.ndarray:
        """A copy of the free IDs, bottom of the stack first. Complexity: O(num_free)."""
        free: np.ndarray = self._stack[: self.num_free].copy()
        return free

    @property
    def device_free_ids(self) -> torch.Tensor | None:
        """The device mirror of the whole stack (first ``num_free`` entries valid), or None."""
        return self._mirror

    def _mirror_range(self, start: int, stop: int) -> None:
        if self._mirror is not None and stop > start:
            self._mirror[start:stop].copy_(self._stack_tensor[start:stop], non_blocking=True)
