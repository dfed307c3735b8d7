"""Scheduler queue hints in the vLLM plugin: the cached prefixes of queued requests are
handed out last while they wait.

prefixcache's own scheduler hints (DESIGN.md, "Scheduler hints") protect a queued
request's cached prefix from the traffic admitted before it. vLLM 0.33 exposes what that
needs without a patch: its ``Scheduler`` holds the queued requests (``kv_holding_waiting``,
drained first, then ``waiting``, each iterable in scheduling order), every ``Request`` has
its ``block_hashes`` from arrival, and ``kv_cache_manager.block_pool`` finds a cached block
by hash (``get_cached_block``). Once per scheduler step (the plugin's wrapper of
``Scheduler.schedule``, before vLLM's: the blocks the last step registered or freed are
protected through this step's allocations) :func:`refresh` finds each queued request's
longest cached prefix (:mod:`.vllm_hint_walk`: kept from the last step, looked up again
only where vLLM's hash map changed) and gives the blocks, in scheduling order, to the
pool's free-block queue (``set_hinted``): its free ones leave the policy's order and go
only when no other free block is left, the newest hint first. They stay free, so vLLM's
accounting (free blocks, ``kv_cache_usage_perc``, admission) is unchanged and a hint can
never make an allocation fail: yielding is implicit.

The bound (:data:`HINTS_ENV`, ``install(..., queue_hints=share)``) is the share of the
pool's blocks hints may hold; 0, the default, turns hints off. Pools whose KV-cache groups
use a block size other than the hash block size (hybrid models) get no hints.
"""

from __future__ import annotations

from itertools import chain
from typing import Any

from prefixcache.errors import ConfigError
from prefixcache.integrations.vllm_hint_walk import close_all, full_walk, prefix_walk
from prefixcache.integrations.vllm_queue import PolicyFreeBlockQueue

__all__ = ["HINTS_ENV", "hint_share", "parse_share", "refresh", "set_share"]

HINTS_ENV = "PREFIXCACHE_VLLM_QUEUE_HINTS"
"""Environment variable the plugin reads: the share of the pool queue hints may hold
(a number in [0, 1]; unset, empty or 0: no hints)."""

_WAITING = ("kv_holding_waiting", "waiting")  # vLLM 0.33's queues, in scheduling order
_share = 0.0


def parse_share(raw: object) -> float:
    """The hint share given as ``raw`` (a number, or its text), checked.

    Raises:
        ConfigError: not a number in [0, 1].
    """
    try:
        share = float(raw)  # type: ignore[arg-type]
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"queue hints: {raw!r} is not a share of the pool in [0, 1]") from exc
    if not 0.0 <= share <= 1.0:
        raise ConfigError(f"queue hints: the share of the pool must be in [0, 1], got {share}")
    return share


def set_share(share: float) -> None:
    """Set the share of each pool that hints may hold from the next step on (0: off)."""
    global _share
    _share = parse_share(share)
    if _share <= 0.0:
        close_all()  # vLLM's hash maps without the walks' recording


def hint_share() -> float:
    """The share of each pool that hints may hold now (0.0: hints are off)."""
    return _share


def refresh(scheduler: Any) -> int | None:
    """Hint the cached prefixes of ``scheduler``'s queued requests in its pool's queue.

    Returns how many free blocks are hinted now, or None when the scheduler's pool has
    no plugin queue (built before :func:`~prefixcache.integrations.vllm.install`, or
    caching off), its groups' block size is not the hash block size, or hints are off
    and none was held.

    Complexity: O(queued requests walked + hash keys vLLM inserted or popped since the
    last step + positions looked up again) lookups (:mod:`.vllm_hint_walk`: only what may
    have changed is looked up again), the walk stopped at the pool's size; the queue's
    work is O(listed + previously hinted).
    """
    pool: Any = getattr(getattr(scheduler, "kv_cache_manager", None), "block_pool", None)
    queue = getattr(pool, "free_block_queue", None)
    if not isinstance(queue, PolicyFreeBlockQueue) or not getattr(pool, "enable_caching", False):
        return None
    if _share <= 0.0:
        return queue.set_hinted((), 0) if queue.num_hinted_blocks else None
    group_ids = _group_ids(scheduler, pool)
    if group_ids is None:
        return None
    num_blocks = int(pool.num_gpu_blocks)
    walk = prefix_walk(pool, group_ids)
    if walk is None:  # a map the walk cannot record: every prefix looked up again
        blocks = full_walk(pool, _queued(scheduler), group_ids, num_blocks)
    else:
        blocks = walk.blocks(_queued(scheduler), num_blocks)
    return queue.set_hinted(blocks, int(_share * num_blocks))


def _queued(scheduler: Any) -> list[Any]:
    """The queued requests, in scheduling order."""
    return list(chain.from_iterable(getattr(scheduler, name, None) or () for name in _WAITING))


def _group_ids(scheduler: Any, pool: Any) -> list[int] | None:
    """The KV-cache group IDs whose blocks a queued prefix holds; None when a group's
    block size differs from the hash block size (the request's hashes are not its)."""
    groups = getattr(getattr(scheduler, "kv_cache_config", None), "kv_cache_groups", None)
    if not groups:
        return None
    hash_size = getattr(pool, "hash_block_size", None)
    for group in groups:
        if getattr(group.kv_cache_spec, "block_size", None) != hash_size:
            return None
    return list(range(len(groups)))
