"""Quick start: allocate, share a prompt prefix, release, and let LRU evict.

Run: python examples/quickstart.py
"""

from prefixcache import KVBlockAllocator

allocator = KVBlockAllocator(total_count=9, block_size_tokens=4, device="cpu")
system_prompt = list(range(100, 112))  # 3 full blocks of 4 tokens

# Request A computes the system prompt plus its own question and registers the full blocks.
tokens_a = [*system_prompt, 1, 2, 3, 4]
hashes_a = allocator.hash_tokens(tokens_a)
blocks_a = allocator.allocate_memory_blocks(len(hashes_a))
assert blocks_a is not None  # None only when even eviction cannot free enough blocks
allocator.register_kv_block_hashes(blocks_a, hashes_a)
print("A holds", blocks_a.tolist(), "|", allocator)

# Request B shares the system prompt: its first three blocks are a prefix hit.
tokens_b = [*system_prompt, 5, 6, 7, 8]
hashes_b = allocator.hash_tokens(tokens_b)
hit = allocator.match_prefix(hashes_b, acquire=True)  # takes references atomically
fresh = allocator.allocate_memory_blocks(len(hashes_b) - len(hit))
assert fresh is not None
allocator.register_kv_block_hashes(fresh, hashes_b[len(hit) :], parent_hash=hashes_b[len(hit) - 1])
print("B reuses", hit.tolist(), "and computes", fresh.tolist(), "|", allocator)

# Both finish: their blocks stay cached (LRU keeps them until memory is needed).
with allocator.free_group():
    allocator.release_memory_blocks(blocks_a)
    allocator.release_memory_blocks(hit)
    allocator.release_memory_blocks(fresh)
print("after release:", allocator)

# A big request needs 6 blocks: the least recently used cached leaves are evicted.
big = allocator.allocate_memory_blocks(6)
assert big is not None
print("big request got", big.tolist(), "|", allocator, "|", allocator.stats())
allocator.check_invariants()
