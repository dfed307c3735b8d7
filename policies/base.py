"""The contract between the engine and an eviction policy: one base class, one choke point.

A policy orders the *evictable leaves* of the prefix cache: blocks that no
request references, that carry a registered hash, and that have no registered
child. The engine tells it when a block becomes such a leaf
(:meth:`EvictionPolicy.insert`), when it stops being one (:meth:`discard`: a
prefix hit took a reference, or a child was registered below it), and when a
tracked leaf is touched. Under memory pressure it asks for victims
(:meth:`evict`, the one choke point) and frees them. Evicting a leaf may turn
its parent into a leaf, which the engine then inserts, so a cached chain is
eaten from the end and never cut in the middle.

Every engine operation that calls the policy runs in a transaction
(DESIGN.md, "The transaction rule"): :meth:`~EvictionPolicy.begin`, the
calls, then :meth:`~EvictionPolicy.commit` when the operation succeeds or
:meth:`~EvictionPolicy.abort` when it fails, which puts the policy's whole
state back as it was at ``begin``. The base class keeps an undo log for
that: a policy calls :meth:`~EvictionPolicy.record_undo` with the inverse of
each change it makes, and pays nothing outside a transaction.

A policy sees block IDs, clock values and the few facts passed to
:meth:`insert`, never the engine. This package imports nothing from
``prefixcache`` outside ``prefixcache.policies``.
"""

from __future__ import annotations

import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

OPTIONAL_HOOKS = ("on_register", "set_retention", "evicts_first", "on_hit", "on_end")
"""The optional methods whose base-class defaults a policy may override."""

_LEGACY_METHODS = ("insert", "discard", "touch", "evict", "clear", "__len__", "__contains__")


class UnknownPolicyError(KeyError):
    """No policy is registered under the requested name."""

    def __init__(self, name: str, known: list[str]) -> None:
        super().__init__(name)
        self.name = name
        self.known = known

    def __str__(self) -> str:
        return f"unknown eviction policy {self.name!r}; known policies: {', '.join(self.known)}"


