"""Tokens as block hashing reads them: little-endian int32 bytes, checked on the way.

Every accepted form of a prompt (a list or tuple of ints, a 1-D integer numpy
array or CPU tensor, an integer memoryview) becomes one contiguous buffer of
little-endian int32 values, the bytes every hash algorithm of
:mod:`prefixcache.engine.hashing` (and the native engine's own chain) digests.
A bool, a value outside int32, a nested sequence or a tensor on a device is
refused with the offending index; nothing is copied from a device.
"""

from __future__ import annotations

import functools
import operator
import struct
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np

from prefixcache.errors import InvalidArgumentError, InvalidTensorError

if TYPE_CHECKING:
    import torch

__all__ = ["int32_le_buffer"]

_INT32_MIN = -(1 << 31)
_INT32_MAX = (1 << 31) - 1
# Up to this many tokens in a list, one C-level pass over their types finds a bool
# sooner than numpy's fixed cost (about 2 us a call) would.
_TYPE_TEST_UP_TO = 64


def int32_le_buffer(tokens: object) -> tuple[memoryview, int]:
    """Canonical bytes of ``tokens`` (little-endian int32) and the token count."""
    if type(tokens) is not list and type(tokens) is not tuple:  # the common case goes first
        # torch is only looked up, never imported: a tensor cannot exist unless
        # its caller imported torch, and importing it here would cost a second.
        torch_module = sys.modules.get("torch")
        if torch_module is not None and isinstance(tokens, torch_module.Tensor):
            tokens = _tensor_to_numpy(tokens, torch_module)
        if isinstance(tokens, memoryview):  # an integer buffer, read as numpy reads it
            tokens = np.asarray(tokens)
        if isinstance(tokens, np.ndarray):
            array = _array_to_int32(tokens)
            return array.view(np.uint8).data, len(array)  # bytes, not int32 items
        if isinstance(tokens, (str, bytes, bytearray)) or not isinstance(tokens, Sequence):
            raise InvalidArgumentError(
                "tokens must be a 1-D torch tensor, a 1-D numpy integer array or a sequence "
                f"of ints, got {type(tokens).__name__}"
            )
    count = len(tokens)
    try:
        # Struct.pack range-checks and packs in one C call: about 2x faster than
        # array.array("i", ...), np.fromiter or struct.pack(fmt, ...), which
        # copies the argument tuple (bench_hashing.py, "variants").
        packed = struct.Struct(f"<{count}i").pack(*tokens)
    except (struct.error, TypeError):
        raise _bad_token_error(tokens) from None
    _refuse_bools(tokens, packed)
    return memoryview(packed), count


def _refuse_bools(tokens: Sequence[object], packed: bytes) -> None:
    """Refuse a bool among ``tokens``, which struct packed as 0 or 1 without a word.

    A type test per token would double the cost of hashing a long list, so
    long lists are screened on the packed values first: only a 0 or a 1 can
    be a bool, and those positions alone are looked at.
    """
    if len(tokens) <= _TYPE_TEST_UP_TO:
        if bool not in set(map(type, tokens)):
            return
        suspects: list[int] = list(range(len(tokens)))
    else:
        values = np.frombuffer(packed, dtype="<i4")
        suspects = np.flatnonzero((values >> 1) == 0).tolist()  # the 0s and 1s
    for index in suspects:
        if type(tokens[index]) is bool:
            raise InvalidArgumentError(f"token at index {index} is a bool; tokens must be ints")


def _tensor_to_numpy(tensor: torch.Tensor, torch_module: ModuleType) -> np.ndarray:
    if not tensor.is_cpu:
        raise InvalidTensorError(
            f"tokens tensor is on device {tensor.device}; block hashing reads tokens on the "
            "host and never copies from the device itself: pass a CPU tensor"
        )
    if tensor.dim() != 1:
        raise InvalidTensorError(f"tokens tensor must be 1-D, got shape {tuple(tensor.shape)}")
    if tensor.dtype not in _torch_integer_dtypes(torch_module):
        raise InvalidTensorError(f"tokens tensor must have an integer dtype, got {tensor.dtype}")
    return tensor.numpy()  # integer tensors never require grad: no detach needed


@functools.cache
def _torch_integer_dtypes(torch_module: ModuleType) -> frozenset[object]:
    names = ("uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64")
    return frozenset(getattr(torch_module, n) for n in names if hasattr(torch_module, n))


def _array_to_int32(array: np.ndarray) -> np.ndarray:
    dtype = array.dtype
    if array.ndim != 1:
        raise InvalidTensorError(f"tokens array must be 1-D, got shape {array.shape}")
    if dtype.kind not in "iu":
        raise InvalidTensorError(f"tokens array must have an integer dtype, got {dtype}")
    if dtype.itemsize < 4 or (dtype.itemsize == 4 and dtype.kind == "i"):
        return np.ascontiguousarray(array, dtype="<i4")  # every value fits; no copy if <i4
    if not dtype.isnative:
        # numpy 2.4's same_value cast misses an overflow from a byte-swapped source
        # (>u4 4294967295 became -1): cast from native order.
        array = array.astype(dtype.newbyteorder("="))
    if _HAS_SAME_VALUE_CAST:
        # One pass that casts and refuses changed values: 0.2 us against 1.7 us
        # for min() + max() on a decode-sized array (bench_hashing.py, "variants").
        try:
            return array.astype("<i4", casting="same_value")
        except ValueError:
            pass  # name the offending token below
    if array.size:
        low, high = int(array.min()), int(array.max())
        if low < _INT32_MIN or high > _INT32_MAX:
            bad = array < _INT32_MIN if low < _INT32_MIN else array > _INT32_MAX
            index = int(np.argmax(bad))
            raise InvalidArgumentError(
                f"token {int(array[index])} at index {index} is outside the int32 range"
            )
    return array.astype("<i4")


def _numpy_has_same_value_cast() -> bool:
    """Whether astype(casting="same_value") exists (numpy >= 2.4)."""
    try:
        np.zeros(1, dtype=np.int64).astype(np.int32, casting="same_value")
    except (TypeError, ValueError):
        return False
    return True


_HAS_SAME_VALUE_CAST = _numpy_has_same_value_cast()


def _bad_token_error(tokens: Sequence[object]) -> InvalidArgumentError:
    """Find the token that struct refused and say what is wrong with it."""
    for index, token in enumerate(tokens):
        if isinstance(token, (Sequence, np.ndarray)) and not isinstance(token, (str, bytes)):
            return InvalidArgumentError(f"tokens must be 1-D; element {index} is a sequence")
        try:
            value = operator.index(token)  # type: ignore[arg-type]  # probing
        except TypeError:
            return InvalidArgumentError(
                f"token at index {index} is {token!r} ({type(token).__name__}); tokens must be ints"
            )
        if not _INT32_MIN <= value <= _INT32_MAX:
            return InvalidArgumentError(
                f"token {value} at index {index} is outside the int32 range"
            )
    return InvalidArgumentError("tokens could not be packed as int32")  # pragma: no cover
