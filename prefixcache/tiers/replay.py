"""Replaying a request trace through a device pool with a host tier behind it.

The model of :func:`prefixcache.tools.replay.replay` (requests in order, no
concurrency, prompt blocks only, the cache trimmed back to ``capacity``
device blocks after each request), with a :class:`TieredCache` in place of the
bare allocator: blocks trimmed from the device are demoted to a host tier of
``host_capacity`` slots, and a request whose prefix runs past the device's
blocks into the host tier has them promoted. With ``host_capacity=0`` the
device hit rate equals ``replay``'s. See DESIGN.md, "Tiers".

>>> from prefixcache.reference.trace import TraceRequest
>>> a, b = TraceRequest(0, 1024, 1, (1, 2)), TraceRequest(5, 1024, 1, (3, 4))
>>> result = replay_tiered([a, b, a], capacity=2, host_capacity=8)
>>> result.device_hit_blocks, result.host_hit_blocks, result.prompt_blocks
(0, 2, 6)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from prefixcache.engine.allocator import KVBlockAllocator
from prefixcache.engine.validation import require_int
from prefixcache.reference.trace import TRACE_BLOCK_SIZE, TraceRequest, trace_block_hashes
from prefixcache.tiers.host import HostTier
from prefixcache.tiers.tiered import TieredCache


@dataclass(frozen=True, slots=True)
class TieredReplayResult:
    """Hit rates per tier of one replay.

    Attributes:
        capacity, host_capacity: device blocks kept cached, host slots.
        num_requests, prompt_blocks: what was replayed.
        device_hit_blocks, host_hit_blocks: prompt blocks found on each tier.
        demoted_blocks, promoted_blocks: copies device -> host and host -> device.
    """

    capacity: int
    host_capacity: int
    num_requests: int
    prompt_blocks: int
    device_hit_blocks: int
    host_hit_blocks: int
    demoted_blocks: int
    promoted_blocks: int

    @property
    def device_hit_rate(self) -> float:
        """Device hit blocks / prompt blocks (0.0 for an empty trace)."""
        return self.device_hit_blocks / self.prompt_blocks if self.prompt_blocks else 0.0

    @property
    def hit_rate(self) -> float:
        """Hit blocks of both tiers / prompt blocks (0.0 for an empty trace)."""
        hits = self.device_hit_blocks + self.host_hit_blocks
        return hits / self.prompt_blocks if self.prompt_blocks else 0.0

    @property
    def promoted_per_request(self) -> float:
        """Copy traffic: blocks promoted per request (0.0 for an empty trace)."""
        return self.promoted_blocks / self.num_requests if self.num_requests else 0.0


def replay_tiered(
    requests: Sequence[TraceRequest],
    capacity: int,
    host_capacity: int,
    *,
    policy: str = "lru",
    host_policy: str = "lru",
) -> TieredReplayResult:
    """Replay ``requests`` in order through ``capacity`` device blocks and a host tier.

    Args:
        requests: the trace.
        capacity: device blocks kept cached after each request, >= 0.
        host_capacity: host slots, >= 0 (0: no host tier).
        policy, host_policy: eviction policy names of the two tiers.

    Raises:
        InvalidArgumentError: a count is not an int >= 0.
        ConfigError: an unknown policy.

    Complexity: O(prompt blocks) bookkeeping, plus policy work per block.
    """
    capacity = require_int(capacity, "capacity", minimum=0)
    host_capacity = require_int(host_capacity, "host_capacity", minimum=0)
    chains = [trace_block_hashes(request.hash_ids) for request in requests]
    longest = max((len(chain) for chain in chains), default=0)
    allocator = KVBlockAllocator(
        total_count=capacity + longest + 2,
        block_size_tokens=TRACE_BLOCK_SIZE,
        eviction_policy=policy,
        device="cpu",
    )
    host = HostTier(max(host_capacity, 1), policy=host_policy, block_size=TRACE_BLOCK_SIZE)
    tiered = TieredCache(allocator, host)
    device_hits = host_hits = 0
    for hashes in chains:
        if host_capacity:
            match = tiered.match(hashes)
            hit_ids, num_device = match.block_ids, match.num_device_blocks
            host_hits += match.num_host_blocks
        else:
            hit_ids = allocator.match_prefix(hashes, acquire=True).numpy()
            num_device = len(hit_ids)
        device_hits += num_device
        num_fresh = len(hashes) - len(hit_ids)
        if host_capacity:
            fresh = tiered.allocate(num_fresh)
        else:
            handed = allocator.allocate_memory_blocks(num_fresh)
            fresh = None if handed is None else handed.numpy()
        assert fresh is not None  # the pool holds the cache plus the longest request
        if len(fresh):
            parent = hashes[len(hit_ids) - 1] if len(hit_ids) else None
            tiered.register(fresh, hashes[len(hit_ids) :], parent_hash=parent)
        tiered.release(fresh)
        tiered.release(hit_ids)
        excess = allocator.get_evictable_block_count() - capacity
        if excess > 0:
            if host_capacity:
                tiered.evict(excess)
            else:
                allocator.evict_cached_blocks(excess)
        tiered.take_transfer()  # a replay moves no K/V
    stats = tiered.stats()
    return TieredReplayResult(
        capacity=capacity,
        host_capacity=host_capacity,
        num_requests=len(requests),
        prompt_blocks=sum(len(chain) for chain in chains),
        device_hit_blocks=device_hits,
        host_hit_blocks=host_hits,
        demoted_blocks=stats.num_demoted_blocks,
        promoted_blocks=stats.num_promoted_blocks,
    )


__all__ = ["TieredReplayResult", "replay_tiered"]
