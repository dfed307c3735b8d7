"""Eviction policies for prefixcache, looked up by name.

Built-in names: ``"lru"`` (the default), ``"fifo"``, ``"lfu"`` (with
dynamic ageing), ``"slru"`` (segmented LRU), ``"s3fifo"`` (small/main FIFO
queues with a ghost list), ``"arc"`` (adaptive recency/frequency lists with
ghost lists of hashes), ``"hazard"`` (the learned chance of reuse within a
few cache lifetimes, per use-count and depth class), ``"reuse_lru"`` (LRU with a bonus for reused
prefixes, counts kept across evictions), ``"protected_lru"`` (blocks used
once evicted before reused ones, use counts kept across evictions by hash),
``"priority"`` (retention
priorities per prefix with expiry), ``"ref_zero"`` (an alias of the
configuration's ``cache_unreferenced=False``: nothing unreferenced is kept)
and ``"belady"`` (the offline optimum, for trace replay only: it needs to
know the future).

Every policy subclasses :class:`EvictionPolicy` (``base.py``): seven
abstract methods, transactions with an undo log, three optional hooks.
A third-party package adds its own (``examples/custom_policy.py``, checked
with :class:`prefixcache.testing.PolicyContract`) either at run time with
:func:`register` or, without any import, through the
``prefixcache.policies`` entry-point group::

    [project.entry-points."prefixcache.policies"]
    my_policy = "my_package.my_module:MyPolicy"

>>> from prefixcache import policies
>>> type(policies.get("lru")).__name__
'LRUPolicy'
"""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Any, TypeVar

from prefixcache.policies.arc import ARCPolicy
from prefixcache.policies.auto import AutoPolicy
from prefixcache.policies.base import (
    OPTIONAL_HOOKS,
    EvictionPolicy,
    UnknownPolicyError,
    deprecated_protocol,
    has_hook,
    is_transactional,
)
from prefixcache.policies.belady import BeladyPolicy
from prefixcache.policies.fifo import FIFOPolicy
from prefixcache.policies.hazard import HazardPolicy
from prefixcache.policies.lfu import LFUPolicy
from prefixcache.policies.lru import LRUPolicy
from prefixcache.policies.priority import PriorityPolicy
from prefixcache.policies.protected_lru import ProtectedLRUPolicy
from prefixcache.policies.ref_zero import RefZeroPolicy
from prefixcache.policies.reuse_lru import ReuseLRUPolicy
from prefixcache.policies.s3fifo import S3FIFOPolicy
from prefixcache.policies.slru import SLRUPolicy

__all__ = [
    "ENTRY_POINT_GROUP",
    "OPTIONAL_HOOKS",
    "ARCPolicy",
    "BeladyPolicy",
    "EvictionPolicy",
    "FIFOPolicy",
    "HazardPolicy",
    "LFUPolicy",
    "LRUPolicy",
    "PriorityPolicy",
    "ProtectedLRUPolicy",
    "RefZeroPolicy",
    "ReuseLRUPolicy",
    "S3FIFOPolicy",
    "SLRUPolicy",
    "UnknownPolicyError",
    "available",
    "get",
    "has_hook",
    "is_registered",
    "is_transactional",
    "register",
]

ENTRY_POINT_GROUP = "prefixcache.policies"

_T = TypeVar("_T", bound=type)
_registry: dict[str, type] = {
    "arc": ARCPolicy,
    "auto": AutoPolicy,
    "belady": BeladyPolicy,
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


def __getattr__(name: str) -> Any:
    """The deprecated protocols (``SupportsRetention``, ...), with a DeprecationWarning."""
    return deprecated_protocol(name, __name__)


def register(name: str) -> Callable[[_T], _T]:
    """Class decorator that registers a policy under ``name``.

    Re-registering a name replaces the previous class (handy in tests and
    notebooks). Raises ``ValueError`` for an empty name.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"policy name must be a non-empty string, got {name!r}")

    def decorator(cls: _T) -> _T:
        _registry[name] = cls
        return cls

    return decorator


def _load_entry_point(name: str) -> type | None:
    for entry in entry_points(group=ENTRY_POINT_GROUP):
        if entry.name == name:
            cls: type = entry.load()
            _registry[name] = cls
            return cls
    return None


def is_registered(name: str) -> bool:
    """Whether a policy is registered under ``name``, entry points included. O(1) for a
    registered class; the entry points are read (and the class loaded) only otherwise."""
    return name in _registry or _load_entry_point(name) is not None


def available() -> list[str]:
    """Sorted names of every registered policy, entry points included."""
    names = set(_registry)
    names.update(entry.name for entry in entry_points(group=ENTRY_POINT_GROUP))
    return sorted(names)


def get(name: str, **kwargs: Any) -> EvictionPolicy:
    """Build the policy registered under ``name`` with ``kwargs``.

    Raises:
        UnknownPolicyError: no such policy; the message lists the known ones.
    """
    cls = _registry.get(name) or _load_entry_point(name)
    if cls is None:
        raise UnknownPolicyError(name, available())
    policy: EvictionPolicy = cls(**kwargs)
    return policy
