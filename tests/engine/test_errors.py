"""Misuse of the allocator: every error of the core issue, each leaving the state untouched.

Each test asserts the library's own exception type (from ``prefixcache.errors``,
a ``PrefixCacheError``) and, through the ``refuses`` fixture, that the full
state digest of ``tests/conftest.py`` is identical before and after the call
(DESIGN.md invariant 6). Most tests run on the ``populated`` allocator, which
has active, paused, cached (LRU only), unhashed and free blocks, a registered
chain and stored routing, once per shipped policy.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from prefixcache import (
    AllocatorConfig,
    BlockStateError,
    BudgetExceededError,
    CapacityError,
    ConfigError,
    HashConflictError,
    InvalidArgumentError,
    InvalidBlockIdError,
    InvalidTensorError,
    KVBlockAllocator,
    PrefixCacheError,
    ReferenceCountError,
    policies,
)

DUMMY = 15
"""The dummy block of the 16-block test allocators."""

Call = Callable[[KVBlockAllocator, Any], object]

ID_METHODS: dict[str, Call] = {
    "release": lambda a, ids: a.release_memory_blocks(ids),
    "release_paused": lambda a, ids: a.release_memory_blocks(ids, paused=True),
    "acquire_blocks": lambda a, ids: a.acquire_blocks(ids),
    "pause": lambda a, ids: a.pause(ids),
    "resume": lambda a, ids: a.resume(ids),
    "update_timestamps": lambda a, ids: a.update_timestamps(ids),
    "register": lambda a, ids: a.register_kv_block_hashes(ids, [901]),
    "reconstruct_routing": lambda a, ids: a.reconstruct_routing_from_blocks(ids, 0),
}
"""Every method taking a batch of block IDs, called with ``ids`` as that batch."""

SINGLE_ID_METHODS: dict[str, Call] = {
    "get_block_routing": lambda a, block_id: a.get_block_routing(block_id),
    "store_block_routing": lambda a, block_id: a.store_block_routing(
        block_id, torch.zeros(4, 2, 2, dtype=torch.int16)
    ),
    "store_routing_per_block": lambda a, block_id: a.store_routing_per_block(
        torch.zeros(1, 2, 2, dtype=torch.int16), [block_id], [0]
    ),
}
"""Methods that name blocks one at a time (or per token); the dummy is refused or skipped."""

BAD_IDS = [-1, 16, 1 << 31, -(1 << 40)]
"""Out-of-range IDs of a 16-block pool (16 is one past the dummy)."""

MALFORMED_IDS: dict[str, object] = {
    "float_tensor": torch.tensor([0.0]),
    "bool_tensor": torch.tensor([True]),
    "complex_tensor": torch.tensor([1j]),
    "float_list": [0.0],
    "bool_list": [True],
    "string": "0",
    "string_list": ["0"],
    "bytes": b"\x00",
    "float_array": np.array([0.5]),
    "bool_array": np.array([True]),
    "2d_tensor": torch.zeros(1, 1, dtype=torch.int32),
    "2d_array": np.zeros((1, 1), dtype=np.int32),
    "0d_tensor": torch.tensor(0, dtype=torch.int32),
    "meta_tensor": torch.zeros(1, dtype=torch.int32, device="meta"),
    "none": None,
    "bare_int": 0,
    "nested_list": [[0]],
    "huge_int_list": [1 << 70],
}
"""Block ID batches of the wrong type, dtype, shape or device."""


def test_digest_sees_every_kind_of_change(
    populated: SimpleNamespace, digest: Callable[[KVBlockAllocator], tuple]
) -> None:
    """Guard against a tautological digest: each of these calls must change it."""
    allocator = populated.allocator
    changes: list[Callable[[], object]] = [
        lambda: allocator.advance_clock(1),
        lambda: allocator.update_timestamps(populated.chain_a[2:]),
        lambda: allocator.acquire_blocks(populated.unhashed),
        lambda: allocator.release_memory_blocks(populated.unhashed),
        lambda: allocator.store_block_routing(
            int(populated.unhashed[0]), torch.ones(1, 2, 2, dtype=torch.int16)
        ),
        lambda: allocator.allocate_memory_blocks(1),
    ]
    if populated.policy == "lru":
        # Touching a cached leaf reorders the policy and nothing else of the counts.
        changes.insert(0, lambda: allocator.update_timestamps(populated.chain_c[1:]))
    for change in changes:
        before = digest(allocator)
        change()
        assert digest(allocator) != before
    with allocator.free_group():
        before = digest(allocator)
        allocator.release_memory_blocks(populated.chain_a[:1])
        assert digest(allocator) != before, "a queued release must show in the digest"


# ---------------------------------------------------------------- unknown and dummy IDs


@pytest.mark.parametrize("bad_id", [*BAD_IDS, DUMMY])
@pytest.mark.parametrize("method", ID_METHODS)
def test_out_of_range_and_dummy_ids_are_refused(
    populated: SimpleNamespace, refuses: Callable[..., PrefixCacheError], method: str, bad_id: int
) -> None:
    """Negative, too large and dummy IDs are refused by every method taking ID batches."""
    allocator = populated.allocator
    assert allocator.dummy_block_id == DUMMY
    error = refuses(allocator, InvalidBlockIdError, ID_METHODS[method], allocator, [bad_id])
    assert str(bad_id) in str(error)


@pytest.mark.parametrize("method", ID_METHODS)
def test_dummy_id_as_int64_tensor_is_refused(
    populated: SimpleNamespace, refuses: Callable[..., PrefixCacheError], method: str
) -> None:
    allocator = populated.allocator
    ids = torch.tensor([allocator.dummy_block_id], dtype=torch.int64)
    error = refuses(allocator, InvalidBlockIdError, ID_METHODS[method], allocator, ids)
    assert "dummy" in str(error)


@pytest.mark.parametrize("bad_id", [*BAD_IDS, DUMMY])
@pytest.mark.parametrize("method", ["get_block_routing", "store_block_routing"])
def test_single_id_routing_methods_refuse_bad_ids(
    populated: SimpleNamespace, refuses: Callable[..., PrefixCacheError], method: str, bad_id: int
) -> None:
    allocator = populated.allocator
    refuses(allocator, InvalidBlockIdError, SINGLE_ID_METHODS[method], allocator, bad_id)


@pytest.mark.parametrize("bad_id", BAD_IDS)
def test_store_routing_per_block_refuses_out_of_range_token_blocks(
    populated: SimpleNamespace, refuses: Callable[..., PrefixCacheError], bad_id: int
) -> None:
    allocator = populated.allocator
    call = SINGLE_ID_METHODS["store_routing_per_block"]
    refuses(allocator, InvalidBlockIdError, call, allocator, bad_id)


def test_store_routing_per_block_skips_dummy_tokens(
    populated: SimpleNamespace, digest: Callable[[KVBlockAllocator], tuple]
) -> None:
    """The one method where the dummy is legal: padded tokens point at it and are skipped."""
    allocator = populated.allocator
    before = digest(allocator)
    SINGLE_ID_METHODS["store_routing_per_block"](allocator, allocator.dummy_block_id)
    assert digest(allocator) == before


# ---------------------------------------------------------------- malformed ID batches


@pytest.mark.parametrize("value", MALFORMED_IDS.values(), ids=MALFORMED_IDS.keys())
@pytest.mark.parametrize("method", ID_METHODS)
def test_malformed_id_batches_are_refused(
    populated: SimpleNamespace, refuses: Callable[..., PrefixCacheError], method: str, value: object
) -> None:
    allocator = populated.allocator
    refuses(allocator, InvalidTensorError, ID_METHODS[method], allocator, value)


@pytest.mark.parametrize(
    "value",
    [v for k, v in MALFORMED_IDS.items() if k != "huge_int_list"],
    ids=[k for k in MALFORMED_IDS if k != "huge_int_list"],
)
@pytest.mark.parametrize("acquire", [False, True])
def test_match_prefix_refuses_malformed_hashes(
    populated: SimpleNamespace,
    refuses: Callable[..., PrefixCacheError],
    value: object,
    acquire: bool,
) -> None:
    """Hashes may be any int (128-bit ones too), but must be ints in a 1-D container."""
    allocator = populated.allocator
    refuses(allocator, InvalidTensorError, allocator.match_prefix, value, acquire=acquire)


@pytest.mark.parametrize(
    "value",
    [v for k, v in MALFORMED_IDS.items() if k != "huge_int_list"],
    ids=[k for k in MALFORMED_IDS if k != "huge_int_list"],
)
def test_register_refuses_malformed_hashes(
    populated: SimpleNamespace, refuses: Callable[..., PrefixCacheError], value: object
) -> None:
    allocator = populated.allocator
    call = allocator.register_kv_block_hashes
    refuses(allocator, InvalidTensorError, call, populated.unhashed, value)


# ---------------------------------------------------------------- reference counts


def test_release_of_a_free_block_is_refused(
    populated: SimpleNamespace, refuses: Callable[..., PrefixCacheError]
) -> None:
    allocator = populated.allocator
    error = refuses(
        allocator, ReferenceCountError, allocator.release_memory_blocks, [populated.free]
    )
    assert str(populated.free) in str(error)
    assert "free" in str(error)


def test_release_of_a_cached_block_is_refused(
    make: Callable[..., KVBlockAllocator], refuses: Callable[..., PrefixCacheError]
) -> None:
    allocator = make("lru")
    blocks = allocator.allocate_memory_blocks(1)
    allocator.register_kv_block_hashes(blocks, [7])
    allocator.release_memory_blocks(blocks)
    assert allocator.get_evictable_block_count() == 1
    refuses(allocator, ReferenceCountError, allocator.release_memory_blocks, blocks)


def test_double_release_is_refused(
    populated: SimpleNamespace, refuses: Callable[..., PrefixCacheError]
) -> None:
    allocator = populated.allocator
    allocator.release_memory_blocks(populated.unhashed)
    refuses(allocator, ReferenceCountError, allocator.release_memory_blocks, populated.unhashed)


def test_release_of_more_duplicates_than_references_is_refused(
    populated: SimpleNamespace, refuses: Callable[..., PrefixCacheError]
) -> None:
    """The first block of chain A holds two references; three occurrences are one too many."""
    allocator = populated.allocator
    first = int(populated.chain_a[0])
    error = refuses(allocator, ReferenceCountError, allocator.release_memory_blocks, [first] * 3)
    assert "2" in str(error) and "3" in str(error)


def test_release_of_paused_references_from_an_active_block_is_refused(
    populated: SimpleNamespace, refuses: Callable[..., PrefixCacheError]
) -> None:
    allocator = populated.allocator
    call = allocator.release_memory_blocks
    refuses(allocator, ReferenceCountError, call, populated.unhashed, paused=True)


def test_release_of_active_references_from_a_paused_block_is_refused(
    populated: SimpleNamespace, refuses: Callable[..., PrefixCacheError]
) -> None:
    allocator = populated.allocator
    refuses(allocator, ReferenceCountError, allocator.release_memory_blocks, populated.paused)


def _valid_prefix(scene: SimpleNamespace, method: str) -> list[int]:
    """IDs on which ``method`` would succeed in the populated allocator."""
    chain_a, unhashed = scene.chain_a.tolist(), scene.unhashed.tolist()
    return {
        "release": chain_a + unhashed,
        "pause": unhashed,
        "resume": scene.paused.tolist(),
        "acquire_blocks": chain_a + unhashed,
        "update_timestamps": chain_a + unhashed,
    }[method]


FREE_ID_ERRORS: dict[str, type[PrefixCacheError]] = {
    "release": ReferenceCountError,
    "pause": ReferenceCountError,
    "resume": ReferenceCountError,
    "acquire_blocks": BlockStateError,
    "update_timestamps": BlockStateError,
}


@pytest.mark.parametrize("last", ["free", "dummy", "past_pool", "negative", "float"])
@pytest.mark.parametrize("method", FREE_ID_ERRORS)
def test_batch_with_only_the_last_id_bad_applies_nothing(
    populated: SimpleNamespace, refuses: Callable[..., PrefixCacheError], method: str, last: str
) -> None:
    """Validation covers the whole batch before the first block is touched."""
    allocator = populated.allocator
    bad, error = {
        "free": (populated.free, FREE_ID_ERRORS[method]),
        "dummy": (DUMMY, InvalidBlockIdError),
        "past_pool": (16, InvalidBlockIdError),
        "negative": (-1, InvalidBlockIdError),
        "float": (1.0, InvalidTensorError),
    }[last]
    ids = [*_valid_prefix(populated, method), bad]
    refuses(allocator, error, ID_METHODS[method], allocator, ids)


def test_batch_release_with_one_duplicate_too_many_at_the_end_applies_nothing(
    populated: SimpleNamespace, refuses: Callable[..., PrefixCacheError]
) -> None:
    allocator = populated.allocator
    ids = [*populated.chain_a.tolist(), *populated.unhashed.tolist(), int(populated.unhashed[0])]
    refuses(allocator, ReferenceCountError, allocator.release_memory_blocks, ids)


def test_batch_release_as_tensor_with_last_id_free_applies_nothing(
    populated: SimpleNamespace, refuses: Callable[..., PrefixCacheError]
) -> None:
    allocator = populated.allocator
    ids = torch.cat([populated.chain_a, torch.tensor([populated.free], dtype=torch.int32)])
    refuses(allocator, ReferenceCountError, allocator.release_memory_blocks, ids)


@pytest.mark.parametrize("which", ["paused_only", "free", "twice_for_one_reference"])
def test_pause_without_an_active_reference_is_refused(
    populated: SimpleNamespace, refuses: Callable[..., PrefixCacheError], which: str
) -> None:
    allocator = populated.allocator
    ids = {
        "paused_only": populated.paused.tolist(),
        "free": [populated.free],
        "twice_for_one_reference": populated.unhashed.tolist() * 2,
    }[which]
    refuses(allocator, ReferenceCountError, allocator.pause, ids)


def test_pause_of_a_cached_block_is_refused(
    populated: SimpleNamespace, refuses: Callable[..., PrefixCacheError]
) -> None:
    if populated.policy != "lru":
        pytest.skip("ref-zero keeps no cached block")
    allocator = populated.allocator
    refuses(allocator, ReferenceCountError, allocator.pause, populated.chain_c)


@pytest.mark.parametrize("which", ["active_only", "free", "twice_for_one_reference"])
def test_resume_without_a_paused_reference_is_refused(
    populated: SimpleNamespace, refuses: Callable[..., PrefixCacheError], which: str
) -> None:
    allocator = populated.allocator
    ids = {
        "active_only": populated.unhashed.tolist(),
        "free": [populated.free],
        "twice_for_one_reference": populated.paused.tolist() * 2,
    }[which]
    refuses(allocator, ReferenceCountError, allocator.resume, ids)


def test_resume_past_the_active_budget_is_refused(
    populated: SimpleNamespace, refuses: Callable[..., PrefixCacheError]
) -> None:
    """Allocation may fill the whole pool; resume is what the active budget binds."""
    allocator = populated.allocator
    room = allocator.active_count - allocator.get_active_used()
    assert allocator.allocate_memory_blocks(room) is not None
    assert allocator.get_active_avail() == 0
    error = refuses(allocator, BudgetExceededError, allocator.resume, populated.paused)
    assert str(allocator.active_count) in str(error)


def test_pause_past_the_paused_budget_is_refused(
    populated: SimpleNamespace, refuses: Callable[..., PrefixCacheError]
) -> None:
    allocator = populated.allocator
    assert allocator.get_paused_avail() == 3
    more = allocator.allocate_memory_blocks(3)
    ids = [*more.tolist(), *populated.unhashed.tolist()]
    error = refuses(allocator, BudgetExceededError, allocator.pause, ids)
    assert str(allocator.paused_count) in str(error)
    allocator.pause(more)
    assert allocator.get_paused_avail() == 0


def test_budget_error_is_a_capacity_error_not_misuse() -> None:
    assert issubclass(BudgetExceededError, CapacityError)
    assert not issubclass(BudgetExceededError, InvalidArgumentError)
    assert issubclass(ReferenceCountError, BlockStateError)


def test_acquire_of_a_free_block_is_refused(
    populated: SimpleNamespace, refuses: Callable[..., PrefixCacheError]
) -> None:
    allocator = populated.allocator
    error = refuses(allocator, BlockStateError, allocator.acquire_blocks, [populated.free])
    assert str(populated.free) in str(error)


def test_update_timestamps_of_a_free_block_is_refused(
    populated: SimpleNamespace, refuses: Callable[..., PrefixCacheError]
) -> None:
    allocator = populated.allocator
    refuses(allocator, BlockStateError, allocator.update_timestamps, [populated.free])


# ---------------------------------------------------------------- registration


def test_register_with_mismatched_lengths_is_refused(
    populated: SimpleNamespace, refuses: Callable[..., PrefixCacheError]
) -> None:
    allocator = populated.allocator
    call = allocator.register_kv_block_hashes
    refuses(allocator, InvalidArgumentError, call, populated.unhashed, [301, 302])
    refuses(allocator, InvalidArgumentError, call, populated.chain_a, [101])


@pytest.mark.parametrize("sentinel", [0, -1])
@pytest.mark.parametrize("position", ["only", "last"])
def test_register_refuses_sentinel_hashes(
    populated: SimpleNamespace,
    refuses: Callable[..., PrefixCacheError],
    sentinel: int,
    position: str,
) -> None:
    allocator = populated.allocator
    more = allocator.allocate_memory_blocks(1)
    if position == "only":
        ids, hashes = more.tolist(), [sentinel]
    else:
        ids, hashes = [*populated.unhashed.tolist(), *more.tolist()], [301, sentinel]
    error = refuses(
        allocator, InvalidArgumentError, allocator.register_kv_block_hashes, ids, hashes
    )
    assert str(sentinel) in str(error)


def test_register_of_a_block_carrying_another_hash_is_refused(
    populated: SimpleNamespace, refuses: Callable[..., PrefixCacheError]
) -> None:
    allocator = populated.allocator
    ids = [*populated.unhashed.tolist(), int(populated.chain_a[1])]
    error = refuses(
        allocator, HashConflictError, allocator.register_kv_block_hashes, ids, [301, 999]
    )
    assert str(int(populated.chain_a[1])) in str(error)


def test_register_of_one_block_twice_with_different_hashes_is_refused(
    populated: SimpleNamespace, refuses: Callable[..., PrefixCacheError]
) -> None:
    allocator = populated.allocator
    ids = populated.unhashed.tolist() * 2
    refuses(allocator, HashConflictError, allocator.register_kv_block_hashes, ids, [301, 302])


def test_register_under_an_unregistered_parent_hash_is_refused(
    populated: SimpleNamespace, refuses: Callable[..., PrefixCacheError]
) -> None:
    allocator = populated.allocator
    error = refuses(
        allocator,
        HashConflictError,
        allocator.register_kv_block_hashes,
        populated.unhashed,
        [301],
        parent_hash=555,
    )
    assert "555" in str(error)


@pytest.mark.parametrize("which", ["free", "free_last"])
def test_register_of_an_unreferenced_block_is_refused(
    populated: SimpleNamespace, refuses: Callable[..., PrefixCacheError], which: str
) -> None:
    allocator = populated.allocator
    if which == "free":
        ids, hashes = [populated.free], [301]
    else:
        ids, hashes = [*populated.unhashed.tolist(), populated.free], [301, 302]
    error = refuses(allocator, BlockStateError, allocator.register_kv_block_hashes, ids, hashes)
    assert not isinstance(error, HashConflictError)


def test_register_of_a_cached_block_is_refused(
    make: Callable[..., KVBlockAllocator], refuses: Callable[..., PrefixCacheError]
) -> None:
    """Registration belongs to the request holding the block; a cached block has none."""
    allocator = make("lru")
    blocks = allocator.allocate_memory_blocks(2)
    allocator.register_kv_block_hashes(blocks[:1], [7])
    allocator.release_memory_blocks(blocks)
    refuses(allocator, BlockStateError, allocator.register_kv_block_hashes, blocks[:1], [7])


# ---------------------------------------------------------------- allocation and eviction


@pytest.mark.parametrize("num_blocks", [-1, 1.0, 2.5, True, False, "2", None, [1]])
def test_allocate_refuses_a_bad_count(
    populated: SimpleNamespace, refuses: Callable[..., PrefixCacheError], num_blocks: object
) -> None:
    allocator = populated.allocator
    refuses(allocator, InvalidArgumentError, allocator.allocate_memory_blocks, num_blocks)


def test_allocate_beyond_free_plus_evictable_returns_none_and_changes_nothing(
    populated: SimpleNamespace, digest: Callable[[KVBlockAllocator], tuple]
) -> None:
    allocator = populated.allocator
    reachable = allocator.pool.num_free + allocator.get_evictable_block_count()
    assert not allocator.is_memory_available(reachable + 1)
    before = digest(allocator)
    assert allocator.allocate_memory_blocks(reachable + 1) is None
    assert digest(allocator) == before
    allocator.check_invariants()


@pytest.mark.parametrize("method", ["evict_cached_blocks", "evict_lru_blocks", "advance_clock"])
@pytest.mark.parametrize("value", [-1, 1.0, True, "1", None])
def test_counts_of_eviction_and_clock_are_validated(
    populated: SimpleNamespace,
    refuses: Callable[..., PrefixCacheError],
    method: str,
    value: object,
) -> None:
    allocator = populated.allocator
    refuses(allocator, InvalidArgumentError, getattr(allocator, method), value)


def test_evict_lru_blocks_beyond_the_cached_count_changes_nothing(
    populated: SimpleNamespace, digest: Callable[[KVBlockAllocator], tuple]
) -> None:
    allocator = populated.allocator
    before = digest(allocator)
    assert allocator.evict_lru_blocks(allocator.get_evictable_block_count() + 1) is False
    assert digest(allocator) == before


# ---------------------------------------------------------------- configuration


def test_unknown_policy_name_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError) as info:
        KVBlockAllocator(total_count=16, device="cpu", eviction_policy="no_such_policy")
    message = str(info.value)
    assert "no_such_policy" in message
    for name in policies.available():
        assert name in message


def test_unknown_policy_name_in_a_mapping_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="lru"):
        KVBlockAllocator(AllocatorConfig(16, device="cpu", eviction_policy={"name": "nope"}))


@pytest.mark.parametrize(
    "fields",
    [
        {"total_count": -16},
        {"total_count": 1},
        {"total_count": 16.0},
        {"total_count": True},
        {"total_count": 16, "paused_count": -1},
        {"total_count": 16, "paused_count": 15},
        {"total_count": 16, "paused_count": 100},
        {"total_count": 16, "block_size_tokens": 0},
        {"total_count": 16, "block_size_tokens": -4},
        {"total_count": 16, "enable_prefix_caching": 1},
        {"total_count": 16, "routing_num_layers": 2},
        {"total_count": 16, "routing_num_layers": 0, "routing_top_k": 2},
        {"total_count": 16, "routing_num_layers": 2, "routing_top_k": -1},
        {"total_count": 16, "routing_num_layers": 2, "routing_top_k": 2, "routing_num_experts": 0},
    ],
)
def test_invalid_config_values_are_refused(fields: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        AllocatorConfig(**fields)
    with pytest.raises(ConfigError):
        AllocatorConfig.from_dict(fields)
    with pytest.raises(ConfigError):
        KVBlockAllocator(**fields)


def test_largest_paused_count_leaves_one_active_block() -> None:
    allocator = KVBlockAllocator(total_count=16, paused_count=14, device="cpu")
    assert allocator.active_count == 1


def test_unknown_config_dict_keys_are_named() -> None:
    with pytest.raises(ConfigError) as info:
        AllocatorConfig.from_dict({"total_count": 16, "evicton_policy": "lru"})
    assert "evicton_policy" in str(info.value)
    assert "eviction_policy" in str(info.value)


@pytest.mark.parametrize("values", [None, [("total_count", 16)], "total_count=16"])
def test_config_from_a_non_mapping_is_refused(values: object) -> None:
    with pytest.raises(ConfigError):
        AllocatorConfig.from_dict(values)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "spec",
    [42, None, {"kind": "lru"}, {"name": "lru", "capacity": 3}, {"name": "ref_zero", "x": 1}],
)
def test_bad_policy_specs_are_refused(spec: object) -> None:
    with pytest.raises(ConfigError):
        KVBlockAllocator(total_count=16, device="cpu", eviction_policy=spec)


@pytest.mark.parametrize(
    "kwargs",
    [{"hash_algo": "md5"}, {"device": "no_such_device"}, {"device": "cuda:x"}],
)
def test_bad_hash_algo_and_device_are_config_errors(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        KVBlockAllocator(total_count=16, **kwargs)


def test_config_and_keywords_together_are_refused() -> None:
    with pytest.raises(ConfigError):
        KVBlockAllocator(AllocatorConfig(16), total_count=16)
    with pytest.raises(ConfigError):
        KVBlockAllocator({"total_count": 16})  # type: ignore[arg-type]


# ---------------------------------------------------------------- MoE routing


ROUTING_METHODS: dict[str, Callable[[KVBlockAllocator], object]] = {
    "store_routing_per_block": lambda a: a.store_routing_per_block(
        torch.zeros(1, 2, 2, dtype=torch.int16), [0], [0]
    ),
    "store_block_routing": lambda a: a.store_block_routing(0, torch.zeros(1, 2, 2)),
    "get_block_routing": lambda a: a.get_block_routing(0),
    "reconstruct_routing_from_blocks": lambda a: a.reconstruct_routing_from_blocks([0], 1),
}


@pytest.mark.parametrize("method", ROUTING_METHODS)
def test_routing_without_configured_dims_is_a_config_error(
    make: Callable[..., KVBlockAllocator], refuses: Callable[..., PrefixCacheError], method: str
) -> None:
    allocator = make("lru")
    allocator.allocate_memory_blocks(1)
    assert allocator.routing is None
    error = refuses(allocator, ConfigError, ROUTING_METHODS[method], allocator)
    assert "routing_num_layers" in str(error)


def _tokens(scene: SimpleNamespace, count: int) -> tuple[list[int], list[int]]:
    """``count`` tokens filling the unhashed block from position 0."""
    return [int(scene.unhashed[0])] * count, list(range(count))


ROUTING_BAD_ARRAYS: dict[str, tuple[object, type[PrefixCacheError]]] = {
    "layers": (torch.zeros(2, 3, 2, dtype=torch.int16), InvalidTensorError),
    "top_k": (torch.zeros(2, 2, 1, dtype=torch.int16), InvalidTensorError),
    "2d": (torch.zeros(2, 4, dtype=torch.int16), InvalidTensorError),
    "1d": (torch.zeros(2, dtype=torch.int16), InvalidTensorError),
    "4d": (torch.zeros(2, 2, 2, 1, dtype=torch.int16), InvalidTensorError),
    "float": (torch.zeros(2, 2, 2), InvalidTensorError),
    "bool": (torch.zeros(2, 2, 2, dtype=torch.bool), InvalidTensorError),
    "float_array": (np.zeros((2, 2, 2)), InvalidTensorError),
    "nested_list": ([[[0, 0], [0, 0]], [[0, 0], [0, 0]]], InvalidTensorError),
    "meta": (torch.zeros(2, 2, 2, dtype=torch.int16, device="meta"), InvalidTensorError),
    "none": (None, InvalidTensorError),
    "rows": (torch.zeros(3, 2, 2, dtype=torch.int16), InvalidTensorError),
    "expert_too_large": (torch.full((2, 2, 2), 8), InvalidArgumentError),
    "expert_negative": (torch.tensor([[[0, 0], [0, 0]], [[0, 0], [0, -1]]]), InvalidArgumentError),
    "last_expert_too_large": (
        torch.tensor([[[0, 0], [0, 0]], [[0, 0], [0, 8]]]),
        InvalidArgumentError,
    ),
}


@pytest.mark.parametrize("case", ROUTING_BAD_ARRAYS)
def test_store_routing_per_block_refuses_bad_routing(
    populated: SimpleNamespace, refuses: Callable[..., PrefixCacheError], case: str
) -> None:
    allocator = populated.allocator
    routing, error = ROUTING_BAD_ARRAYS[case]
    blocks, positions = _tokens(populated, 2)
    refuses(allocator, error, allocator.store_routing_per_block, routing, blocks, positions)


@pytest.mark.parametrize("case", [c for c in ROUTING_BAD_ARRAYS if c != "rows"])
def test_store_block_routing_refuses_bad_routing(
    populated: SimpleNamespace, refuses: Callable[..., PrefixCacheError], case: str
) -> None:
    allocator = populated.allocator
    routing, error = ROUTING_BAD_ARRAYS[case]
    refuses(allocator, error, allocator.store_block_routing, int(populated.unhashed[0]), routing)


def test_store_routing_per_block_refuses_a_0d_routing_tensor(
    populated: SimpleNamespace, refuses: Callable[..., PrefixCacheError]
) -> None:
    allocator = populated.allocator
    blocks, positions = _tokens(populated, 1)
    call = allocator.store_routing_per_block
    refuses(allocator, InvalidTensorError, call, torch.tensor(1), blocks, positions)


def test_store_block_routing_refuses_more_rows_than_a_block_holds(
    populated: SimpleNamespace, refuses: Callable[..., PrefixCacheError]
) -> None:
    allocator = populated.allocator
    routing = torch.zeros(5, 2, 2, dtype=torch.int16)
    call = allocator.store_block_routing
    refuses(allocator, InvalidTensorError, call, int(populated.unhashed[0]), routing)


@pytest.mark.parametrize("case", ["block_ids_short", "positions_short", "positions_float"])
def test_store_routing_per_block_refuses_mismatched_token_arrays(
    populated: SimpleNamespace, refuses: Callable[..., PrefixCacheError], case: str
) -> None:
    allocator = populated.allocator
    blocks, positions = _tokens(populated, 2)
    if case == "block_ids_short":
        blocks = blocks[:1]
    elif case == "positions_short":
        positions = positions[:1]
    else:
        positions = [0.0, 1.0]
    routing = torch.zeros(2, 2, 2, dtype=torch.int16)
    call = allocator.store_routing_per_block
    refuses(allocator, InvalidTensorError, call, routing, blocks, positions)


@pytest.mark.parametrize("bad_position", [4, -1, 100])
def test_store_routing_per_block_refuses_positions_outside_the_block(
    populated: SimpleNamespace, refuses: Callable[..., PrefixCacheError], bad_position: int
) -> None:
    """Only the last token is bad; none of the earlier ones may be written."""
    allocator = populated.allocator
    blocks, positions = _tokens(populated, 3)
    positions[-1] = bad_position
    routing = torch.ones(3, 2, 2, dtype=torch.int16)
    call = allocator.store_routing_per_block
    refuses(allocator, InvalidArgumentError, call, routing, blocks, positions)


@pytest.mark.parametrize("target", ["free", "cached"])
def test_routing_of_an_unreferenced_block_is_refused(
    populated: SimpleNamespace, refuses: Callable[..., PrefixCacheError], target: str
) -> None:
    """Only a request holding a block writes its routing; the last token is the bad one."""
    if target == "cached" and populated.policy != "lru":
        pytest.skip("ref-zero keeps no cached block")
    allocator = populated.allocator
    bad = populated.free if target == "free" else int(populated.chain_c[1])
    blocks = [int(populated.unhashed[0]), bad]
    routing = torch.ones(2, 2, 2, dtype=torch.int16)
    call = allocator.store_routing_per_block
    error = refuses(allocator, BlockStateError, call, routing, blocks, [0, 0])
    assert str(bad) in str(error)
    refuses(allocator, BlockStateError, allocator.store_block_routing, bad, routing)


@pytest.mark.parametrize("total_tokens", [-1, 13, 1.0, True, None])
def test_reconstruct_refuses_a_bad_token_count(
    populated: SimpleNamespace, refuses: Callable[..., PrefixCacheError], total_tokens: object
) -> None:
    """Three blocks of four tokens hold at most 12 tokens."""
    allocator = populated.allocator
    call = allocator.reconstruct_routing_from_blocks
    refuses(allocator, InvalidArgumentError, call, populated.chain_a, total_tokens)
