"""prefixcache's eviction policies inside vLLM's v1 block pool, as a vLLM general plugin.

vLLM 0.33 keeps its free KV-cache blocks in one queue (``FreeKVCacheBlockQueue`` in
``vllm/v1/core/kv_cache_utils.py``) and evicts from its front: blocks freed without a hash
are put in front, cached blocks are appended in the order requests free them, so the
order is LRU because callers free a request's blocks in reverse. :func:`install` puts a
:class:`PolicyFreeBlockQueue` with the same interface where ``vllm.v1.core.block_pool``
looks the queue up, and wraps six ``BlockPool`` methods to learn what the queue cannot
see. No vLLM file changes; :func:`uninstall` puts everything back.

What maps to what (DESIGN.md, "vLLM integration"):

- A free block without a hash (never filled, or its hash removed) is handed out first,
  newest prepended first, as vLLM does: reusing it costs nothing.
- A free cached block with no cached child is an *evictable leaf*: the policy orders
  these (``insert`` when freed, ``discard`` on a prefix hit, ``evict`` when vLLM needs a
  block). ``last_access`` is a clock that ticks once per freed block, in vLLM's free
  order, so ``"lru"`` reproduces vLLM's own order; ``num_accesses`` is 1 plus the
  prefix hits (``BlockPool.touch``) since the block was filled; ``depth`` its position
  in the request's block table; the hash is XXH3-64 of vLLM's key (hash and group ID).
- Parents come from ``cache_full_blocks`` (block ``i - 1`` of the same table). Evicting a
  leaf exposes its parent, which the policy then orders, so a chain is eaten from its
  end whatever order callers free it in.
- A free cached block whose child is still cached but in use (a sliding-window layer
  frees a running request's early blocks) is not a leaf; it goes only when no leaf is
  left, oldest freed first. A hash-less block vLLM *appends* (``unpin_blocks``: still
  being read until reused) joins the policy's leaves as vLLM puts it at the queue's
  tail among the cached blocks (its key: its block ID), so ``"lru"`` keeps vLLM's
  order there too.
- Events, metrics and the hash table stay vLLM's: its ``BlockRemoved`` events and
  ``kv_cache_usage_perc`` report the policy's victims unchanged. The plugin adds
  counters of its own, labelled with the policy (:mod:`.vllm_metrics`).

The queue is :mod:`prefixcache.integrations.vllm_queue`. A built-in policy installed by
name (``lru`` too) runs in its native twin, :mod:`prefixcache.integrations.vllm_native_queue`
(the bookkeeping in the compiled extension's arrays and the policy's native unit, one C
call per vLLM call, the same blocks handed out), unless the extension is not built or
``PREFIXCACHE_ENGINE=python``; then a policy that builds a plain ``LRUPolicy`` gets
:mod:`prefixcache.integrations.vllm_lru`'s queue (the same order kept inline), and any
other policy, or a policy class or factory, runs its Python object in the Python queue.
``touch``, ``cache_full_blocks`` and ``_remove_cached_block_hashes`` (which vLLM calls per
block) are wrapped by C method descriptors (``_native.BlockPoolHook``) that do the
wrapper's work in C for the native queue, counting the metrics there until they are read;
for that queue ``get_new_blocks`` runs vLLM's steps in C too (vLLM's own
``_remove_cached_block_hashes`` called directly per block: no frame of vLLM's
``_maybe_evict_cached_block`` or of a hook per block).

Scheduler queue hints (:mod:`.vllm_hints`, off by default: ``queue_hints`` /
``PREFIXCACHE_VLLM_QUEUE_HINTS``): after each ``Scheduler.schedule`` the free cached blocks
on queued requests' cached prefixes leave the policy's order and are handed out last.

Costs: ``append``/``remove``/``popleft`` O(1) plus the policy's O(log n); the views
vLLM's tests read (``fake_free_list_head``, ``get_all_free_blocks``) replay the order on a
copy, O(n log n). Not thread-safe, as vLLM's queue (the scheduler owns its pool).
"""

from __future__ import annotations

import importlib
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prefixcache import policies
from prefixcache.engine.version import installed_version
from prefixcache.errors import ConfigError
from prefixcache.integrations import vllm_ends, vllm_hints, vllm_metrics
from prefixcache.integrations.vllm_lru import LruFreeBlockQueue
from prefixcache.integrations.vllm_native_queue import native_queue, native_queue_spec
from prefixcache.integrations.vllm_queue import PolicyFreeBlockQueue, policy_hash
from prefixcache.integrations.vllm_wrappers import (
    _MARK,
    _WRAPPERS,
    _wrap_schedule,
    _wrap_scheduler_init,
)
from prefixcache.policies import EvictionPolicy, UnknownPolicyError

