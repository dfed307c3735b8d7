"""The Python :class:`Session`: the reference of a conversation's turns (``sessions.py``).

What a turn does and why (hash only the new tokens, trust the remembered
blocks while the structure key holds or the tail's registration generation is
unchanged, pin the hit chain's tail) is told in
``sessions.py``, whose :meth:`~prefixcache.engine.sessions.SessionMethods.open_session`
makes this object, or on the fused path the extension's twin
(``engine/native/session.cpp``), which makes the same engine calls in the
same order. Import it from ``prefixcache.engine.sessions``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from prefixcache.engine.core import fused_core
from prefixcache.engine.facade_view import FacadeView
from prefixcache.engine.pins import room_beside
from prefixcache.engine.session_inputs import checked_tokens, valid_prefix_length
from prefixcache.engine.validation import require_int
from prefixcache.errors import BlockStateError, CapacityError, InvalidArgumentError

__all__ = ["Session"]

_EMPTY = np.empty(0, dtype=np.int32)


class Session:
    """One conversation's chain between turns; made by :meth:`KVBlockAllocator.open_session`.

    A turn is :meth:`admit` (the new prompt tokens), any number of
    :meth:`append` (decoded tokens; a block that fills is registered at once),
    then :meth:`release`. Not thread-safe; one turn at a time.

    >>> from prefixcache import KVBlockAllocator
    >>> allocator = KVBlockAllocator(total_count=64, block_size_tokens=4, device="cpu")
    >>> session = allocator.open_session()
    >>> session.admit(list(range(10)))  # first turn: nothing cached
    0
    >>> session.append([10, 11, 12])  # the response: block 2 fills and is registered
    >>> session.block_ids.tolist(), session.num_tokens
    ([0, 1, 2, 3], 13)
    >>> session.release()
    >>> session.admit([13, 14, 15, 16])  # the next turn sends only its new tokens
    3
    >>> session.release()
    """

    def __init__(self, host: FacadeView) -> None:
        self._host = host
        self._hashes: list[int] = []  # chained hashes of the full blocks so far
        self._ids = np.zeros(16, dtype=np.int32)  # their blocks, then the turn's partial one
        self._pending = _EMPTY  # tokens of the partial last block
        self._num_tokens = 0
        self._num_held = 0  # blocks the running turn references (0: idle)
        self._key: tuple[int, int, int] | None = None  # structure key at the last release
        # The per-session check (_valid_prefix): each remembered block's registration
        # generation, read while a turn held it, for the first ``_recorded`` blocks; the layout
        # epoch at the last release, None when a block did not carry its hash then.
        self._generations = np.zeros(16, dtype=np.int64)
        self._recorded = 0
        self._epoch: int | None = None
        self._refused = False  # a registration of this turn was refused (hash held elsewhere)
        self._pinned = 0  # the running turn's pinned chain length (0: full references)
        self._shared = 0  # blocks the first turn hit (maybe shared prefixes): end() keeps them
        # Pins where the engine allows them (a caching policy that reads no held counts and
        # hears of no hit) and no collaborator watches (events and routing see releases).
        engine_can_pin = bool(getattr(host._engine, "can_pin", False))
        self._can_pin = engine_can_pin and not host._track_changes and host.enable_prefix_caching
        # The native engine's extension object when its chains are the facade's (xxh3_64
        # from the facade's root, salt included; ``fused``): its hash_tokens is then one C
        # call instead of a Python loop over the blocks.
        engine = host._engine
        core = fused_core(engine)
        self._hash: Any = core.hash_tokens if core is not None else self._facade_hash

    # ------------------------------------------------------------------ reading

    @property
    def num_tokens(self) -> int:
        """Tokens of the conversation so far (prompts and appended tokens)."""
        return self._num_tokens

    @property
    def running(self) -> bool:
        """Whether a turn holds blocks (between :meth:`admit` and :meth:`release`)."""
        return self._num_held > 0

    @property
    def block_ids(self) -> np.ndarray:
        """The running turn's block table row: a view of the session's own array."""
        return self._ids[: self._num_held]

    def block_ids_from(self, first: int) -> np.ndarray:
        """The running turn's row from block ``first`` on (a view; O(1)): the blocks a step
        handed out or registered, without the context before them.

        Raises:
            InvalidArgumentError: ``first`` is not an int in ``0..len(block_ids)``.
        """
        first = require_int(first, "first", minimum=0, maximum=self._num_held)
        return self._ids[first : self._num_held]

    def chain_hashes(self, first: int = 0, stop: int | None = None) -> list[int]:
        """The chained hashes of the conversation's full blocks ``first..stop-1`` (default:
        to the end; ``num_tokens // block_size`` in all): what the session registered or
        looked up there. O(stop - first).

        Raises:
            InvalidArgumentError: not ``0 <= first <= stop <= num_tokens // block_size``.
        """
        known = len(self._hashes)
        stop = known if stop is None else require_int(stop, "stop", minimum=0, maximum=known)
        first = require_int(first, "first", minimum=0, maximum=stop)
        return self._hashes[first:stop]

    # ------------------------------------------------------------------ a turn

    def turn(self, tokens: Any, response: Any, start: int = 0) -> int:
        """A whole turn in one call: :meth:`admit` ``tokens[start:]``, :meth:`append`
        ``response``, :meth:`release`; ``tokens`` may be the whole conversation, with
        ``start`` = :attr:`num_tokens` (no slice made). The capacity check covers the
        response too, so a refused turn changes nothing. Returns admit's hits.

        Raises:
            BlockStateError: a turn is running.
            InvalidArgumentError, InvalidTensorError: malformed or no tokens or
                response, ``start`` outside ``tokens``.
            CapacityError: the pool cannot hold the prompt and the response.

        Complexity: those of the three calls (the extension's twin: one native call).
        """
        if self._num_held:
            raise BlockStateError("a turn of this session is running; release() it first")
        reply = checked_tokens(response)  # checked before anything changes
        if start:
            if not 0 <= start <= len(tokens):
                raise InvalidArgumentError(f"start {start} is outside the {len(tokens)} tokens")
            tokens = tokens[start:]
        num_hit = self._admit(tokens, len(reply))
        self.append(reply)  # admit checked its room
        self.release()
        return num_hit

    def admit(self, tokens: Any, *, reserve: int = 0) -> int:
        """Start a turn whose prompt is the conversation so far plus ``tokens``.

        Pins the cached context, matches the new full blocks, allocates the
        rest (evicting through the policy) and registers the new full blocks.
        ``reserve`` tokens more (a response to come) must fit beside the
        prompt, or the admit is refused: what :meth:`turn` checks, for a
        caller that runs the turn's steps apart (a tiered session).

        Returns:
            How many leading blocks of the prompt came from the cache.

        Raises:
            BlockStateError: a turn is running (release it first).
            InvalidArgumentError, InvalidTensorError: malformed or no tokens,
                ``reserve`` not an int >= 0.
            CapacityError: the pool cannot hold the prompt (and ``reserve``)
                even after eviction. Nothing changes, the session included.

        Complexity: O(len(tokens)) hashing and matching, O(1) to check the
        context and pin its chain (O(context blocks) reference updates with
        full references, and the row's copies in this Python object).
        """
        if self._num_held:
            raise BlockStateError("a turn of this session is running; release() it first")
        return self._admit(tokens, require_int(reserve, "reserve", minimum=0))

    def _admit(self, tokens: Any, reserve: int) -> int:
        """:meth:`admit`, whose capacity check also counts ``reserve`` tokens after the
        prompt (:meth:`turn`'s response)."""
        host = self._host
        size = host.block_size_tokens
        fresh = checked_tokens(tokens)
        prompt = np.concatenate([self._pending, fresh]) if self._pending.size else fresh
        num_tokens = self._num_tokens + len(fresh)
        parent = self._hashes[-1] if self._hashes else None
        new_hashes = self._hash(prompt, parent) if len(prompt) >= size else []
        engine = host._engine
        known = base = len(self._hashes)  # base: leading remembered blocks known cached
        if not host.enable_prefix_caching:  # nothing was registered: nothing stayed cached
            base = 0
        elif known:
            key = host._structure_key()
            if key != self._key:  # something was evicted, dropped, moved: check the chain
                base = self._valid_prefix() if self._epoch == key[0] else 0
        context = self._ids[:base]
        num_matchable = (num_tokens - 1) // size
        hashes_after = self._hashes[base:] + new_hashes if base < known else new_hashes
        later = _EMPTY
        if host.enable_prefix_caching and num_matchable > base:
            later = engine.lookup(hashes_after[: num_matchable - base])
        hit = np.concatenate([context, later]).astype(np.int32) if later.size else context
        num_hit = len(hit)
        num_blocks = -(-num_tokens // size)
        needed = num_blocks - num_hit
        wanted = -(-(num_tokens + reserve) // size) - num_hit  # what the check covers
        if wanted > engine.num_free:  # else no eviction: no need to count the cached hits
            room = engine.num_free + engine.num_cached - num_hit  # at most: see room_beside
            if wanted > room - engine.pin_bound:
                active, paused = engine.reference_counts(hit.astype(np.intp))
                cached_hits = int(((active + paused) == 0).sum())  # a chain's are distinct
                room = room_beside(engine, wanted, hit, cached_hits)
            if wanted > room:
                if host._yield_hints(wanted, hit):  # withdrew scheduler hints: room now
                    return self._admit(tokens, reserve)
                raise CapacityError(f"the turn needs {wanted} blocks; {room} can be freed")
        # The chain pin (engine/pins.py): one reference on the hit chain's tail stands for
        # one on each of its blocks, where the engine allows it and nothing watches.
        pinned = num_hit if num_hit > 1 and self._can_pin else 0
        if pinned:
            engine.pin_chain(int(hit[-1]), num_hit, num_matchable)
        elif host.enable_prefix_caching:  # as admit_request: no lookup is counted without it
            engine.take_hit(hit, num_matchable, acquire=True)
        new = self._allocate(needed)
        num_full = known + len(new_hashes)
        if num_full > num_hit:
            first = num_hit - base
            self._register(
                new[: num_full - num_hit],
                hashes_after[first:],
                self._hash_at(num_hit - 1, new_hashes),
                self._tokens_of_blocks(num_hit, num_full, prompt, known),
            )
        self._grow(num_blocks)
        self._recorded = base  # the blocks after it get their generations at release
        self._ids[base:num_hit] = later
        self._ids[num_hit:num_blocks] = new
        if not known:
            self._shared = num_hit
        self._hashes.extend(new_hashes)
        self._num_tokens = num_tokens
        self._pending = prompt[len(new_hashes) * size :].copy()
        self._num_held = num_blocks
        self._pinned = pinned
        return num_hit

    def append(self, tokens: Any) -> None:
        """Add decoded ``tokens`` to the running turn: blocks they need, blocks they fill.

        Each block that fills is registered at once, chained onto the last (not
        when the last block's hash is no longer registered: a registration of it
        was refused and its holder evicted since; the next turn looks up again).

        Raises:
            BlockStateError: no turn is running.
            InvalidArgumentError, InvalidTensorError: malformed or no tokens.
            CapacityError: no room for the blocks the tokens need; nothing changes.

        Complexity: O(len(tokens)).
        """
        if not self._num_held:
            raise BlockStateError("no turn of this session is running; admit() one first")
        host = self._host
        size = host.block_size_tokens
        fresh = checked_tokens(tokens)
        pending = np.concatenate([self._pending, fresh])
        num_tokens = self._num_tokens + len(fresh)
        needed = -(-num_tokens // size) - self._num_held
        engine = host._engine
        short = needed > engine.num_free and needed > room_beside(engine, needed, _EMPTY, 0)
        if short and not host._yield_hints(needed):  # else scheduler hints made room
            raise CapacityError(f"the tokens need {needed} more blocks; the pool is short")
        parent = self._hashes[-1] if self._hashes else None
        filled = self._hash(pending, parent) if len(pending) >= size else []
        if needed:
            self._grow(self._num_held + needed)
            self._ids[self._num_held : self._num_held + needed] = self._allocate(needed)
            self._num_held += needed
        if filled and parent is not None and host._engine.block_of(parent) is None:
            # The parent hash is gone: this turn's registration of it was refused (another
            # block held it) and that block was evicted since. The filled blocks stay
            # unregistered (uncached, as a refused registration) and the next turn looks
            # the chain up again; registering under a missing parent would raise after the
            # allocation above.
            self._refused = True
        elif filled:
            known = len(self._hashes)
            self._register(
                self._ids[known : known + len(filled)],
                filled,
                parent,
                pending[: len(filled) * size],
            )
        self._hashes.extend(filled)
        self._pending = pending[len(filled) * size :].copy()
        self._num_tokens = num_tokens

    def release(self) -> None:
        """End the turn: drop its references; full blocks stay cached, the partial one is freed.

        Raises:
            BlockStateError: no turn is running.

        Complexity: O(blocks of the turn) in the engine.
        """
        if not self._num_held:
            raise BlockStateError("no turn of this session is running")
        host = self._host
        before = host._structure_key()
        known = len(self._hashes)
        if not self._refused and known > self._recorded and host.enable_prefix_caching:
            # The generations of the blocks this turn added, read while it holds them.
            added = self._ids[self._recorded : known]
            self._generations[self._recorded : known] = host._engine.registrations(
                self._engine_ids(added)
            )
        held = self._ids[: self._num_held]
        if self._pinned:  # the tail stands for its chain: release it and the turn's blocks
            engine_ids = self._engine_ids(held[self._pinned - 1 :])
            host._engine.release_pinned(engine_ids, self._pinned)
        elif host._track_changes:
            host.release_memory_blocks(held)
        else:
            host._engine.release(self._engine_ids(held), paused=False)
        self._num_held = self._pinned = 0
        after = host._structure_key()
        # The next turn trusts the remembered blocks only if this release dropped none of
        # them (ref-zero drops every released hashed block) and every block carries its
        # hash (a hash another block already held was not registered on the session's
        # block, which the release just freed); otherwise it looks the chain up again.
        self._key = after if before == after and not self._refused else None
        self._epoch = None if self._refused else after[0]
        self._recorded = 0 if self._refused else known
        self._refused = False

    def end(self) -> int:
        """The conversation ended: free its cached blocks after the first turn's hits (maybe
        shared prefixes) through ``evict_blocks`` (tail-first, looked up: no hit counted);
        the session starts over. Returns how many were freed. Raises BlockStateError (nothing
        changes) while a turn runs. Complexity: O(context) lookups, O(log n) a freed block."""
        if self._num_held:
            raise BlockStateError("a turn of this session is running; release() it first")
        host, freed = self._host, 0
        if host.enable_prefix_caching and len(self._hashes) > self._shared:
            found = host._engine.lookup(self._hashes)
            freed = host.evict_blocks(found[self._shared :]) if len(found) > self._shared else 0
        self._hashes, self._pending, self._num_tokens, self._shared = [], _EMPTY, 0, 0
        self._key, self._refused, self._epoch, self._recorded = None, False, None, 0
        return freed

    # ------------------------------------------------------------------ internals

    def _facade_hash(self, tokens: np.ndarray, parent: int | None) -> list[int]:
        return self._host.hash_tokens(tokens, parent=parent)

    def _allocate(self, num_blocks: int) -> np.ndarray:
        """``num_blocks`` fresh blocks (room was checked): through the engine when no
        collaborator watches (no events, no routing), else through the facade."""
        host = self._host
        if host._track_changes:
            ids = host.allocate_memory_blocks(num_blocks)
            assert ids is not None  # room was checked
            return ids.numpy()
        fresh = host._engine.allocate(num_blocks)
        assert fresh is not None  # room was checked
        return fresh

    def _register(
        self, block_ids: np.ndarray, hashes: list[int], parent: int | None, tokens: np.ndarray
    ) -> None:
        """Register a run of this session's blocks (``tokens``: theirs, for KV events); notes
        a hash held elsewhere."""
        host = self._host
        if host._track_changes:
            token_ids = tokens if host.events is not None and len(tokens) else None
            carried = host.register_kv_block_hashes(
                block_ids, hashes, parent_hash=parent, token_ids=token_ids
            )
            holds = carried.numpy()
        elif host.enable_prefix_caching:
            holds, _ = host._engine.register(self._engine_ids(block_ids), hashes, parent)
        else:
            return
        self._refused = self._refused or not bool(holds.all())

    def _engine_ids(self, block_ids: np.ndarray) -> np.ndarray:
        """IDs as the engine indexes with them (the Python engine: intp, like the facade)."""
        return block_ids if self._host._engine.name == "native" else block_ids.astype(np.intp)

    def _tokens_of_blocks(
        self, first: int, stop: int, prompt: np.ndarray, known: int
    ) -> np.ndarray:
        """The tokens of the prompt's blocks ``first..stop-1``, for KV events.

        ``prompt`` holds the tokens after the ``known`` remembered full blocks;
        blocks before them (re-registered after an eviction) are not kept by the
        session: the empty array, and the run's events carry no tokens.
        """
        size = self._host.block_size_tokens
        if first < known:
            return _EMPTY
        return prompt[(first - known) * size : (stop - known) * size]

    def _hash_at(self, index: int, new_hashes: list[int]) -> int | None:
        """The hash of block ``index`` of the prompt (None before the first)."""
        if index < 0:
            return None
        known = len(self._hashes)
        return self._hashes[index] if index < known else new_hashes[index - known]

    def _valid_prefix(self) -> int:
        """How many leading remembered blocks still hold the chain. O(1) when the tail is
        intact, O(log n) engine reads otherwise.

        Block i is valid when its registration generation is the one read while a turn held
        it. Every deregistration takes a leaf or a whole subtree (the leaf rule), so a valid
        block's parent stays registered, and a parent (set at registration) moves only with
        relocation, which the layout epoch covers: valid(i) implies valid(i - 1). So an
        intact tail vouches for every ancestor, and a binary search finds the first invalid
        block otherwise. Generations are given once: a chain evicted and recomputed into
        other blocks, its tail landing on the old ID, fails here (``hash_of(tail)`` would
        pass).
        """
        known = self._recorded
        ids, generations = self._ids, self._generations
        registrations = self._host._engine.registrations  # takes int32 IDs (no copy of the row)

        def valid(index: int) -> bool:
            return bool(registrations(ids[index : index + 1])[0] == generations[index])

        return valid_prefix_length(valid, known)

    def _grow(self, num_blocks: int) -> None:
        """Make room for ``num_blocks`` IDs in place (doubling), keeping the row's contents
        (and the generations beside it)."""
        if num_blocks > len(self._ids):
            size = max(num_blocks, 2 * len(self._ids))
            grown = np.zeros(size, dtype=np.int32)
            grown[: len(self._ids)] = self._ids
            self._ids = grown
            generations = np.zeros(size, dtype=np.int64)
            generations[: len(self._generations)] = self._generations
            self._generations = generations
