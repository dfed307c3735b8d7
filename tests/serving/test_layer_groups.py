"""LayerGroups: per-group tables and pools, sliding windows that give blocks back."""

from __future__ import annotations

import pytest
import torch

from prefixcache.engine.hashing import compute_block_hashes
from prefixcache.errors import (
    CapacityError,
    ConfigError,
    InvalidArgumentError,
    InvariantError,
    PrefixCacheError,
)
from prefixcache.serving.layer_groups import LayerGroups, LayerGroupSpec, first_needed_block

B = 4  # tokens per block

FULL = LayerGroupSpec("full", "full", num_layers=2, k_heads=2, k_head_dim=4)
SWA = LayerGroupSpec("swa", "sliding_window", num_layers=3, k_heads=2, k_head_dim=4, window=6)
INDEXER = LayerGroupSpec("idx", "indexer", num_layers=1, k_heads=1, k_head_dim=8)


def make(specs=(FULL, SWA), num_blocks=32, **kwargs) -> LayerGroups:
    options = {"block_size": B, "max_requests": 4, "max_blocks_per_request": 12, "device": "cpu"}
    options |= kwargs
    return LayerGroups(list(specs), num_blocks=num_blocks, dtype=torch.float32, **options)


def hashes(tokens: list[int]) -> list[int]:
    return compute_block_hashes(tokens, B)


def run(groups: LayerGroups, tokens: list[int], *, finish: bool = True) -> int:
    """Admit ``tokens`` (with its hit), compute it in one chunk, optionally finish it."""
    base = hashes(tokens)
    slot = groups.admit(groups.longest_hit(base), base)
    assert groups.reserve(slot, len(tokens))
    groups.commit(slot, len(tokens), base)
    groups.check_invariants()
    if finish:
        groups.finish(slot)
    return slot


def test_first_needed_block_follows_the_window() -> None:
    # The token at position n attends to n - window + 1 .. n.
    assert first_needed_block(0, 6, 4) == 0
    assert first_needed_block(8, 6, 4) == 0  # position 8 reads 3..8: block 0 holds 3
    assert first_needed_block(9, 6, 4) == 1  # position 9 reads 4..9
    assert first_needed_block(20, 1, 4) == 5  # a window of one reads only itself


def test_each_group_gets_its_own_table_and_pool_by_default() -> None:
    groups = make((FULL, SWA, INDEXER))
    assert set(groups.allocators) == {"full", "swa", "idx"}
    assert set(groups.tables) == {"full", "swa", "idx"}
    assert groups.kv_caches["idx"].v_head_dim == 0  # the indexer keeps keys only
    assert groups.kv_caches["swa"].num_layers == 3


def test_groups_sharing_a_pool_share_one_allocator_and_storage() -> None:
    shared = LayerGroupSpec("swa", "sliding_window", 3, 2, 4, window=6, pool="full")
    groups = make((FULL, shared))
    assert list(groups.allocators) == ["full"]
    assert groups.kv_caches["full"].num_layers == 3  # the larger group's layers
    base = hashes(list(range(12)))
    assert groups.group_hashes(0, base) == base
    mixed = groups.group_hashes(1, base)
    assert not set(mixed) & set(base) and all(0 < h < 1 << 63 for h in mixed)
    slot = run(groups, list(range(12)), finish=False)
    full_ids = groups.blocks_of("full", slot).tolist()
    swa_ids = groups.blocks_of("swa", slot).tolist()
    dummy = groups.allocators["full"].dummy_block_id
    assert not set(full_ids) & ({*swa_ids} - {dummy})  # one pool, distinct blocks
    allocator = groups.allocators["full"]
    assert all(allocator.is_hash_registered(h) for h in base + mixed)


def test_sliding_window_blocks_out_of_the_window_are_given_back_while_running() -> None:
    groups = make()
    tokens = list(range(20))
    slot = run(groups, tokens, finish=False)
    # 20 tokens computed: the next reads 15..20, so blocks 0..2 are out of the window.
    row = groups.blocks_of("swa", slot).tolist()
    dummy = groups.allocators["swa"].dummy_block_id
    assert row[:3] == [dummy] * 3 and dummy not in row[3:]
    assert groups.num_held_blocks() == {"full": 5, "swa": 2}
    swa = groups.allocators["swa"]
    assert swa.get_active_used() == 2
    assert swa.get_evictable_block_count() == 3  # registered roots, cached, evictable now
    groups.finish(slot)
    assert swa.get_active_used() == 0 and groups.allocators["full"].get_active_used() == 0


