"""Issue 28, "How to test": hostile programs over the Megatron drop-in, on both engines.

Megatron's own allocator accepts misuse silently; the drop-in promises the
library's errors and no change. These programs mix Megatron's ``add_request``
bookkeeping (:mod:`prefixcache.testing.megatron_requests`) with calls of every
public method of :class:`MegatronKVBlockAllocator`, and writes through
``block_ref_counts[...] = ...``, with arguments drawn from a hostile pool and
from the blocks held now. After every call: a refusal is the library's error
and leaves the whole drop-in as it was (:func:`deep_state`: the backing
allocator, every mirror tensor and dict), and ``check_consistency()`` holds.
Needs no megatron-core (a stand-in context).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from prefixcache import PrefixCacheError
from prefixcache.engine.native_engine import native_available
from prefixcache.integrations.megatron import MegatronKVBlockAllocator
from prefixcache.testing import deep_state
from prefixcache.testing.megatron_requests import add_request


class FakeContext:
    """What the drop-in reads of Megatron's context."""

    def __init__(self) -> None:
        self.prefix_cache_lru_clock = 0
        self.block_size_tokens = 4
        self.paused_request_count = 0
        self.total_request_count = 0
        self.request_to_kv_block_ids = torch.full((4, 8), -1, dtype=torch.int32)
        self.request_kv_block_counts = torch.zeros(4, dtype=torch.int32)
        self.active_token_count = 0
        self.token_to_block_idx = torch.zeros(64, dtype=torch.int32)
        self.token_to_local_position_within_kv_block = torch.zeros(64, dtype=torch.int32)


HOSTILE: list[Any] = [
    -1,
    0,
    1,
    3,
    2**63,
    True,
    2.5,
    None,
    "1",
    [],
    [[1]],
    [None],
    [1.5],
    [-1],
    [2**64],
    np.int64(2),
    np.array([[1, 2]]),
    np.array([1.5]),
    torch.tensor([1, 2]),
    torch.tensor([[1]]),
    torch.tensor([1.5]),
    torch.tensor([-1]),
    torch.tensor([99]),
]
"""Values wrong for most arguments, or right by a hair."""

READ_ONLY = {"check_consistency", "stats", "take_events", "reset"}
ENGINES = ["python", "native"] if native_available() else ["python"]


def public_methods(allocator: MegatronKVBlockAllocator) -> list[str]:
    """The drop-in's public methods (read from the class), the read-only ones left out."""
    return sorted(
        name
        for name, _ in inspect.getmembers(type(allocator), inspect.isfunction)
        if not name.startswith("_") and name not in READ_ONLY
    )


def hostile_call(allocator: MegatronKVBlockAllocator, data: st.DataObject) -> None:
    """One public method, or a ``block_ref_counts`` write, with drawn arguments, checked."""
    held = [i for i in range(8) if allocator.block_ref_counts[i] > 0] or [0]
    ids = st.lists(st.sampled_from([*held, 7, 8]), max_size=3)

    def argument(label: str) -> Any:
        return data.draw(
            st.one_of(
                st.sampled_from(HOSTILE),
                ids.map(lambda i: torch.tensor(i, dtype=torch.int32)),
                st.integers(0, 4),
            ),
            label=label,
        )

    name = data.draw(st.sampled_from([*public_methods(allocator), "block_ref_counts[...] ="]))
    call: Callable[[], Any]
    if name.startswith("block_ref_counts"):
        index, value = argument("index"), argument("value")

        def call() -> Any:
            allocator.block_ref_counts[index] = value

    else:
        method = getattr(allocator, name)
        args = [
            argument(parameter.name)
            for parameter in inspect.signature(method).parameters.values()
            if parameter.default is inspect.Parameter.empty
        ]

        def call() -> Any:
            return method(*args)

    before = deep_state(allocator)
    try:
        call()
    except PrefixCacheError:
        assert deep_state(allocator) == before, f"{name} refused but changed"
    except Exception as error:  # anything else is what this test hunts
        pytest.fail(f"{name} raised bare {error!r}")
    allocator.check_consistency()


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("policy", ["lru", "ref_zero"])
@settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    phases=[Phase.explicit, Phase.generate],  # a failure reports at once, unshrunk
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(data=st.data())
def test_hostile_calls_on_the_drop_in_change_nothing_when_refused(
    engine: str, policy: str, data: st.DataObject
) -> None:
    allocator = MegatronKVBlockAllocator(
        FakeContext(),
        total_count=9,
        paused_count=2,
        enable_prefix_caching=True,
        prefix_caching_eviction_policy=policy,
        engine=engine,
    )
    for _ in range(data.draw(st.integers(3, 20), label="steps")):
        if data.draw(st.booleans(), label="hostile"):
            hostile_call(allocator, data)
        else:
            hashes = data.draw(st.lists(st.integers(1, 6), min_size=1, max_size=4, unique=True))
            add_request(allocator, hashes)  # None when short: nothing changes
            allocator.check_consistency()


def holding_two_blocks() -> MegatronKVBlockAllocator:
    """An LRU drop-in with one request of two blocks admitted."""
    allocator = MegatronKVBlockAllocator(
        FakeContext(),
        total_count=9,
        paused_count=2,
        enable_prefix_caching=True,
        prefix_caching_eviction_policy="lru",
    )
    add_request(allocator, [1, 2])
    return allocator


FOUND = [
    ("release_memory_blocks", (5,)),
    ("update_timestamps", (5,)),
    ("is_memory_available", ([1, 2],)),
    ("evict_lru_blocks", ([1],)),
    ("register_kv_block_hashes", (5, [1])),
    ("register_kv_block_hashes", (torch.tensor([]), [])),
    ("get_block_routing", (np.array([1, 2]),)),
    ("reconstruct_routing_from_blocks", (3, 4)),
    ("store_block_routing", (1, [0], 5)),
    ("store_block_routing", ([1], [0], np.zeros((1, 1, 1)))),
]
"""What these programs found on the code before the fix: each raised a bare error."""


@pytest.mark.parametrize(("name", "args"), FOUND, ids=lambda value: str(value)[:40])
def test_what_the_programs_found_is_refused_with_the_librarys_error(
    name: str, args: tuple[Any, ...]
) -> None:
    allocator = holding_two_blocks()
    before = deep_state(allocator)
    with pytest.raises(PrefixCacheError):
        getattr(allocator, name)(*args)
    assert deep_state(allocator) == before


@pytest.mark.parametrize(
    ("index", "value"),
    [(torch.tensor([1.5]), 1), (torch.tensor([0, 1]), torch.tensor([])), (0, "x"), (0, 2**70)],
    ids=["float index", "shape", "str value", "huge value"],
)
def test_a_bad_write_to_the_mirror_is_refused_and_undone(index: Any, value: Any) -> None:
    allocator = holding_two_blocks()
    before = deep_state(allocator)
    with pytest.raises(PrefixCacheError):
        allocator.block_ref_counts[index] = value
    assert deep_state(allocator) == before
    allocator.check_consistency()