__all__ = [
    "HINTS_ENV",
    "OPTIONS_ENV",
    "POLICY_ENV",
    "SUPPORTED_VERSION",
    "TESTED_VERSIONS",
    "PolicyFreeBlockQueue",
    "install",
    "installed_policy",
    "policy_hash",
    "register",
    "uninstall",
]

SUPPORTED_VERSION = "0.33"
"""The vLLM minor version whose ``BlockPool`` this adapter knows (0.33.x)."""

TESTED_VERSIONS = ("0.33.0",)
"""The vLLM releases CI's integration stage runs the plugin against (README, "Integration
tests"); any other 0.33.x is supported, and untested until it is listed here."""

POLICY_ENV = "PREFIXCACHE_VLLM_POLICY"
"""Environment variable the plugin reads: a policy name; unset or empty installs nothing."""

OPTIONS_ENV = "PREFIXCACHE_VLLM_POLICY_OPTIONS"
"""Environment variable with the policy's keyword arguments as a JSON object (optional)."""

HINTS_ENV = vllm_hints.HINTS_ENV
"""Environment variable: the share of each pool that scheduler queue hints may hold
(:mod:`.vllm_hints`); unset, empty or 0: no hints (the default)."""

AUTO_POLICY = "protected_lru"
"""What ``"auto"`` means until a policy registers under that name.

Chosen by ``benchmarks/bench_vllm_plugin.py`` (best hit rate over its trace family)."""

_REFUSED = {
    "belady": "it is the offline optimum and needs the future; use it in trace replay",
    "ref_zero": "keeping nothing unreferenced is vLLM's --no-enable-prefix-caching",
}


# ====================================================================== installing


class _QueueFactory:
    """Stands where ``block_pool`` looks up ``FreeKVCacheBlockQueue``: one queue per pool.

    A built-in policy by name gets the native queue; else a policy that builds a plain
    ``LRUPolicy`` gets the same order from
    :class:`~prefixcache.integrations.vllm_lru.LruFreeBlockQueue`, which keeps it inline.
    """

    def __init__(self) -> None:
        self.name = ""
        self.runs = "inline lru queue"  # what runs the policy: the log line, a metric label
        self.make_policy: Callable[[], EvictionPolicy] = policies.LRUPolicy
        self.fast_lru = True
        # A built-in policy by name runs in the native queue: the name and options of
        # its native unit, and whether its class takes on_register calls.
        self.native: tuple[str, dict[str, float], bool] | None = None

    def __call__(self, blocks: list[Any]) -> PolicyFreeBlockQueue:
        queue: PolicyFreeBlockQueue
        if self.native is not None:
            name, options, on_register = self.native
            queue = native_queue(blocks, name, options, on_register=on_register)
        elif self.fast_lru:
            queue = LruFreeBlockQueue(blocks)
        else:
            queue = PolicyFreeBlockQueue(blocks, self.make_policy())
        vllm_metrics.track(queue, self.name, self.runs)
        return queue


@dataclass
class _Patch:
    owner: Any
    name: str
    original: Any


_FACTORY = _QueueFactory()
_patches: list[_Patch] = []
_LOG = logging.getLogger(__name__)