def swa_block(groups: LayerGroups, base: list[int], index: int) -> int:
    """The sliding-window block registered for chain position ``index``."""
    block_hash = groups.group_hashes(1, base)[index]
    return int(groups.allocators["swa"].match_prefix([block_hash])[0])


def evict_swa_blocks(groups: LayerGroups, base: list[int], doomed: list[int]) -> None:
    """Evict exactly the sliding-window blocks of chain positions ``doomed`` (all cached)."""
    swa = groups.allocators["swa"]
    keep = [swa_block(groups, base, i) for i in range(len(base)) if i not in doomed]
    swa.update_timestamps(keep)  # the doomed are now the least recently used
    assert swa.evict_cached_blocks(len(doomed)) == len(doomed)
    assert [swa.is_hash_registered(h) for h in groups.group_hashes(1, base)] == [
        i not in doomed for i in range(len(base))
    ]


def test_a_sliding_window_hit_needs_only_the_blocks_inside_the_window() -> None:
    groups = make()
    tokens = list(range(20))
    run(groups, tokens)
    prompt = hashes(tokens)  # 5 blocks; the window at 20 tokens needs blocks 3 and 4
    assert groups.longest_hit(prompt).num_blocks == 5
    evict_swa_blocks(groups, prompt, [0, 1, 2])
    hit = groups.longest_hit(prompt)
    assert hit.num_blocks == 5 and hit.first_block == (0, 3)
    assert len(hit.block_ids[0]) == 5 and len(hit.block_ids[1]) == 2
    slot = groups.admit(hit, prompt)
    assert groups.num_tokens(slot) == 20
    row = groups.blocks_of("swa", slot).tolist()
    dummy = groups.allocators["swa"].dummy_block_id
    assert row[:3] == [dummy] * 3 and row[3:] == hit.block_ids[1].tolist()
    groups.check_invariants()


def test_a_missing_window_block_shortens_the_hit_to_a_window_that_avoids_it() -> None:
    groups = make()
    tokens = list(range(24))
    run(groups, tokens)
    prompt = hashes(tokens)
    evict_swa_blocks(groups, prompt, [4])
    # 6 blocks need 4 and 5 in the window, 5 need 3 and 4, 4 need 2 and 3.
    assert groups.longest_hit(prompt).num_blocks == 4


def test_the_full_group_bounds_the_hit() -> None:
    groups = make()
    tokens = list(range(16))
    run(groups, tokens)
    groups.allocators["full"].evict_cached_blocks(2)  # the chain's last two blocks
    assert groups.longest_hit(hashes(tokens)).num_blocks == 2


def test_accept_filters_hit_lengths() -> None:
    groups = make((FULL,))
    tokens = list(range(16))
    run(groups, tokens)
    assert groups.longest_hit(hashes(tokens), lambda n: n % 3 == 0).num_blocks == 3
    assert groups.longest_hit(hashes(tokens), lambda n: False).num_blocks == 0


def test_reserve_is_all_or_nothing_across_pools() -> None:
    groups = make(num_blocks={"full": 32, "swa": 4})
    slot = groups.admit(groups.longest_hit([]), [])
    assert groups.reserve(slot, 12)  # 3 blocks in each pool
    before = {pool: a.get_active_used() for pool, a in groups.allocators.items()}
    assert not groups.reserve(slot, 16)  # swa has 3 usable blocks, all held
    assert {pool: a.get_active_used() for pool, a in groups.allocators.items()} == before
    assert groups.tables["full"].num_blocks(slot) == 3


def test_reserve_beyond_a_row_is_a_capacity_error() -> None:
    groups = make()
    slot = groups.admit(groups.longest_hit([]), [])
    with pytest.raises(CapacityError):
        groups.reserve(slot, 13 * B)
    assert groups.tables["full"].num_blocks(slot) == 0


