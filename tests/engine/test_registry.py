"""HashRegistry on its own: prefix match, chain depths, dtypes, check(), read-only views.

The allocator's tests query the registry with short hash lists, so the
binary search in :meth:`HashRegistry.match` is driven here through long
queries with unmatched tails, and the chain depth that
:meth:`HashRegistry.register` records for the policies is read back (found by
mutation testing, ``tests/MUTATION.md``).
"""

from __future__ import annotations

import copy
import re

import numpy as np
import pytest

from prefixcache.engine.registry import NONE, ROOT, HashRegistry
from prefixcache.errors import InvariantError

NUM_BLOCKS = 40


def _chain(registry: HashRegistry, length: int, first_block: int = 0) -> list[int]:
    """Register blocks ``first_block ..`` as one chain with hashes ``1000 + block``."""
    parent = ROOT
    for block_id in range(first_block, first_block + length):
        registry.register(block_id, 1000 + block_id, parent)
        parent = block_id
    return [1000 + block_id for block_id in range(first_block, first_block + length)]


@pytest.mark.parametrize("registered", range(0, 13))
@pytest.mark.parametrize("unmatched", [0, 1, 2, 3, 7])
def test_match_returns_the_registered_prefix(registered: int, unmatched: int) -> None:
    registry = HashRegistry(NUM_BLOCKS)
    hashes = _chain(registry, registered)
    query = hashes + [5000 + i for i in range(unmatched)]
    assert registry.match(query) == list(range(registered))


def test_match_of_nothing_is_empty() -> None:
    registry = HashRegistry(NUM_BLOCKS)
    _chain(registry, 3)
    assert registry.match([]) == []
    assert registry.match([4242]) == []


def test_match_stops_at_a_gap_left_by_a_collision() -> None:
    # Hashes registered out of prefix order (as a collision can leave them):
    # the match must still end at the first hash with no block.
    registry = HashRegistry(NUM_BLOCKS)
    registry.register(0, 10, ROOT)
    registry.register(1, 30, ROOT)
    registry.register(2, 40, 1)
    assert registry.match([10, 20, 30, 40]) == [0]
    assert registry.match([10, 20, 30]) == [0]
    assert registry.match([20, 30, 40]) == []


def test_register_records_the_depth_in_the_chain() -> None:
    registry = HashRegistry(NUM_BLOCKS)
    _chain(registry, 4)
    registry.register(10, 2010, ROOT)
    registry.register(11, 2011, 1)  # a branch off the first chain's second block
    assert [int(registry.depth_of[block_id]) for block_id in (0, 1, 2, 3)] == [0, 1, 2, 3]
    assert int(registry.depth_of[10]) == 0
    assert int(registry.depth_of[11]) == 2
    assert registry.check() == []


def test_register_chain_and_register_agree_on_depths() -> None:
    one_by_one, batched = HashRegistry(NUM_BLOCKS), HashRegistry(NUM_BLOCKS)
    _chain(one_by_one, 2)
    _chain(batched, 2)
    one_by_one.register(5, 3005, 1)
    one_by_one.register(6, 3006, 5)
    batched.register_chain(np.array([5, 6]), [5, 6], [3005, 3006], 1)
    assert one_by_one.depth_of.tolist() == batched.depth_of.tolist()
    assert int(batched.depth_of[6]) == 3


def test_fields_have_their_documented_dtypes() -> None:
    # int32 links and counts keep the registry near 25 bytes a block
    # (benchmarks/bench_core.py --memory); numpy's default int64 or float64
    # would double that.
    registry = HashRegistry(NUM_BLOCKS)
    fields = {
        "parent_of": registry.parent_of,
        "depth_of": registry.depth_of,
        "num_children": registry.num_children,
        "_first_child": registry._first_child,
        "_next_sibling": registry._next_sibling,
        "_prev_sibling": registry._prev_sibling,
    }
    assert {name: array.dtype for name, array in fields.items()} == dict.fromkeys(fields, np.int32)
    assert registry.is_registered.dtype == np.bool_


# --------------------------------------------------------------------------
# check(): each kind of corruption is named (white-box: check() exists to find
# internal corruption, which no public call can produce)
# --------------------------------------------------------------------------


