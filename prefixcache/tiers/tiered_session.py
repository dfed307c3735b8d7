"""TieredSession: a conversation's turns through a :class:`TieredCache` (issue 27).

An allocator's session (:meth:`KVBlockAllocator.open_session`) hands out and
registers blocks itself, behind a tier's back: a block it reuses would never
be demoted, and a block it registers would never be remembered. This wrapper
keeps the tier's one rule (every hand-out and registration goes through it)
around the allocator's own session, whose turns keep their cost (hash and
look up only the new tokens, check the context in O(1)):

- *Hand-outs.* After each step (the inner session's ``admit`` or ``append``,
  which return before anything else runs), the blocks it handed out get the
  tier's demotion check: what each held, if the tier remembers it and no other
  device block or host slot holds it, is queued for demotion. The old K/V is
  still in device memory then: nothing writes a block before the caller's
  forward pass. **Contract:** take the queued copies
  (:meth:`TieredCache.take_transfer`) and run them before the forward pass
  that writes the step's blocks, as after :meth:`TieredCache.allocate`.
- *Registrations.* The blocks the step registered (the session's
  ``block_ids_from`` and ``chain_hashes``: only the step's part of the row and
  the chain) are remembered by the tier with their hash, parent, depth and
  weight epoch, exactly as :meth:`TieredCache.register` remembers them.
- *Promotion.* A turn whose context lost device blocks continues into the
  host tier: when the allocator's structure key moved since the session's last
  release (something was evicted, dropped, moved or reset: the O(1) check the
  session itself makes) and the chain's tail hash is gone, a binary search
  (O(log n) registry reads; registration is prefix-closed, the leaf rule)
  finds the first lost block; if the host (or remote) tier holds it, the
  remembered context goes through :meth:`TieredCache.match` (device hits
  acquired, host hits promoted, copies queued), and the turn then finds the
  promoted blocks on the device. That match counts in the device's preempted
  counters (``resumed``: the session's own context, as a preempted request's).
  The common turn (nothing evicted) stays O(new tokens). Only the remembered
  context is promoted: new tokens whose blocks only the host tier holds (another
  conversation's identical continuation) are computed.
- *Weight epochs.* Sessions hash from the allocator's root, which carries no
  weight epoch (``WeightEpochs.hash_keys`` go into the roots of
  :class:`~prefixcache.tiers.requests.RequestCache`'s chains instead, so the
  two never share blocks). After :meth:`TieredCache.begin_weight_epoch` a
  session would hit blocks computed under older weights, so the combination is
  refused: :meth:`TieredCache.open_session` raises ``ConfigError`` once an epoch
  has begun, and an open session's next ``admit`` or ``turn`` raises it after
  one (a running turn may still append and release: its blocks keep epoch 0,
  retired, never demoted). Serve conversations through ``RequestCache`` when
  weights change.

Beyond the allocator's public API it reads what sessions read: the facade's structure key
(``_structure_key``) and the engine's ``hash_of`` (whether a registration held).

Refusals: the running check, the tokens and ``reserve`` are checked before
anything changes. A refused ``admit`` (``CapacityError``) after a promotion
leaves the promoted blocks cached and their copies queued, as
``TieredCache.match`` followed by a refused allocation does; the tier's
bookkeeping stays the allocator's (``TieredCache.check``). Not thread-safe.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from prefixcache.engine.session_inputs import checked_tokens, valid_prefix_length
from prefixcache.engine.sessions import SessionHandle
from prefixcache.engine.validation import require_int
from prefixcache.errors import BlockStateError, ConfigError, InvalidArgumentError

if TYPE_CHECKING:  # the tier opens its sessions: no import back at run time
    from prefixcache.tiers.tiered import TieredCache

__all__ = ["TieredSession"]

_EPOCH = 0  # the epoch whose chains start at the allocator's root (see the module doc)


def _refuse_new_epoch(tier: TieredCache) -> None:
    if tier.epochs.current != _EPOCH:
        raise ConfigError(
            "sessions hash from the allocator's root, which carries no weight epoch: after "
            "begin_weight_epoch a session could hit blocks of older weights; serve "
            "conversations through RequestCache"
        )


class TieredSession:
    """One conversation over a :class:`TieredCache`; made by :meth:`TieredCache.open_session`.

    The allocator session's surface (``admit``, ``append``, ``release``,
    ``turn``, ``end``, ``num_tokens``, ``running``, ``block_ids``,
    ``block_ids_from``, ``chain_hashes``); see the module doc for what the
    tier adds and the transfer contract.

    Raises:
        ConfigError: a weight epoch has begun, or the allocator refuses sessions.
    """

    def __init__(self, tier: TieredCache) -> None:
        _refuse_new_epoch(tier)
        self._tier = tier
        self._inner: SessionHandle = tier.allocator.open_session()
        self._size = tier.allocator.block_size_tokens
        self._key: tuple[int, int, int] | None = None  # structure key at the last release

    # ------------------------------------------------------------------ reading

    @property
    def num_tokens(self) -> int:
        """Tokens of the conversation so far."""
        return self._inner.num_tokens

    @property
    def running(self) -> bool:
        """Whether a turn holds blocks."""
        return self._inner.running

    @property
    def block_ids(self) -> Any:
        """The running turn's block table row (as the inner session gives it)."""
        return self._inner.block_ids

    def block_ids_from(self, first: int) -> Any:
        """The running turn's row from block ``first`` on."""
        return self._inner.block_ids_from(first)

    def chain_hashes(self, first: int = 0, stop: int | None = None) -> list[int]:
        """The conversation's full blocks' chained hashes ``first..stop-1``."""
        return self._inner.chain_hashes(first, stop)

    # ------------------------------------------------------------------ a turn

    def admit(self, tokens: Any, *, reserve: int = 0) -> int:
        """Start a turn (the inner session's ``admit``), promoting a lost context first.

        Returns:
            The prompt's leading blocks found on the device (promoted ones included).

        Raises:
            BlockStateError: a turn is running.
            ConfigError: a weight epoch has begun since the session opened.
            InvalidArgumentError, InvalidTensorError: malformed or no tokens, bad ``reserve``.
            CapacityError: as the inner session's (see the module doc after a promotion).

        Complexity: the inner admit's, plus O(blocks handed out and registered);
        O(log context) registry reads when something was evicted, O(context) when a
        lost context is promoted.
        """
        if self._inner.running:
            raise BlockStateError("a turn of this session is running; release() it first")
        reserve = require_int(reserve, "reserve", minimum=0)
        fresh = checked_tokens(tokens)
        _refuse_new_epoch(self._tier)
        self._tier._follow_layout()  # before anything is handed out
        matched = self._promote_lost_context()
        try:
            num_hit = self._inner.admit(fresh, reserve=reserve)
        finally:
            if matched is not None:  # the inner turn holds its own references now
                self._tier.release(matched)
        self._after_step(num_hit, num_hit)
        return num_hit

    def append(self, tokens: Any) -> None:
        """Decoded tokens of the running turn (the inner ``append``), through the tier.

        Raises:
            As the inner session's ``append`` (nothing changes).

        Complexity: the inner append's, plus O(blocks handed out and registered).
        """
        size = self._size
        before = self._inner.num_tokens
        self._tier._follow_layout()
        self._inner.append(tokens)
        self._after_step(before // size, -(-before // size))

    def release(self) -> None:
        """End the turn (the inner ``release``); remember the allocator's structure key.

        Raises:
            BlockStateError: no turn is running.
        """
        self._inner.release()
        self._key = self._tier.allocator._structure_key()

    def turn(self, tokens: Any, response: Any, start: int = 0) -> int:
        """:meth:`admit` ``tokens[start:]`` with room for ``response``, :meth:`append` it,
        :meth:`release`; a turn refused for room changes nothing (but see the module doc
        after a promotion). Returns admit's hits.

        Raises:
            As the allocator session's ``turn``, and ConfigError as :meth:`admit`.
        """
        if self._inner.running:
            raise BlockStateError("a turn of this session is running; release() it first")
        reply = checked_tokens(response)
        if start:
            if not 0 <= start <= len(tokens):
                raise InvalidArgumentError(f"start {start} is outside the {len(tokens)} tokens")
            tokens = tokens[start:]
        num_hit = self.admit(tokens, reserve=len(reply))
        self.append(reply)
        self.release()
        return num_hit

    def end(self) -> int:
        """The conversation ended (the inner ``end``): its own cached blocks are freed and the
        session starts over. The tier still remembers what they held, so handing them out
        later demotes them as any evicted block. Returns how many were freed.

        Raises:
            BlockStateError: a turn is running (nothing changes).
        """
        freed = self._inner.end()
        self._key = None
        return freed

    # ------------------------------------------------------------------ internals

    def _after_step(self, first: int, handed_from: int) -> None:
        """The tier's part of a step that returned: demote what the blocks handed out from
        row position ``handed_from`` held, then remember the blocks registered from position
        ``first`` on (the step registered positions ``first..num_tokens // size - 1``)."""
        tier, inner = self._tier, self._inner
        full = inner.num_tokens // self._size
        ids = np.asarray(inner.block_ids_from(first), dtype=np.int32)
        chain = inner.chain_hashes(first - 1 if first else 0, full)
        parent = chain[0] if first else None
        run = chain[1:] if first else chain
        run_ids = ids[: len(run)]
        hash_of = tier.allocator._engine.hash_of
        carried = [hash_of(b) == h for b, h in zip(run_ids.tolist(), run, strict=True)]
        fresh = frozenset(h for h, held in zip(run, carried, strict=True) if held)
        tier._demote_handed_out(ids[handed_from - first :], fresh)
        if run:
            tier._remember(run_ids, run, parent, np.array(carried, dtype=bool), _EPOCH)

    def _promote_lost_context(self) -> np.ndarray | None:
        """Match the remembered context through the tier when its device tail is gone and the
        host (or remote) tier may hold what was lost; returns the blocks the match referenced
        (released once the inner admit holds its own), None when nothing was matched."""
        tier, inner = self._tier, self._inner
        known = inner.num_tokens // self._size
        if not known or (not len(tier.host) and tier.remote is None):
            return None
        if tier.allocator._structure_key() == self._key:  # nothing evicted, dropped or moved
            return None
        registered = tier.allocator.is_hash_registered

        def kept(index: int) -> bool:
            return registered(inner.chain_hashes(index, index + 1)[0])

        first_lost = valid_prefix_length(kept, known)  # the leaf rule: prefix-closed
        if first_lost == known:
            return None
        if (
            tier.remote is None
            and inner.chain_hashes(first_lost, first_lost + 1)[0] not in tier.host
        ):
            return None
        match = tier.match(inner.chain_hashes(0, known), resumed=True)
        return match.block_ids
