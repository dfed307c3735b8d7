"""Turning caller-supplied block IDs into validated host arrays, and back.

Every public call accepts block IDs as a 1-D CPU integer tensor, a 1-D numpy
integer array or a sequence of ints, and returns a fresh CPU int32 tensor.
Conversion never reads device memory: a tensor on any device but the CPU is
refused rather than copied back (that copy would stall the host on the GPU).
"""

from __future__ import annotations

import array as array_module
from collections.abc import Sequence

import numpy as np
import torch

from prefixcache.engine.validation import is_int
from prefixcache.errors import InvalidBlockIdError, InvalidTensorError

BlockIdsLike = torch.Tensor | np.ndarray | Sequence[int]
"""What the public API accepts wherever it takes block IDs."""

EMPTY_IDS = np.empty(0, dtype=np.intp)

# Up to this many IDs, min() and max() over a Python list check the range faster
# than numpy's compare and count, whose fixed cost is over 1 us a call (timeit of
# to_block_ids on a loaded 2-core VM: 1 to 16 IDs 2.4-2.8 -> 1.1-1.9 us; even at
# 32, slower from 64).
_CHECK_IN_PYTHON_UP_TO = 16

_PLAIN_INT = frozenset({int})

_TORCH_INTEGER_DTYPES = frozenset(
    {torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.uint16, torch.uint32}
    | ({torch.uint64} if hasattr(torch, "uint64") else set())
)
"""Tensor dtypes read as IDs: every integer width numpy arrays are read in, uint64 included."""


def to_int_array(values: BlockIdsLike, what: str) -> np.ndarray:
    """Convert ``values`` to a 1-D numpy integer array without validating the range.

    The result may share memory with ``values``; callers only read it.

    Raises:
        InvalidTensorError: not 1-D, not an integer dtype, or a non-CPU tensor.
    """
    if isinstance(values, torch.Tensor):
        if not values.is_cpu:
            raise InvalidTensorError(
                f"{what} must be a CPU tensor (host IDs), got device {values.device}"
            )
        if values.dtype not in _TORCH_INTEGER_DTYPES:
            raise InvalidTensorError(f"{what} must have an integer dtype, got {values.dtype}")
        array = values.numpy()  # integer tensors never require grad
    elif isinstance(values, np.ndarray):
        array = values
    elif isinstance(values, (memoryview, array_module.array)):  # other integer buffers
        try:
            array = np.asarray(values)
        except (TypeError, ValueError) as exc:
            raise InvalidTensorError(f"{what} must be an integer buffer: {exc}") from exc
    elif isinstance(values, (str, bytes, bytearray)) or not isinstance(values, Sequence):
        raise InvalidTensorError(
            f"{what} must be a tensor, an array or a sequence of ints, got {type(values).__name__}"
        )
    else:
        # All plain ints is the common case: one C-level pass over the types,
        # and np.asarray below reports a value outside int64.
        if not _PLAIN_INT.issuperset(map(type, values)) and not all(map(is_int, values)):
            raise InvalidTensorError(f"{what} must contain only ints")
        try:
            array = np.asarray(values, dtype=np.int64)
        except OverflowError as exc:
            raise InvalidTensorError(f"{what} holds an integer out of range") from exc
    if array.ndim != 1:
        raise InvalidTensorError(f"{what} must be 1-D, got shape {tuple(array.shape)}")
    if array.dtype.kind not in "iu":
        raise InvalidTensorError(f"{what} must have an integer dtype, got {array.dtype}")
    return array


def to_block_ids(values: BlockIdsLike, num_usable: int, what: str = "block_ids") -> np.ndarray:
    """Validate ``values`` as IDs of usable blocks and return them as an intp array.

    intp because numpy indexes with it directly: fancy indexing with int32
    IDs converts them on every use (several times slower on the hot paths,
    see ``benchmarks/bench_core.py``). The dummy block has the ID
    ``num_usable`` (the last one), so one range check rejects it along with
    every out-of-range ID; viewing the IDs as unsigned folds the negative
    ones into that same check. Small batches are checked in Python instead,
    where two C-level scans of a list cost less than numpy's per-call overhead.

    Raises:
        InvalidTensorError: see :func:`to_int_array`.
        InvalidBlockIdError: an ID is negative, the dummy block, or past the pool.
    """
    array = to_int_array(values, what)
    if array.size == 0:
        return EMPTY_IDS
    if array.dtype.kind == "u" and array.itemsize == 8 and np.count_nonzero(array >> 62):
        raise InvalidBlockIdError(
            f"{what} holds block {int(array.max())}, outside [0, {num_usable})"
        )
    ids = array.astype(np.intp, copy=False)
    if ids.size <= _CHECK_IN_PYTHON_UP_TO:
        id_list = ids.tolist()
        out_of_range = min(id_list) < 0 or max(id_list) >= num_usable
    else:
        out_of_range = bool(np.count_nonzero(ids.view(np.uintp) >= num_usable))
    if out_of_range:
        low, high = int(ids.min()), int(ids.max())
        bad = low if low < 0 else high
        if bad == num_usable:
            raise InvalidBlockIdError(
                f"{what} names the dummy block {bad}, which is never handed out"
            )
        raise InvalidBlockIdError(f"{what} holds block {bad}, outside [0, {num_usable})")
    return ids


def to_tensor(ids: np.ndarray) -> torch.Tensor:
    """Wrap a fresh int32 array as a CPU tensor (no copy: the array must not be shared)."""
    return torch.from_numpy(ids)
