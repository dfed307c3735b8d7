"""One check for "an int, not a bool", used by every layer.

Python's ``bool`` is an ``int``, so ``isinstance(value, int)`` lets
``True`` through as a block count; numpy integers are not ``int``, so the
same test refuses ``np.int64(3)`` that comes straight out of an array. The
library's rule, written once here: an int is a Python ``int`` or a numpy
integer, never a bool (Python's or numpy's), and within signed 64 bits, the
width of every ID, count and hash the engine stores. :func:`require_int`
returns it as a Python ``int``, so a numpy scalar never leaks into a counter.

>>> import numpy as np
>>> require_int(np.int32(3), "num_blocks", minimum=0)
3
>>> require_int(True, "num_blocks")
Traceback (most recent call last):
    ...
prefixcache.errors.InvalidArgumentError: num_blocks must be an int, got True
>>> require_flag(1, "verify")
Traceback (most recent call last):
    ...
prefixcache.errors.InvalidArgumentError: verify must be a bool, got 1
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping
from typing import Any, TypeGuard

import numpy as np

from prefixcache.errors import InvalidArgumentError

__all__ = [
    "INT64_MAX",
    "INT64_MIN",
    "is_int",
    "require_flag",
    "require_fraction",
    "require_hashable",
    "require_int",
    "require_int_list",
    "require_positive_number",
    "require_sequence",
]

INT64_MIN = -(1 << 63)
INT64_MAX = (1 << 63) - 1


def is_int(value: object) -> TypeGuard[int | np.integer]:
    """Whether ``value`` is an int by the library's rule (see the module docstring).

    For callers that answer a bad value with something other than an error
    (a predicate that returns False), or that keep an error message a test pins.

    >>> is_int(3), is_int(np.uint8(3)), is_int(False), is_int(3.0), is_int(1 << 63)
    (True, True, False, False, False)

    Complexity: O(1).
    """
    if type(value) is int:  # the common case first: one type test
        return INT64_MIN <= value <= INT64_MAX
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        return False
    return INT64_MIN <= int(value) <= INT64_MAX


def require_int(
    value: object,
    name: str,
    *,
    minimum: int | None = None,
    maximum: int | None = None,
    error: type[InvalidArgumentError] = InvalidArgumentError,
) -> int:
    """``value`` as a Python int, or an error naming ``name`` and the bounds.

    Args:
        value: the argument to check.
        name: the argument's name, for the message.
        minimum: smallest accepted value (inclusive), if any.
        maximum: largest accepted value (inclusive), if any.
        error: the exception type to raise, :class:`~prefixcache.errors.InvalidArgumentError`
            or a subclass (``ConfigError`` for configuration values).

    Returns:
        ``int(value)``.

    Raises:
        InvalidArgumentError: (or ``error``) ``value`` is a bool, not an
            integer, outside signed 64 bits, or outside ``[minimum, maximum]``.

    >>> require_int(5, "step_ms", minimum=1, maximum=4)
    Traceback (most recent call last):
        ...
    prefixcache.errors.InvalidArgumentError: step_ms must be an int in [1, 4], got 5

    Complexity: O(1).
    """
    if (
        type(value) is int  # the common case, tested inline: callers sit on hot paths
        and (INT64_MIN if minimum is None else minimum) <= value
        and value <= (INT64_MAX if maximum is None else maximum)
        and INT64_MIN <= value <= INT64_MAX
    ):
        return value
    if is_int(value):
        number = int(value)
        if (minimum is None or number >= minimum) and (maximum is None or number <= maximum):
            return number
    raise error(f"{name} must be {_expected(minimum, maximum)}, got {value!r}")


def require_sequence(
    values: object,
    name: str,
    *,
    of: str = "",
    error: type[InvalidArgumentError] = InvalidArgumentError,
) -> Iterable[Any]:
    """``values`` if it is an iterable of items: a single int, a string, bytes or a
    mapping is refused rather than iterated (a caller passing the wrong thing).

    Raises:
        InvalidArgumentError: (or ``error``) naming ``name`` and what was expected
            (``of`` completes "a sequence", e.g. ``" of ints"``).

    Complexity: O(1).
    """
    if isinstance(values, (str, bytes, bytearray, Mapping)) or not isinstance(values, Iterable):
        raise error(f"{name} must be a sequence{of}, got {type(values).__name__}")
    return values


def require_int_list(
    values: object, name: str, *, error: type[InvalidArgumentError] = InvalidArgumentError
) -> list[int]:
    """``values`` (any iterable of ints by :func:`is_int`) as a list of Python ints.

    A single int, a string, bytes or a mapping is refused rather than iterated:
    each is a caller passing the wrong thing, not a list.

    >>> require_int_list((np.int64(2), 3), "slots")
    [2, 3]
    >>> require_int_list(3, "slots")
    Traceback (most recent call last):
        ...
    prefixcache.errors.InvalidArgumentError: slots must be a sequence of ints, got int

    Raises:
        InvalidArgumentError: (or ``error``) not an iterable, or an item that is not an int.

    Complexity: O(len(values)).
    """
    items = list(require_sequence(values, name, of=" of ints", error=error))
    for item in items:
        if not is_int(item):
            raise error(f"{name} must hold only ints, got {item!r}")
    return [int(item) for item in items]


def require_hashable(value: object, name: str) -> Hashable:
    """``value`` if it can key a dict (a request ID), else :class:`InvalidArgumentError`.

    Raises:
        InvalidArgumentError: ``hash(value)`` raises ``TypeError`` (a list, a dict).

    Complexity: O(1) for the usual keys (``hash`` of a tuple is O(len)).
    """
    try:
        hash(value)
    except TypeError:
        raise InvalidArgumentError(f"{name} must be hashable, got {type(value).__name__}") from None
    return value


def require_flag(
    value: object, name: str, *, error: type[InvalidArgumentError] = InvalidArgumentError
) -> bool:
    """``value`` if it is a bool (Python's or numpy's), else an error naming ``name``.

    ``1`` and ``"yes"`` are refused: a flag that takes any truthy value hides
    an argument passed in the wrong position.

    Raises:
        InvalidArgumentError: (or ``error``) ``value`` is not a bool.

    Complexity: O(1).
    """
    if not isinstance(value, (bool, np.bool_)):
        raise error(f"{name} must be a bool, got {value!r}")
    return bool(value)


def is_number(value: object) -> TypeGuard[int | float | np.integer | np.floating]:
    """An int or float (Python's or numpy's), never a bool."""
    return not isinstance(value, (bool, np.bool_)) and isinstance(
        value, (int, float, np.integer, np.floating)
    )


def require_positive_number(
    value: object, name: str, *, error: type[InvalidArgumentError] = InvalidArgumentError
) -> float:
    """``value`` as a float if it is a finite number above zero (a time), else an error.

    Bools are refused as everywhere; numpy floats and ints are numbers.

    >>> require_positive_number(0.5, "timeout_s")
    0.5
    >>> require_positive_number(True, "timeout_s")
    Traceback (most recent call last):
        ...
    prefixcache.errors.InvalidArgumentError: timeout_s must be a number > 0, got True

    Complexity: O(1).
    """
    if is_number(value) and 0 < float(value) < float("inf"):
        return float(value)
    raise error(f"{name} must be a number > 0, got {value!r}")


def require_fraction(
    value: object, name: str, *, error: type[InvalidArgumentError] = InvalidArgumentError
) -> float:
    """``value`` as a float if it is a number in ``[0, 1]`` (a share), else an error.

    >>> require_fraction(1, "scan_fraction")
    1.0
    >>> require_fraction("0.5", "scan_fraction")
    Traceback (most recent call last):
        ...
    prefixcache.errors.InvalidArgumentError: scan_fraction must lie in [0, 1], got '0.5'

    Complexity: O(1).
    """
    if is_number(value) and 0 <= float(value) <= 1:
        return float(value)
    raise error(f"{name} must lie in [0, 1], got {value!r}")


def _expected(minimum: int | None, maximum: int | None) -> str:
    if minimum is not None and maximum is not None:
        return f"an int in [{minimum}, {maximum}]"
    if minimum is not None:
        return f"an int >= {minimum}"
    if maximum is not None:
        return f"an int <= {maximum}"
    return "an int"
