"""AllocatorConfig, and turning a plain dict (from YAML/JSON) into one."""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from prefixcache import policies
from prefixcache.engine import hashing
from prefixcache.errors import ConfigError
from prefixcache.policies import EvictionPolicy, UnknownPolicyError, is_transactional

PolicySpec = str | Mapping[str, Any] | EvictionPolicy
"""A policy name, ``{"name": ..., **kwargs}``, or a ready policy object."""

REF_ZERO = "ref_zero"
"""The policy name that is an alias of ``cache_unreferenced=False``."""


def names_ref_zero(spec: object) -> bool:
    """Whether the policy spec ``spec`` is the ref-zero alias (by name, mapping or object).

    An object counts when it says ``retains_unreferenced = False`` (the
    ``RefZeroPolicy`` object, or a policy of the old protocol). O(1).
    """
    if isinstance(spec, str):
        return spec == REF_ZERO
    if isinstance(spec, Mapping):
        return spec.get("name") == REF_ZERO
    return getattr(spec, "retains_unreferenced", True) is False


def _require_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name} must be an int >= {minimum}, got {value!r}")


def _check_hash_algo(algo: object) -> None:
    """Refuse a ``hash_algo`` that is neither a known name nor a usable hash function.

    Being callable is not enough: ``np.array`` and ``print`` are callable, and
    would fail (or hash nothing) only at the first ``hash_tokens``. The
    allocator calls ``algo(tokens, block_size, parent=..., salt=...,
    extra_keys=...)``, so the signature must bind those arguments: two
    positional ones and the three keywords, by name or through ``**kwargs``.
    A callable whose signature cannot be read (some C builtins) is refused,
    since nothing shows that it takes them.
    """
    valid = ", ".join(hashing.HASH_ALGORITHMS)
    if isinstance(algo, str):
        if algo not in hashing.HASH_ALGORITHMS:
            raise ConfigError(f"unknown hash_algo {algo!r}; valid: {valid}")
        return
    if not callable(algo):
        raise ConfigError(
            f"hash_algo must be one of {valid} or a hash function, got {type(algo).__name__}"
        )
    call = "algo(tokens, block_size, *, parent, salt, extra_keys)"
    try:
        signature = inspect.signature(algo)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"hash_algo {algo!r} has no readable signature; need {call}") from exc
    try:
        signature.bind(None, None, parent=None, salt=None, extra_keys=None)
    except TypeError as exc:
        raise ConfigError(f"hash_algo {algo!r} cannot be called as {call}: {exc}") from exc


ENGINE_NAMES = ("auto", "python", "native")

FREE_LIST_MODES = ("stack", "lowest")
"""``AllocatorConfig.free_list``: the LIFO stack (default) or lowest IDs first."""


