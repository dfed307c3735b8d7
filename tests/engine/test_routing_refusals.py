"""Routing calls say exactly what is wrong, and a block held active and paused keeps its routing.

``tests/MUTATION.md`` lists the mutants these tests kill and the survivors that are equivalent.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from prefixcache.policies import LRUPolicy

from prefixcache import KVBlockAllocator

Make = Callable[..., KVBlockAllocator]


def _routing_allocator() -> KVBlockAllocator:
    return KVBlockAllocator(
        total_count=10,
        paused_count=2,
        block_size_tokens=2,
        device="cpu",
        routing_num_layers=1,
        routing_top_k=1,
    )


def _rows(count: int) -> torch.Tensor:
    return torch.ones((count, 1, 1), dtype=torch.int64)


# ---------------------------------------------------------------------- routing


def test_routing_calls_say_exactly_what_is_wrong(make_small: Make) -> None:
    allocator = _routing_allocator()
    (held,) = allocator.allocate_memory_blocks(1).tolist()
    free_id = int(allocator.pool.free_ids()[-1])
    cases: list[tuple[Callable[[], Any], str]] = [
        (
            lambda: allocator.store_routing_per_block(_rows(1), [0.5], [0]),
            "token_block_ids must contain only ints",
        ),
        (
            lambda: allocator.store_routing_per_block(_rows(1), [held], [0.5]),
            "token_positions must contain only ints",
        ),
        (
            lambda: allocator.store_routing_per_block(_rows(2), [held], [0]),
            "lengths differ: 2 routing rows, 1 block IDs, 1 positions",
        ),
        (
            lambda: allocator.store_routing_per_block(_rows(1), [99], [0]),
            r"token_block_ids holds block 99, outside \[0, 9\)",
        ),
        (
            lambda: allocator.store_routing_per_block(_rows(1), [held], [5]),
            r"token_positions must lie in \[0, 2\), got \[5, 5\]",
        ),
        (
            lambda: allocator.store_routing_per_block(_rows(1), [free_id], [0]),
            rf"store_routing_per_block: block {free_id} \(free\) is not referenced",
        ),
        (
            lambda: allocator.store_block_routing(99, _rows(1)),
            r"block_id holds block 99, outside \[0, 9\)",
        ),
        (
            lambda: allocator.store_block_routing(held, _rows(3)),
            "routing has 3 rows; a block holds 2 tokens",
        ),
        (
            lambda: allocator.store_block_routing(free_id, _rows(1)),
            rf"store_block_routing: block {free_id} \(free\) is not referenced",
        ),
        (
            lambda: allocator.store_block_routing(held, [[[1]]]),
            "routing must be a tensor or an array, got list",
        ),
        (
            lambda: allocator.store_block_routing(held, torch.ones((1, 1, 1), device="meta")),
            r"routing must be on the CPU \(copy it off the device first\), got meta",
        ),
        (
            # numpy has no bfloat16: refused as a dtype, never a bare TypeError from .numpy()
            lambda: allocator.store_block_routing(held, _rows(1).to(torch.bfloat16)),
            "routing must have an integer dtype, got torch.bfloat16",
        ),
        (
            lambda: allocator.store_routing_per_block(_rows(1).float(), [held], [0]),
            "routing must have an integer dtype, got torch.float32",
        ),
        (lambda: allocator.get_block_routing(99), r"block_id holds block 99, outside \[0, 9\)"),
        (
            lambda: allocator.reconstruct_routing_from_blocks([held], "2"),
            "total_tokens must be an int, got '2'",
        ),
        (
            lambda: allocator.reconstruct_routing_from_blocks([held], 3),
            r"total_tokens 3 outside \[0, 2\] for 1 blocks",
        ),
        (
            lambda: allocator.match_prefix(torch.tensor([1.5])),
            "block_hashes must have an integer dtype, got torch.float32",
        ),
    ]
    for call, message in cases:
        with pytest.raises(Exception, match=f"^{message}$"):
            call()
    unrouted = make_small(LRUPolicy())
    with pytest.raises(
        Exception,
        match=r"^MoE routing is not configured \(set routing_num_layers and routing_top_k\)$",
    ):
        unrouted.get_block_routing(0)


def test_routing_of_a_block_held_active_and_paused_is_stored_and_read_back() -> None:
    allocator = _routing_allocator()
    _, block = allocator.allocate_memory_blocks(2).tolist()  # not block 0
    allocator.acquire_blocks([block])
    allocator.pause([block])
    allocator.store_routing_per_block(torch.tensor([[[3]], [[4]]]), [block, block], [0, 1])
    routing = allocator.reconstruct_routing_from_blocks([block], 2)
    assert routing is not None and routing.flatten().tolist() == [3, 4]
