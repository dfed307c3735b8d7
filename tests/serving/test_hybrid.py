"""HybridMemory: prefix hits restore KV in every layer group and the recurrent state.

The end-to-end checks serve requests through a :class:`ToyHybridModel` whose layers
read and write only the memory's caches, and compare every output with a dense run
without any cache: a wrong block, a window block given back too early or a state not
restored changes the outputs.
"""

from __future__ import annotations

import random
import runpy
from pathlib import Path

import numpy as np
import pytest
import torch

from prefixcache.engine.hashing import compute_block_hashes
from prefixcache.errors import ConfigError, InvalidArgumentError, InvariantError
from prefixcache.reference.toy_hybrid import ToyHybridModel
from prefixcache.serving.hybrid import HybridMemory, HybridRequest, build_hybrid_memory
from prefixcache.serving.layer_groups import LayerGroups, LayerGroupSpec
from prefixcache.serving.state_pool import StateShape

B = 4
GROUPS = [
    LayerGroupSpec("full", "full", num_layers=2, k_heads=2, k_head_dim=4),
    LayerGroupSpec("swa", "sliding_window", num_layers=2, k_heads=2, k_head_dim=4, window=6),
    LayerGroupSpec("idx", "indexer", num_layers=1, k_heads=1, k_head_dim=4),
]
LINEAR = StateShape(num_layers=2, num_heads=2, k_dim=3, v_dim=3, conv_dim=5, conv_kernel=4)


def make(groups=GROUPS, linear=LINEAR, **kwargs) -> HybridMemory:
    options = {
        "num_blocks": 64,
        "block_size": B,
        "max_requests": 4,
        "max_blocks_per_request": 16,
        "num_checkpoints": 4,
        "checkpoint_every": 2,
        "dtype": torch.float32,
        "device": "cpu",
    }
    options |= kwargs
    if linear is None:
        options["num_checkpoints"] = 0
    return build_hybrid_memory(groups, linear=linear, **options)


def serve(
    memory: HybridMemory, model: ToyHybridModel, tokens: list[int]
) -> tuple[HybridRequest, list[torch.Tensor]]:
    """Prefill ``tokens`` in chunks ending at the checkpoint boundaries; keep the request."""
    request = memory.admit(compute_block_hashes(tokens[:-1], B), len(tokens))
    assert request is not None
    outputs: list[torch.Tensor] = []
    for stop in [*memory.chunk_boundaries(request), len(tokens)]:
        if stop <= request.num_computed_tokens:
            continue
        assert memory.reserve(request, stop)
        outputs += model.forward_cached(request, tokens, stop)
        memory.commit(request, stop, compute_block_hashes(tokens[:stop], B))
        memory.check_invariants()
    return request, outputs


def assert_matches_reference(
    model: ToyHybridModel, tokens: list[int], start: int, outputs: list[torch.Tensor]
) -> None:
    reference = model.forward_reference(tokens)[start:]
    assert len(outputs) == len(reference)
    for position, (got, want) in enumerate(zip(outputs, reference, strict=True), start):
        assert torch.equal(got, want), f"position {position} differs"


def test_a_prefix_hit_restores_kv_and_state_and_continues_exactly() -> None:
    memory = make()
    model = ToyHybridModel(memory)
    shared = list(range(1, 23))
    first, outputs = serve(memory, model, [*shared, 30, 31, 32])
    assert first.num_hit_tokens == 0
    assert_matches_reference(model, [*shared, 30, 31, 32], 0, outputs)
    memory.finish(first)
    tokens = [*shared, 40, 41, 42, 43]
    second, outputs = serve(memory, model, tokens)
    # The first checkpointed at 2, 4 and 6 blocks (every 2, prompt end 6); the second
    # shares 5 full blocks, so the deepest usable checkpoint ends at block 4.
    assert second.num_hit_tokens == 16 and second.restored_from is not None
    assert_matches_reference(model, tokens, 16, outputs)
    memory.finish(second)
    memory.check_invariants()


def test_the_comparison_catches_a_state_that_was_not_restored() -> None:
    memory = make()
    model = ToyHybridModel(memory)
    shared = list(range(1, 23))
    first, _ = serve(memory, model, [*shared, 30])
    memory.finish(first)
    tokens = [*shared, 40]
    second = memory.admit(compute_block_hashes(tokens[:-1], B), len(tokens))
    assert second is not None and second.num_hit_tokens == 20  # the first prompt's end
    memory.state_pool.recurrent_states[:, second.state_slot] = 0.0  # forget the restore
    assert memory.reserve(second, len(tokens))
    outputs = model.forward_cached(second, tokens, len(tokens))
    reference = model.forward_reference(tokens)[20:]
    assert not torch.equal(outputs[0], reference[0])


