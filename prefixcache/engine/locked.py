"""ThreadSafeAllocator: an opt-in lock around a KVBlockAllocator.

:class:`~prefixcache.KVBlockAllocator` is not thread-safe, on purpose, as
``cachetools`` caches are not: one scheduler thread owns an allocator, and a
lock on every call would cost the common case for the rare one. A deployment
that does share an allocator between threads (a tokenizer thread registering
hashes while the scheduler allocates, a metrics thread reading counts) wraps
it here: every public method runs under one ``threading.RLock``.

Each call is atomic on its own. A sequence that must not interleave with
other threads (match, then allocate the rest, then register) holds
:attr:`ThreadSafeAllocator.lock` around the sequence; the lock is re-entrant,
so the wrapper's own methods can be called inside. :meth:`free_group` holds
the lock for the whole group, so the releases queued in it are applied
before any other thread sees the allocator.

The locked methods are generated from the allocator's class when this
module is imported, so a method the facade gains is locked without an edit
here: a plain method or property runs under the lock; a context manager
(``@contextmanager``, as ``free_group``) holds it from enter to exit. A
member that a lock around the call would not guard (a generator, which runs
after the call returns) stops the import with a TypeError until it gets a
hand-written form in the class below. Results are values (fresh
tensors and lists, frozen stats), safe to use after the lock is released;
the members that would hand out the allocator's internal objects
(:data:`LIVE_STATE`, e.g. ``pool``) are refused, not forwarded.

>>> from prefixcache import KVBlockAllocator
>>> shared = ThreadSafeAllocator(KVBlockAllocator(total_count=8, device="cpu"))
>>> blocks = shared.allocate_memory_blocks(2)
>>> with shared.lock:  # a sequence no other thread may interleave with
...     shared.release_memory_blocks(blocks)
...     shared.get_total_used()
0
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from prefixcache.engine.allocator import KVBlockAllocator
from prefixcache.errors import ConfigError

if TYPE_CHECKING:
    # Type checkers see the allocator's methods with their signatures; at run
    # time they are the generated forwarders below (ThreadSafeAllocator is no
    # KVBlockAllocator: isinstance says False).
    _Base = KVBlockAllocator
else:
    _Base = object

__all__ = ["LIVE_STATE", "ThreadSafeAllocator", "locked_member_names"]

LIVE_STATE = frozenset({"pool", "registry", "open_session"})
"""Public members of the allocator that hand out its internal objects, not values.

``open_session`` is one: a session calls the allocator directly on every turn.

A lock around the call would not guard them: the caller would go on using
the object after the lock is released. The wrapper refuses them (an
AttributeError that says how to reach them: ``with shared.lock:
shared.allocator.pool``). ``tests/engine/test_thread_safety.py`` checks that
every other public member returns a value.
"""


class ThreadSafeAllocator(_Base):
    """Serialises every public method of a :class:`KVBlockAllocator` with one re-entrant lock.

    The methods and properties are those of the wrapped allocator, with the
    same arguments, results and errors (see there); each holds :attr:`lock`
    while it runs. :meth:`free_group` holds it for the whole group. Besides
    them: :attr:`lock` and :attr:`allocator`.

    Complexity: each method as the wrapped one, plus one lock acquisition
    (about 0.1 us uncontended) and one forwarding call.

    Args:
        allocator: the allocator to guard. After wrapping, use it only
            through this object (or while holding :attr:`lock`).

    Raises:
        ConfigError: ``allocator`` is not a KVBlockAllocator.
    """

    def __init__(self, allocator: KVBlockAllocator) -> None:
        if not isinstance(allocator, KVBlockAllocator):
            raise ConfigError(
                f"ThreadSafeAllocator wraps a KVBlockAllocator, got {type(allocator).__name__}"
            )
        self._allocator = allocator
        self._lock = threading.RLock()

    @property
    def lock(self) -> threading.RLock:
        """The re-entrant lock every method holds; hold it to make a sequence atomic."""
        return self._lock

    @property
    def allocator(self) -> KVBlockAllocator:
        """The wrapped allocator; touch it only while holding :attr:`lock`."""
        return self._allocator

    def __str__(self) -> str:
        with self._lock:
            return str(self._allocator)

    def __repr__(self) -> str:
        return f"ThreadSafeAllocator({self._allocator!r})"


# ---------------------------------------------------------------------- generated members


def _is_context_manager(function: Callable[..., Any]) -> bool:
    """Whether ``function`` was made by ``contextlib.contextmanager`` (it wraps a generator)."""
    wrapped = getattr(function, "__wrapped__", None)
    return (
        wrapped is not None
        and inspect.isgeneratorfunction(wrapped)
        and not inspect.isgeneratorfunction(function)
    )


def _locked_call(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(function)
    def method(self: ThreadSafeAllocator, /, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            return getattr(self._allocator, name)(*args, **kwargs)

    return method


def _locked_context(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(function)
    @contextmanager
    def method(self: ThreadSafeAllocator, /, *args: Any, **kwargs: Any) -> Iterator[Any]:
        with self._lock, getattr(self._allocator, name)(*args, **kwargs) as value:
            yield value

    method.__doc__ = f"{function.__doc__ or ''}\n\nThe wrapper holds its lock from enter to exit."
    return method


def _locked_property(name: str, prop: property) -> property:
    def get(self: ThreadSafeAllocator) -> Any:
        with self._lock:
            return getattr(self._allocator, name)

    def put(self: ThreadSafeAllocator, value: Any) -> None:
        with self._lock:
            setattr(self._allocator, name, value)

    return property(get, put if prop.fset is not None else None, doc=prop.__doc__)


def _refused(name: str) -> property:
    def refuse(self: ThreadSafeAllocator) -> Any:
        raise AttributeError(
            f"ThreadSafeAllocator.{name} would hand out the allocator's live state; "
            f"hold the lock while you use it: with shared.lock: shared.allocator.{name}"
        )

    return property(refuse)


def _locked_member(name: str, member: object) -> object:
    """The locked form of one public member of KVBlockAllocator's class.

    Raises:
        TypeError: a kind of member a lock around the call would not guard
            (a generator runs after the call returns; a static method or a
            class attribute is no method of the instance). Raised at import,
            so such a member gets a hand-written locked form before it ships.
    """
    if isinstance(member, property):
        return _locked_property(name, member)
    if inspect.isfunction(member) and _is_context_manager(member):
        return _locked_context(name, member)
    if (
        inspect.isfunction(member)
        and not inspect.isgeneratorfunction(member)
        and not inspect.iscoroutinefunction(member)
        and not inspect.isasyncgenfunction(member)
    ):
        return _locked_call(name, member)
    raise TypeError(
        f"KVBlockAllocator.{name} ({type(member).__name__}) cannot be locked by forwarding; "
        "give ThreadSafeAllocator a hand-written form of it in prefixcache/engine/locked.py"
    )


def locked_member_names() -> list[str]:
    """Names of the allocator's public class members, sorted (locked, but LIVE_STATE refused).

    Complexity: O(members of KVBlockAllocator).
    """
    return sorted(
        {
            name
            for klass in KVBlockAllocator.__mro__[:-1]  # object's members excluded
            for name in vars(klass)
            if not name.startswith("_")
        }
    )


def _install() -> None:
    """Add the locked form of every public member not written by hand in the class."""
    for name in locked_member_names():
        if name in LIVE_STATE:
            setattr(ThreadSafeAllocator, name, _refused(name))
        elif name not in vars(ThreadSafeAllocator):
            member = inspect.getattr_static(KVBlockAllocator, name)
            setattr(ThreadSafeAllocator, name, _locked_member(name, member))


_install()
