"""Sessions: a conversation's turns whose cost follows the new tokens, not the context.

Chat and agentic serving resend the whole conversation every turn. Admitting
each turn as a new request (:meth:`KVBlockAllocator.admit_request`) hashes and
matches the whole context again. A :class:`Session` remembers, between turns,
the chain it built: the hashes of its full blocks, the blocks that held them
and the tokens of its partial last block. A turn then

- hashes only the new tokens, chained onto the remembered tail hash;
- checks that the remembered blocks still hold the context in O(1): nothing
  was evicted, dropped, relocated or reset since the session's last release
  (the allocator's eviction and drop counters and its layout epoch). Only a
  block eviction, a ref-zero drop, defragmentation or a reset can unregister or
  move a block, so when none happened every remembered block is where it was.
  Otherwise, the layout unchanged, it checks its own chain: the tail's
  registration generation (engine ``registrations``) unchanged vouches for every
  ancestor (the leaf rule), in O(1); else a binary search finds the blocks still
  held and only the hashes after them are looked up. A refused registration or a
  moved layout falls back to one lookup of the remembered hashes (what
  :meth:`admit_request` does every turn); either way it rebuilds what was lost;
- pins the context and allocates and registers the rest through the same
  engine calls as :meth:`admit_request`, so both engines, every policy, KV
  events and MoE routing see the same calls.

An idle session holds no block: between turns its blocks are cached like any
other, and eviction may take them (unlike vLLM's streaming sessions, which
keep theirs pinned). The block table row is the session's own array, grown in
place (capacity doubling), read through :attr:`Session.block_ids`.

On the fused path (the native engine, xxh3_64 chains from the facade's root, no
collaborator watching) :meth:`SessionMethods.open_session` returns the
extension's ``Session`` instead: the same state and the same engine calls in
C++ (``engine/native/session.cpp``), one native call a step. This class stays
the reference, and the path for the Python engine, events, routing and wide
hashes (``tests/engine/test_sessions.py`` runs both against each other).

A turn references only its hit chain's tail where the engine allows it (the
chain pin, ``engine/pins.py``: ``pin_chain`` and ``release_pinned``); the
ancestors stay cached, kept by the leaf rule. What still costs O(context) per
turn: with ``auto`` or ref-zero (full references: ``take_hit`` and the release
walk every context block), and when the free blocks and the pinned chains'
bound cannot show room, the capacity check's exact count.
"""

from __future__ import annotations

from typing import Any, Protocol

from prefixcache.engine.core import EngineCore, fused_core
from prefixcache.engine.facade_view import FacadeView
from prefixcache.engine.native_engine import native_module
from prefixcache.engine.python_session import Session
from prefixcache.errors import ConfigError

__all__ = ["Session", "SessionHandle", "SessionMethods"]


class SessionHandle(Protocol):
    """What :meth:`SessionMethods.open_session` returns: a :class:`Session` or the native one.

    ``block_ids`` is a numpy view of the session's row (:class:`Session`) or a
    ``BlockIds`` copy of it (the native session); both have ``tolist()`` and the
    buffer protocol. ``block_ids_from(first)`` and ``chain_hashes(first, stop)`` read
    only part of the row and of the chain (what a tiered session reads after each step),
    and ``admit``'s ``reserve`` widens its capacity check to a response to come.
    """

    @property
    def num_tokens(self) -> int: ...

    @property
    def running(self) -> bool: ...

    @property
    def block_ids(self) -> Any: ...

    def block_ids_from(self, first: int) -> Any: ...

    def chain_hashes(self, first: int = 0, stop: int | None = None) -> list[int]: ...

    def admit(self, tokens: Any, *, reserve: int = 0) -> int: ...

    def append(self, tokens: Any) -> None: ...

    def release(self) -> None: ...

    def turn(self, tokens: Any, response: Any, start: int = 0) -> int: ...

    def end(self) -> int: ...


class SessionMethods:
    """Adds :meth:`open_session` to the allocator facade, and what sessions check against."""

    _engine: EngineCore
    _layout_epoch: int
    _track_changes: bool
    enable_prefix_caching: bool
    _hints: dict[Any, Any]  # scheduler hints held (hint_methods.py)
    verify_prefix_hits: bool

    def open_session(self) -> SessionHandle:
        """A new conversation handle: its turns hash and match only their new tokens.

        See :class:`Session`. Where ``admit_request`` is the native engine's fused
        call (no events, routing or verification watch, prefix caching on, the
        facade's own chains), the handle is the extension's ``Session``: each step
        one native call composing the same engine calls. The session calls this
        allocator directly: with :class:`~prefixcache.engine.locked.ThreadSafeAllocator`,
        open it on ``shared.allocator`` and hold ``shared.lock`` around each of its calls.

        Raises:
            ConfigError: ``verify_prefix_hits`` is on (a session does not chain
                fingerprints yet; use :meth:`admit_request`).

        Complexity: O(1).
        """
        if self.verify_prefix_hits:
            raise ConfigError(
                "sessions do not verify prefix hits yet (verify_prefix_hits is on): "
                "use admit_request"
            )
        engine = self._engine
        core = fused_core(engine)
        # A Python policy object's hooks can raise in any engine call of a turn; the native
        # session's steps are not engine transactions, so such an engine keeps the Python
        # Session (each of its facade calls is one).
        python_policy = getattr(engine, "policy_object", None) is not None
        # Scheduler hints held: the Python Session, whose turns yield them (the native one's
        # cannot); a native session opened before any hint does not yield (DESIGN.md).
        if (
            core is not None
            and not python_policy
            and not self._track_changes
            and self.enable_prefix_caching
            and not self._hints
        ):
            native: SessionHandle = native_module().Session(core)
            return native
        host: FacadeView = self  # type: ignore[assignment]  # mixed into the facade
        return Session(host)

    def _structure_key(self) -> tuple[int, int, int]:
        """Changes whenever a block may have been unregistered or moved. O(1).

        Blocks lose their hash only by eviction or a ref-zero drop (both
        counted by the engine) or a reset; they move only by defragmentation.
        The facade bumps ``_layout_epoch`` on reset and relocation.
        """
        counters = self._engine.counters()
        return (self._layout_epoch, counters.num_evicted_blocks, counters.num_dropped_blocks)