class EvictionPolicy(ABC):
    """What every eviction policy is: seven abstract methods, transactions, three hooks.

    Tracking (abstract): :meth:`insert`, :meth:`discard`, :meth:`touch`,
    :meth:`evict`, :meth:`clear`, ``__len__``, ``__contains__``.

    Transactions (concrete, an undo log): :meth:`begin`, :meth:`commit`,
    :meth:`abort`, and :meth:`record_undo` for subclasses. Between ``begin``
    and ``abort`` every call is undone, whatever it was (``on_register`` and
    ``set_retention`` included): the eviction order, ages, ghost lists,
    histories, clocks and retention entries all return to their state at
    ``begin``. A method that raises inside a transaction may leave a partial
    change: ``abort`` takes it back too, provided the method recorded each
    change right after making it. Outside a transaction calls are final and
    cost nothing extra. A policy may instead override ``begin``, ``commit``
    and ``abort`` (for example with a copy of its state taken on first
    write), as long as the laws of :class:`prefixcache.testing.PolicyContract`
    hold.

    Optional hooks (defaults here; the engine checks :func:`has_hook` once,
    so a policy pays nothing for a hook it does not override):
    :meth:`on_register`, :meth:`set_retention`, :meth:`evicts_first`.

    Subclasses are not thread-safe unless they say so: one engine owns a policy.

    Attributes:
        retains_unreferenced: deprecated. Whether unreferenced blocks stay
            cached is the configuration's ``cache_unreferenced``; the
            ``ref_zero`` policy sets it ``False`` as an alias.
    """

    retains_unreferenced: ClassVar[bool] = True
    _txn_undo: list[tuple[Any, ...]] | None = None  # the open transaction's undo log

    # ------------------------------------------------------------------ tracking

    @abstractmethod
    def insert(
        self, block_id: int, block_hash: int, last_access: int, num_accesses: int, depth: int
    ) -> None:
        """Start tracking ``block_id``, which just became an evictable leaf.

        Args:
            block_id: the block; not tracked yet.
            block_hash: the chained content hash it is registered under. Block
                IDs are recycled; a hash names the same prefix for good, so
                state that must outlive the block (ghost lists, retention
                priorities) is keyed by hash.
            last_access: clock value of the block's last access.
            num_accesses: how many times the block was handed to a request
                (1 for a block filled once and never hit again).
            depth: 0-based position of the block in its hash chain.
        """

    @abstractmethod
    def discard(self, block_id: int) -> None:
        """Stop tracking ``block_id`` (it was hit or gained a child).

        Raises:
            KeyError: ``block_id`` is not tracked (nothing changes).
        """

    @abstractmethod
    def touch(self, block_id: int, now: int) -> None:
        """Record an access at clock ``now`` to the tracked leaf ``block_id``.

        Raises:
            KeyError: ``block_id`` is not tracked (nothing changes).
        """

    @abstractmethod
    def evict(self, num_blocks: int) -> list[int]:
        """Choose up to ``num_blocks`` tracked leaves, stop tracking them, return them.

        The one choke point: every victim comes from here. Returns fewer than
        asked only when fewer are tracked, and never an untracked block. The
        engine may call again after inserting the parents the victims exposed.
        """

    @abstractmethod
    def clear(self) -> None:
        """Forget every tracked block and all history (engine reset).

        Not transactional: it ends any open transaction without undo.
        """

    @abstractmethod
    def __len__(self) -> int:
        """Number of tracked leaves."""

    @abstractmethod
    def __contains__(self, block_id: object) -> bool:
        """Whether ``block_id`` is tracked."""

    # ------------------------------------------------------------------ transactions

    def begin(self) -> None:
        """Open a transaction; one still open is committed first. Complexity: O(1)."""
        self._txn_undo = []

    def commit(self) -> None:
        """Keep every change since :meth:`begin` and close the transaction. Complexity: O(1)."""
        self._txn_undo = None

    def abort(self) -> None:
        """Undo every change since :meth:`begin`, newest first, and close the transaction.

        Without an open transaction it does nothing. Must not raise.
        Complexity: O(changes recorded).
        """
        undo = self._txn_undo
        self._txn_undo = None  # the inverses run untracked
        while undo:
            entry = undo.pop()
            entry[0](*entry[1:])

    @property
    def in_transaction(self) -> bool:
        """Whether a transaction is open (changes are being recorded). Complexity: O(1)."""
        return self._txn_undo is not None

    def record_undo(self, inverse: Callable[..., object], *args: Any) -> None:
        """In a transaction, remember to call ``inverse(*args)`` should it abort.

        Call it right after each change, with what takes exactly that change
        back given the state right after it; :meth:`abort` calls the
        inverses newest first. Outside a transaction it does nothing. Hot
        paths may inline it: ``undo = self._txn_undo``, then ``if undo is
        not None: undo.append((inverse, *args))``. Complexity: O(1).
        """
        undo = self._txn_undo
        if undo is not None:
            undo.append((inverse, *args))

    # ------------------------------------------------------------------ optional hooks

    def on_register(self, block_hashes: list[int], first_depth: int) -> None:
        """``block_hashes`` were just registered as one chain run, the first at ``first_depth``.

        Every hash registered, not only evictable leaves: a prefix evicted and
        computed again inside a longer request comes back registered but,
        being an inner block, never becomes a leaf while that request runs.
        The engine calls it once per run of consecutive chain positions a
        registration adds, before it commits the registration. The list
        belongs to the caller: copy what you keep. The default does nothing.
        Complexity: O(len(block_hashes)) at most; it is on the serving path.
        """
        return None

    def on_hit(self, block_hashes: list[int]) -> None:
        """A request just took the cached prefix ``block_hashes`` (root first): one hit each.

        Every matched block, inner ones included: a hit that ends inside a
        chain hands no leaf out, so :meth:`discard` alone does not see it.
        Both engines call it inside the hit's transaction, after the hit's
        leaves were discarded: when it raises, the hit fails, the engine
        keeps nothing of it and the policy's transaction is aborted (record
        undo entries for what it changed, as the built-ins do). The native
        engine calls its built-in policies' twin (``Policy::on_hit``) or a
        policy object's method. The list belongs to the caller.
        The default does nothing. Complexity: O(len(block_hashes)) at most.
        """
        return None

    def on_end(self, block_hashes: list[int]) -> None:
        """A conversation's end freed the cached blocks ``block_hashes`` (``evict_blocks``).

        Each left the policy by :meth:`discard` first (as a hit takes a leaf
        out) and was then freed and unregistered: the cache is smaller by
        ``len(block_hashes)`` blocks, which no :meth:`evict` told. A policy
        that simulates another cache beside the real one (``auto``'s LRU
        shadow) drops them there too. Both engines call it once the blocks
        are chosen, inside the eviction's transaction, tail-first order (a
        Python policy object on the native engine too): if it raises, the
        end changes nothing and the transaction is aborted.
        The list belongs to the caller. The default does nothing.
        Complexity: O(len(block_hashes)) at most.
        """
        return None

    def set_retention(self, block_hash: int, priority: int, expires_at: int | None) -> None:
        """Give ``block_hash`` retention ``priority`` until clock ``expires_at`` (None: forever).

        Lower priorities are evicted first; after ``expires_at`` the hash
        falls back to the policy's default priority. The allocator's
        ``set_retention_priority`` forwards here when :func:`has_hook` says
        the policy overrides it.

        Raises:
            NotImplementedError: the default; the policy has no priorities.
        """
        raise NotImplementedError(f"{type(self).__name__} has no retention priorities")

    def evicts_first(
        self, block_id: int, block_hash: int, last_access: int, num_accesses: int, depth: int
    ) -> bool:
        """Whether ``evict(1)`` would return ``block_id`` right after inserting it with these.

        Evicting a chain from its end exposes the parent of each victim; under
        LRU that parent is usually the next victim itself, and with this hook
        the engine skips the insert-and-evict round trip. Must not change
        which leaves are tracked or their order. The default, ``False``
        (no prediction), is always correct. Arguments as for :meth:`insert`.
        """
        return False

    def relocate(
        self,
        old_id: int,
        new_id: int,
        block_hash: int,
        last_access: int,
        num_accesses: int,
        depth: int,
    ) -> None:
        """The tracked leaf ``old_id`` now lives at ``new_id`` (defragmentation moved it).

        Other arguments as for :meth:`insert`, with the leaf's recorded values.
        The default discards ``old_id`` and inserts ``new_id``: exact for a
        policy whose order is a function of those arguments and the ID (LRU;
        FIFO re-enters at the leaf's last access, not its entry time), and
        transactional through those two calls. Override it to carry state
        the arguments do not give (ages, frequencies, queue positions).
        The native engine does the same for its ``lru`` and ``fifo``.
        """
        self.discard(old_id)
        self.insert(new_id, block_hash, last_access, num_accesses, depth)

    # ------------------------------------------------------------------ legacy

    @classmethod
    def __subclasshook__(cls, subclass: type) -> bool | Any:
        """A class with the seven tracking methods counts as a policy (the old protocol).

        Such a *legacy* policy does not subclass this class: it has no
        transactions, so the engine takes its calls back with inverse calls
        (see :func:`is_transactional`), and building it warns.
        """
        if cls is EvictionPolicy and all(
            callable(getattr(subclass, name, None)) for name in _LEGACY_METHODS
        ):
            return True
        return NotImplemented