def test_without_a_checkpoint_at_the_prefix_end_there_is_no_hit() -> None:
    memory = make(num_checkpoints=0)
    model = ToyHybridModel(memory)
    first, _ = serve(memory, model, list(range(1, 20)))
    memory.finish(first)
    hashes = compute_block_hashes(list(range(1, 20)), B)
    assert memory.groups.longest_hit(hashes).num_blocks == 4  # the KV is all there
    assert memory.match_prefix(hashes).num_blocks == 0  # but no state to resume from


def test_an_evicted_checkpoint_shortens_the_hit() -> None:
    memory = make()
    model = ToyHybridModel(memory)
    tokens = list(range(1, 26))  # 6 full blocks: checkpoints at 2, 4, 6
    first, _ = serve(memory, model, tokens)
    memory.finish(first)
    hashes = compute_block_hashes(tokens, B)
    assert memory.match_prefix(hashes).num_blocks == 6
    assert memory.checkpoints.discard(hashes[5])
    match = memory.match_prefix(hashes)
    assert match.num_blocks == 4 and match.checkpoint_slot == memory.checkpoints.lookup(hashes[3])


def test_prune_drops_checkpoints_whose_kv_was_evicted() -> None:
    memory = make(groups=GROUPS[:1])
    model = ToyHybridModel(memory)
    tokens = list(range(1, 18))
    first, _ = serve(memory, model, tokens)
    memory.finish(first)
    allocator = memory.groups.allocators["full"]
    assert allocator.evict_cached_blocks(64) == 4
    assert len(memory.checkpoints) == 2
    assert memory.checkpoints.prune(allocator.is_hash_registered) == 2


def test_a_pure_attention_memory_hits_without_checkpoints() -> None:
    memory = make(linear=None)
    assert memory.state_pool is None and memory.checkpoints is None
    model = ToyHybridModel(memory)
    tokens = list(range(1, 18))
    first, _ = serve(memory, model, tokens)
    memory.finish(first)
    second, outputs = serve(memory, model, [*tokens[:16], 50, 51])
    assert second.num_hit_tokens == 16 and second.state_slot is None
    assert_matches_reference(model, [*tokens[:16], 50, 51], 16, outputs)


def test_decode_continues_exactly_and_checkpoints_every_kth_block() -> None:
    memory = make()
    model = ToyHybridModel(memory)
    tokens = list(range(1, 10))
    request, outputs = serve(memory, model, tokens)
    saved = memory.checkpoints.stats().num_saved
    for token in (11, 12, 13, 14, 15, 16, 17):  # decode one token at a time
        tokens.append(token)
        assert memory.reserve(request, len(tokens))
        outputs += model.forward_cached(request, tokens, len(tokens))
        memory.commit(request, len(tokens), compute_block_hashes(tokens, B))
    assert_matches_reference(model, tokens, 0, outputs)
    assert memory.checkpoints.stats().num_saved == saved + 1  # at 16 tokens, block 4


def test_randomised_workloads_always_match_the_reference() -> None:
    rng = random.Random(7)
    memory = make(num_blocks=40, num_checkpoints=3)
    model = ToyHybridModel(memory)
    prefixes = [[rng.randrange(64) for _ in range(rng.randrange(4, 20))] for _ in range(3)]
    total_hit = 0
    for _ in range(24):
        tokens = rng.choice(prefixes) + [rng.randrange(64) for _ in range(rng.randrange(1, 9))]
        request, outputs = serve(memory, model, tokens)
        total_hit += request.num_hit_tokens
        assert_matches_reference(model, tokens, request.num_hit_tokens, outputs)
        memory.finish(request)
        memory.check_invariants()
    assert total_hit > 0


def test_admit_returns_none_when_no_row_or_state_slot_is_free() -> None:
    memory = make(max_requests=1)
    assert memory.admit([], 1) is not None
    assert memory.admit([], 1) is None


def test_memory_bytes_counts_every_pool_and_the_states() -> None:
    memory = make()
    sizes = memory.memory_bytes
    assert set(sizes) == {"full", "swa", "idx", "states"}
    cache = memory.groups.kv_caches["full"]
    assert sizes["full"] == sum(t.nbytes for t in (*cache.k_caches, *cache.v_caches))
    pool = memory.state_pool
    assert sizes["states"] == pool.recurrent_states.nbytes + pool.conv_states.nbytes
    assert pool.num_slots == 1 + 4 + 4  # dummy, a slot per request row, checkpoints


