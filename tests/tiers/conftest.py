"""A tiny serving loop over a real KVCache for the tier tests: K/V is a function of the hash."""

from __future__ import annotations

from collections.abc import Hashable

import pytest
import torch

from prefixcache import KVBlockAllocator
from prefixcache.serving.kv_cache import KVCache
from prefixcache.tiers import HostKVStore, HostTier, KVTransfer, RequestCache, TieredCache
from prefixcache.tiers.remote import RemoteTier

BLOCK = 4


def content(block_hash: int, shape: tuple[int, ...]) -> torch.Tensor:
    """The K (or V) a forward pass computes for the block of ``block_hash``: seeded by it."""
    generator = torch.Generator().manual_seed(block_hash % (1 << 62))
    return torch.randn(shape, generator=generator)


class Loop:
    """Admit, "compute" (write hash-derived K/V), check, finish: a serving loop in miniature."""

    def __init__(
        self,
        device_blocks: int,
        host_slots: int,
        *,
        events: int = 0,
        batched: bool | None = None,
        policy: str = "lru",
        engine: str = "python",
        remote: RemoteTier | None = None,
    ) -> None:
        self.allocator = KVBlockAllocator(
            total_count=device_blocks,
            block_size_tokens=BLOCK,
            device="cpu",
            kv_events_capacity=events,
            engine=engine,
        )
        self.host = HostTier(host_slots, block_size=BLOCK, events_capacity=events, policy=policy)
        self.kv = KVCache(
            2, device_blocks, BLOCK, k_heads=2, k_head_dim=3, dtype=torch.float32, device="cpu"
        )
        self.store = HostKVStore(self.kv, host_slots)
        self.tiered = TieredCache(self.allocator, self.host, remote=remote, store=self.store)
        self.requests = RequestCache(self.tiered)
        self.transfer = KVTransfer(self.kv, self.store, batched=batched, remote=remote)
        self.num_computed_blocks = 0
        self.block_ids: dict[Hashable, list[int]] = {}

    def copy(self) -> None:
        self.transfer.run(self.tiered.take_transfer())
        self.transfer.wait()

    def compute(self, request_id: Hashable, first: int) -> None:
        """Write the K/V of the request's full blocks from ``first`` on, as a forward pass would."""
        hashes = self.requests.hashes_of(request_id)
        ids = self.block_ids[request_id]
        for index in range(first, len(hashes)):
            self.write(ids[index], hashes[index])
            self.num_computed_blocks += 1

    def write(self, block_id: int, block_hash: int) -> None:
        for layer in range(self.kv.num_layers):
            for tensors, salt in ((self.kv.k_caches, 1), (self.kv.v_caches, 2)):
                tensors[layer][block_id] = content(block_hash * 3 + salt + layer, (BLOCK, 2, 3))

    def admit(self, request_id: Hashable, tokens: object, **kwargs: object) -> int:
        """Admit, run the copies, compute what missed; return the cached tokens."""
        admission = self.requests.admit(request_id, tokens, **kwargs)  # type: ignore[arg-type]
        assert admission is not None
        self.block_ids[request_id] = admission.block_ids.tolist()
        self.copy()  # demotions read evicted blocks before the forward pass writes them
        self.compute(request_id, admission.num_cached_tokens // BLOCK)
        self.check(request_id)
        return admission.num_cached_tokens

    def check(self, request_id: Hashable) -> None:
        """Every full block of the request holds the K/V of its hash."""
        hashes = self.requests.hashes_of(request_id)
        ids = self.block_ids[request_id]
        for index, block_hash in enumerate(hashes):
            for layer in range(self.kv.num_layers):
                for tensors, salt in ((self.kv.k_caches, 1), (self.kv.v_caches, 2)):
                    want = content(block_hash * 3 + salt + layer, (BLOCK, 2, 3))
                    assert torch.equal(tensors[layer][ids[index]], want), (request_id, index)


@pytest.fixture
def make_loop() -> type[Loop]:
    """The :class:`Loop` class, to build loops of any size."""
    return Loop