def test_a_parent_hash_gone_meanwhile_is_repaired_by_registering_from_the_root() -> None:
    groups = make((FULL,), eviction_policy="ref_zero")
    base = hashes(list(range(16)))
    # Two requests compute the same prompt at once: the second's blocks lose the race.
    first = groups.admit(groups.longest_hit(base[:2]), base[:2])
    second = groups.admit(groups.longest_hit(base[:2]), base[:2])
    for slot in (first, second):
        assert groups.reserve(slot, 8)
        groups.commit(slot, 8, base)
    allocator = groups.allocators["full"]
    holder = int(allocator.match_prefix(base[:2])[1])
    assert holder in groups.blocks_of("full", first).tolist()
    groups.finish(first)  # ref-zero frees the blocks that held the second's parent hash
    assert not allocator.is_hash_registered(base[1])
    assert groups.reserve(second, 16)
    groups.commit(second, 16, base)
    assert allocator.match_prefix(base).tolist() == groups.blocks_of("full", second).tolist()
    groups.check_invariants()


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda g, s, h: g.commit(s, 3, h), InvalidArgumentError),  # fewer than before
        (lambda g, s, h: g.commit(s, 13, h), InvalidArgumentError),  # beyond the reserved
        (lambda g, s, h: g.commit(s, 12, h[:2]), InvalidArgumentError),  # too few hashes
        (lambda g, s, h: g.commit(7, 8, h), InvalidArgumentError),  # no such request
        (lambda g, s, h: g.commit(True, 8, h), InvalidArgumentError),
        (lambda g, s, h: g.reserve(s, -1), InvalidArgumentError),
        (lambda g, s, h: g.finish(3), InvalidArgumentError),
        (lambda g, s, h: g.blocks_of("nope", s), InvalidArgumentError),
    ],
)
def test_bad_calls_raise_and_change_nothing(call, error) -> None:
    groups = make()
    base = hashes(list(range(12)))
    slot = groups.admit(groups.longest_hit([]), [])
    groups.reserve(slot, 12)
    groups.commit(slot, 4, base)

    def state() -> tuple:
        return (
            {pool: str(a) for pool, a in groups.allocators.items()},
            {name: t.blocks_of(slot).tolist() for name, t in groups.tables.items()},
            groups.num_tokens(slot),
        )

    before = state()
    with pytest.raises(error) as info:
        call(groups, slot, base)
    assert isinstance(info.value, PrefixCacheError)
    assert state() == before


def test_admitting_with_no_free_row_is_a_capacity_error() -> None:
    groups = make(max_requests=1)
    groups.admit(groups.longest_hit([]), [])
    with pytest.raises(CapacityError):
        groups.admit(groups.longest_hit([]), [])


@pytest.mark.parametrize(
    "build",
    [
        lambda: LayerGroupSpec("a", "mamba", 1, 1, 1),
        lambda: LayerGroupSpec("a", "full", 1, 1, 1, window=4),
        lambda: LayerGroupSpec("a", "sliding_window", 1, 1, 1),
        lambda: LayerGroupSpec("a", "sliding_window", 1, 1, 1, window=0),
        lambda: LayerGroupSpec("", "full", 1, 1, 1),
        lambda: LayerGroupSpec("a", "full", 0, 1, 1),
        lambda: LayerGroupSpec("a", "full", 1, 1, 1, pool=""),
        lambda: make(()),
        lambda: make((FULL, FULL)),
        lambda: make((FULL, LayerGroupSpec("b", "full", 1, 4, 4, pool="full"))),  # shapes differ
        lambda: make(num_blocks=1),
        lambda: make(block_size=0),
    ],
)
def test_bad_configuration_is_a_config_error(build) -> None:
    with pytest.raises(ConfigError):
        build()


def test_admitting_a_hit_longer_than_its_hashes_or_a_row_is_refused() -> None:
    groups = make()
    tokens = list(range(16))
    run(groups, tokens)
    hit = groups.longest_hit(hashes(tokens))
    with pytest.raises(InvalidArgumentError):
        groups.admit(hit, hashes(tokens)[:2])
    short_rows = make(max_blocks_per_request=2)
    run(short_rows, tokens[:8])
    with pytest.raises(CapacityError):
        short_rows.admit(groups.longest_hit(hashes(tokens)), hashes(tokens))


@pytest.mark.parametrize("corrupt", ["dummy", "unreferenced"])
def test_check_invariants_sees_a_row_holding_what_it_does_not_own(corrupt) -> None:
    groups = make((FULL,))
    slot = run(groups, list(range(8)), finish=False)
    table = groups.tables["full"]
    if corrupt == "dummy":
        table._rows[slot, 0] = table.dummy_block_id
    else:
        groups.allocators["full"].release_memory_blocks(table.blocks_of(slot)[:1])
    with pytest.raises(InvariantError):
        groups.check_invariants()
