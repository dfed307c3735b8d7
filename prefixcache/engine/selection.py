"""Which engine runs an allocator: the native one when it can, else the Python reference."""

from __future__ import annotations

import os
from collections.abc import Mapping

from prefixcache.engine import hashing
from prefixcache.engine.config import AllocatorConfig
from prefixcache.engine.core import EngineCore
from prefixcache.engine.native_engine import (
    NATIVE_POLICIES,
    NativeEngine,
    native_available,
    native_unavailable_reason,
    warn_if_unavailable,
)
from prefixcache.engine.pool import resolve_device
from prefixcache.engine.python_engine import PythonEngine
from prefixcache.errors import ConfigError
from prefixcache.policies import EvictionPolicy, FIFOPolicy, LRUPolicy, RefZeroPolicy

ENGINE_ENV = "PREFIXCACHE_ENGINE"
"""Environment variable that overrides ``engine="auto"``: ``python`` or ``native``."""

AUTO_PREFERS_NATIVE = True
"""Whether ``engine="auto"`` runs the native engine where it can (else only on request)."""

_NATIVE_POLICY_TYPES: dict[str, type] = {
    "lru": LRUPolicy,
    "fifo": FIFOPolicy,
    "ref_zero": RefZeroPolicy,
}


def requested_engine(config: AllocatorConfig) -> str:
    """``config.engine``, with ``"auto"`` replaced by ``PREFIXCACHE_ENGINE`` when that is set.

    Raises:
        ConfigError: the environment variable holds something other than
            ``python``, ``native`` or ``auto``.
    """
    if config.engine != "auto":
        return config.engine
    choice = os.environ.get(ENGINE_ENV, "auto").strip().lower() or "auto"
    if choice not in ("auto", "python", "native"):
        raise ConfigError(f"{ENGINE_ENV} must be python, native or auto, got {choice!r}")
    return choice


def native_policy_name(config: AllocatorConfig, policy: EvictionPolicy) -> str | None:
    """The native policy that ``config`` names, or None when it names another (or an object).

    A policy given as an object, or as a mapping with arguments, keeps its
    Python object (the caller may hold it); so does a name that a program
    re-registered to another class.
    """
    if config.cache_unreferenced is False:  # nothing is cached: the policy never runs
        return "ref_zero"
    spec = config.eviction_policy
    if isinstance(spec, Mapping):
        if set(spec) != {"name"}:
            return None
        spec = spec["name"]
    if not isinstance(spec, str) or spec not in NATIVE_POLICIES:
        return None
    return spec if type(policy) is _NATIVE_POLICY_TYPES[spec] else None


def native_unsupported_reason(config: AllocatorConfig, policy: EvictionPolicy) -> str | None:
    """Why the native engine cannot run ``config`` (None: it can). Complexity: O(1)."""
    if not native_available():
        return f"the extension is not built ({native_unavailable_reason()})"
    if native_policy_name(config, policy) is None:
        return (
            f"it runs the policies {', '.join(NATIVE_POLICIES)} given by name, "
            f"not {config.eviction_policy!r}"
        )
    if config.hash_algo != "xxh3_64":
        return "it keeps 64-bit hashes: hash_algo must be 'xxh3_64'"
    if resolve_device(config.device).type != "cpu":
        return "it has no device mirror of the free stack yet: use device='cpu'"
    if config.total_count > 2**31 - 1:
        return "block IDs must fit in int32"
    return None


def build_engine(
    config: AllocatorConfig, policy: EvictionPolicy, *, track_changes: bool
) -> EngineCore:
    """The engine for ``config`` (:attr:`AllocatorConfig.engine`; DESIGN.md, "The engine seam").

    ``"auto"`` runs the native engine when it is built and supports the
    configuration (:func:`native_unsupported_reason`), else the Python one;
    ``PREFIXCACHE_ENGINE`` overrides ``"auto"``. ``"native"`` (from the
    config or the environment) requires the native engine.

    Args:
        config: the allocator's configuration.
        policy: the policy object built from ``config.eviction_policy``.
        track_changes: the engine records freed blocks and removed hashes
            for the facade's collaborators (events, routing).

    Raises:
        ConfigError: ``"native"`` was asked for and cannot run this config.
    """
    choice = requested_engine(config)
    if choice == "auto" and not AUTO_PREFERS_NATIVE:
        choice = "python"
    if choice != "python":
        reason = native_unsupported_reason(config, policy)
        if reason is None:
            salt_keys = [] if config.hash_salt is None else [config.hash_salt]
            return NativeEngine(
                config.total_count,
                config.paused_count,
                native_policy_name(config, policy) or "lru",
                track_changes=track_changes,
                block_size=config.block_size_tokens,
                root_hash=hashing.root_hash(None, salt_keys or None, "xxh3_64"),
                lowest_first=config.free_list == "lowest",
                page_size=config.page_size_blocks,
            )
        if choice == "native":
            raise ConfigError(f"engine='native' cannot run this allocator: {reason}")
        if not native_available():
            warn_if_unavailable()
    return PythonEngine(
        config.total_count,
        config.paused_count,
        policy,
        config.device,
        track_changes=track_changes,
        cache_unreferenced=config.cache_unreferenced,
        free_list=config.free_list,
        page_size=config.page_size_blocks,
    )