def is_transactional(policy: object) -> bool:
    """Whether ``policy`` subclasses :class:`EvictionPolicy` (and so has transactions). O(1)."""
    return EvictionPolicy in type(policy).__mro__


def has_hook(policy: object, name: str) -> bool:
    """Whether ``policy`` implements the optional hook ``name`` (one of :data:`OPTIONAL_HOOKS`).

    A subclass has it when it overrides the base-class default; a legacy
    policy when it has the method at all. The engine asks once, at
    construction. Complexity: O(1).

    Raises:
        ValueError: ``name`` is not an optional hook.
    """
    if name not in OPTIONAL_HOOKS:
        raise ValueError(f"{name!r} is not an optional hook; hooks: {', '.join(OPTIONAL_HOOKS)}")
    method = getattr(type(policy), name, None)
    return callable(method) and method is not getattr(EvictionPolicy, name)


# ---------------------------------------------------------------- deprecated protocols


class _HookCheck(type):
    """Metaclass of the deprecated protocols: ``isinstance`` asks :func:`has_hook`."""

    _hook: str
    _advice: str

    def __instancecheck__(cls, instance: object) -> bool:
        if cls._hook in OPTIONAL_HOOKS:
            return has_hook(instance, cls._hook)
        return callable(getattr(type(instance), cls._hook, None))


def _protocol(name: str, hook: str, advice: str) -> _HookCheck:
    return _HookCheck(name, (), {"_hook": hook, "_advice": advice, "__doc__": advice})


_DEPRECATED = {
    name: _protocol(name, hook, advice)
    for name, hook, advice in (
        ("SupportsRetention", "set_retention", "ask has_hook(policy, 'set_retention')"),
        ("ObservesRegistrations", "on_register", "ask has_hook(policy, 'on_register')"),
        ("PredictsNextVictim", "evicts_first", "ask has_hook(policy, 'evicts_first')"),
        (
            "ObservesRollbacks",
            "on_rollback",
            "nothing calls on_rollback: a failed call ends with EvictionPolicy.abort()",
        ),
    )
}


def deprecated_protocol(name: str, module: str) -> Any:
    """The deprecated protocol ``name`` (``isinstance`` = :func:`has_hook`), with a warning.

    Raises:
        AttributeError: ``name`` is no deprecated protocol.
    """
    protocol = _DEPRECATED.get(name)
    if protocol is not None:
        warnings.warn(
            f"{module}.{name} is deprecated: optional hooks are methods of EvictionPolicy; "
            f"{protocol._advice}",
            DeprecationWarning,
            stacklevel=3,
        )
        return protocol
    raise AttributeError(f"module {module!r} has no attribute {name!r}")


def __getattr__(name: str) -> Any:
    return deprecated_protocol(name, __name__)
