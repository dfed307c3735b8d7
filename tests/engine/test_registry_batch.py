"""HashRegistry.deregister_leaves (batch deregistration for evictions) and match at a gap."""

from __future__ import annotations

import copy
import random

import numpy as np
import pytest

from prefixcache.engine import registry as registry_module
from prefixcache.engine.registry import NONE, ROOT, HashRegistry
from prefixcache.errors import InvariantError


def _state(registry: HashRegistry) -> dict[str, object]:
    """Everything a deregistration may change, including the raw child-list links."""
    num_blocks = len(registry.is_registered)
    return {
        "items": sorted(registry.items()),
        "hash_of": [registry.hash_of(block_id) for block_id in range(num_blocks)],
        "is_registered": registry.is_registered.tolist(),
        "num_children": registry.num_children.tolist(),
        "parent_of": registry.parent_of.tolist(),
        "depth_of": registry.depth_of.tolist(),
        "first_child": registry._first_child.tolist(),
        "next_sibling": registry._next_sibling.tolist(),
        "prev_sibling": registry._prev_sibling.tolist(),
    }


def _random_forest(rng: random.Random, num_blocks: int) -> HashRegistry:
    """A registry holding a random forest: chains from register_chain and single blocks."""
    registry = HashRegistry(num_blocks)
    unused = list(range(num_blocks))
    rng.shuffle(unused)
    registered: list[int] = []
    next_hash = 1000
    while unused:
        parent_id = rng.choice(registered) if registered and rng.random() < 0.8 else ROOT
        if rng.random() < 0.5:
            length = min(len(unused), rng.randint(1, 5))
            chain = [unused.pop() for _ in range(length)]
            hashes = list(range(next_hash, next_hash + length))
            registry.register_chain(np.array(chain, dtype=np.intp), chain, hashes, parent_id)
            registered.extend(chain)
            next_hash += length
        else:
            block_id = unused.pop()
            registry.register(block_id, next_hash, parent_id)
            registered.append(block_id)
            next_hash += 1
    return registry


def _eviction_order(rng: random.Random, registry: HashRegistry, count: int) -> list[int]:
    """``count`` blocks, each a leaf once the ones before it are removed."""
    children_left = registry.num_children.astype(int).tolist()
    leaves = [b for b in np.flatnonzero(registry.is_registered).tolist() if not children_left[b]]
    order: list[int] = []
    while leaves and len(order) < count:
        block_id = leaves.pop(rng.randrange(len(leaves)))
        order.append(block_id)
        parent_id = int(registry.parent_of[block_id])
        if parent_id != ROOT:
            children_left[parent_id] -= 1
            if not children_left[parent_id]:
                leaves.append(parent_id)
    return order


@pytest.mark.parametrize("one_by_one_up_to", [0, registry_module._DEREGISTER_ONE_BY_ONE_UP_TO])
@pytest.mark.parametrize("seed", range(40))
def test_batch_matches_one_at_a_time(
    seed: int, one_by_one_up_to: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both paths of deregister_leaves: vectorised, and one by one for small plans."""
    monkeypatch.setattr(registry_module, "_DEREGISTER_ONE_BY_ONE_UP_TO", one_by_one_up_to)
    rng = random.Random(seed)
    registry = _random_forest(rng, rng.randint(2, 60))
    order = _eviction_order(rng, registry, rng.randint(1, 60))
    expected_hashes = [registry.hash_of(block_id) for block_id in order]
    one_by_one = copy.deepcopy(registry)
    for block_id in order:
        one_by_one.deregister_leaf(block_id)

    assert registry.deregister_leaves(order) == expected_hashes
    assert _state(registry) == _state(one_by_one)
    assert registry.check() == []


def test_removing_a_middle_sibling_keeps_the_parent_list_linked() -> None:
    registry = HashRegistry(8)
    registry.register(0, 100, ROOT)
    for block_id in (1, 2, 3):
        registry.register(block_id, 100 + block_id, 0)
    registry.register(4, 104, 2)  # a grandchild under the middle sibling

    assert registry.deregister_leaves([4, 2]) == [104, 102]

    assert sorted(registry.children_of(0)) == [1, 3]
    assert registry.num_children[0] == 2
    assert registry.block_of(102) is None and registry.block_of(104) is None
    assert registry.parent_of[2] == ROOT and registry._first_child[2] == NONE
    assert registry.check() == []


def test_removing_a_whole_tree_empties_the_registry() -> None:
    registry = HashRegistry(6)
    chain = [3, 1, 4, 0]
    registry.register_chain(np.array(chain, dtype=np.intp), chain, [11, 12, 13, 14], ROOT)
    registry.register(2, 15, 1)

    assert registry.deregister_leaves([2, 0, 4, 1, 3]) == [15, 14, 13, 12, 11]

    assert len(registry) == 0
    assert not registry.is_registered.any()
    assert not registry.num_children.any()
    assert (registry.parent_of == ROOT).all()
    assert registry.check() == []


def test_an_empty_batch_changes_nothing() -> None:
    registry = _random_forest(random.Random(7), 20)
    before = _state(registry)

    assert registry.deregister_leaves([]) == []
    assert _state(registry) == before


def test_match_cuts_at_a_gap_that_the_binary_search_skips() -> None:
    # Only a hash collision makes a chain's registered hashes non-prefix-closed;
    # registering 30 under the block of 10 fakes one.
    registry = HashRegistry(4)
    registry.register(0, 10, ROOT)
    registry.register(2, 30, 0)

    assert registry.match([10, 20, 30]) == [0]
    assert registry.match([10, 30]) == [0, 2]
    assert registry.match([20, 30]) == []


@pytest.mark.parametrize("block_ids", [[1, 1], [1, 3], [3]])
def test_unregistered_or_repeated_blocks_are_refused_before_any_change(
    block_ids: list[int],
) -> None:
    registry = HashRegistry(4)
    registry.register(0, 10, ROOT)
    registry.register(1, 11, 0)
    before = _state(registry)

    with pytest.raises(InvariantError):
        registry.deregister_leaves(block_ids)
    assert _state(registry) == before