@dataclass(frozen=True)
class AllocatorConfig:
    """Everything a :class:`~prefixcache.KVBlockAllocator` is built from.

    Attributes:
        total_count: blocks in the pool, the dummy block included.
        paused_count: budget of blocks that paused requests may hold; the
            active budget is ``total_count - 1 - paused_count``.
        block_size_tokens: tokens per block (used for hashing and routing).
        enable_prefix_caching: when False, hashes are ignored: nothing is
            registered and nothing matches.
        eviction_policy: ``"lru"``, any registered name, ``{"name": "lru",
            ...kwargs}``, or a policy object (used as is: give each
            allocator its own, a policy holds per-allocator state). A policy
            object should subclass :class:`~prefixcache.policies.EvictionPolicy`;
            one that only has the old protocol's methods still works, with a
            DeprecationWarning. ``"ref_zero"`` is an alias of
            ``cache_unreferenced=False``.
        device: where device mirrors live; ``None`` = CUDA when available.
        hash_algo: ``"xxh3_64"`` (default), ``"xxh3_128"`` or ``"sha256"``;
            or a hash function called as ``algo(tokens, block_size, *,
            parent, salt, extra_keys) -> list[int]`` like
            :func:`prefixcache.engine.hashing.compute_block_hashes` (tests inject a
            deliberately weak one to force collisions). Its signature is
            checked here; what it returns is not.
        hash_salt: deployment-wide salt (model or weight version) mixed into
            every chain's root by :meth:`KVBlockAllocator.hash_tokens`.
        routing_num_layers, routing_top_k: MoE routing dimensions; both set
            enables per-block routing storage.
        routing_num_experts: decides the stored dtype (int16 up to 32,767
            experts, int32 beyond); defaults to int16.
        kv_events_capacity: 0 (default) records no KV cache events; a
            positive number enables them and bounds the queue that
            :meth:`KVBlockAllocator.take_events` drains.
        kv_events_medium: storage tier named in events (``"GPU"``).
        verify_prefix_hits: keep a second, independent fingerprint per
            registered block and check it on every match, so a hash
            collision (accidental or crafted) can never share a block.
            Registration and matching then require ``fingerprints``.
        engine: ``"auto"`` (default) runs the native engine when it is built
            and supports the policy, else the Python engine; ``"python"``
            forces the reference engine, ``"native"`` requires the native one.
            The environment variable ``PREFIXCACHE_ENGINE`` overrides
            ``"auto"``. See DESIGN.md, "The engine seam".
        cache_unreferenced: True keeps a hashed block cached when its last
            reference is released, until the policy evicts it; False is
            ref-zero mode (Megatron-core's ``REF_ZERO``): such a block is
            dropped at once and the policy tracks nothing. None (default)
            resolves to False for the ``ref_zero`` policy and True otherwise;
            after construction it is always a bool.
        free_list: ``"stack"`` (default) hands out the most recently freed
            blocks first, O(1) per block; ``"lowest"`` hands out the lowest
            free IDs first and keeps the live blocks packed, O(log n) per
            block (:mod:`prefixcache.engine.free_list`; DESIGN.md, "Locality").
        page_size_blocks: blocks per page of the KV storage's mapping (>= 1).
            Above 1 (only with ``free_list="lowest"``) requests of at least
            a page start at a page boundary when a whole page is free, and
            small requests fill partly used pages first (both engines, the
            same order).

    Raises:
        ConfigError: a count of the wrong type or out of range, a non-bool
            flag, routing dimensions set apart, a ``hash_algo`` that is
            neither a known name nor callable as described above, or
            ``cache_unreferenced=True`` with the ``ref_zero`` alias.
    """

    total_count: int
    paused_count: int = 0
    block_size_tokens: int = 16
    enable_prefix_caching: bool = True
    eviction_policy: PolicySpec = "lru"
    device: str | None = None
    hash_algo: str | Callable[..., list[int]] = "xxh3_64"
    hash_salt: str | None = None
    routing_num_layers: int | None = None
    routing_top_k: int | None = None
    routing_num_experts: int | None = None
    kv_events_capacity: int = 0
    kv_events_medium: str | None = "GPU"
    verify_prefix_hits: bool = False
    engine: str = "auto"
    cache_unreferenced: bool | None = None
    free_list: str = "stack"
    page_size_blocks: int = 1

    def __post_init__(self) -> None:
        _require_int("total_count", self.total_count, 2)
        _require_int("paused_count", self.paused_count, 0)
        _require_int("block_size_tokens", self.block_size_tokens, 1)
        _require_int("kv_events_capacity", self.kv_events_capacity, 0)
        _check_hash_algo(self.hash_algo)
        if self.paused_count > self.total_count - 2:
            raise ConfigError(
                f"paused_count {self.paused_count} leaves no active blocks "
                f"(total_count {self.total_count}, one is the dummy)"
            )
        if not isinstance(self.verify_prefix_hits, bool):
            raise ConfigError(f"verify_prefix_hits must be a bool, got {self.verify_prefix_hits!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ConfigError(
                f"enable_prefix_caching must be a bool, got {self.enable_prefix_caching!r}"
            )
        if not isinstance(self.engine, str) or self.engine not in ENGINE_NAMES:
            raise ConfigError(f"engine must be one of {ENGINE_NAMES}, got {self.engine!r}")
        if not isinstance(self.free_list, str) or self.free_list not in FREE_LIST_MODES:
            raise ConfigError(f"free_list must be one of {FREE_LIST_MODES}, got {self.free_list!r}")
        _require_int("page_size_blocks", self.page_size_blocks, 1)
        if self.page_size_blocks > 1 and self.free_list != "lowest":
            raise ConfigError(
                "page_size_blocks > 1 (page-aligned allocation) needs free_list='lowest'"
            )
        self._resolve_cache_mode()
        if isinstance(self.eviction_policy, (str, Mapping)):
            build_policy(self.eviction_policy)  # a name or options it refuses: refused here
        if (self.routing_num_layers is None) != (self.routing_top_k is None):
            raise ConfigError("routing_num_layers and routing_top_k must be set together")
        for name in ("routing_num_layers", "routing_top_k", "routing_num_experts"):
            value = getattr(self, name)
            if value is not None:
                _require_int(name, value, 1)

    def _resolve_cache_mode(self) -> None:
        """Turn ``cache_unreferenced=None`` into a bool; refuse True with the ref-zero alias."""
        ref_zero = names_ref_zero(self.eviction_policy)
        if self.cache_unreferenced is None:
            object.__setattr__(self, "cache_unreferenced", not ref_zero)
        elif not isinstance(self.cache_unreferenced, bool):
            raise ConfigError(
                f"cache_unreferenced must be a bool or None, got {self.cache_unreferenced!r}"
            )
        elif self.cache_unreferenced and ref_zero:
            raise ConfigError(
                "eviction_policy 'ref_zero' means cache_unreferenced=False; "
                "drop one of the two, or pick another policy"
            )

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> AllocatorConfig:
        """Build a config from a mapping, refusing unknown keys by name.

        >>> config = AllocatorConfig.from_dict({"total_count": 64, "eviction_policy": "ref_zero"})
        >>> config.paused_count, config.cache_unreferenced
        (0, False)
        """
        if not isinstance(values, Mapping):
            raise ConfigError(f"config must be a mapping, got {type(values).__name__}")
        known = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"unknown config keys {unknown}; valid keys: {sorted(known)}")
        return cls(**values)


