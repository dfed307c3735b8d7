"""StateCheckpoints: a bounded set of states keyed by chain hash, evicted under a policy."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from prefixcache.errors import (
    ConfigError,
    InvalidArgumentError,
    InvariantError,
    PrefixCacheError,
    ReferenceCountError,
)
from prefixcache.serving.checkpoints import StateCheckpoints
from prefixcache.serving.state_pool import StatePool, StateShape

SHAPE = StateShape(num_layers=2, num_heads=1, k_dim=2, v_dim=2, conv_dim=3, conv_kernel=3)


def make(capacity: int = 3, num_requests: int = 2, **kwargs) -> tuple[StateCheckpoints, list[int]]:
    """A checkpoint set over a fresh pool, and ``num_requests`` request slots tagged 1, 2, ..."""
    pool = StatePool(SHAPE, 1 + capacity + num_requests, dtype=torch.float32, device="cpu")
    checkpoints = StateCheckpoints(pool, capacity, **kwargs)
    slots = []
    for tag in range(1, num_requests + 1):
        slot = pool.allocate()
        pool.recurrent_states[:, slot] = float(tag)
        pool.conv_states[:, slot] = float(tag)
        slots.append(slot)
    return checkpoints, slots


def tag_of(pool: StatePool, slot: int) -> float:
    value = float(pool.recurrent_states[0, slot].flatten()[0])
    assert bool((pool.recurrent_states[:, slot] == value).all())
    assert bool((pool.conv_states[:, slot] == value).all())
    return value


def test_capacity_slots_are_reserved_at_construction() -> None:
    checkpoints, _ = make(capacity=3, num_requests=2)
    assert checkpoints.pool.num_free == 0  # 3 reserved + 2 requests of 5 usable
    with pytest.raises(ConfigError):
        StateCheckpoints(checkpoints.pool, 1)  # nothing left to reserve


def test_save_copies_the_state_and_lookup_finds_it() -> None:
    checkpoints, (a, b) = make()
    slot = checkpoints.save(1001, a, depth=3)
    assert slot is not None and slot not in (a, b)
    assert checkpoints.lookup(1001) == slot and 1001 in checkpoints and len(checkpoints) == 1
    assert tag_of(checkpoints.pool, slot) == 1.0
    assert checkpoints.lookup(1002) is None


def test_saving_a_held_hash_again_only_touches_it() -> None:
    checkpoints, (a, b) = make()
    slot = checkpoints.save(7, a)
    assert checkpoints.save(7, b) == slot
    assert tag_of(checkpoints.pool, slot) == 1.0  # equal hashes, equal states: no copy
    assert checkpoints.stats().num_refreshed == 1 and checkpoints.stats().num_saved == 1


def test_restore_copies_into_the_request_slot() -> None:
    checkpoints, (a, b) = make()
    checkpoints.save(5, a)
    assert checkpoints.restore(5, b) == checkpoints.lookup(5)
    assert tag_of(checkpoints.pool, b) == 1.0
    assert checkpoints.stats().num_restored == 1


def test_lru_evicts_the_least_recently_used_checkpoint() -> None:
    checkpoints, (a, b) = make(capacity=2)
    checkpoints.save(1, a)
    checkpoints.save(2, b)
    checkpoints.restore(1, b)  # 1 is now the most recently used
    checkpoints.save(3, a)
    assert 2 not in checkpoints and 1 in checkpoints and 3 in checkpoints
    assert checkpoints.stats().num_evicted == 1


def test_fifo_evicts_the_oldest_checkpoint_whatever_its_use() -> None:
    checkpoints, (a, b) = make(capacity=2, policy="fifo")
    checkpoints.save(1, a)
    checkpoints.save(2, b)
    checkpoints.restore(1, b)
    checkpoints.save(3, a)
    assert 1 not in checkpoints and 2 in checkpoints


def test_capacity_zero_keeps_nothing() -> None:
    checkpoints, (a, _) = make(capacity=0)
    assert checkpoints.save(1, a) is None and len(checkpoints) == 0


def test_discard_and_prune() -> None:
    checkpoints, (a, b) = make(capacity=3)
    for block_hash in (10, 11, 12):
        checkpoints.save(block_hash, a)
    assert checkpoints.discard(10) and not checkpoints.discard(10)
    assert checkpoints.prune(lambda block_hash: block_hash != 11) == 1
    assert set(checkpoints._slot_of) == {12}
    assert checkpoints.stats().num_dropped == 2
    checkpoints.save(13, b)  # the freed slots are reused
    checkpoints.save(14, b)
    assert len(checkpoints) == 3 and checkpoints.stats().num_evicted == 0
    checkpoints.check_invariants()


def test_boundaries_are_every_kth_block_and_the_prompt_end() -> None:
    checkpoints, _ = make(every=4)
    assert checkpoints.boundaries(10) == [4, 8, 10]
    assert checkpoints.boundaries(8) == [4, 8]
    assert checkpoints.boundaries(3) == [3]
    assert checkpoints.boundaries(0) == []
    assert checkpoints.is_boundary(8) and checkpoints.is_boundary(10, 10)
    assert not checkpoints.is_boundary(9, 10) and not checkpoints.is_boundary(0, 0)


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda c, a: c.save(0, a), InvalidArgumentError),
        (lambda c, a: c.save(-1, a), InvalidArgumentError),
        (lambda c, a: c.save(True, a), InvalidArgumentError),
        (lambda c, a: c.save(1 << 70, a), InvalidArgumentError),
        (lambda c, a: c.save(5, a, depth=-1), InvalidArgumentError),
        (lambda c, a: c.save(5, 0), InvalidArgumentError),
        (lambda c, a: c.save(5, 99), InvalidArgumentError),
        (lambda c, a: c.save(5, c.lookup(1)), InvalidArgumentError),  # a checkpoint slot
        (lambda c, a: c.restore(5, a), InvalidArgumentError),  # no such checkpoint
        (lambda c, a: c.restore(1, c.lookup(1)), InvalidArgumentError),
        (lambda c, a: c.restore(1, [a]), InvalidArgumentError),
        (lambda c, a: c.lookup("1"), InvalidArgumentError),
        (lambda c, a: c.is_boundary(-1), InvalidArgumentError),
        (lambda c, a: c.boundaries(1.5), InvalidArgumentError),
    ],
)
def test_bad_input_raises_and_changes_nothing(call, error) -> None:
    checkpoints, (a, b) = make(capacity=1)
    checkpoints.save(1, a)
    checkpoints.pool.free(b)
    before = (checkpoints.stats(), dict(checkpoints._slot_of), checkpoints.pool.num_free)
    with pytest.raises(error) as info:
        call(checkpoints, a)
    assert isinstance(info.value, PrefixCacheError)
    assert (checkpoints.stats(), dict(checkpoints._slot_of), checkpoints.pool.num_free) == before
    checkpoints.check_invariants()


def test_a_freed_request_slot_is_refused_as_a_source() -> None:
    checkpoints, (_, b) = make()
    checkpoints.pool.free(b)
    with pytest.raises(ReferenceCountError):
        checkpoints.save(3, b)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"capacity": -1},
        {"capacity": True},
        {"every": 0},
        {"policy": "nope"},
        {"policy": "ref_zero"},
    ],
)
def test_bad_configuration_is_a_config_error(kwargs) -> None:
    pool = StatePool(SHAPE, 4, dtype=torch.float32, device="cpu")
    options = {"capacity": 1} | kwargs
    with pytest.raises(ConfigError):
        StateCheckpoints(pool, **options)


def test_check_invariants_sees_a_policy_out_of_step() -> None:
    checkpoints, (a, _) = make()
    slot = checkpoints.save(1, a)
    checkpoints._policy.discard(slot)  # corrupt on purpose
    with pytest.raises(InvariantError):
        checkpoints.check_invariants()


class CheckpointMachine(RuleBasedStateMachine):
    """The LRU checkpoint set against a model of hash -> (tag, last use).

    Request slots hold states tagged by the hash they stand for. The model
    evicts the least recently used hash when full, as LRU must (a clock per
    save, refresh and restore). After every step: the same hashes held,
    each checkpoint slot holding its hash's state, capacity never exceeded.
    """

    @initialize(capacity=st.integers(0, 4))
    def setup(self, capacity: int) -> None:
        self.capacity = capacity
        self.pool = StatePool(SHAPE, 1 + capacity + 2, dtype=torch.float32, device="cpu")
        self.checkpoints = StateCheckpoints(self.pool, capacity, policy="lru")
        self.src, self.dst = self.pool.allocate(), self.pool.allocate()
        self.model: dict[int, list[float]] = {}  # hash -> [tag, last use]
        self.clock = 0

    @rule(block_hash=st.integers(1, 8))
    def save(self, block_hash: int) -> None:
        tag = float(block_hash)
        self.pool.recurrent_states[:, self.src] = tag
        self.pool.conv_states[:, self.src] = tag
        slot = self.checkpoints.save(block_hash, self.src)
        if not self.capacity:
            assert slot is None
            return
        self.clock += 1
        if block_hash not in self.model and len(self.model) == self.capacity:
            victim = min(self.model, key=lambda h: self.model[h][1])
            del self.model[victim]
        self.model[block_hash] = [tag, self.clock]

    @rule(block_hash=st.integers(1, 8))
    def restore(self, block_hash: int) -> None:
        if block_hash not in self.model:
            with pytest.raises(InvalidArgumentError):
                self.checkpoints.restore(block_hash, self.dst)
            return
        self.checkpoints.restore(block_hash, self.dst)
        self.clock += 1
        self.model[block_hash][1] = self.clock
        assert tag_of(self.pool, self.dst) == self.model[block_hash][0]

    @rule(block_hash=st.integers(1, 8))
    def discard(self, block_hash: int) -> None:
        assert self.checkpoints.discard(block_hash) == (block_hash in self.model)
        self.model.pop(block_hash, None)

    @invariant()
    def matches_the_model(self) -> None:
        self.checkpoints.check_invariants()
        self.pool.check_invariants()
        assert set(self.checkpoints._slot_of) == set(self.model)
        assert len(self.checkpoints) <= self.capacity
        for block_hash, (tag, _) in self.model.items():
            assert tag_of(self.pool, self.checkpoints.lookup(block_hash)) == tag


CheckpointMachine.TestCase.settings = settings(
    max_examples=40,
    stateful_step_count=30,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
test_checkpoint_machine = CheckpointMachine.TestCase


def corrupt_maps(checkpoints: StateCheckpoints) -> None:
    block_hash, slot = next(iter(checkpoints._slot_of.items()))
    checkpoints._slot_of[block_hash] = slot + 100


def corrupt_reverse_map(checkpoints: StateCheckpoints) -> None:
    checkpoints._hash_of[checkpoints._free_slots[0]] = 999


def corrupt_free_slots(checkpoints: StateCheckpoints) -> None:
    checkpoints._free_slots.append(checkpoints._free_slots[0])


def free_a_reserved_slot(checkpoints: StateCheckpoints) -> None:
    checkpoints.pool.free(checkpoints._free_slots[0])


@pytest.mark.parametrize(
    "corrupt", [corrupt_maps, corrupt_reverse_map, corrupt_free_slots, free_a_reserved_slot]
)
def test_check_invariants_names_each_kind_of_corruption(corrupt) -> None:
    checkpoints, (a, _) = make(capacity=3)
    checkpoints.save(1, a)
    corrupt(checkpoints)
    with pytest.raises(InvariantError):
        checkpoints.check_invariants()


def test_a_policy_that_returns_no_victim_is_an_invariant_error(monkeypatch) -> None:
    checkpoints, (a, _) = make(capacity=1)
    checkpoints.save(1, a)
    monkeypatch.setattr(checkpoints._policy, "evict", lambda num_blocks: [])
    with pytest.raises(InvariantError):
        checkpoints.save(2, a)


def test_the_pool_must_be_a_state_pool() -> None:
    with pytest.raises(ConfigError):
        StateCheckpoints(object(), 1)  # type: ignore[arg-type]


def test_repr_names_capacity_and_policy() -> None:
    checkpoints, _ = make(capacity=2)
    assert "capacity=2" in repr(checkpoints) and "LRU" in repr(checkpoints)