@pytest.mark.parametrize(
    "call",
    [
        lambda m, r: m.admit([1.5], 3),
        lambda m, r: m.admit([], 0),
        lambda m, r: m.admit([], True),
        lambda m, r: m.match_prefix("abc"),
        lambda m, r: m.commit(r, 2, [True]),
        lambda m, r: m.reserve(HybridRequest(9, None, 1, 0, 0, None), 4),
        lambda m, r: m.finish(HybridRequest(r.slot, r.state_slot, 1, 0, 0, None)),
        lambda m, r: m.chunk_boundaries(None),
    ],
)
def test_bad_calls_are_invalid_argument_errors(call) -> None:
    memory = make()
    request = memory.admit([], 5)
    with pytest.raises(InvalidArgumentError):
        call(memory, request)
    memory.check_invariants()


def test_a_finished_request_is_refused() -> None:
    memory = make()
    request = memory.admit([], 5)
    memory.finish(request)
    with pytest.raises(InvalidArgumentError):
        memory.finish(request)


def test_bad_configuration_is_a_config_error() -> None:
    sizes = {"num_blocks": 8, "block_size": B, "max_requests": 1, "max_blocks_per_request": 2}
    with pytest.raises(ConfigError):  # checkpoints without linear layers
        build_hybrid_memory(GROUPS, num_checkpoints=2, device="cpu", **sizes)
    with pytest.raises(ConfigError):
        make(num_checkpoints=-1)
    with pytest.raises(ConfigError):
        make(checkpoint_policy="nope")
    groups = LayerGroups(GROUPS, device="cpu", **sizes)
    with pytest.raises(ConfigError):  # checkpoints of another pool
        HybridMemory(groups, None, make().checkpoints)


def test_the_example_reuses_the_shared_prompt_and_matches_the_uncached_run(capsys) -> None:
    example = Path(__file__).parents[2] / "examples" / "hybrid_model.py"
    runpy.run_path(str(example), run_name="__main__")
    lines = capsys.readouterr().out.splitlines()
    served = [line for line in lines if line.startswith("request ")]
    assert len(served) == 3
    assert all(line.endswith("outputs equal to the uncached run: True") for line in served)
    assert "reused 0 " in served[0] and all("reused 16 " in line for line in served[1:])


def test_a_state_pool_without_checkpoints_never_hits() -> None:
    full = make()
    memory = HybridMemory(full.groups, full.state_pool, None)
    model = ToyHybridModel(memory)
    first, _ = serve(memory, model, list(range(1, 18)))
    memory.finish(first)
    assert memory.match_prefix(compute_block_hashes(list(range(1, 18)), B)).num_blocks == 0


def test_admit_returns_none_when_the_state_pool_is_full() -> None:
    memory = make(max_requests=2)
    while memory.state_pool.num_free:
        memory.state_pool.allocate()
    assert memory.admit([], 3) is None


def test_hashes_may_come_as_a_tensor_or_an_array() -> None:
    memory = make()
    hashes = compute_block_hashes(list(range(8)), B)
    model = ToyHybridModel(memory)
    first, _ = serve(memory, model, list(range(9)))
    memory.finish(first)
    for given in (torch.tensor(hashes, dtype=torch.int64), np.array(hashes, dtype=np.int64)):
        match = memory.match_prefix(given)
        assert match.num_blocks == 2 and match.checkpoint_slot is not None


def test_check_invariants_sees_a_request_that_lost_its_state_slot() -> None:
    memory = make()
    request = memory.admit([], 3)
    memory.state_pool.free(request.state_slot)
    with pytest.raises(InvariantError):
        memory.check_invariants()


def test_the_toy_model_refuses_a_stop_outside_the_sequence() -> None:
    memory = make()
    request = memory.admit([], 3)
    with pytest.raises(InvalidArgumentError):
        ToyHybridModel(memory).forward_cached(request, [1, 2, 3], 4)


def test_grouped_query_attention_groups_continue_exactly() -> None:
    groups = [LayerGroupSpec("gqa", "full", 1, k_heads=2, k_head_dim=4, v_heads=1, v_head_dim=4)]
    memory = make(groups=groups)
    model = ToyHybridModel(memory)
    tokens = list(range(1, 14))
    _, outputs = serve(memory, model, tokens)
    assert_matches_reference(model, tokens, 0, outputs)