def install(
    policy: str | Callable[..., EvictionPolicy] = "auto",
    *,
    queue_hints: float = 0.0,
    conversation_ends: bool = False,
    **options: Any,
) -> None:
    """Make vLLM's v1 block pools built from now on evict in ``policy``'s order.

    Idempotent: calling it again (also after ``importlib.reload`` of vLLM's modules)
    leaves one plugin in place, with the latest policy for pools built afterwards.

    Args:
        policy: a registered policy name (``prefixcache.policies.available()``), or
            ``"auto"``, or a policy class or zero-argument factory.
        queue_hints: the share of each pool (0 to 1) that the cached prefixes of
            queued requests may hold, handed out last while they wait
            (:mod:`.vllm_hints`; refreshed once per scheduler step, every pool the
            plugin built, from the next step on); 0, the default, turns hints off.
        conversation_ends: when a streaming (resumable) session ends, its own cached
            blocks are handed out first (:mod:`.vllm_ends`); off by default.
        **options: keyword arguments for the policy's constructor.

    Raises:
        ConfigError: unknown or unusable policy, bad options, a hint share outside
            [0, 1], vLLM missing, not 0.33.x, or without a method the plugin wraps.
            Nothing is changed then.

    Complexity: O(1).
    """
    share = vllm_hints.parse_share(queue_hints)
    make_policy, name = _policy_factory(policy, dict(options))
    block_pool, scheduler = _vllm_modules()
    ends = _ends_wrappers(scheduler) if conversation_ends else []  # checked before changes
    vllm_hints.set_share(share)
    vllm_ends.set_ends(conversation_ends)
    sample = make_policy()
    _FACTORY.make_policy, _FACTORY.name = make_policy, name
    _FACTORY.fast_lru = type(sample) is policies.LRUPolicy
    _FACTORY.native = native_queue_spec(name, isinstance(policy, str), options, sample)
    if _FACTORY.native is not None:
        _FACTORY.runs = "native queue"
    else:
        _FACTORY.runs = "inline lru queue" if _FACTORY.fast_lru else "Python policy object"
    if block_pool.FreeKVCacheBlockQueue is not _FACTORY:
        _patch(block_pool, "FreeKVCacheBlockQueue", _FACTORY)
    pool_class = block_pool.BlockPool
    for method, wrap in _WRAPPERS.items():
        current = pool_class.__dict__[method]
        if not hasattr(current, _MARK):
            _patch(pool_class, method, wrap(current))
    if scheduler is not None:
        sched = scheduler.Scheduler
        if not hasattr(sched.__init__, _MARK):
            _patch(sched, "__init__", _wrap_scheduler_init(sched.__init__))
        step = sched.__dict__.get("schedule")  # the metrics' flush point, once per step
        if step is not None and not hasattr(step, _MARK):
            _patch(sched, "schedule", _wrap_schedule(step))
    for owner, method, wrap in ends:
        if not hasattr(owner.__dict__[method], _MARK):
            _patch(owner, method, wrap(owner.__dict__[method]))
    vllm_metrics.metrics()  # the families exist (and a name clash is logged) from now on
    # One line at start-up says what runs: a user reading vLLM's log sees the policy.
    _LOG.info(
        "prefixcache %s: vLLM %s block pools built from now on evict with policy %r (%s)%s",
        installed_version(),
        getattr(importlib.import_module("vllm"), "__version__", "unknown"),
        name,
        _FACTORY.runs,
        f", queue hints up to {share:g} of the pool" if share else "",
    )


def uninstall() -> bool:
    """Put back every vLLM name :func:`install` replaced; return whether any was.

    Pools built while installed keep their queue (vLLM builds its pools once, at
    start). Complexity: O(1).
    """
    removed = bool(_patches)
    vllm_hints.set_share(0.0)
    vllm_ends.set_ends(False)
    while _patches:
        patch = _patches.pop()
        setattr(patch.owner, patch.name, patch.original)
    _FACTORY.name = ""
    return removed


def installed_policy() -> str | None:
    """The policy new pools get, or None when not installed. Complexity: O(1)."""
    return _FACTORY.name if _patches else None


def register() -> None:
    """The vLLM general plugin (entry point group ``vllm.general_plugins``).

    Installs the policy named by ``PREFIXCACHE_VLLM_POLICY`` with the options in
    ``PREFIXCACHE_VLLM_POLICY_OPTIONS`` (a JSON object) and the queue hints' share in
    ``PREFIXCACHE_VLLM_QUEUE_HINTS``; does nothing when the policy variable is unset or
    empty. vLLM may call it once per process.

    Raises:
        ConfigError: as :func:`install`, or the options are not a JSON object.
    """
    name = os.environ.get(POLICY_ENV, "").strip()
    if not name:
        return
    raw = os.environ.get(OPTIONS_ENV, "").strip() or "{}"
    try:
        options = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{OPTIONS_ENV} is not JSON: {exc}") from exc
    if not isinstance(options, dict):
        raise ConfigError(f"{OPTIONS_ENV} must be a JSON object, got {raw!r}")
    for key, env in (("queue_hints", HINTS_ENV), ("conversation_ends", vllm_ends.ENDS_ENV)):
        if key in options:
            raise ConfigError(f"{OPTIONS_ENV} holds the policy's options: set {env} instead")
    share = vllm_hints.parse_share(os.environ.get(HINTS_ENV, "").strip() or 0)
    ends = os.environ.get(vllm_ends.ENDS_ENV, "").strip()
    if ends not in ("", "0", "1"):
        raise ConfigError(f"{vllm_ends.ENDS_ENV} must be 0 or 1, got {ends!r}")
    install(name, queue_hints=share, conversation_ends=ends == "1", **options)


