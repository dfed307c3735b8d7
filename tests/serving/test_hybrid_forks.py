"""Forks and copy-on-write in a hybrid memory: reference counts, and a state machine.

:meth:`HybridMemory.fork` shares every block in every layer group, the partly filled
last one included, and copies the state; the first write into a shared partial block
copies it (:class:`SharedTails`). The state machine forks at any point (mid-prompt,
mid-decode, forks of forks), writes random chunks, defragments the pools, finishes in any
order, and checks after every rule the memory's invariants and, at each write and
finish, every output against the uncached run.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from prefixcache.engine.hashing import compute_block_hashes
from prefixcache.errors import CapacityError, InvalidArgumentError
from prefixcache.reference.toy_hybrid import ToyHybridModel
from prefixcache.serving.hybrid import HybridMemory, HybridRequest, build_hybrid_memory
from prefixcache.serving.layer_groups import LayerGroupSpec
from prefixcache.serving.state_pool import StateShape

B = 4
VOCAB = 16
GROUPS = [
    LayerGroupSpec("full", "full", num_layers=1, k_heads=2, k_head_dim=4),
    LayerGroupSpec("swa", "sliding_window", 1, 2, 4, window=5, pool="full"),
    LayerGroupSpec("idx", "indexer", num_layers=1, k_heads=1, k_head_dim=4),
]
LINEAR = StateShape(num_layers=1, num_heads=1, k_dim=3, v_dim=3, conv_dim=4, conv_kernel=3)


def make(num_blocks: int = 64, max_requests: int = 4) -> ToyHybridModel:
    memory = build_hybrid_memory(
        GROUPS,
        num_blocks=num_blocks,
        block_size=B,
        max_requests=max_requests,
        max_blocks_per_request=8,
        linear=LINEAR,
        num_checkpoints=3,
        checkpoint_every=2,
        dtype=torch.float32,
        device="cpu",
    )
    return ToyHybridModel(memory, vocab_size=VOCAB)


def compute(
    model: ToyHybridModel, request: HybridRequest, tokens: list[int], stop: int
) -> list[torch.Tensor] | None:
    memory = model.memory
    if not memory.reserve(request, stop):
        return None
    outputs = model.forward_cached(request, tokens, stop)
    memory.commit(request, stop, compute_block_hashes(tokens[:stop], B))
    return outputs


def active_counts(memory: HybridMemory, group: str, slot: int) -> list[int]:
    row = memory.groups.blocks_of(group, slot)
    spec = next(spec for spec in memory.groups.specs if spec.name == group)
    allocator = memory.groups.allocators[spec.pool_name]
    held = row[row != allocator.dummy_block_id]
    return allocator.reference_counts(held)[0].tolist()


def test_a_fork_shares_every_block_and_the_first_writer_copies_the_tail() -> None:
    model = make()
    memory = model.memory
    tokens = list(range(10))  # 2 full blocks and 2 tokens in the third
    parent = memory.admit(compute_block_hashes(tokens[:-1], B), len(tokens))
    assert parent is not None and compute(model, parent, tokens, 10) is not None
    child = memory.fork(parent)
    assert child is not None and child.num_computed_tokens == 10
    assert memory.groups.blocks_of("full", child.slot).tolist() == (
        memory.groups.blocks_of("full", parent.slot).tolist()
    )
    assert active_counts(memory, "full", child.slot) == [2, 2, 2]
    assert active_counts(memory, "idx", child.slot) == [2, 2, 2]
    shared_tail = int(memory.groups.blocks_of("full", parent.slot)[2])
    memory.check_invariants()

    child_tokens = [*tokens, 3]
    assert compute(model, child, child_tokens, 11) is not None  # the child writes first
    assert [(c.src, c.num_tokens) for c in memory.last_copies][:1] == [(shared_tail, 2)]
    assert len(memory.last_copies) == 3  # one per group
    assert int(memory.groups.blocks_of("full", parent.slot)[2]) == shared_tail
    assert int(memory.groups.blocks_of("full", child.slot)[2]) != shared_tail
    parent_tokens = [*tokens, 4]
    parent_outputs = compute(model, parent, parent_tokens, 11)
    assert parent_outputs is not None and memory.last_copies == []  # in place now
    reference = model.forward_reference(parent_tokens)
    assert torch.equal(parent_outputs[0], reference[10])
    memory.check_invariants()
    memory.finish(parent)
    memory.finish(child)
    memory.check_invariants()
    assert all(a.stats().num_active == 0 for a in memory.groups.allocators.values())


def test_fork_refusals_change_nothing() -> None:
    model = make(max_requests=1)
    memory = model.memory
    request = memory.admit(compute_block_hashes(list(range(5)), B), 6)
    assert request is not None
    assert memory.fork(request) is None  # no free row
    memory.finish(request)
    with pytest.raises(InvalidArgumentError):
        memory.fork(request)  # finished
    with pytest.raises(InvalidArgumentError):
        memory.groups.fork(0)
    memory.check_invariants()


def test_a_copy_the_pool_cannot_supply_makes_reserve_refuse_without_change() -> None:
    model = make(num_blocks=7)  # 6 usable blocks in the pool shared by full and swa
    memory = model.memory
    tokens = list(range(6))
    parent = memory.admit([], len(tokens))
    assert parent is not None and compute(model, parent, tokens, 6) is not None
    child = memory.fork(parent)
    assert child is not None
    free = memory.groups.allocators["full"].stats().num_free
    hog = memory.groups.allocators["full"].allocate_memory_blocks(free)
    assert hog is not None
    before = memory.groups.blocks_of("full", child.slot).tolist()
    assert not memory.reserve(child, 7)  # the copy needs fresh blocks
    assert memory.groups.blocks_of("full", child.slot).tolist() == before
    assert memory.tails.is_tracked(child.slot)
    memory.groups.allocators["full"].release_memory_blocks(hog)
    with pytest.raises(CapacityError):
        memory.reserve(child, 100)


def test_a_defragmentation_moves_a_shared_tail_and_both_sharers_follow() -> None:
    model = make()
    memory = model.memory
    early = memory.admit([], 12)  # takes the low IDs, then leaves holes
    assert early is not None and compute(model, early, list(range(12)), 12) is not None
    tokens = [9, 8, 7, 6, 5, 4]
    parent = memory.admit([], len(tokens))
    assert parent is not None and compute(model, parent, tokens, 6) is not None
    child = memory.fork(parent)
    assert child is not None
    memory.finish(early)
    memory.groups.allocators["full"].evict_cached_blocks(64)  # free the holes for good
    tail = int(memory.groups.blocks_of("full", parent.slot)[1])
    assert tail in memory.groups.allocators["full"].plan_defragment().sources.tolist()

    assert memory.defragment()["full"] > 0
    memory.check_invariants()  # the tails followed their rows
    moved = int(memory.groups.blocks_of("full", parent.slot)[1])
    assert moved != tail and int(memory.groups.blocks_of("full", child.slot)[1]) == moved
    for request, token in ((child, 1), (parent, 2)):
        written = [*tokens, token]
        outputs = compute(model, request, written, 7)
        assert outputs is not None
        assert torch.equal(outputs[0], model.forward_reference(written)[6])
    assert [copy.src for copy in memory.last_copies] == []  # the parent writes in place
    memory.check_invariants()


class HybridForkMachine(RuleBasedStateMachine):
    """Random admits, forks, chunks and finishes; every output checked at its finish."""

    def __init__(self) -> None:
        super().__init__()
        self.model = make(num_blocks=40)
        self.memory = self.model.memory
        # slot -> (request, tokens, outputs by position)
        self.live: dict[int, tuple[HybridRequest, list[int], dict[int, torch.Tensor]]] = {}

    @rule(prefix=st.sampled_from([(1, 2, 3, 4, 5, 6), (1, 2, 3, 9), ()]), data=st.data())
    def admit(self, prefix: tuple[int, ...], data: st.DataObject) -> None:
        tail = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=5))
        tokens = [*prefix, *tail]
        request = self.memory.admit(compute_block_hashes(tokens[:-1], B), len(tokens))
        if request is not None:
            self.live[request.slot] = (request, tokens, {})

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        self._fork(data.draw(st.sampled_from(sorted(self.live))))

    def _fork(self, slot: int) -> int | None:
        request, tokens, outputs = self.live[slot]
        child = self.memory.fork(request)
        if child is None:
            return None
        self.live[child.slot] = (child, tokens[: child.num_computed_tokens], dict(outputs))
        return child.slot

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork_and_diverge(self, data: st.DataObject) -> None:
        """Fork, then both write: the case copy-on-write exists for."""
        slot = data.draw(st.sampled_from(sorted(self.live)))
        child = self._fork(slot)
        forks = [] if child is None else [child]
        for target in [*forks, slot, *forks, slot]:
            self.write(data, target)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def write(self, data: st.DataObject, slot: int | None = None) -> None:
        if slot is None:
            slot = data.draw(st.sampled_from(sorted(self.live)))
        request, tokens, outputs = self.live[slot]
        start = request.num_computed_tokens
        while len(tokens) <= start:  # a decode: append the next token first
            tokens.append(data.draw(st.integers(0, VOCAB - 1)))
        room = 8 * B - start
        if room <= 0:
            return
        stop = data.draw(st.integers(start + 1, min(len(tokens) + 3, start + room)))
        tokens += [data.draw(st.integers(0, VOCAB - 1)) for _ in range(stop - len(tokens))]
        computed = compute(self.model, request, tokens, stop)
        if computed is not None:
            outputs.update(enumerate(computed, start))
            self.check_outputs(tokens, outputs)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        slot = data.draw(st.sampled_from(sorted(self.live)))
        request, tokens, outputs = self.live.pop(slot)
        self.memory.finish(request)
        self.check_outputs(tokens, outputs)

    def check_outputs(self, tokens: list[int], outputs: dict[int, torch.Tensor]) -> None:
        if outputs:
            reference = self.model.forward_reference(tokens[: max(outputs) + 1])
            for position, output in outputs.items():
                assert torch.equal(output, reference[position]), f"position {position}"

    @rule()
    def defragment(self) -> None:
        """Compact the pools mid-run: rows, KV data and shared tails move together."""
        self.memory.defragment()

    @invariant()
    def consistent(self) -> None:
        self.memory.check_invariants()


TestHybridForkMachine = HybridForkMachine.TestCase
TestHybridForkMachine.settings = settings(
    max_examples=25,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