OFFLINE_POLICY = "belady"
"""The offline optimum: built by name only with its ``next_use`` (trace replay)."""


def build_policy(spec: PolicySpec) -> EvictionPolicy:
    """Turn a policy spec into a fresh policy object (an object spec is used as is).

    A policy of the old protocol (the methods, no :class:`EvictionPolicy`
    base class) is accepted with a DeprecationWarning: it has no
    transactions, so the engine takes a failed call back with inverse calls.

    Raises:
        ConfigError: unknown name (the message lists the known ones), bad
            keyword arguments or values out of the policy's range, ``belady``
            without ``next_use`` (offline only), or an object that is not an
            EvictionPolicy.
    """
    if isinstance(spec, str):
        name, kwargs = spec, {}
    elif isinstance(spec, Mapping):
        if "name" not in spec:
            raise ConfigError(f"eviction_policy mapping needs a 'name' key, got {dict(spec)}")
        kwargs = {key: value for key, value in spec.items() if key != "name"}
        name = spec["name"]
    elif isinstance(spec, EvictionPolicy):
        _warn_if_legacy(spec)
        return spec
    else:
        raise ConfigError(f"eviction_policy must be a name, a mapping or a policy, got {spec!r}")
    if name == OFFLINE_POLICY and "next_use" not in kwargs:
        raise ConfigError(
            f"eviction policy {OFFLINE_POLICY!r} is the offline optimum: it needs each block's "
            "next use, which only a trace replay knows (prefixcache compare, "
            "prefixcache.tools.replay); configure an online policy such as 'lru' or 's3fifo'"
        )
    try:
        policy = policies.get(name, **kwargs)
    except UnknownPolicyError as exc:
        raise ConfigError(str(exc)) from exc
    except (TypeError, ValueError) as exc:  # a keyword the class lacks, or out of its range
        raise ConfigError(f"bad arguments for eviction policy {name!r}: {exc}") from exc
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"eviction policy {name!r} could not be loaded: {exc}") from exc
    if not isinstance(policy, EvictionPolicy):
        raise ConfigError(
            f"eviction policy {name!r} built a {type(policy).__name__}, "
            "which does not implement policies.EvictionPolicy"
        )
    _warn_if_legacy(policy)
    return policy


def _warn_if_legacy(policy: EvictionPolicy) -> None:
    if not is_transactional(policy):
        warnings.warn(
            f"eviction policy {type(policy).__name__} does not subclass "
            "prefixcache.policies.EvictionPolicy: it has no transactions, so a failed call is "
            "taken back with inverse calls (exact only for LRU-like policies); the old protocol "
            "is deprecated",
            DeprecationWarning,
            stacklevel=3,
        )
