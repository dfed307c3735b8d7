"""Megatron-core drop-in: prefixcache's allocator behind Megatron's ``KVBlockAllocator``.

Megatron-core 0.19's ``DynamicInferenceContext`` builds its allocator as
``KVBlockAllocator(context=..., total_count=..., paused_count=...,
enable_prefix_caching=..., prefix_caching_eviction_policy=...)`` and then
reads and writes the allocator's state directly: plain attributes
(``total_avail``, ``active_count``, ``paused_count``, ``dummy_block_idx``),
in prefix-caching modes the live CPU tensors ``block_ref_counts`` (int32),
``block_hashes`` (int64) and, in LRU mode, ``block_timestamps``,
``block_parent_id``, ``block_child_count`` (int64), the dict
``kv_hash_to_block_id`` and the ``on_blocks_deregistered`` callback that the
Mamba slot allocator sets. :class:`MegatronKVBlockAllocator` has that surface,
attribute by attribute and method by method (the table, and what is not
covered and why: DESIGN.md, "Megatron-core drop-in"), and runs every state change
through a :class:`~prefixcache.KVBlockAllocator` (O(log n) eviction instead
of Megatron's scan of the whole pool, every prefixcache policy, KV events,
statistics). :func:`install` makes Megatron's modules build it; :func:`attach`
switches one existing context. Both build it in compat mode by default
(:class:`MegatronCompatAllocator`: Megatron's block IDs, free stack and
accepted calls, for a host whose tests rely on them); ``strict=True`` builds
:class:`MegatronKVBlockAllocator` itself.

Who owns what (DESIGN.md, "Megatron-core drop-in"): the prefixcache
allocator is authoritative. The tensors and the dict are mirrors that this
class updates after every call it makes, so Megatron reads exactly what it
would read from its own allocator. The one place Megatron's context writes
the allocator's state itself, ``block_ref_counts[ids] += 1`` when it pins
matched blocks (and ``-= 1`` when it rolls the pin back), goes through
``block_ref_counts.__setitem__``, which this class intercepts and turns into
``acquire_blocks`` / ``release_memory_blocks``; a write the allocator refuses
is undone on the tensor and raised. Other in-place tensor methods on these
mirrors (``fill_``, ``add_``, writes through a slice view) are not seen, and
Megatron's callers use none of them.

On the native engine the hot calls (allocate, release, touch, register, a pin
of distinct IDs) go to the compiled engine directly, which validates them and
raises the library's errors before any change; what it deregistered is read
back with its ``take_changes`` (DESIGN.md, "Megatron-core drop-in"). With KV
events on, or on the Python engine, every call goes through the facade.

Megatron is imported lazily (only :func:`install`, :func:`attach` and the
default policy names need it), so this module imports without it.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from prefixcache.errors import ConfigError
from prefixcache.integrations.megatron.allocator import MegatronKVBlockAllocator
from prefixcache.integrations.megatron.compat import MegatronCompatAllocator
from prefixcache.integrations.megatron.options import (
    _OPTION_KEYS,
    SUPPORTED_VERSIONS,
    PrefixCachePolicy,
    _installed_options,
)

__all__ = [
    "SUPPORTED_VERSIONS",
    "MegatronCompatAllocator",
    "MegatronKVBlockAllocator",
    "PrefixCachePolicy",
    "attach",
    "check_version",
    "install",
    "installed",
    "uninstall",
]

# ---------------------------------------------------------------------- switching

_replaced: list[tuple[Any, Any]] = []


def check_version() -> str:
    """The installed megatron-core version; ConfigError unless this module supports it."""
    try:
        version = importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError as exc:
        raise ConfigError("megatron-core is not installed") from exc
    if not version.startswith(SUPPORTED_VERSIONS):
        supported = ", ".join(prefix + "x" for prefix in SUPPORTED_VERSIONS)
        raise ConfigError(
            f"prefixcache's Megatron drop-in supports megatron-core {supported}; found {version}"
        )
    return version


def _class_of(strict: bool) -> type[MegatronKVBlockAllocator]:
    return MegatronKVBlockAllocator if strict else MegatronCompatAllocator


def install(*, strict: bool = False, **options: Any) -> None:
    """Make every loaded Megatron module that bound ``KVBlockAllocator`` build the drop-in.

    Call it before building a ``DynamicInferenceContext``. By default the
    drop-in is :class:`MegatronCompatAllocator` (compat mode: Megatron's
    block IDs, writable ``total_avail``, registration on free blocks);
    ``strict=True`` installs :class:`MegatronKVBlockAllocator` (prefixcache's
    free order, every misuse refused, the native fast paths). ``options``
    become the drop-in's defaults (``cached_policy``, ``engine``,
    ``kv_events_capacity``, ``kv_events_medium``, ``device``, ``hash_algo``).
    Calling it again replaces the mode and options. Undo with :func:`uninstall`.

    Raises:
        ConfigError: megatron-core is missing or not a supported version, or
            an option is unknown.
    """
    check_version()
    unknown = sorted(set(options) - {"cached_policy", *_OPTION_KEYS})
    if unknown:
        raise ConfigError(f"unknown options {unknown}; valid: {['cached_policy', *_OPTION_KEYS]}")
    uninstall()  # installed already: start from Megatron's own class
    _installed_options.update(options)
    defining = importlib.import_module("megatron.core.inference.contexts.kv_block_allocator")
    original = defining.KVBlockAllocator
    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("megatron") and (
            getattr(module, "KVBlockAllocator", None) is original
        ):
            _replaced.append((module, original))
            setattr(module, "KVBlockAllocator", _class_of(strict))  # noqa: B010


def uninstall() -> None:
    """Put Megatron's own ``KVBlockAllocator`` back everywhere :func:`install` replaced it."""
    while _replaced:
        module, original = _replaced.pop()
        setattr(module, "KVBlockAllocator", original)  # noqa: B010
    _installed_options.clear()


@contextmanager
def installed(*, strict: bool = False, **options: Any) -> Iterator[None]:
    """:func:`install` for the ``with`` block, then :func:`uninstall`."""
    install(strict=strict, **options)
    try:
        yield
    finally:
        uninstall()


def attach(context: Any, *, strict: bool = False, **options: Any) -> MegatronKVBlockAllocator:
    """Switch one existing context to the drop-in, keeping its sizes, mode and callback.

    Compat mode (:class:`MegatronCompatAllocator`) unless ``strict=True``, as :func:`install`.

    Raises:
        ConfigError: the context's allocator holds blocks (switch before serving).
    """
    old = context.kv_block_allocator
    if old.get_total_used():
        raise ConfigError(f"the context's allocator holds {old.get_total_used()} blocks")
    new = _class_of(strict)(
        context,
        total_count=old.total_count,
        paused_count=old.paused_count,
        enable_prefix_caching=old.enable_prefix_caching,
        prefix_caching_eviction_policy=old.prefix_caching_eviction_policy,
        **options,
    )
    new.on_blocks_deregistered = old.on_blocks_deregistered
    context.kv_block_allocator = new
    return new
