"""The test kit's reference model: who holds which reference, checked against an allocator.

:class:`prefixcache.testing.ReferenceModel` is the model the state machine and
the fault-injection program keep beside the allocator. A model that agreed
with anything would make them vacuous, so these tests show it agreeing with
a real allocator and catching each kind of disagreement.
"""

from __future__ import annotations

import pytest

from prefixcache import KVBlockAllocator
from prefixcache.testing import ReferenceModel

PAUSED_COUNT = 2


def _allocator() -> KVBlockAllocator:
    return KVBlockAllocator(
        total_count=8, block_size_tokens=2, paused_count=PAUSED_COUNT, device="cpu"
    )


def test_the_model_follows_hand_outs_acquires_pauses_and_releases() -> None:
    allocator, model = _allocator(), ReferenceModel()
    ids = allocator.allocate_memory_blocks(3).tolist()
    model.handed_out(ids)
    allocator.register_kv_block_hashes(ids, [11, 12, 13])
    model.block_of_hash.update({11: ids[0], 12: ids[1], 13: ids[2]})
    allocator.acquire_blocks([ids[0]])
    model.active.append(ids[0])
    model.check(allocator)
    taken = model.take(model.active, [1])  # the second reference: ids[1]
    assert taken == [ids[1]]
    assert not model.pause_exceeds(taken, PAUSED_COUNT)
    allocator.pause(taken)
    model.paused.extend(taken)
    model.check(allocator)
    released = model.take(model.active, [0, 2])
    allocator.release_memory_blocks(released)
    model.check(allocator)
    assert model.held() == {ids[1], ids[2]}  # both of ids[0]'s references went


def test_a_block_handed_out_again_loses_its_hash_in_the_model() -> None:
    model = ReferenceModel(block_of_hash={11: 0, 12: 1})
    model.handed_out([0])
    assert model.block_of_hash == {12: 1} and model.active == [0]


def test_a_hand_out_of_a_held_block_is_caught() -> None:
    model = ReferenceModel(active=[3])
    with pytest.raises(AssertionError, match="block 3 handed out while held"):
        model.handed_out([3])
    model = ReferenceModel(paused=[4])
    with pytest.raises(AssertionError, match="block 4 handed out while held"):
        model.handed_out([4])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda model: model.active.append(5), "active reference counts"),
        (lambda model: model.paused.append(5), "paused reference counts"),
    ],
)
def test_a_disagreement_with_the_allocator_is_caught(change, message: str) -> None:
    allocator, model = _allocator(), ReferenceModel()
    model.handed_out(allocator.allocate_memory_blocks(2).tolist())
    model.check(allocator)
    change(model)
    with pytest.raises(AssertionError, match=message):
        model.check(allocator)


def test_the_paused_budget_counts_blocks_holding_any_paused_reference() -> None:
    model = ReferenceModel(active=[0, 0], paused=[1, 2])
    # Block 0 still runs, but its first paused reference takes the budget's third place.
    assert model.pause_exceeds(model.take(model.active, [0]), 2)
    model = ReferenceModel(active=[0], paused=[1])
    assert not model.pause_exceeds(model.take(model.active, [0]), 2)  # fills it exactly
    model = ReferenceModel(active=[0, 3], paused=[1])
    assert model.pause_exceeds(model.take(model.active, [0, 1]), 2)  # two new holders, room 1
    model = ReferenceModel(active=[1, 1], paused=[1, 2])  # full, but no new holder
    assert not model.pause_exceeds(model.take(model.active, [0]), 2)
    assert not ReferenceModel().pause_exceeds([], 0)


def test_a_paused_budget_the_allocator_misreports_is_caught(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The model checks ``get_paused_avail()`` against the blocks holding paused references."""
    allocator, model = _allocator(), ReferenceModel()
    ids = allocator.allocate_memory_blocks(2).tolist()
    model.handed_out(ids)
    allocator.acquire_blocks(ids[:1])
    model.active.append(ids[0])
    allocator.pause(ids[:1])  # one block holds a paused reference and still runs
    model.paused.append(model.active.pop(model.active.index(ids[0])))
    model.check(allocator)
    # What the old count said: room for every block not paused-only.
    monkeypatch.setattr(allocator, "get_paused_avail", lambda: PAUSED_COUNT)
    with pytest.raises(AssertionError, match="paused budget available"):
        model.check(allocator)


def test_the_active_budget_counts_newly_active_blocks() -> None:
    model = ReferenceModel(active=[0, 1], paused=[2])
    assert model.resume_exceeds(model.take(model.paused, [0]), 2)
    model = ReferenceModel(active=[0, 1], paused=[1])
    assert not model.resume_exceeds(model.take(model.paused, [0]), 2)  # already active
    model = ReferenceModel(active=[0], paused=[2])
    assert not model.resume_exceeds(model.take(model.paused, [0]), 2)
    assert not ReferenceModel().resume_exceeds([], 0)


def test_reset_forgets_everything() -> None:
    model = ReferenceModel(active=[1], paused=[2], block_of_hash={11: 1})
    model.reset()
    assert model == ReferenceModel()
