"""A hybrid model's memory: prefix hits that restore KV in every layer group and the state.

The model (a toy, seeded random weights) has full-attention layers, sliding-window
layers sharing the full layers' block pool, a sparse-attention indexer's key cache in a
pool of its own, and linear-attention layers whose per-request recurrent state lives in
a state pool. Three requests share a system prompt: the first computes it and leaves
state checkpoints behind; the next two hit the prefix, get the KV blocks and a copy of
the state at the end of the hit, and compute only the rest. Every output is compared
with a dense run of the same model without any cache.

Run: python examples/hybrid_model.py
"""

import torch

from prefixcache.engine.hashing import compute_block_hashes
from prefixcache.reference.toy_hybrid import ToyHybridModel
from prefixcache.serving.hybrid import build_hybrid_memory
from prefixcache.serving.layer_groups import LayerGroupSpec, first_needed_block
from prefixcache.serving.state_pool import StateShape

BLOCK_SIZE = 4
WINDOW = 8  # tokens the sliding-window layers attend to
memory = build_hybrid_memory(
    [
        LayerGroupSpec("full", "full", num_layers=2, k_heads=2, k_head_dim=8),
        LayerGroupSpec("swa", "sliding_window", 4, 2, 8, window=WINDOW, pool="full"),
        LayerGroupSpec("indexer", "indexer", num_layers=1, k_heads=1, k_head_dim=16),
    ],
    num_blocks=96,
    block_size=BLOCK_SIZE,
    max_requests=4,
    max_blocks_per_request=16,
    linear=StateShape(num_layers=6, num_heads=2, k_dim=8, v_dim=8, conv_dim=16, conv_kernel=4),
    num_checkpoints=8,
    checkpoint_every=2,
    dtype=torch.float32,
    device="cpu",
)
model = ToyHybridModel(memory, vocab_size=64)
print("memory (bytes):", memory.memory_bytes)

system_prompt = [7, 3, 9, 1, 4, 4, 2, 8, 5, 6, 0, 3, 1, 9, 9, 2, 7, 5]  # 4.5 blocks
questions = [[11, 12, 13], [21, 22, 23, 24, 25], [31]]

for number, question in enumerate(questions):
    tokens = system_prompt + question
    # Match on the prompt minus its last token: that token is always computed (its
    # logits start the answer).
    request = memory.admit(compute_block_hashes(tokens[:-1], BLOCK_SIZE), len(tokens))
    assert request is not None  # None only when the pools cannot hold the request
    hit = request.num_hit_tokens
    outputs = []
    for stop in [*memory.chunk_boundaries(request), len(tokens)]:  # chunks end at checkpoints
        if stop > request.num_computed_tokens:
            memory.reserve(request, stop)
            outputs += model.forward_cached(request, tokens, stop)
            memory.commit(request, stop, compute_block_hashes(tokens[:stop], BLOCK_SIZE))
    held = memory.groups.num_held_blocks()
    in_window = hit // BLOCK_SIZE - first_needed_block(hit, WINDOW, BLOCK_SIZE)
    reference = model.forward_reference(tokens)[hit:]
    same = all(torch.equal(a, b) for a, b in zip(outputs, reference, strict=True))
    print(
        f"request {number}: {len(tokens)} tokens, reused {hit} "
        f"(KV of {hit // BLOCK_SIZE} blocks, {in_window} in the window for the sliding "
        f"layers; state from checkpoint slot {request.restored_from}), computed "
        f"{len(tokens) - hit}; blocks held now {held}; "
        f"outputs equal to the uncached run: {same}"
    )
    memory.finish(request)
    memory.check_invariants()

assert memory.checkpoints is not None  # the model has linear-attention layers
print("checkpoints:", memory.checkpoints.stats())
