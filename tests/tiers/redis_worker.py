"""The second process of the two-process remote-tier test (tests/tiers/test_remote_redis.py).

Run as ``python redis_worker.py URL NAMESPACE SEED NUM_BLOCKS OTHER_SEED``: builds
its own allocator, host tier and KV cache (the same layout as the test's loop),
admits the prompt of ``SEED`` through the shared Redis tier, runs the copies
and prints one JSON line with its cache numbers and a SHA-256 of every block's
K/V. It then computes the prompt of ``OTHER_SEED`` itself and pushes it
through its host tier to the server, so the parent can find it in turn. Not a
test module: pytest does not collect it, and it imports only the library.
"""

from __future__ import annotations

import hashlib
import json
import sys

import torch

from prefixcache import KVBlockAllocator
from prefixcache.serving.kv_cache import KVCache
from prefixcache.tiers import HostKVStore, HostTier, KVTransfer, RequestCache, TieredCache, connect

BLOCK = 4


def prompt(seed: int, num_blocks: int) -> list[int]:
    """The test's prompt of ``seed``: the same tokens in both processes."""
    return [seed * 1000 + i for i in range(num_blocks * BLOCK)]


def content(block_hash: int, shape: tuple[int, ...]) -> torch.Tensor:
    """The K (or V) of a block, seeded by its hash, as the test's loop writes it."""
    generator = torch.Generator().manual_seed(block_hash % (1 << 62))
    return torch.randn(shape, generator=generator)


def block_digest(kv: KVCache, block_id: int) -> str:
    """SHA-256 of a device block's K then V bytes, layer by layer."""
    digest = hashlib.sha256()
    for layer in range(kv.num_layers):
        for tensors in (kv.k_caches, kv.v_caches):
            digest.update(tensors[layer][block_id].contiguous().numpy().tobytes())
    return digest.hexdigest()


def main(url: str, namespace: str, seed: int, num_blocks: int, other_seed: int) -> None:
    """Read ``seed``'s prompt from the server, then publish ``other_seed``'s; print JSON."""
    device_blocks, host_slots = 9, 8  # room to load a whole prompt
    remote = connect(url, namespace=namespace, timeout_s=2.0)
    allocator = KVBlockAllocator(
        total_count=device_blocks, block_size_tokens=BLOCK, device="cpu", engine="python"
    )
    kv = KVCache(
        2, device_blocks, BLOCK, k_heads=2, k_head_dim=3, dtype=torch.float32, device="cpu"
    )
    store = HostKVStore(kv, host_slots)
    host = HostTier(host_slots, block_size=BLOCK)
    tiered = TieredCache(allocator, host, remote=remote, store=store)
    requests = RequestCache(tiered)
    transfer = KVTransfer(kv, store, remote=remote)

    admission = requests.admit("read", prompt(seed, num_blocks))
    assert admission is not None
    transfer.run(tiered.take_transfer())
    transfer.wait()
    ids = admission.block_ids.tolist()
    report = {
        "cached_tokens": admission.num_cached_tokens,
        "remote_tokens": admission.num_remote_cached_tokens,
        "digests": [block_digest(kv, block_id) for block_id in ids],
    }
    requests.finish("read")

    for index, request in enumerate(("publish", *(f"spill-{n}" for n in range(6)))):
        tokens = prompt(other_seed + index, num_blocks)
        admission = requests.admit(request, tokens)
        assert admission is not None
        transfer.run(tiered.take_transfer())
        transfer.wait()
        for block_id, block_hash in zip(
            admission.block_ids.tolist(), requests.hashes_of(request), strict=True
        ):
            for layer in range(kv.num_layers):
                for tensors, salt in ((kv.k_caches, 1), (kv.v_caches, 2)):
                    shape = (BLOCK, 2, 3)
                    tensors[layer][block_id] = content(block_hash * 3 + salt + layer, shape)
        requests.finish(request)
    transfer.run(tiered.take_transfer())  # the last host evictions' writes
    transfer.wait()
    remote.flush()
    report["stats"] = remote.stats().as_dict()
    remote.close()
    print(json.dumps(report))


if __name__ == "__main__":
    url, namespace, *numbers = sys.argv[1:]
    main(url, namespace, *(int(n) for n in numbers))
