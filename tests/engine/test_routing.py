"""Per-block MoE routing: store, read back, survive prefix hits, die with recycled blocks.

Allocators here have blocks of 4 tokens, 2 layers and top-2 routing over 8
experts unless a test says otherwise. Routing errors (shapes, dtypes, ranges,
unreferenced blocks) are in ``test_errors.py``.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

from prefixcache import InvalidArgumentError, KVBlockAllocator

LAYERS, TOP_K, EXPERTS, BLOCK = 2, 2, 8, 4


@pytest.fixture
def moe(make: Callable[..., KVBlockAllocator]) -> KVBlockAllocator:
    return make(routing_num_layers=LAYERS, routing_top_k=TOP_K, routing_num_experts=EXPERTS)


def random_routing(tokens: int, seed: int = 0, experts: int = EXPERTS) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, experts, (tokens, LAYERS, TOP_K), generator=generator)


def fill_blocks(allocator: KVBlockAllocator, blocks: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """Store routing for every token of ``blocks``; return it as ``[tokens, layers, top_k]``."""
    routing = random_routing(len(blocks) * BLOCK, seed)
    token_blocks = blocks.repeat_interleave(BLOCK)
    positions = torch.arange(BLOCK).repeat(len(blocks))
    allocator.store_routing_per_block(routing, token_blocks, positions)
    return routing


def test_round_trip_skips_tokens_of_the_dummy_block(moe: KVBlockAllocator) -> None:
    blocks = moe.allocate_memory_blocks(3)
    # 10 real tokens over 3 blocks (the last one half full), shuffled, with 3 padded
    # tokens pointing at the dummy block (their positions are garbage and ignored).
    real_blocks = blocks.repeat_interleave(BLOCK)[:10]
    real_positions = torch.arange(BLOCK).repeat(3)[:10]
    dummy = torch.full((3,), moe.dummy_block_id, dtype=torch.int32)
    token_blocks = torch.cat([real_blocks.to(torch.int32), dummy])
    positions = torch.cat([real_positions, torch.tensor([99, -5, 0])])
    routing = random_routing(13)
    order = torch.randperm(13, generator=torch.Generator().manual_seed(1))
    moe.store_routing_per_block(routing[order], token_blocks[order], positions[order])
    moe.check_invariants()

    rebuilt = moe.reconstruct_routing_from_blocks(blocks, 10)
    assert rebuilt is not None
    assert rebuilt.dtype == torch.int16
    assert rebuilt.shape == (10, LAYERS, TOP_K)
    assert torch.equal(rebuilt.long(), routing[:10])
    assert torch.equal(moe.reconstruct_routing_from_blocks(blocks[:2], 5).long(), routing[:5])
    assert moe.reconstruct_routing_from_blocks(blocks, 0).shape == (0, LAYERS, TOP_K)
    assert moe.reconstruct_routing_from_blocks(blocks, 11) is None, "token 10 has no routing"

    first = moe.get_block_routing(int(blocks[0]))
    assert first is not None and first.shape == (BLOCK, LAYERS, TOP_K)
    assert torch.equal(first.long(), routing[:BLOCK])
    assert moe.get_block_routing(int(blocks[2])) is None, "half-written block"


def test_routing_accepts_numpy_arrays(moe: KVBlockAllocator) -> None:
    block = int(moe.allocate_memory_blocks(1)[0])
    routing = np.arange(BLOCK * LAYERS * TOP_K, dtype=np.int32).reshape(BLOCK, LAYERS, TOP_K) % 8
    moe.store_routing_per_block(routing, np.full(BLOCK, block), np.arange(BLOCK))
    assert np.array_equal(moe.get_block_routing(block).numpy(), routing)


def test_routing_reads_are_copies(moe: KVBlockAllocator) -> None:
    blocks = moe.allocate_memory_blocks(2)
    routing = fill_blocks(moe, blocks)
    moe.get_block_routing(int(blocks[0])).fill_(7)
    moe.reconstruct_routing_from_blocks(blocks, 8).fill_(7)
    assert torch.equal(moe.reconstruct_routing_from_blocks(blocks, 8).long(), routing)


def test_stored_routing_is_a_copy_of_the_input(moe: KVBlockAllocator) -> None:
    block = int(moe.allocate_memory_blocks(1)[0])
    routing = torch.ones(BLOCK, LAYERS, TOP_K, dtype=torch.int16)
    moe.store_block_routing(block, routing)
    routing.fill_(5)
    assert moe.get_block_routing(block).eq(1).all()


def test_none_when_a_block_lacks_routing(moe: KVBlockAllocator) -> None:
    blocks = moe.allocate_memory_blocks(2)
    assert moe.get_block_routing(int(blocks[0])) is None
    fill_blocks(moe, blocks[:1])
    assert moe.get_block_routing(int(blocks[0])) is not None
    assert moe.reconstruct_routing_from_blocks(blocks, 8) is None
    assert moe.reconstruct_routing_from_blocks(blocks, 4) is not None


def test_routing_survives_a_prefix_hit(moe: KVBlockAllocator) -> None:
    blocks = moe.allocate_memory_blocks(2)
    routing = fill_blocks(moe, blocks, seed=3)
    moe.register_kv_block_hashes(blocks, [10, 11])
    moe.release_memory_blocks(blocks)
    assert moe.get_evictable_block_count() == 2
    cached = moe.get_block_routing(int(blocks[1]))
    assert cached is not None and torch.equal(cached.long(), routing[BLOCK:])
    # Filling the rest of the pool leaves the cached chain alone.
    others = moe.allocate_memory_blocks(moe.pool.num_free)
    fill_blocks(moe, others, seed=4)
    matched = moe.match_prefix([10, 11], acquire=True)
    assert matched.tolist() == blocks.tolist()
    rebuilt = moe.reconstruct_routing_from_blocks(matched, 2 * BLOCK)
    assert rebuilt is not None and torch.equal(rebuilt.long(), routing)
    moe.check_invariants()


def test_routing_of_an_evicted_block_is_gone_and_stays_gone_when_reused(
    moe: KVBlockAllocator,
) -> None:
    blocks = moe.allocate_memory_blocks(2)
    fill_blocks(moe, blocks)
    moe.register_kv_block_hashes(blocks, [10, 11])
    moe.release_memory_blocks(blocks)
    assert moe.evict_cached_blocks(1) == 1
    assert moe.get_block_routing(int(blocks[1])) is None, "evicted: routing cleared"
    assert moe.get_block_routing(int(blocks[0])) is not None, "still cached"
    reused = moe.allocate_memory_blocks(moe.pool.num_free)
    assert int(blocks[1]) in reused.tolist()
    assert int(blocks[0]) not in reused.tolist()
    assert moe.get_block_routing(int(blocks[1])) is None
    moe.check_invariants()


def test_a_recycled_block_loses_its_routing(moe: KVBlockAllocator) -> None:
    """Evicted by allocation pressure, handed out again: no stale routing."""
    blocks = moe.allocate_memory_blocks(1)
    fill_blocks(moe, blocks)
    moe.register_kv_block_hashes(blocks, [10])
    moe.release_memory_blocks(blocks)
    everything = moe.allocate_memory_blocks(moe.num_usable)
    assert everything is not None and int(blocks[0]) in everything.tolist()
    assert moe.match_prefix([10]).numel() == 0
    assert moe.get_block_routing(int(blocks[0])) is None
    assert moe.reconstruct_routing_from_blocks(blocks, 1) is None


def test_an_unhashed_block_handed_out_again_has_no_routing(moe: KVBlockAllocator) -> None:
    blocks = moe.allocate_memory_blocks(1)
    fill_blocks(moe, blocks)
    moe.release_memory_blocks(blocks)
    again = moe.allocate_memory_blocks(1)
    assert again.tolist() == blocks.tolist(), "LIFO hands the same block back"
    assert moe.get_block_routing(int(again[0])) is None


def test_ref_zero_drops_routing_with_the_block(make: Callable[..., KVBlockAllocator]) -> None:
    allocator = make(
        "ref_zero", routing_num_layers=LAYERS, routing_top_k=TOP_K, routing_num_experts=EXPERTS
    )
    blocks = allocator.allocate_memory_blocks(1)
    fill_blocks(allocator, blocks)
    allocator.register_kv_block_hashes(blocks, [10])
    allocator.release_memory_blocks(blocks)
    assert allocator.get_block_routing(int(blocks[0])) is None
    allocator.check_invariants()


@pytest.mark.parametrize(
    ("num_experts", "dtype"),
    [(None, torch.int16), (8, torch.int16), (32_767, torch.int16), (32_768, torch.int32)],
)
def test_routing_dtype_follows_the_expert_count(
    make: Callable[..., KVBlockAllocator], num_experts: int | None, dtype: torch.dtype
) -> None:
    allocator = make(
        routing_num_layers=LAYERS, routing_top_k=TOP_K, routing_num_experts=num_experts
    )
    block = int(allocator.allocate_memory_blocks(1)[0])
    routing = torch.zeros(BLOCK, LAYERS, TOP_K, dtype=torch.int64)
    allocator.store_block_routing(block, routing)
    assert allocator.get_block_routing(block).dtype == dtype


def test_int32_routing_past_32767_experts(make: Callable[..., KVBlockAllocator]) -> None:
    allocator = make(routing_num_layers=LAYERS, routing_top_k=TOP_K, routing_num_experts=40_000)
    blocks = allocator.allocate_memory_blocks(2)
    routing = random_routing(2 * BLOCK, experts=40_000)
    routing[0, 0, 0], routing[-1, -1, -1] = 39_999, 32_768
    allocator.store_routing_per_block(
        routing, blocks.repeat_interleave(BLOCK), torch.arange(BLOCK).repeat(2)
    )
    rebuilt = allocator.reconstruct_routing_from_blocks(blocks, 2 * BLOCK)
    assert rebuilt.dtype == torch.int32
    assert torch.equal(rebuilt.long(), routing)
    with pytest.raises(InvalidArgumentError):
        allocator.store_block_routing(int(blocks[0]), torch.full((1, LAYERS, TOP_K), 40_000))


def test_int16_routing_refuses_an_expert_past_its_range(
    make: Callable[..., KVBlockAllocator],
) -> None:
    allocator = make(routing_num_layers=LAYERS, routing_top_k=TOP_K)
    block = int(allocator.allocate_memory_blocks(1)[0])
    allocator.store_block_routing(block, torch.full((1, LAYERS, TOP_K), 32_767))
    with pytest.raises(InvalidArgumentError):
        allocator.store_block_routing(block, torch.full((1, LAYERS, TOP_K), 32_768))


def test_store_block_routing_partial_rows(moe: KVBlockAllocator) -> None:
    block = int(moe.allocate_memory_blocks(1)[0])
    head = random_routing(2, seed=5)
    moe.store_block_routing(block, head)
    assert moe.get_block_routing(block) is None, "positions 2 and 3 are missing"
    assert torch.equal(moe.reconstruct_routing_from_blocks([block], 2).long(), head)
    assert moe.reconstruct_routing_from_blocks([block], 3) is None
    tail = random_routing(2, seed=6)
    moe.store_routing_per_block(tail, [block, block], [2, 3])
    full = moe.get_block_routing(block)
    assert full is not None and torch.equal(full.long(), torch.cat([head, tail]))


def test_store_block_routing_overwrites(moe: KVBlockAllocator) -> None:
    block = int(moe.allocate_memory_blocks(1)[0])
    moe.store_block_routing(block, torch.zeros(BLOCK, LAYERS, TOP_K, dtype=torch.int16))
    moe.store_block_routing(block, torch.ones(1, LAYERS, TOP_K, dtype=torch.int16))
    stored = moe.get_block_routing(block)
    assert stored[0].eq(1).all() and stored[1:].eq(0).all()


def test_a_paused_block_accepts_routing(make: Callable[..., KVBlockAllocator]) -> None:
    allocator = make(
        paused_count=1, routing_num_layers=LAYERS, routing_top_k=TOP_K, routing_num_experts=8
    )
    blocks = allocator.allocate_memory_blocks(1)
    allocator.pause(blocks)
    routing = fill_blocks(allocator, blocks)
    assert torch.equal(allocator.get_block_routing(int(blocks[0])).long(), routing)


def test_reset_clears_routing(moe: KVBlockAllocator) -> None:
    blocks = moe.allocate_memory_blocks(1)
    fill_blocks(moe, blocks)
    moe.reset()
    assert moe.get_block_routing(int(blocks[0])) is None
