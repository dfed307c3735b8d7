"""Which engine runs an allocator: the native one when it can, else the Python reference."""

from __future__ import annotations

import logging
import numbers
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
from prefixcache.engine.python_engine import PythonEngine
from prefixcache.engine.wide_keys import WideKeyEngine
from prefixcache.errors import ConfigError
from prefixcache.policies import (
    ARCPolicy,
    EvictionPolicy,
    FIFOPolicy,
    HazardPolicy,
    LFUPolicy,
    LRUPolicy,
    PriorityPolicy,
    ProtectedLRUPolicy,
    RefZeroPolicy,
    ReuseLRUPolicy,
    S3FIFOPolicy,
    SLRUPolicy,
    is_transactional,
)
from prefixcache.policies.auto import AutoPolicy

ENGINE_ENV = "PREFIXCACHE_ENGINE"
"""Environment variable that overrides ``engine="auto"``: ``python`` or ``native``."""

AUTO_PREFERS_NATIVE = True
"""Whether ``engine="auto"`` runs the native engine where it can (else only on request)."""

_LOG = logging.getLogger(__name__)
_logged_reasons: set[str] = set()  # each fallback reason is logged once per process

# The built-in class behind each name: a name a program re-registered to another class
# keeps its Python object.
_BUILT_IN_TYPES: dict[str, type] = {
    "arc": ARCPolicy,
    "auto": AutoPolicy,
    "fifo": FIFOPolicy,
    "hazard": HazardPolicy,
    "lfu": LFUPolicy,
    "lru": LRUPolicy,
    "priority": PriorityPolicy,
    "protected_lru": ProtectedLRUPolicy,
    "ref_zero": RefZeroPolicy,
    "reuse_lru": ReuseLRUPolicy,
    "s3fifo": S3FIFOPolicy,
    "slru": SLRUPolicy,
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


def native_policy(
    config: AllocatorConfig, policy: EvictionPolicy
) -> tuple[str, dict[str, float]] | None:
    """The native policy ``config`` names and its options, or None when it names another.

    A built-in policy given by name, or as a mapping of its name and numeric keyword
    arguments (validated already: ``policy`` was built from them), runs natively. A
    policy given as an object keeps its Python object (the caller may hold it); so do a
    name a program re-registered to another class and options that are not numbers.
    """
    if config.cache_unreferenced is False:  # nothing is cached: the policy never runs
        return "ref_zero", {}
    return native_policy_spec(config.eviction_policy, policy)


def native_policy_spec(spec: object, policy: EvictionPolicy) -> tuple[str, dict[str, float]] | None:
    """The native policy that answers as ``policy``, built from ``spec``, or None.

    ``spec`` is what the user gave: a name, or a mapping of ``name`` and keyword
    arguments. Also what the vLLM plugin asks before it runs a native policy in its
    queue. Complexity: O(options).
    """
    name: object = spec
    options: dict[str, float] = {}
    if isinstance(spec, Mapping):
        options = {key: value for key, value in spec.items() if key != "name"}
        name = spec.get("name")
        if name == "auto" and options.get("safety_z", 0) is None:
            del options["safety_z"]
            options["safety_net"] = 0  # safety_z=None: the net is off
        # The policy object was built from them, so its class has checked their ranges.
        if not all(isinstance(value, numbers.Real) for value in options.values()):
            return None
    if not isinstance(name, str) or name not in NATIVE_POLICIES:
        return None
    if type(policy) is not _BUILT_IN_TYPES.get(name):
        return None
    if isinstance(policy, AutoPolicy):  # the seed travels as the multipliers it picked
        options = {key: value for key, value in options.items() if key != "seed"}
        options.update(auto_sketch_options(policy))
    return name, options


def auto_sketch_options(policy: AutoPolicy) -> dict[str, float]:
    """The native ``auto``'s options for the sketch multipliers ``policy``'s seed picked.

    They come from Python's ``random.Random(seed)`` (the Python class computes them), so
    the native policy is not left to reimplement the generator: each 64-bit multiplier
    travels as two exact 32-bit halves (options are doubles). Complexity: O(1).
    """
    options: dict[str, float] = {}
    for row, multiplier in enumerate(policy.sketch_multipliers):
        options[f"multiplier{row}_high"] = multiplier >> 32
        options[f"multiplier{row}_low"] = multiplier & 0xFFFF_FFFF
    return options


_PYTHON_ONLY = ("belady",)  # built-in names kept on the Python engine (see below)

PYTHON_POLICY_MAX_BLOCKS = 32_768
"""The largest pool on which the native engine drives a policy object. Each engine call
copies the engine's state first (``native/engine_checkpoint.h``, the transaction rule), about
5-11 ns a block: 10 us at 2,048 blocks, 0.7 ms at 65,536, where the Python engine's own
cost per call is comparable. Above it the Python engine runs (with its reason)."""


def python_policy_reason(config: AllocatorConfig, policy: EvictionPolicy) -> str | None:
    """Why the native engine cannot drive the Python object ``policy`` (None: it can).

    The native engine calls a policy object's hooks through ``python_policy.cpp`` and keeps
    the transaction rule with its own checkpoint (DESIGN.md, "Native policies"). It needs
    the object's transactions (an ``EvictionPolicy`` subclass: a legacy policy keeps the
    Python engine's inverse-call journal), the hashes themselves (under wider hashes the
    engine holds keys), no hold on the Python engine's own state (a page-aware policy
    reads its free list), and a pool of at most
    :data:`PYTHON_POLICY_MAX_BLOCKS`. ``belady`` (offline) stays Python by name.
    Complexity: O(1).
    """
    cls = type(policy).__name__
    if config.eviction_policy in _PYTHON_ONLY:
        return f"{config.eviction_policy!r} runs on the Python engine"
    if not is_transactional(policy):
        return f"a {cls} object follows the legacy protocol (no transactions)"
    if callable(getattr(policy, "bind_free_counts", None)):
        return f"a {cls} object reads the Python engine's free list"
    if not getattr(policy, "retains_unreferenced", True):
        return f"a {cls} object caches nothing (ref_zero runs by name)"
    if config.hash_algo != "xxh3_64":
        return f"a {cls} object under hash_algo={config.hash_algo!r} would see keys, not hashes"
    if config.total_count > PYTHON_POLICY_MAX_BLOCKS:
        return (
            f"a {cls} object needs a copy of the engine's state per call, too slow above "
            f"{PYTHON_POLICY_MAX_BLOCKS:,} blocks"
        )
    return None


def native_unsupported_reason(config: AllocatorConfig, policy: EvictionPolicy) -> str | None:
    """Why the native engine cannot run ``config`` (None: it can). Complexity: O(1)."""
    if not native_available():
        return f"the extension is not built ({native_unavailable_reason()})"
    if isinstance(policy, AutoPolicy) and config.hash_algo != "xxh3_64":
        # The engine would hand auto keys, not hashes: its sketch would count other cells.
        algo = config.hash_algo
        return f"auto's sketch counts hashes, and under hash_algo={algo!r} it would see keys"
    if native_policy(config, policy) is None and python_policy_reason(config, policy) is not None:
        spec = config.eviction_policy
        # A policy object by its class: one reason (and one log line) for all its instances.
        by_class = f"a {type(spec).__name__} object"
        named = repr(spec) if isinstance(spec, (str, Mapping)) else by_class
        return (
            f"it runs the policies {', '.join(NATIVE_POLICIES)} given by name (with numeric "
            f"options) and policy objects it can drive, not {named}: "
            f"{python_policy_reason(config, policy)}"
        )
    if config.total_count > 2**31 - 1:
        return "block IDs must fit in int32"
    return None


def build_engine(
    config: AllocatorConfig, policy: EvictionPolicy, *, track_changes: bool
) -> tuple[EngineCore, str]:
    """The engine for ``config`` and why it runs (DESIGN.md, "The engine seam").

    ``"auto"`` (:attr:`AllocatorConfig.engine`) runs the native engine when it
    is built and supports the configuration (:func:`native_unsupported_reason`),
    else the Python one, and then logs the reason once per process (a warning of
    the ``prefixcache`` logger): nothing falls back silently.
    ``PREFIXCACHE_ENGINE`` overrides ``"auto"``. ``"native"`` (from the config
    or the environment) requires the native engine. The device plays no part:
    both engines keep their state on the host (the device mirror is the
    facade's, :mod:`prefixcache.engine.device_mirror`).

    Args:
        config: the allocator's configuration.
        policy: the policy object built from ``config.eviction_policy``.
        track_changes: the engine records freed blocks and removed hashes
            for the facade's collaborators (events, routing).

    Returns:
        The engine, and one sentence saying why it is the one that runs.

    Raises:
        ConfigError: ``"native"`` was asked for and cannot run this config.
    """
    choice = requested_engine(config)
    if choice == "python":
        source = "engine='python'" if config.engine == "python" else f"{ENGINE_ENV}=python"
        return _python_engine(config, policy, track_changes), f"{source} asks for it"
    if choice == "auto" and not AUTO_PREFERS_NATIVE:
        return _python_engine(config, policy, track_changes), "auto prefers the Python engine"
    reason = native_unsupported_reason(config, policy)
    named = native_policy(config, policy)
    if reason is None and named is None:  # a policy object, its hooks called natively
        engine = NativeEngine(
            config.total_count,
            config.paused_count,
            type(policy).__name__,
            policy_object=policy,
            track_changes=track_changes,
            block_size=config.block_size_tokens,
            lowest_first=config.free_list == "lowest",
            page_size=config.page_size_blocks,
        )
        return engine, (
            f"the native engine is built and runs this configuration, calling the "
            f"{type(policy).__name__} object's hooks"
        )
    if reason is None and named is not None:
        salt_keys = [] if config.hash_salt is None else [config.hash_salt]
        # Other hashes than the native chain's (wider, or a custom function) get keys.
        engine_class = NativeEngine if config.hash_algo == "xxh3_64" else WideKeyEngine
        engine = engine_class(
            config.total_count,
            config.paused_count,
            named[0],
            policy_options=named[1],
            track_changes=track_changes,
            block_size=config.block_size_tokens,
            root_hash=hashing.root_hash(None, salt_keys or None, "xxh3_64"),
            lowest_first=config.free_list == "lowest",
            page_size=config.page_size_blocks,
        )
        return engine, "the native engine is built and runs this configuration"
    if choice == "native":
        raise ConfigError(f"engine='native' cannot run this allocator: {reason}")
    if not native_available():
        warn_if_unavailable()  # its own warning, once, already says why
    elif reason not in _logged_reasons:
        _logged_reasons.add(str(reason))
        _LOG.warning("prefixcache: running the Python engine, because the native one: %s", reason)
    return _python_engine(config, policy, track_changes), f"the native engine: {reason}"


def _python_engine(
    config: AllocatorConfig, policy: EvictionPolicy, track_changes: bool
) -> PythonEngine:
    return PythonEngine(
        config.total_count,
        config.paused_count,
        policy,
        track_changes=track_changes,
        cache_unreferenced=config.cache_unreferenced,
        free_list=config.free_list,
        page_size=config.page_size_blocks,
    )
