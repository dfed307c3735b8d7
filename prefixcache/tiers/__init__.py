"""The tiers layer: where cached K/V lives besides device memory, and how it ages.

Owns the host tier (:class:`HostTier` bookkeeping, :class:`HostKVStore`
storage, :class:`KVTransfer` copies), the :class:`TieredCache` that demotes
blocks the device evicts and promotes them back on a match, weight epochs
(:class:`WeightEpochs`: new weights without draining), hash keys for token
ranges (:class:`RangeKey`: images, LoRA spans) and :class:`RequestCache`, which
admits requests through all of these with per-request cache numbers. Every
piece is a collaborator above the engine, built on the allocator's public API.
It may import serving, engine, policies and :mod:`prefixcache.errors`; cluster
and tools may import it. See DESIGN.md, "Tiers".
"""

from prefixcache.tiers.epochs import WeightEpochs
from prefixcache.tiers.host import MEDIUM_CPU, UNUSABLE_POLICIES, HostTier, HostTierStats
from prefixcache.tiers.range_keys import RangeKey, range_keyed_hashes
from prefixcache.tiers.remote import RemoteTier, RemoteTierStats, connect
from prefixcache.tiers.replay import TieredReplayResult, replay_tiered
from prefixcache.tiers.requests import Admission, LabelCounters, RequestCache
from prefixcache.tiers.tiered import TieredCache, TieredMatch, TieredStats
from prefixcache.tiers.transfer import (
    DEMOTE,
    LOAD,
    PROMOTE,
    STORE,
    HostKVStore,
    KVTransfer,
    TransferPlan,
)

__all__ = [
    "DEMOTE",
    "LOAD",
    "MEDIUM_CPU",
    "PROMOTE",
    "STORE",
    "UNUSABLE_POLICIES",
    "Admission",
    "HostKVStore",
    "HostTier",
    "HostTierStats",
    "KVTransfer",
    "LabelCounters",
    "RangeKey",
    "RemoteTier",
    "RemoteTierStats",
    "RequestCache",
    "TieredCache",
    "TieredMatch",
    "TieredReplayResult",
    "TieredStats",
    "TransferPlan",
    "WeightEpochs",
    "connect",
    "range_keyed_hashes",
    "replay_tiered",
]
