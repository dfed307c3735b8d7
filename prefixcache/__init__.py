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

The package is layered (DESIGN.md, "Layers"): :mod:`prefixcache.engine` (the
block manager), :mod:`prefixcache.serving` and :mod:`prefixcache.wire` above
it, :mod:`prefixcache.cluster` above those, :mod:`prefixcache.tools` on top;
eviction policies are :mod:`prefixcache.policies`. The names below are the
public API, importable from here.
"""

from prefixcache import _checkout, _moved  # noqa: F401 (_checkout acts on import: its docstring)
from prefixcache.engine.allocator import KVBlockAllocator
from prefixcache.engine.block_ids import BlockIdsLike
from prefixcache.engine.config import AllocatorConfig, build_policy
from prefixcache.engine.hashing import HASH_ALGORITHMS, compute_block_hashes, root_hash
from prefixcache.engine.pool import BlockPool
from prefixcache.engine.registry import HashRegistry
from prefixcache.engine.routing import RoutingStore
from prefixcache.engine.stats import AllocatorStats
from prefixcache.engine.types import BlockHash, BlockId
from prefixcache.errors import (
    BlockStateError,
    BudgetExceededError,
    CapacityError,
    ConfigError,
    EngineMismatchError,
    HashConflictError,
    InvalidArgumentError,
    InvalidBlockIdError,
    InvalidTensorError,
    InvariantError,
    PrefixCacheError,
    ReentrantCallError,
    ReferenceCountError,
)
from prefixcache.serving.block_table import BlockTable
from prefixcache.serving.kv_cache import KVCache, blocks_for_memory_budget

__version__ = "0.2.0"

_moved.install()

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
    "EngineMismatchError",
    "HashConflictError",
    "HashRegistry",
    "InvalidArgumentError",
    "InvalidBlockIdError",
    "InvalidTensorError",
    "InvariantError",
    "KVBlockAllocator",
    "KVCache",
    "PrefixCacheError",
    "ReentrantCallError",
    "ReferenceCountError",
    "RoutingStore",
    "blocks_for_memory_budget",
    "build_policy",
    "compute_block_hashes",
    "root_hash",
]
