"""BlockTable: slots, rows padded with the dummy block, host truth and device mirror."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from prefixcache import (
    CapacityError,
    ConfigError,
    InvalidArgumentError,
    InvalidBlockIdError,
    InvalidTensorError,
    KVBlockAllocator,
)
from prefixcache.serving.block_table import BlockTable

DUMMY = 15


def make_table(max_requests: int = 3, max_blocks: int = 4, device: str = "cpu") -> BlockTable:
    return BlockTable(max_requests, max_blocks, DUMMY, device)


def snapshot(table: BlockTable) -> tuple[object, ...]:
    """Everything observable on the host, for "a refused call changes nothing" checks."""
    slots = [s for s in range(table.max_requests) if table.is_active(s)]
    return (
        slots,
        [table.blocks_of(s).tolist() for s in slots],
        table.num_free_slots,
        table._rows.tolist(),
    )


def test_add_append_remove_round_trip() -> None:
    table = make_table()
    slot = table.add_request([3, 5])
    table.append_blocks(slot, torch.tensor([7], dtype=torch.int64))
    assert table.num_blocks(slot) == 3
    assert table.blocks_of(slot).tolist() == [3, 5, 7]
    assert table.device_table[slot].tolist() == [3, 5, 7, DUMMY]
    released = table.remove_request(slot)
    assert released.dtype == torch.int32 and released.device.type == "cpu"
    assert released.tolist() == [3, 5, 7]
    assert table.device_table[slot].tolist() == [DUMMY] * 4
    assert not table.is_active(slot)


def test_unused_entries_point_at_the_dummy_block() -> None:
    table = make_table()
    assert (table.device_table == DUMMY).all()
    assert table.device_table.shape == (3, 4) and table.device_table.dtype == torch.int32
    empty = table.add_request([])
    assert table.num_blocks(empty) == 0 and table.blocks_of(empty).tolist() == []
    assert table.device_table[empty].tolist() == [DUMMY] * 4


def test_blocks_of_is_a_fresh_copy() -> None:
    table = make_table()
    slot = table.add_request([1, 2])
    answer = table.blocks_of(slot)
    answer[0] = 9
    assert table.blocks_of(slot).tolist() == [1, 2]
    released = table.remove_request(slot)
    released[1] = 9
    assert table.device_table[slot].tolist() == [DUMMY] * 4


def test_slots_are_recycled_lowest_first() -> None:
    table = make_table()
    slots = [table.add_request([i]) for i in range(3)]
    assert slots == [0, 1, 2]
    table.remove_request(2)
    table.remove_request(0)
    assert table.num_free_slots == 2 and table.num_requests == 1
    assert table.add_request([8]) == 0
    assert table.add_request([9]) == 2
    assert table.blocks_of(0).tolist() == [8]


def test_no_free_slot_is_a_capacity_error_and_changes_nothing() -> None:
    table = make_table(max_requests=1)
    table.add_request([1])
    before = snapshot(table)
    with pytest.raises(CapacityError, match="slots"):
        table.add_request([2])
    assert snapshot(table) == before


@pytest.mark.parametrize("first", [[], [1, 2, 3]])
def test_full_row_is_a_capacity_error_and_changes_nothing(first: list[int]) -> None:
    table = make_table(max_blocks=4)
    slot = table.add_request(first)
    before = snapshot(table)
    with pytest.raises(CapacityError, match="row holds 4"):
        table.append_blocks(slot, [4, 5] if first else [4, 5, 6, 7, 8])
    with pytest.raises(CapacityError):
        table.add_request([0, 1, 2, 3, 4])
    assert snapshot(table) == before


@pytest.mark.parametrize("slot", [-1, 3, 1, True, 1.0, "0"])
def test_unknown_slot_is_an_invalid_argument(slot: object) -> None:
    table = make_table()
    table.add_request([1])
    for call in (table.blocks_of, table.num_blocks, table.remove_request):
        with pytest.raises(InvalidArgumentError, match="slot"):
            call(slot)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="slot"):
        table.append_blocks(slot, [2])  # type: ignore[arg-type]
    assert not table.is_active(slot)  # type: ignore[arg-type]


def test_removed_slot_is_unknown() -> None:
    table = make_table()
    slot = table.add_request([1])
    table.remove_request(slot)
    with pytest.raises(InvalidArgumentError, match="holds no request"):
        table.remove_request(slot)


@pytest.mark.parametrize(
    ("block_ids", "error"),
    [
        ([DUMMY], InvalidBlockIdError),
        ([-1], InvalidBlockIdError),
        ([DUMMY + 1], InvalidBlockIdError),
        ([1.5], InvalidTensorError),
        (torch.zeros(2, 2, dtype=torch.int32), InvalidTensorError),
        (torch.tensor([1.0]), InvalidTensorError),
        (torch.tensor([1], device="meta"), InvalidTensorError),
    ],
)
def test_bad_block_ids_are_refused_before_any_change(block_ids: object, error: type) -> None:
    table = make_table()
    slot = table.add_request([1])
    before = snapshot(table)
    with pytest.raises(error):
        table.add_request(block_ids)  # type: ignore[arg-type]
    with pytest.raises(error):
        table.append_blocks(slot, block_ids)  # type: ignore[arg-type]
    assert snapshot(table) == before


@pytest.mark.parametrize(
    "args", [(0, 4, DUMMY), (2, 0, DUMMY), (2, 4, 0), (2.0, 4, DUMMY), (True, 4, DUMMY)]
)
def test_bad_sizes_are_config_errors(args: tuple[object, ...]) -> None:
    with pytest.raises(ConfigError):
        BlockTable(*args, device="cpu")  # type: ignore[arg-type, misc]


def test_for_allocator_uses_its_dummy_block_and_device() -> None:
    allocator = KVBlockAllocator(total_count=10, block_size_tokens=4, device="meta")
    table = BlockTable.for_allocator(allocator, max_requests=2, max_blocks_per_request=3)
    assert table.dummy_block_id == allocator.dummy_block_id == 9
    assert table.device_table.device.type == "meta"


def test_meta_device_never_reads_the_device_table() -> None:
    # Meta tensors hold no values: a read of the device table would raise.
    table = make_table(device="meta")
    assert table.device_table.device.type == "meta"
    a = table.add_request([1, 2])
    b = table.add_request(np.array([3], dtype=np.int64))
    table.append_blocks(a, [4, 5])
    assert table.blocks_of(a).tolist() == [1, 2, 4, 5]
    assert table.remove_request(b).tolist() == [3]
    assert table.add_request([6]) == b
    assert table.blocks_of(b).tolist() == [6]
    with pytest.raises(CapacityError):
        table.append_blocks(a, [7])


def test_random_actions_match_a_dict_model() -> None:
    rng = random.Random(7)
    table = make_table(max_requests=5, max_blocks=6)
    model: dict[int, list[int]] = {}
    for _ in range(2000):
        action = rng.random()
        if action < 0.35 and len(model) < 5:
            ids = [rng.randrange(DUMMY) for _ in range(rng.randrange(4))]
            model[table.add_request(ids)] = ids
        elif action < 0.7 and model:
            slot = rng.choice(sorted(model))
            ids = [rng.randrange(DUMMY) for _ in range(rng.randrange(3))]
            if len(model[slot]) + len(ids) <= 6:
                table.append_blocks(slot, ids)
                model[slot] += ids
            else:
                with pytest.raises(CapacityError):
                    table.append_blocks(slot, ids)
        elif model:
            slot = rng.choice(sorted(model))
            assert table.remove_request(slot).tolist() == model.pop(slot)
        expected = np.full((5, 6), DUMMY, dtype=np.int32)
        for slot, ids in model.items():
            expected[slot, : len(ids)] = ids
        assert np.array_equal(table.device_table.numpy(), expected)
        assert table.num_requests == len(model)


def test_add_request_at_pads_leading_columns_with_the_dummy() -> None:
    table = make_table(max_requests=2, max_blocks=6)
    slot = table.add_request_at(2, [4, 5])
    assert table.blocks_of(slot).tolist() == [DUMMY, DUMMY, 4, 5]
    assert table.num_blocks(slot) == 4
    table.append_blocks(slot, [6])
    assert table.device_table[slot].tolist() == [DUMMY, DUMMY, 4, 5, 6, DUMMY]
    assert table.remove_request(slot).tolist() == [DUMMY, DUMMY, 4, 5, 6]
    with pytest.raises(CapacityError):
        table.add_request_at(5, [1, 2])
    with pytest.raises(InvalidArgumentError):
        table.add_request_at(-1, [1])
    assert table.num_requests == 0  # the refusals took no slot


def test_clear_blocks_and_set_block_rewrite_one_row() -> None:
    table = make_table(max_requests=2, max_blocks=6)
    other = table.add_request([9, 8])
    slot = table.add_request([1, 2, 3, 4])
    assert table.clear_blocks(slot, 0, 2).tolist() == [1, 2]
    assert table.blocks_of(slot).tolist() == [DUMMY, DUMMY, 3, 4]
    assert table.set_block(slot, 3, 7) == 4
    assert table.device_table[slot].tolist() == [DUMMY, DUMMY, 3, 7, DUMMY, DUMMY]
    assert table.blocks_of(other).tolist() == [9, 8]
    for bad in (
        lambda: table.clear_blocks(slot, 2, 5),  # past the row
        lambda: table.set_block(slot, 4, 1),  # not a held column
        lambda: table.set_block(slot, 0, DUMMY),  # the dummy is not a usable block
    ):
        with pytest.raises(InvalidArgumentError):
            bad()
    assert table.blocks_of(slot).tolist() == [DUMMY, DUMMY, 3, 7]
