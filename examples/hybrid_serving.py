"""Serving a hybrid model in a dynamic-batching loop, every output checked against no cache.

The toy model has full-attention, sliding-window and indexer layers (KV blocks in
layer groups) and linear-attention layers (a recurrent state per request). Requests
sharing a system prompt arrive over time: later ones hit the prefix and get both the
KV blocks and the state from a checkpoint; the sliding-window layers give back blocks
that leave their window while requests run; one request is forked into three samples
that share its partly filled last block until each writes (copy-on-write); in the
middle of the run the KV pools are defragmented under the running requests. Every
finished request's outputs are compared with a run of the same model without any
cache, exactly (the loop raises on any difference).

Run: python examples/hybrid_serving.py
"""

from prefixcache.reference.sim_hybrid import HybridSimRequest, run_hybrid
from prefixcache.reference.toy_hybrid import build_toy_hybrid

# Full-attention, sliding-window (8 tokens), indexer and linear-attention layers
# (prefixcache.reference.toy_hybrid.build_toy_hybrid spells out the layer groups).
model = build_toy_hybrid(
    num_blocks=128, block_size=4, window=8, max_requests=8, num_checkpoints=8, vocab_size=64
)

system_prompt = [7, 3, 9, 1, 4, 4, 2, 8, 5, 6, 0, 3, 1, 9, 9, 2, 7]  # 17 tokens
requests = [
    HybridSimRequest("q0", (*system_prompt, 11, 12), output_length=12),
    HybridSimRequest("q1", (*system_prompt, 21, 22, 23), output_length=12, arrival_step=6),
    # Three samples of one question: the fork ranks pick the 2nd and 3rd best tokens.
    HybridSimRequest(
        "q2", (*system_prompt, 31), output_length=8, arrival_step=8, fork_ranks=(1, 2)
    ),
]


def show(sim, step):
    """Print what the step did; after step 15, evict some cached blocks and compact the pools
    under the running request."""
    sim.memory.check_invariants()
    print(
        f"step {step.step:2}: running {step.num_running}, held blocks {step.held_blocks}, "
        f"hit {step.hit_tokens} tokens, states restored {step.num_restored_states}, "
        f"forks {step.num_forks}, copies {step.num_copies}"
    )
    if step.step == 15:
        for allocator in sim.memory.groups.allocators.values():
            allocator.evict_cached_blocks(6)  # as memory pressure would: holes below live blocks
        moved = sim.memory.defragment()  # KV data, tables and shared tails move together
        sim.memory.check_invariants()
        print(f"         defragmented mid-run: blocks moved per pool {moved}")


report, outputs = run_hybrid(model, requests, step_token_budget=12, between_steps=show)
for output in outputs:
    print(
        f"{output.request_id}: reused {output.num_hit_tokens} prompt tokens "
        f"(state restored {output.num_restored_states}x), generated {list(output.tokens)}"
    )
print(
    f"hit rate {report.hit_rate:.0%}, {report.num_checkpoints_saved} checkpoints saved, "
    f"{report.num_copies} copy-on-write copies; all {report.num_finished} requests equal "
    "to the uncached run"
)
