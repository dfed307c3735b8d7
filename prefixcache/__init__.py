"""prefixcache: a prefix-caching KV-cache block manager with pluggable eviction policies.

>>> from prefixcache import KVBlockAllocator
>>> allocator = KVBlockAllocator(total_count=64, block_size_tokens=4, device="cpu")
>>> hashes = allocator.hash_tokens(list(range(8)))
>>> blocks = allocator.allocate_memory_blocks(2)
>>> allocator.register_kv_block_hashes(blocks, hashes).tolist()
[True, True]
>>> allocator.release_memory_blocks(blocks)
>>> allocator.match_prefix(hashes, acquire=True).tolist() == blocks.tolist()
True
"""

from prefixcache.allocator import KVBlockAllocator
from prefixcache.block_ids import BlockIdsLike
from prefixcache.block_table import BlockTable
from prefixcache.config import AllocatorConfig, build_policy
from prefixcache.errors import (
    BlockStateError,
    BudgetExceededError,
    CapacityError,
    ConfigError,
    HashConflictError,
    InvalidArgumentError,
    InvalidBlockIdError,
    InvalidTensorError,
    InvariantError,
    PrefixCacheError,
    ReferenceCountError,
)
from prefixcache.hashing import HASH_ALGORITHMS, compute_block_hashes, root_hash
from prefixcache.kv_cache import KVCache, blocks_for_memory_budget
from prefixcache.pool import BlockPool
from prefixcache.registry import HashRegistry
from prefixcache.routing import RoutingStore
from prefixcache.stats import AllocatorStats
from prefixcache.types import BlockHash, BlockId

__version__ = "0.1.0"

__all__ = [
    "HASH_ALGORITHMS",
    "AllocatorConfig",
    "AllocatorStats",
    "BlockHash",
    "BlockId",
    "BlockIdsLike",
    "BlockPool",
    "BlockStateError",
    "BlockTable",
    "BudgetExceededError",
    "CapacityError",
    "ConfigError",
    "HashConflictError",
    "HashRegistry",
    "InvalidArgumentError",
    "InvalidBlockIdError",
    "InvalidTensorError",
    "InvariantError",
    "KVBlockAllocator",
    "KVCache",
    "PrefixCacheError",
    "ReferenceCountError",
    "RoutingStore",
    "blocks_for_memory_budget",
    "build_policy",
    "compute_block_hashes",
    "root_hash",
]
