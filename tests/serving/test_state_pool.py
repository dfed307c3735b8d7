"""StatePool: slots of recurrent and conv state, handed out zeroed, copied, freed once."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    precondition,
    rule,
)

from prefixcache.errors import (
    CapacityError,
    ConfigError,
    InvalidArgumentError,
    InvalidTensorError,
    InvariantError,
    PrefixCacheError,
    ReferenceCountError,
)
from prefixcache.serving.state_pool import DUMMY_SLOT, StatePool, StateShape

SHAPE = StateShape(num_layers=2, num_heads=2, k_dim=3, v_dim=4, conv_dim=5, conv_kernel=4)


def make_pool(num_slots: int = 4, dtype: torch.dtype = torch.bfloat16) -> StatePool:
    return StatePool(SHAPE, num_slots, dtype=dtype, device="cpu")


def pool_digest(pool: StatePool) -> tuple:
    """Everything observable of a pool, for "a refused call changes nothing"."""
    return (
        pool.num_free,
        [pool.is_allocated(slot) for slot in range(pool.num_slots)],
        pool.recurrent_states.clone(),
        pool.conv_states.clone(),
    )


def assert_same(before: tuple, after: tuple) -> None:
    assert before[:2] == after[:2]
    assert torch.equal(before[2], after[2]) and torch.equal(before[3], after[3])


def test_tensors_have_the_documented_shapes_dtypes_and_size() -> None:
    pool = make_pool(num_slots=5)
    assert pool.recurrent_states.shape == (2, 5, 2, 3, 4)
    assert pool.recurrent_states.dtype == torch.float32
    assert pool.conv_states.shape == (2, 5, 5, 3)
    assert pool.conv_states.dtype == torch.bfloat16
    # Per slot: 2 layers * (2*3*4 float32 + 5*3 bfloat16) = 2 * (96 + 30) bytes.
    assert pool.bytes_per_slot() == 252
    assert pool.memory_bytes == 5 * 252
    real = pool.recurrent_states.nbytes + pool.conv_states.nbytes
    assert pool.memory_bytes == real


def test_slots_are_handed_out_lowest_first_never_the_dummy_and_run_out() -> None:
    pool = make_pool(num_slots=4)
    assert [pool.allocate() for _ in range(3)] == [1, 2, 3]
    assert pool.num_free == 0 and pool.num_allocated == 3
    with pytest.raises(CapacityError):
        pool.allocate()
    assert not pool.is_allocated(DUMMY_SLOT)


def test_a_slot_is_zeroed_when_handed_out_again() -> None:
    pool = make_pool()
    slot = pool.allocate()
    pool.recurrent_states[:, slot] = 7.0
    pool.conv_states[:, slot] = 3.0
    pool.free(slot)
    assert pool.allocate() == slot
    recurrent, conv = pool.read_states(slot)
    assert not recurrent.any() and not conv.any()


def test_freeing_is_o1_and_lifo() -> None:
    pool = make_pool(num_slots=5)
    a, b, c = pool.allocate(), pool.allocate(), pool.allocate()
    pool.free(b)
    pool.free(a)
    assert pool.allocate() == a and pool.allocate() == b
    assert pool.is_allocated(c)


def test_copy_states_copies_every_layer_and_only_the_target() -> None:
    pool = make_pool(dtype=torch.float32)
    a, b, c = pool.allocate(), pool.allocate(), pool.allocate()
    pool.recurrent_states[:, a] = torch.arange(48, dtype=torch.float32).view(2, 2, 3, 4)
    pool.conv_states[:, a] = 2.5
    pool.copy_states(a, b)
    assert torch.equal(pool.recurrent_states[:, b], pool.recurrent_states[:, a])
    assert torch.equal(pool.conv_states[:, b], pool.conv_states[:, a])
    assert not pool.recurrent_states[:, c].any()


def test_write_and_read_states_round_trip_as_fresh_tensors() -> None:
    pool = make_pool(dtype=torch.float32)
    slot = pool.allocate()
    recurrent = torch.rand(2, 2, 3, 4)
    conv = torch.rand(2, 5, 3)
    pool.write_states(slot, recurrent, conv)
    got_recurrent, got_conv = pool.read_states(slot)
    assert torch.equal(got_recurrent, recurrent) and torch.equal(got_conv, conv)
    got_recurrent += 1  # a copy: the pool is untouched
    assert torch.equal(pool.read_states(slot)[0], recurrent)


def test_tensor_addresses_never_change() -> None:
    pool = make_pool()
    addresses = (pool.recurrent_states.data_ptr(), pool.conv_states.data_ptr())
    slots = [pool.allocate() for _ in range(3)]
    pool.copy_states(slots[0], slots[1])
    for slot in slots:
        pool.free(slot)
    assert (pool.recurrent_states.data_ptr(), pool.conv_states.data_ptr()) == addresses


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda pool, held: pool.free(0), InvalidArgumentError),
        (lambda pool, held: pool.free(4), InvalidArgumentError),
        (lambda pool, held: pool.free(-1), InvalidArgumentError),
        (lambda pool, held: pool.free(True), InvalidArgumentError),
        (lambda pool, held: pool.free(1.0), InvalidArgumentError),
        (lambda pool, held: pool.free(2), ReferenceCountError),
        (lambda pool, held: pool.copy_states(held, held), InvalidArgumentError),
        (lambda pool, held: pool.copy_states(held, 2), ReferenceCountError),
        (lambda pool, held: pool.copy_states(0, held), InvalidArgumentError),
        (lambda pool, held: pool.read_states(3), ReferenceCountError),
        (
            lambda pool, held: pool.write_states(held, torch.zeros(2, 2, 3), torch.zeros(2, 5, 3)),
            InvalidTensorError,
        ),
        (
            lambda pool, held: pool.write_states(
                held, torch.zeros(2, 2, 3, 4, dtype=torch.float64), torch.zeros(2, 5, 3)
            ),
            InvalidTensorError,
        ),
        (lambda pool, held: pool.write_states(held, "x", torch.zeros(2, 5, 3)), InvalidTensorError),
    ],
)
def test_bad_input_raises_the_library_error_and_changes_nothing(call, error) -> None:
    pool = make_pool(dtype=torch.float32)
    held = pool.allocate()
    pool.recurrent_states[:, held] = 1.0
    before = pool_digest(pool)
    with pytest.raises(error) as info:
        call(pool, held)
    assert isinstance(info.value, PrefixCacheError)
    assert_same(before, pool_digest(pool))
    pool.check_invariants()


@pytest.mark.parametrize(
    "build",
    [
        lambda: StatePool(SHAPE, 1, device="cpu"),
        lambda: StatePool(SHAPE, True, device="cpu"),
        lambda: StatePool("shape", 4, device="cpu"),  # type: ignore[arg-type]
        lambda: StatePool(SHAPE, 4, dtype=torch.int32, device="cpu"),
        lambda: StateShape(0, 1, 1, 1, 1, 1),
        lambda: StateShape(1, 1, 1, 1, 1, conv_kernel=0),
    ],
)
def test_bad_configuration_is_a_config_error(build) -> None:
    with pytest.raises(ConfigError):
        build()


def test_is_allocated_answers_false_for_anything_not_held() -> None:
    pool = make_pool()
    assert not any(pool.is_allocated(value) for value in (0, 1, 99, -1, True, "1", None))


def test_check_invariants_finds_a_slot_both_free_and_held() -> None:
    pool = make_pool()
    slot = pool.allocate()
    pool._free.append(slot)  # corrupt on purpose: the check must see it
    with pytest.raises(InvariantError):
        pool.check_invariants()


class StatePoolMachine(RuleBasedStateMachine):
    """The pool against a model: which slots are held and what tag each holds.

    Each held slot's state is filled with a tag; copies move tags. After
    every step the held set, the free count and every held slot's contents
    must match the model, and fresh slots must read zero.
    """

    slots = Bundle("slots")

    def __init__(self) -> None:
        super().__init__()
        self.pool = make_pool(num_slots=6, dtype=torch.float32)
        self.tags: dict[int, float] = {}
        self.next_tag = 1.0

    @precondition(lambda self: self.pool.num_free == 0)
    @rule()
    def allocate_when_full(self) -> None:
        with pytest.raises(CapacityError):
            self.pool.allocate()

    @precondition(lambda self: self.pool.num_free > 0)
    @rule(target=slots)
    def allocate(self) -> int:
        slot = self.pool.allocate()
        assert slot not in self.tags and slot != DUMMY_SLOT
        assert not self.pool.recurrent_states[:, slot].any()
        assert not self.pool.conv_states[:, slot].any()
        self.tags[slot] = 0.0
        return slot

    @rule(slot=slots)
    def fill(self, slot: int) -> None:
        if slot not in self.tags:
            return
        self.pool.recurrent_states[:, slot] = self.next_tag
        self.pool.conv_states[:, slot] = self.next_tag
        self.tags[slot] = self.next_tag
        self.next_tag += 1.0

    @rule(src=slots, dst=slots)
    def copy(self, src: int, dst: int) -> None:
        if src in self.tags and dst in self.tags and src != dst:
            self.pool.copy_states(src, dst)
            self.tags[dst] = self.tags[src]
        else:
            with pytest.raises((InvalidArgumentError, ReferenceCountError)):
                self.pool.copy_states(src, dst)

    @rule(slot=consumes(slots))
    def free(self, slot: int) -> None:
        if slot in self.tags:
            self.pool.free(slot)
            del self.tags[slot]
        else:  # freed already through another handle
            with pytest.raises(ReferenceCountError):
                self.pool.free(slot)

    @rule(slot=st.integers(-2, 8))
    def free_anything(self, slot: int) -> None:
        if slot in self.tags:
            return
        with pytest.raises((InvalidArgumentError, ReferenceCountError)):
            self.pool.free(slot)

    @invariant()
    def matches_the_model(self) -> None:
        self.pool.check_invariants()
        assert self.pool.num_allocated == len(self.tags)
        for slot in range(self.pool.num_slots):
            assert self.pool.is_allocated(slot) == (slot in self.tags)
        for slot, tag in self.tags.items():
            assert bool((self.pool.recurrent_states[:, slot] == tag).all())
            assert bool((self.pool.conv_states[:, slot] == tag).all())


StatePoolMachine.TestCase.settings = settings(
    max_examples=40,
    stateful_step_count=30,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
test_state_pool_machine = StatePoolMachine.TestCase


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda pool: pool._free.append(pool._free[-1]),  # a slot free twice
        lambda pool: pool._free.append(0),  # the dummy on the free stack
        lambda pool: pool._held.__setitem__(0, True),  # the dummy held
    ],
)
def test_check_invariants_names_each_kind_of_corruption(corrupt) -> None:
    pool = make_pool()
    pool.allocate()
    corrupt(pool)
    with pytest.raises(InvariantError):
        pool.check_invariants()


def test_repr_names_the_sizes() -> None:
    assert "num_slots=4, held=0" in repr(make_pool())
