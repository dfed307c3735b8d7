"""``examples/custom_policy.py``: a third-party policy that keeps the contract and runs."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest
from prefixcache.policies import EvictionPolicy

from prefixcache import KVBlockAllocator, policies
from prefixcache.testing import PolicyContract

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "custom_policy.py"


def load_example() -> ModuleType:
    """Import the example by path (examples/ is no package); it registers its policy."""
    spec = importlib.util.spec_from_file_location("custom_policy_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_without_registering() -> ModuleType:
    """The example, with the policy registry left as it was (other modules list it)."""
    saved = dict(policies._registry)
    try:
        return load_example()
    finally:
        policies._registry.clear()
        policies._registry.update(saved)


example = load_without_registering()


class TestDeepestFirst(PolicyContract):
    def make_policy(self) -> EvictionPolicy:
        policy: EvictionPolicy = example.DeepestFirstPolicy()
        return policy


def test_the_policy_is_30_to_60_lines() -> None:
    lines = EXAMPLE.read_text().splitlines()
    start = lines.index('@policies.register("deepest_first")')
    end = next(i for i, line in enumerate(lines) if "return block_id in self._key_of" in line)
    assert 30 <= end - start + 1 <= 60


def test_it_is_registered_by_name_and_runs_through_the_allocator(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(policies, "_registry", dict(policies._registry))
    assert "deepest_first" not in policies.available()
    load_example()
    assert "deepest_first" in policies.available()
    allocator = KVBlockAllocator(
        total_count=6, block_size_tokens=2, device="cpu", eviction_policy="deepest_first"
    )
    assert type(allocator.policy).__name__ == "DeepestFirstPolicy"
    hashes = allocator.hash_tokens([1, 2, 3, 4, 5, 6])
    blocks = allocator.allocate_memory_blocks(3)
    allocator.register_kv_block_hashes(blocks, hashes)
    allocator.release_memory_blocks(blocks)
    assert allocator.evict_cached_blocks(1) == 1
    assert len(allocator.match_prefix(hashes)) == 2  # the deepest block went
    allocator.check_invariants()


def test_deepest_first_keeps_every_conversation_s_head_where_lru_drops_one_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(policies._registry, "deepest_first", example.DeepestFirstPolicy)
    assert example.surviving_conversations("lru") == [
        "A: 2/4 blocks cached",
        "B: 4/4 blocks cached",
    ]
    assert example.surviving_conversations("deepest_first") == [
        "A: 3/4 blocks cached",
        "B: 3/4 blocks cached",
    ]