def _forest() -> HashRegistry:
    """Chain 0 -> 1 -> 2, block 3 a second child of 0, block 4 a lone root."""
    registry = HashRegistry(NUM_BLOCKS)
    _chain(registry, 3)
    registry.register(3, 1003, 0)
    registry.register(4, 1004, ROOT)
    assert registry.check() == []
    return registry


def test_check_names_a_registered_block_without_a_hash() -> None:
    registry = _forest()
    registry._is_registered[9] = True
    problems = registry.check()
    assert "block 9 flagged registered without a hash" in problems
    assert "6 blocks flagged registered, 5 hashes" in problems


def test_check_names_a_hash_whose_block_carries_another() -> None:
    registry = _forest()
    registry._hash_of_block[4] = 2004  # block 4 still listed under hash 1004
    assert "hash 1004 maps to block 4, which carries another" in registry.check()


def test_check_names_a_block_under_an_unregistered_parent() -> None:
    registry = _forest()
    registry._is_registered[0] = False  # the root of chain 0 -> 1 -> 2 drops out
    assert "block 1 is registered under unregistered parent 0" in registry.check()


def test_check_names_the_block_with_a_wrong_child_count() -> None:
    registry = _forest()
    registry._num_children[1] += 1
    assert "block 1 counts 2 children, 1 registered" in registry.check()


def test_check_names_the_first_of_several_wrong_child_counts() -> None:
    registry = _forest()
    registry._num_children[2] = 3
    registry._num_children[4] = 1
    problems = registry.check()
    assert "block 2 counts 3 children, 0 registered" in problems
    assert not any(problem.startswith("block 4 counts") for problem in problems)


def test_check_names_a_stale_child_link_of_a_childless_block() -> None:
    registry = _forest()
    registry._first_child[4] = 2  # block 4 has no registered child
    problems = registry.check()
    assert "block 2 is listed as a child of 4" in problems
    assert "block 4 lists 1 children, 0 registered" in problems


def test_check_names_a_lost_head_of_a_single_child_list() -> None:
    registry = _forest()
    registry._first_child[1] = NONE  # block 2 is 1's only child
    assert registry.check() == ["block 1 lists 0 children, 1 registered"]


def test_check_names_an_extra_block_at_the_end_of_a_child_list() -> None:
    registry = _forest()
    registry._next_sibling[2] = 7  # unregistered block 7 after 1's only child
    registry._prev_sibling[7] = 2
    problems = registry.check()
    assert "block 7 is listed as a child of 1" in problems
    assert "block 1 lists 2 children, 1 registered" in problems


def test_check_names_a_registered_block_in_another_parents_list() -> None:
    registry = _forest()
    registry._next_sibling[2] = 4  # block 4 is registered, but a root
    registry._prev_sibling[4] = 2
    assert "block 4 is listed as a child of 1" in registry.check()


def test_check_names_a_broken_back_link() -> None:
    registry = _forest()
    second = registry.children_of(0)[1]
    registry._prev_sibling[second] = NONE
    assert registry.check() == [f"block {second} has a broken back link"]


@pytest.mark.parametrize("block_ids", [[2, 9], [2, 2]], ids=["unregistered", "twice"])
def test_deregister_leaves_names_the_batch_it_refuses(block_ids: list[int]) -> None:
    registry = _forest()
    with pytest.raises(InvariantError, match=re.escape(f"deregister_leaves: {block_ids} holds")):
        registry.deregister_leaves(block_ids)
    assert registry.check() == [] and len(registry) == 5


def test_the_public_arrays_are_read_only_views() -> None:
    registry = _forest()
    for name in ("is_registered", "num_children", "parent_of", "depth_of"):
        with pytest.raises(ValueError, match="read-only"):
            getattr(registry, name)[0] = 0
    registry.deregister_leaf(2)  # the registry itself still writes, and the views follow
    assert not registry.is_registered[2]


def test_a_copy_has_views_of_its_own_arrays() -> None:
    registry = _forest()
    clone = copy.deepcopy(registry)
    clone.deregister_leaf(2)
    assert not clone.is_registered[2]
    assert registry.is_registered[2]
