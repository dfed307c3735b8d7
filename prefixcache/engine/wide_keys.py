"""The native engine under hashes wider than its 63-bit keys (``xxh3_128``, ``sha256``).

The compiled engine indexes blocks by 63-bit keys. :class:`WideKeyEngine` runs
it for any other hash algorithm (the wide ones, a custom function) by giving
each wide hash a key of its own at the engine seam: ``wide -> key`` and
``key -> wide`` maps, one entry per hash the engine knows, so the mapping is a
bijection and no two hashes ever share a block. The key is the hash's low 63
bits; when another hash already holds that key (a 63-bit collision, crafted or
not), the next key of a fixed probe sequence. Everything above the seam (the
facade, events, sessions, the policy's identity of a chain) sees the wide
hashes; the policy sees keys, which it only compares for identity.

An entry lives while its hash is registered (the engine reports every removal,
which the wrapper reads after each call that can remove one), or while a
retention priority names it: the keys of hashes that were given a priority
but never registered stay until :meth:`reset`, one entry each. Lookups of
unknown hashes stop the match without touching the maps.

Cost: one dict lookup per hash crossing the seam and one ``take_changes``
call after each call that can evict; the fused request path and native chain
hashing (xxh3_64 only) are not used, so requests take the composed path.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from prefixcache.engine.native_engine import NativeEngine
from prefixcache.errors import HashConflictError

__all__ = ["WideKeyEngine"]

_MASK63 = (1 << 63) - 1
_STEP = 0x9E3779B97F4A7C15  # odd: the probe sequence visits every key


def _probe(wide: int, attempt: int) -> int:
    """Key number ``attempt`` for ``wide``: its low 63 bits, then a fixed sequence (never 0)."""
    key = (wide + attempt * _STEP) & _MASK63
    return key or 1


class WideKeyEngine(NativeEngine):
    """:class:`NativeEngine` behind a bijection of wide hashes and 63-bit keys (module docstring).

    Args: those of :class:`NativeEngine`; ``track_changes`` says whether the
    facade reads :meth:`take_changes` (the wrapper always reads the engine's).
    """

    fused = False  # its native calls chain xxh3_64 from the root: not this allocator's hashes

    def __init__(self, *args: Any, track_changes: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, track_changes=True, **kwargs)
        self._facade_tracks = track_changes
        self._key_of: dict[int, int] = {}
        self._hash_of: dict[int, int] = {}
        self._freed: list[np.ndarray] = []
        self._removed: list[int] = []

    # ------------------------------------------------------------------ the bijection

    def _free_key(self, wide: int) -> int:
        """The first key of ``wide``'s probe sequence that no hash holds."""
        attempt = 0
        key = _probe(wide, 0)
        while key in self._hash_of:
            attempt += 1
            key = _probe(wide, attempt)
        return key

    def _assign(self, wide: int) -> int:
        key = self._key_of.get(wide)
        if key is None:
            key = self._free_key(wide)
            self._key_of[wide] = key
            self._hash_of[key] = wide
        return key

    def _forget(self, key: int) -> None:
        wide = self._hash_of.pop(key, None)
        if wide is not None:
            del self._key_of[wide]

    def _drain(self) -> None:
        """Read the engine's removals: drop their keys, keep them for the facade."""
        freed, removed = super().take_changes()
        if removed:
            wides = [self._hash_of[key] for key in removed]
            for key in removed:
                self._forget(key)
            if self._facade_tracks:
                self._removed.extend(wides)
        if self._facade_tracks and len(freed):
            self._freed.append(freed.copy())

    # ------------------------------------------------------------------ calls that can remove

    def allocate(self, num_blocks: int) -> np.ndarray | None:
        try:
            return super().allocate(num_blocks)
        finally:
            self._drain()

    def release(self, block_ids: np.ndarray, *, paused: bool) -> None:
        try:
            super().release(block_ids, paused=paused)
        finally:
            self._drain()

    def close_group(self) -> None:
        try:
            super().close_group()
        finally:
            self._drain()

    def evict(self, num_blocks: int) -> int:
        try:
            return super().evict(num_blocks)
        finally:
            self._drain()

    def evict_blocks(self, block_ids: np.ndarray) -> int:
        try:
            return super().evict_blocks(block_ids)
        finally:
            self._drain()

    def reset(self) -> None:
        super().reset()
        super().take_changes()  # the reset's own removals: every key goes below
        self._key_of.clear()
        self._hash_of.clear()
        self._freed.clear()
        self._removed.clear()

    def take_changes(self) -> tuple[np.ndarray, list[int]]:
        self._drain()
        freed = np.concatenate(self._freed) if self._freed else np.empty(0, dtype=np.int32)
        removed, self._removed = self._removed, []
        self._freed = []
        return freed, removed

    # ------------------------------------------------------------------ hashes in and out

    def lookup(self, block_hashes: list[int]) -> np.ndarray:
        keys = []
        for wide in block_hashes:
            key = self._key_of.get(wide)
            if key is None:  # unknown to the engine: the match stops here
                break
            keys.append(key)
        return super().lookup(keys)

    def register(
        self, block_ids: np.ndarray, block_hashes: list[int], parent_hash: int | None
    ) -> tuple[np.ndarray, np.ndarray]:
        parent_key = None
        if parent_hash is not None:
            parent_key = self._key_of.get(parent_hash)
            if parent_key is None:  # a key no hash holds: unregistered, as the hash is
                parent_key = self._free_key(parent_hash)
        fresh = [wide for wide in dict.fromkeys(block_hashes) if wide not in self._key_of]
        keys = [self._assign(wide) for wide in fresh]
        try:
            holds, new = super().register(
                block_ids, [self._key_of[wide] for wide in block_hashes], parent_key
            )
        except BaseException as error:
            message = str(error)
            if isinstance(error, HashConflictError):  # it names keys: say the hashes
                names = dict(self._hash_of)
                if parent_hash is not None and parent_key is not None:
                    names[parent_key] = parent_hash
                message = re.sub(r"\d+", lambda m: str(names.get(int(m[0]), m[0])), message)
            for key in keys:
                self._forget(key)
            if isinstance(error, HashConflictError):
                raise HashConflictError(message) from None
            raise
        for key in keys:  # a hash whose registration was refused keeps no key
            if super().block_of(key) is None:
                self._forget(key)
        return holds, new

    def block_of(self, block_hash: int) -> int | None:
        key = self._key_of.get(block_hash)
        return None if key is None else super().block_of(key)

    def hash_of(self, block_id: int) -> int | None:
        key = super().hash_of(block_id)
        return None if key is None else self._hash_of[key]

    def registered_chains(self) -> list[tuple[int, int | None]]:
        wide = self._hash_of
        return [
            (wide[key], None if parent is None else wide[parent])
            for key, parent in super().registered_chains()
        ]

    def set_retention(self, block_hashes: list[int], priority: int, expires_at: int | None) -> None:
        super().set_retention([self._assign(wide) for wide in block_hashes], priority, expires_at)

    def find_problems(self) -> list[str]:
        problems = super().find_problems()
        if len(self._key_of) != len(self._hash_of):
            problems.append("wide keys: the two maps differ in size")
        for key, _ in super().registered_chains():
            if key not in self._hash_of:
                problems.append(f"wide keys: registered key {key} maps to no hash")
                break
        return problems

    def memory_bytes(self) -> int:
        """The native state plus about 200 bytes per mapped hash (two dict entries, two ints)."""
        return super().memory_bytes() + 200 * len(self._key_of)
