"""NativeEngine: the compiled engine (``prefixcache.engine._native``) behind EngineCore.

The C++ engine (``prefixcache/engine/native/``) owns the same state as
:class:`~prefixcache.engine.python_engine.PythonEngine` in flat arrays and runs
the built-in policies ``lru``, ``fifo`` and the ref-zero mode inside; this
class only adapts its results to the interface's types (numpy arrays, an
:class:`~prefixcache.engine.core.EngineCounters`). It hands out exactly the IDs
the Python engine would, in the same order, which the differential test
(``tests/native/``) checks after every step. See DESIGN.md, "The native engine".

The extension is optional: when it is not built (no compiler at install time),
:func:`native_available` is False, :func:`native_unavailable_reason` says why,
and the allocator runs on the Python engine.
"""

from __future__ import annotations

import os
import warnings
from types import ModuleType

import numpy as np

from prefixcache.engine.core import EngineCounters
from prefixcache.policies import EvictionPolicy, has_hook

_native: ModuleType | None
_IMPORT_ERROR: str | None
try:
    from prefixcache.engine import _native  # type: ignore[attr-defined,no-redef]

    _IMPORT_ERROR = None
except ImportError as exc:  # not built: the package falls back to the Python engine
    _native = None
    _IMPORT_ERROR = str(exc)

NATIVE_POLICIES: tuple[str, ...] = (
    tuple(sorted([*_native.native_policy_names(), "ref_zero"])) if _native is not None else ()
)
"""Policies the native engine runs inside, by name (each one file of ``native/policies/``)."""

_warned = False


def native_available() -> bool:
    """Whether the compiled engine was built and imports. Complexity: O(1)."""
    return _native is not None


def native_unavailable_reason() -> str | None:
    """Why the compiled engine is missing (the import error), or None when it is there."""
    return _IMPORT_ERROR


def warn_if_unavailable() -> None:
    """Warn once per process that the native engine is missing and Python runs instead.

    Silent when ``PREFIXCACHE_ENGINE=python`` asks for the Python engine anyway.
    """
    global _warned
    if _native is None and not _warned and os.environ.get("PREFIXCACHE_ENGINE") != "python":
        _warned = True
        warnings.warn(
            "prefixcache: the native engine (prefixcache.engine._native) is not built "
            f"({_IMPORT_ERROR}); running the pure-Python engine, which is several times "
            "slower. Reinstall with a C++17 compiler (g++ or clang++) to build it.",
            RuntimeWarning,
            stacklevel=2,
        )


def native_module() -> ModuleType:
    """The extension module itself (raises ImportError when it is not built)."""
    if _native is None:
        raise ImportError(f"prefixcache.engine._native is not built: {_IMPORT_ERROR}")
    return _native


