"""Exception types of prefixcache.

Every error is raised before any state changes: a call that raises leaves the
allocator exactly as it was. Misuse (a bad ID, a count that would go negative)
is kept apart from running out of capacity, so a scheduler can catch the one
and let the other crash loudly.

Hierarchy::

    PrefixCacheError
    ├── InvalidArgumentError (also a ValueError)
    │   ├── InvalidBlockIdError     out-of-range ID, the dummy block
    │   ├── InvalidTensorError      wrong dtype, shape or device
    │   └── ConfigError             bad configuration, unknown policy name
    ├── BlockStateError             operation not valid in the block's state
    │   ├── ReferenceCountError     a reference count would go negative
    │   └── HashConflictError       a block already carries another hash
    ├── CapacityError               not enough room
    │   └── BudgetExceededError     the active or paused budget would overflow
    ├── InvariantError              internal corruption found by check_invariants()
    ├── ReentrantCallError          a call began while another on the same object ran
    └── EngineMismatchError         one engine's internals asked of the other (an AttributeError)
"""

from __future__ import annotations


class PrefixCacheError(Exception):
    """Base class of every error raised by prefixcache."""


class InvalidArgumentError(PrefixCacheError, ValueError):
    """An argument is malformed or out of range."""


class InvalidBlockIdError(InvalidArgumentError):
    """A block ID is outside ``[0, total_count)`` or names the dummy block."""


class InvalidTensorError(InvalidArgumentError):
    """A tensor or array argument has the wrong dtype, shape or device."""


class ConfigError(InvalidArgumentError):
    """A configuration value is invalid (unknown policy, impossible sizes)."""


class BlockStateError(PrefixCacheError):
    """The operation is not valid for the block's current state."""


class ReferenceCountError(BlockStateError):
    """A reference count would go negative (double free, pause without a reference)."""


class HashConflictError(BlockStateError):
    """A block already carries a different hash, or a parent hash is not registered."""


class CapacityError(PrefixCacheError):
    """There is not enough room for the request."""


class BudgetExceededError(CapacityError):
    """Moving references would overflow the active or paused partition's budget."""


class InvariantError(PrefixCacheError, AssertionError):
    """``check_invariants()`` found internal state that breaks a documented invariant."""


class ReentrantCallError(PrefixCacheError, RuntimeError):
    """A call into a native engine or policy began while another call on it was running.

    Python code can run in the middle of a native call (an argument's ``__index__``,
    ``numpy()`` or ``__len__``, a finaliser run by the garbage collector); if it calls
    back into the same object, the outer call would go on with buffers and state the
    inner call changed. The native engine refuses the inner call instead, before it
    changes anything, and the outer call finishes as if it had not happened.
    """


class EngineMismatchError(PrefixCacheError, AttributeError):
    """An attribute that only one engine has was asked of an allocator running the other.

    ``allocator.pool`` and ``allocator.registry`` are the Python engine's internals;
    the native engine keeps its state in C++ and has neither. Also an
    ``AttributeError``, so ``hasattr`` and ``getattr(..., default)`` answer as for
    any missing attribute.
    """
