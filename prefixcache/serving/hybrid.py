"""build_hybrid_memory: a hybrid model's whole cache memory in one call.

Builds what a hybrid model's cache is made of (a KV pool, allocator and block table
per layer group, a state pool for the linear-attention layers, the state checkpoints
over it) and hands it to a :class:`HybridMemory`, which admits, grows, commits and
finishes requests across all of them (``hybrid_memory.py``; it and its records are
importable from here). See DESIGN.md, "Hybrid models".
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from prefixcache.engine.config import PolicySpec
from prefixcache.engine.validation import require_int
from prefixcache.errors import ConfigError
from prefixcache.serving.checkpoints import StateCheckpoints
from prefixcache.serving.hybrid_memory import HybridMemory, HybridPrefixMatch, HybridRequest
from prefixcache.serving.layer_groups import LayerGroups, LayerGroupSpec
from prefixcache.serving.state_pool import StatePool, StateShape

__all__ = ["HybridMemory", "HybridPrefixMatch", "HybridRequest", "build_hybrid_memory"]


def build_hybrid_memory(
    groups: Sequence[LayerGroupSpec],
    *,
    num_blocks: int | dict[str, int],
    block_size: int,
    max_requests: int,
    max_blocks_per_request: int,
    linear: StateShape | None = None,
    num_checkpoints: int = 0,
    checkpoint_every: int = 4,
    checkpoint_policy: PolicySpec = "lru",
    eviction_policy: PolicySpec = "lru",
    dtype: torch.dtype = torch.float16,
    device: str | torch.device | None = None,
) -> HybridMemory:
    """Build a hybrid model's whole cache memory: KV pools, allocators, tables, state pool.

    The state pool gets one slot per request row plus ``num_checkpoints``
    reserved checkpoint slots plus the dummy.

    Args:
        groups: the attention layer groups.
        num_blocks: blocks per KV pool, the dummy included (an int for all).
        block_size: tokens per block.
        max_requests, max_blocks_per_request: the block tables' size.
        linear: the linear-attention layers' state shape, or None.
        num_checkpoints: state checkpoint slots (0: no prefix hits with
            linear layers).
        checkpoint_every: checkpoint every this many blocks.
        checkpoint_policy: eviction policy of the checkpoints.
        eviction_policy: eviction policy of the KV blocks.
        dtype: KV and conv-state dtype (recurrent states are float32).
        device: where everything lives.

    >>> memory = build_hybrid_memory(
    ...     [LayerGroupSpec("attn", "full", num_layers=2, k_heads=2, k_head_dim=8)],
    ...     num_blocks=33, block_size=16, max_requests=4, max_blocks_per_request=8,
    ...     linear=StateShape(num_layers=6, num_heads=2, k_dim=8, v_dim=8, conv_dim=32,
    ...                       conv_kernel=4),
    ...     num_checkpoints=8, dtype=torch.bfloat16, device="cpu")
    >>> memory.memory_bytes
    {'attn': 67584, 'states': 54912}

    Raises:
        ConfigError: inconsistent sizes or an unknown policy.

    Complexity: O(storage size) to zero the tensors.
    """
    layer_groups = LayerGroups(
        groups,
        num_blocks=num_blocks,
        block_size=block_size,
        max_requests=max_requests,
        max_blocks_per_request=max_blocks_per_request,
        eviction_policy=eviction_policy,
        dtype=dtype,
        device=device,
    )
    if linear is None:
        if num_checkpoints:
            raise ConfigError("num_checkpoints needs linear layers (linear=StateShape(...))")
        return HybridMemory(layer_groups)
    num_checkpoints = require_int(num_checkpoints, "num_checkpoints", minimum=0, error=ConfigError)
    pool = StatePool(
        linear, 1 + layer_groups.tables[groups[0].name].max_requests + num_checkpoints,
        dtype=dtype, device=layer_groups.device,
    )  # fmt: skip
    checkpoints = StateCheckpoints(
        pool, num_checkpoints, every=checkpoint_every, policy=checkpoint_policy
    )
    return HybridMemory(layer_groups, pool, checkpoints)