class NativeEngine:
    """The EngineCore interface over a native ``Engine`` object (see module docstring).

    Beyond the interface, the native object (:attr:`core`) offers the fused
    request path ``admit_request(tokens, out_row)`` / ``release_request(ids)``
    and ``hash_tokens(tokens)``, which the allocator facade binds directly.

    Args:
        total_count: blocks including the dummy.
        paused_count: budget of the paused partition.
        policy_name: one of :data:`NATIVE_POLICIES`.
        policy_options: the policy's keyword arguments (numbers), as for its Python class.
        track_changes: record freed blocks and removed hashes for :meth:`take_changes`.
        block_size: tokens per block, for the fused path's hashing.
        root_hash: root of the fused path's hash chains (``hashing.root_hash``
            of the allocator's salt); None for the default root.
        lowest_first: hand out the lowest free IDs first (``free_list="lowest"``).
        page_size: blocks per page of the lowest-first list (``page_size_blocks``).
        policy_object: a Python policy object (an ``EvictionPolicy`` subclass) whose hooks
            the engine calls instead of a native policy; ``policy_name`` then only names it.
    """

    name = "native"
    fused = True
    """Whether the facade may bind :attr:`core`'s fused calls (chains of xxh3_64 from the
    root, computed natively): false under other hashes (:mod:`~prefixcache.engine.wide_keys`)."""

    def __init__(
        self,
        total_count: int,
        paused_count: int,
        policy_name: str,
        *,
        policy_options: dict[str, float] | None = None,
        track_changes: bool = False,
        block_size: int = 16,
        root_hash: int | None = None,
        lowest_first: bool = False,
        page_size: int = 1,
        policy_object: EvictionPolicy | None = None,
    ) -> None:
        module = native_module()
        # A Python policy object: the engine calls its hooks (native/python_policy.cpp).
        hooks = tuple(
            hook
            for hook in ("evicts_first", "on_register", "on_end", "on_hit")
            if has_hook(policy_object, hook)
        )
        self.core = module.Engine(
            total_count,
            paused_count,
            policy_name,
            track_changes,
            block_size,
            root_hash,
            lowest_first,
            page_size,
            policy_options,
            policy_object,
            hooks,
        )
        self.policy_object = policy_object
        self.policy_name = policy_name
        self.num_usable = total_count - 1
        self.paused_count = paused_count
        self.active_count = self.num_usable - paused_count
        self.retains_unreferenced = policy_name != "ref_zero"

    # ------------------------------------------------------------------ counters

    @property
    def num_free(self) -> int:
        return int(self.core.num_free)

    @property
    def num_active(self) -> int:
        return int(self.core.num_active)

    @property
    def num_paused(self) -> int:
        return int(self.core.num_paused)

    @property
    def num_holding_paused(self) -> int:
        return int(self.core.num_holding_paused)

    @property
    def num_cached(self) -> int:
        return int(self.core.num_cached)

    @property
    def num_registered(self) -> int:
        return int(self.core.num_registered)

    @property
    def clock(self) -> int:
        return int(self.core.clock)

    def counters(self) -> EngineCounters:
        return EngineCounters(*self.core.counters())

    def advance_clock(self, ticks: int) -> int:
        return int(self.core.advance_clock(ticks))

    # ------------------------------------------------------------------ allocation

    def allocate(self, num_blocks: int) -> np.ndarray | None:
        block_ids = self.core.allocate(num_blocks)
        return None if block_ids is None else np.frombuffer(block_ids, dtype=np.int32)

    def release(self, block_ids: np.ndarray, *, paused: bool) -> None:
        self.core.release(block_ids, paused)

    def open_group(self) -> None:
        self.core.open_group()

    def close_group(self) -> None:
        self.core.close_group()

    # ------------------------------------------------------------------ prefix reuse

    def lookup(self, block_hashes: list[int]) -> np.ndarray:
        return np.frombuffer(self.core.lookup(block_hashes), dtype=np.int32)

    def take_hit(self, block_ids: np.ndarray, num_queried: int, *, acquire: bool) -> None:
        self.core.take_hit(block_ids, num_queried, acquire)

    def acquire(self, block_ids: np.ndarray) -> None:
        self.core.acquire(block_ids)

    def register(
        self, block_ids: np.ndarray, block_hashes: list[int], parent_hash: int | None
    ) -> tuple[np.ndarray, np.ndarray]:
        holds, new = self.core.register(block_ids, block_hashes, parent_hash)
        return np.frombuffer(holds, dtype=np.bool_).copy(), np.frombuffer(new, dtype=np.bool_)

    def block_of(self, block_hash: int) -> int | None:
        block_id: int | None = self.core.block_of(block_hash)
        return block_id

    def hash_of(self, block_id: int) -> int | None:
        block_hash: int | None = self.core.hash_of(block_id)
        return block_hash

    def registrations(self, block_ids: np.ndarray) -> np.ndarray:
        return np.frombuffer(self.core.registrations(block_ids), dtype=np.int64)

    def registered_chains(self) -> list[tuple[int, int | None]]:
        chains: list[tuple[int, int | None]] = self.core.registered_chains()
        return chains

    # ------------------------------------------------------------------ partitions and time

    def move(self, block_ids: np.ndarray, *, to_paused: bool) -> None:
        self.core.move(block_ids, to_paused)

    def touch(self, block_ids: np.ndarray) -> None:
        self.core.touch(block_ids)

    def evict(self, num_blocks: int) -> int:
        return int(self.core.evict(num_blocks))

    def evict_blocks(self, block_ids: np.ndarray) -> int:
        return int(self.core.evict_blocks(block_ids))

    # ------------------------------------------------------------------ chain pins (pins.py)

    @property
    def can_pin(self) -> bool:
        # A Python policy object's hooks may read anything: full references there.
        return self.policy_object is None and bool(self.core.can_pin)

    @property
    def pin_bound(self) -> int:
        return int(self.core.pin_bound)

    def pin_chain(self, tail: int, chain_length: int, num_queried: int) -> None:
        self.core.pin_chain(tail, chain_length, num_queried)

    def release_pinned(self, block_ids: np.ndarray, chain_length: int) -> None:
        self.core.release_pinned(block_ids, chain_length)

    def reclaimable(self, block_ids: np.ndarray) -> int:
        return int(self.core.reclaimable(block_ids))

    def num_evictable(self, num_blocks: int) -> int:
        return int(self.core.num_evictable(num_blocks))

    def pinned_tails(self) -> list[tuple[int, int]]:
        return [(int(tail), int(count)) for tail, count in self.core.pinned_tails()]

    def set_retention(self, block_hashes: list[int], priority: int, expires_at: int | None) -> None:
        policy = self.policy_object
        if policy is not None:  # engine state is untouched: only the object's transaction
            policy.begin()
            try:
                for block_hash in block_hashes:
                    policy.set_retention(block_hash, priority, expires_at)
            except BaseException:
                policy.abort()
                raise
            policy.commit()
            return
        set_retention = self.core.set_retention  # a native policy never fails midway
        for block_hash in block_hashes:
            set_retention(block_hash, priority, expires_at)

    def reference_counts(self, block_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        active, paused = self.core.reference_counts(block_ids)
        return np.frombuffer(active, dtype=np.int32), np.frombuffer(paused, dtype=np.int32)

    def relocate(self, sources: np.ndarray, destinations: np.ndarray, *, check_only: bool) -> None:
        self.core.relocate(sources, destinations, check_only)

    def describe_state(self, block_id: int) -> str:
        state: str = self.core.describe_state(block_id)
        return state

    # ------------------------------------------------------------------ collaborators

    def take_changes(self) -> tuple[np.ndarray, list[int]]:
        freed, removed = self.core.take_changes()
        return np.frombuffer(freed, dtype=np.int32), removed

    def reset(self) -> None:
        self.core.reset()

    def find_problems(self) -> list[str]:
        problems: list[str] = self.core.find_problems()
        return problems

    def free_ids(self) -> np.ndarray:
        """The free stack, bottom first (as ``BlockPool.free_ids``); lowest-first mode: descending.

        Complexity: O(num_free).
        """
        return np.frombuffer(self.core.free_ids(), dtype=np.int32)

    def memory_bytes(self) -> int:
        """Host bytes the native state holds. Complexity: O(1)."""
        return int(self.core.memory_bytes())


warn_if_unavailable()  # once, when prefixcache is imported
