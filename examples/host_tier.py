"""A host tier behind the device pool: evicted prefixes come back by copy, not recompute.

Also shows a weight update without draining, per-request cached-token numbers and range
keys for images (the same placeholder tokens, different pictures).
Run: python examples/host_tier.py
"""

import torch

from prefixcache import KVBlockAllocator
from prefixcache.serving.kv_cache import KVCache
from prefixcache.tiers import (
    HostKVStore,
    HostTier,
    KVTransfer,
    RangeKey,
    RequestCache,
    TieredCache,
)

BLOCK = 4
device = "cuda" if torch.cuda.is_available() else "cpu"
allocator = KVBlockAllocator(total_count=9, block_size_tokens=BLOCK, device=device)
host = HostTier(32, policy="lru", block_size=BLOCK)  # 4x the device pool, its own policy
tiered = TieredCache(allocator, host)
requests = RequestCache(tiered)
kv = KVCache(2, 9, BLOCK, k_heads=2, k_head_dim=8, dtype=torch.float32, device=device)
transfer = KVTransfer(kv, HostKVStore(kv, 32))  # pinned host memory on CUDA


def serve(name: str, tokens: list[int], ranges: tuple[RangeKey, ...] = ()) -> None:
    """Admit a request, run its copies, "compute" what missed, finish it."""
    admission = requests.admit(name, tokens, ranges=ranges)
    assert admission is not None
    transfer.run(tiered.take_transfer())  # demotions first: they read blocks about to be reused
    transfer.wait()  # the compute stream waits for the copies; the host does not
    hashes = requests.hashes_of(name)
    for index in range(admission.num_cached_tokens // BLOCK, len(hashes)):
        block = int(admission.block_ids[index])  # a forward pass writes the K/V it computes
        for layer in range(kv.num_layers):
            kv.k_caches[layer][block] = float(hashes[index] % 1000)
            kv.v_caches[layer][block] = -float(hashes[index] % 1000)
    print(
        f"{name}: {len(tokens)} tokens, {admission.num_cached_tokens} cached "
        f"({admission.num_device_cached_tokens} on the device, "
        f"{admission.num_host_cached_tokens} from the host tier)"
    )
    for index, block_hash in enumerate(hashes):  # every block holds the K/V of its hash
        block = int(admission.block_ids[index])
        assert torch.all(kv.k_caches[0][block] == float(block_hash % 1000))
    requests.finish(name)


document = list(range(100, 124))  # 6 blocks
serve("first read", document)
serve("another document", list(range(500, 524)))  # evicts the first: demoted to the host
serve("second read", document)  # promoted back from the host tier
requests.begin_weight_epoch("rl-step-1")  # new weights: nothing cached matches any more
serve("after the update", document)
stats = tiered.stats()
print(
    f"demoted {stats.num_demoted_blocks}, promoted {stats.num_promoted_blocks}, "
    f"weight epoch {stats.weight_epoch}"
)
print("counters:", requests.counters()["default"])
tiered.check()

# An image covers placeholder tokens that are the same for every image: its range key goes
# into the hashes of the blocks it covers, so only the text before it is shared.
text, placeholders = list(range(900, 908)), [0] * 8
serve("cat picture", text + placeholders, (RangeKey(8, 16, "sha256-of-cat.png"),))
serve("dog picture", text + placeholders, (RangeKey(8, 16, "sha256-of-dog.png"),))
