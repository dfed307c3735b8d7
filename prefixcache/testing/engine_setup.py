"""Setup shared by the engine tests that run each case on both engines.

Tests run with ``--import-mode=importlib``, so one test module cannot import
another; the setup several of them share lives here instead of being copied:
a small CPU allocator on a chosen engine and policy (:func:`small_allocator`),
the policies that cache (:data:`CACHING_POLICIES`), a cached chain on it
(:func:`cache_chain`), a session of each kind (:func:`open_session`,
:data:`SESSION_KINDS`) and a call's outcome as a value two runs can be
compared by (:func:`outcome`).

pytest is imported only when a case is skipped.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hypothesis import HealthCheck, settings

from prefixcache import policies
from prefixcache.engine.allocator import KVBlockAllocator
from prefixcache.engine.native_engine import NATIVE_POLICIES, native_available
from prefixcache.engine.sessions import Session, SessionHandle
from prefixcache.errors import PrefixCacheError

__all__ = [
    "CACHING_POLICIES",
    "SESSION_KINDS",
    "cache_chain",
    "open_session",
    "outcome",
    "program_settings",
    "small_allocator",
]

CACHING_POLICIES = [name for name in policies.available() if name not in ("belady", "ref_zero")]
"""The policies by name that keep unreferenced blocks cached and choose their own victims
(``belady`` is the offline oracle, which needs the future; ``ref_zero`` caches nothing)."""

SESSION_KINDS = ["python", "native", "native+python-session"] if native_available() else ["python"]
"""Engine and session object: the Python engine's session, the extension's on the native
engine, and the Python reference session forced onto the native engine."""


def small_allocator(
    engine: str,
    policy: str = "lru",
    total_count: int = 16,
    *,
    block_size_tokens: int = 2,
    **kwargs: Any,
) -> KVBlockAllocator:
    """A small CPU allocator on ``engine`` running ``policy``; ``kwargs`` go to its config.

    Skips the calling test where ``engine`` is ``"native"`` and the extension is
    not built or does not run ``policy`` by name, so one parametrisation over
    engines and policies serves everywhere.
    """
    if engine == "native" and not (native_available() and policy in NATIVE_POLICIES):
        import pytest

        pytest.skip(f"the native engine does not run {policy} here")
    return KVBlockAllocator(
        total_count=total_count,
        block_size_tokens=block_size_tokens,
        device="cpu",
        eviction_policy=policy,
        engine=engine,
        **kwargs,
    )


def cache_chain(
    allocator: KVBlockAllocator, hashes: list[int], parent: int | None = None
) -> list[int]:
    """Allocate, register (under ``parent``) and release one block per hash: a cached chain.

    Returns:
        The chain's block IDs, in chain order.
    """
    ids = allocator.allocate_memory_blocks(len(hashes))
    assert ids is not None
    allocator.register_kv_block_hashes(ids, hashes, parent_hash=parent)
    allocator.release_memory_blocks(ids)
    return ids.tolist()


def open_session(allocator: KVBlockAllocator, kind: str) -> SessionHandle:
    """A session on ``allocator`` of ``kind`` (one of :data:`SESSION_KINDS`).

    The allocator's own session (the extension's on the native engine's fused
    path), or for ``"native+python-session"`` the Python reference forced onto
    the native engine, so the two can be compared step by step.
    """
    if kind == "native+python-session":
        return Session(allocator)  # the facade is its host
    session = allocator.open_session()
    assert isinstance(session, Session) == (kind == "python")
    return session


def outcome(call: Callable[[], Any], messages: bool = False) -> object:
    """What ``call()`` did: ``("ok", result)``, or ``("raised", error type's name)`` for the
    library's errors, with the message too when ``messages`` (equal only if the engines agree
    word for word)."""
    try:
        return ("ok", call())
    except PrefixCacheError as error:
        return ("raised", type(error).__name__) + ((str(error),) if messages else ())


def program_settings(max_examples: int) -> settings:
    """Hypothesis settings for random programs run on both engines: the same programs on
    every run (derandomized: CI sees what a developer saw), no deadline (a program's steps
    vary in cost), and the health checks such programs trip by design (slow data, the
    function-scoped engine fixtures) off."""
    return settings(
        max_examples=max_examples,
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )
