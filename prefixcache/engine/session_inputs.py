"""What both session wrappers check the same way: a step's tokens, and a chain's valid prefix.

The Python :class:`~prefixcache.engine.python_session.Session` and the tiered session
(``prefixcache/tiers/tiered_session.py``) read their tokens with :func:`checked_tokens`
before anything changes, and find how much of a remembered chain survived with
:func:`valid_prefix_length` (the session against its blocks' registration generations,
the tiered session against the device registry).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from prefixcache.engine.block_ids import to_int_array
from prefixcache.errors import InvalidArgumentError

__all__ = ["checked_tokens", "valid_prefix_length"]

_INT32 = np.iinfo(np.int32)


def checked_tokens(tokens: Any) -> np.ndarray:
    """``tokens`` as an int32 array, refused (before any change) outside int32 or empty."""
    if type(tokens) is np.ndarray and tokens.dtype == np.int32 and tokens.ndim == 1 and tokens.size:
        return tokens  # what a tokenizer hands over: nothing to convert or check
    array = to_int_array(tokens, "tokens")
    if array.size and (int(array.min()) < _INT32.min or int(array.max()) > _INT32.max):
        raise InvalidArgumentError("tokens must lie in the int32 range")
    if not array.size:
        raise InvalidArgumentError("a turn or an append needs at least one token")
    return array.astype(np.int32)


def valid_prefix_length(valid: Callable[[int], bool], known: int) -> int:
    """How many of the first ``known`` (>= 1) chain positions are valid, where validity is
    prefix-closed (``valid(i)`` implies ``valid(i - 1)``): the last one decides for all in
    O(1), else a binary search finds the first invalid one in O(log known) calls."""
    if valid(known - 1):
        return known
    low, high = 0, known - 1  # positions before low valid, position high not
    while low < high:
        middle = (low + high) // 2
        if valid(middle):
            low = middle + 1
        else:
            high = middle
    return low
