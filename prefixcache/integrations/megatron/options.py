"""The drop-in's choices: Megatron's policy values, the supported versions, install options.

:class:`PrefixCachePolicy` lets Megatron's ``prefix_caching_eviction_policy``
name any prefixcache policy; :func:`_policy_of` maps Megatron's values; the
options :func:`~prefixcache.integrations.megatron.install` sets are kept here,
where the allocator reads them.
"""

from __future__ import annotations

from typing import Any

from prefixcache.engine.config import PolicySpec
from prefixcache.errors import ConfigError

SUPPORTED_VERSIONS = ("0.19.",)
"""megatron-core versions (prefixes) whose allocator surface this module reproduces."""

_LRU, _REF_ZERO = "lru", "ref_zero"
_OPTION_KEYS = ("engine", "kv_events_capacity", "kv_events_medium", "device", "hash_algo")

_installed_options: dict[str, Any] = {}
"""The options of the last install(): the drop-in's defaults (cleared by uninstall())."""


class PrefixCachePolicy(str):
    """A Megatron ``prefix_caching_eviction_policy`` value that names a prefixcache policy.

    It equals ``"lru"`` as a string, so it equals Megatron's
    ``PrefixCachingEvictionPolicy.LRU`` (a ``str`` enum) and every check in
    Megatron's context takes its caching path; the drop-in reads
    :attr:`spec` and runs that policy instead of LRU.

    >>> choice = PrefixCachePolicy("s3fifo")
    >>> choice == "lru", choice.spec
    (True, 's3fifo')

    Args:
        spec: a prefixcache policy name, ``{"name": ..., **kwargs}`` or policy object.
    """

    spec: PolicySpec

    def __new__(cls, spec: PolicySpec) -> PrefixCachePolicy:
        if isinstance(spec, str) and spec == _REF_ZERO:
            raise ConfigError("use Megatron's PrefixCachingEvictionPolicy.REF_ZERO for ref-zero")
        choice = super().__new__(cls, _LRU)
        choice.spec = spec
        return choice

    def __repr__(self) -> str:
        return f"PrefixCachePolicy({self.spec!r})"


def _policy_of(value: object, default_cached: PolicySpec) -> tuple[PolicySpec, bool]:
    """``(prefixcache policy spec, caches unreferenced blocks)`` for a Megatron policy value."""
    if isinstance(value, PrefixCachePolicy):
        return value.spec, True
    if value == _REF_ZERO:
        return _REF_ZERO, False
    if value == _LRU:
        return default_cached, True
    raise ConfigError(
        f"prefix_caching_eviction_policy must be Megatron's REF_ZERO or LRU, or a "
        f"PrefixCachePolicy, got {value!r}"
    )
