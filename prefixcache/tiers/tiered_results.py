"""The values TieredCache hands back: a match's result and the counts per tier.

Plain frozen records apart from the bookkeeping in :mod:`prefixcache.tiers.tiered`,
so the class's module holds only the class.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from prefixcache.engine.stats import AllocatorStats
from prefixcache.tiers.host import HostTierStats
from prefixcache.tiers.transfer import TransferPlan


@dataclass(frozen=True, slots=True)
class TieredMatch:
    """The result of :meth:`TieredCache.match`.

    Attributes:
        block_ids: int32 IDs of the whole matched prefix, each with one active
            reference for the caller: device hits, then promoted blocks.
        num_device_blocks: how many came from the device pool.
        num_host_blocks: how many were promoted from the host tier (their
            K/V arrives with the copies of :meth:`TieredCache.take_transfer`).
        plan: the copies this match queued (demotions of the blocks it
            allocated, then its promotions); already in the tier's queue.
        num_remote_blocks: how many came from the remote tier (loaded into
            host slots, then promoted like host hits).
    """

    block_ids: np.ndarray
    num_device_blocks: int
    num_host_blocks: int
    plan: TransferPlan
    num_remote_blocks: int = 0


@dataclass(frozen=True, slots=True)
class TieredStats:
    """Counts per tier, plain values (``as_dict`` for JSON)."""

    device: AllocatorStats
    host: HostTierStats
    num_demoted_blocks: int
    num_promoted_blocks: int
    weight_epoch: int

    def as_dict(self) -> dict[str, Any]:
        """Nested plain dicts: ``{"device": {...}, "host": {...}, ...}``."""
        return {
            "device": self.device.as_dict(),
            "host": self.host.as_dict(),
            "num_demoted_blocks": self.num_demoted_blocks,
            "num_promoted_blocks": self.num_promoted_blocks,
            "weight_epoch": self.weight_epoch,
        }