def _policy_factory(
    policy: str | Callable[..., EvictionPolicy], options: dict[str, Any]
) -> tuple[Callable[[], EvictionPolicy], str]:
    """A factory of fresh policies, checked by building one."""
    if isinstance(policy, str):
        name = policy.strip().lower()
        if name == "auto" and not policies.is_registered("auto"):  # not available(): it
            # reads every installed distribution's entry points (about 3 ms an install)
            name = AUTO_POLICY
        if name in _REFUSED:
            raise ConfigError(f"policy {name!r} cannot run inside vLLM: {_REFUSED[name]}")

        def make() -> EvictionPolicy:
            return policies.get(name, **options)

    elif callable(policy):
        name = getattr(policy, "__name__", type(policy).__name__)

        def make() -> EvictionPolicy:
            return policy(**options)

    else:
        raise ConfigError(f"policy must be a name or a policy class, got {policy!r}")
    try:
        sample = make()
    except UnknownPolicyError as exc:
        raise ConfigError(str(exc)) from exc
    except (TypeError, ValueError) as exc:  # an unknown keyword, or a value out of range
        raise ConfigError(f"policy {name!r} refused options {sorted(options)}: {exc}") from exc
    if not isinstance(sample, EvictionPolicy):
        raise ConfigError(f"policy {name!r} built {sample!r}, which is no EvictionPolicy")
    return make, name


def _vllm_modules() -> tuple[Any, Any]:
    """``vllm.v1.core.block_pool`` and the scheduler's module, once vLLM is 0.33.x.

    The scheduler's module (None where it does not import) only labels the metrics.
    """
    supported = f"vLLM {SUPPORTED_VERSION}.x (tested: {', '.join(TESTED_VERSIONS)})"
    advice = f"install vllm=={SUPPORTED_VERSION}.*, or unset {POLICY_ENV} to run vLLM without it"
    try:
        vllm = importlib.import_module("vllm")
    except ImportError as exc:
        raise ConfigError(f"prefixcache's vLLM plugin needs {supported}: {exc}") from exc
    version = str(getattr(vllm, "__version__", "unknown"))
    if version.split(".")[:2] != SUPPORTED_VERSION.split("."):
        raise ConfigError(
            f"prefixcache {installed_version()}'s vLLM plugin supports {supported} only; "
            f"this is vLLM {version}, whose block pool may differ: {advice}"
        )
    block_pool = importlib.import_module("vllm.v1.core.block_pool")
    pool_class = getattr(block_pool, "BlockPool", None)
    missing = [
        f"BlockPool.{name}" for name in _WRAPPERS if name not in getattr(pool_class, "__dict__", {})
    ]
    if not hasattr(block_pool, "FreeKVCacheBlockQueue"):
        missing.insert(0, "FreeKVCacheBlockQueue")
    if missing:
        raise ConfigError(
            f"vLLM {version}'s vllm.v1.core.block_pool has no {', '.join(missing)}, which "
            f"prefixcache's vLLM plugin replaces ({supported} has them): {advice}"
        )
    try:
        scheduler = importlib.import_module("vllm.v1.core.sched.scheduler")
    except ImportError:
        scheduler = None
    return block_pool, scheduler


def _ends_wrappers(scheduler: Any) -> list[tuple[Any, str, Callable[..., Any]]]:
    """What conversation ends wrap (:mod:`.vllm_ends`): the scheduler's ``_free_blocks``
    and the KV-cache manager's ``get_computed_blocks``, each (owner, name, wrapper).

    Raises:
        ConfigError: vLLM's scheduler or either method is missing.
    """
    try:
        manager = importlib.import_module("vllm.v1.core.kv_cache_manager").KVCacheManager
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"conversation ends need vLLM's KVCacheManager: {exc}") from exc
    wrappers = [
        (getattr(scheduler, "Scheduler", None), "_free_blocks", vllm_ends.wrap_free),
        (manager, "get_computed_blocks", vllm_ends.wrap_computed),
    ]
    for owner, name, _ in wrappers:
        if name not in getattr(owner, "__dict__", {}):
            raise ConfigError(f"conversation ends wrap vLLM's {name}, which this vLLM lacks")
    return wrappers


def _patch(owner: Any, name: str, value: Any) -> None:
    """Replace ``owner.name``; a stale record of the same name (a reload) is dropped."""
    _patches[:] = [p for p in _patches if not (p.owner is owner and p.name == name)]
    _patches.append(_Patch(owner, name, getattr(owner, name)))
    setattr(owner, name, value)
