"""Issue 15, item 9: tenants of a shared deployment never share a block.

The preset for a deployment that serves several tenants who choose their
prompts: ``hash_algo="sha256"`` (no crafted collision) and a per-deployment
secret ``hash_salt`` (no tenant can compute the chain hashes offline), with
each tenant's ID as the ``salt`` of ``hash_tokens``. The alternative,
``verify_prefix_hits=True``, is tested with forced collisions in
``tests/test_collisions.py``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache import KVBlockAllocator
from prefixcache.engine.hashing import compute_block_hashes

SECRET = b"\x8f\x02 per-deployment secret, from the deployment's secret store"
BLOCK = 4

tokens_strategy = st.lists(st.integers(0, 50_000), min_size=BLOCK, max_size=8 * BLOCK)
tenant_ids = st.text(min_size=1, max_size=12)


@pytest.fixture
def make(make: Callable[..., KVBlockAllocator]) -> Callable[..., KVBlockAllocator]:
    return functools.partial(make, engine="python", block_size_tokens=BLOCK)


def serve(allocator: KVBlockAllocator, tokens: list[int], tenant: str) -> list[int]:
    """Admit a prompt for ``tenant``: hit what is cached, allocate and register the rest."""
    hashes = allocator.hash_tokens(tokens, salt=tenant)
    hit = allocator.match_prefix(hashes, acquire=True)
    fresh = allocator.allocate_memory_blocks(len(hashes) - len(hit))
    assert fresh is not None
    parent = hashes[len(hit) - 1] if len(hit) else None
    allocator.register_kv_block_hashes(fresh, hashes[len(hit) :], parent_hash=parent)
    return [*hit.tolist(), *fresh.tolist()]


@pytest.mark.parametrize("algo", ["sha256", "xxh3_64"])
def test_two_tenants_with_the_same_prompt_share_no_block(
    make: Callable[..., KVBlockAllocator], algo: str
) -> None:
    allocator = make(total_count=64, hash_algo=algo, hash_salt=SECRET)
    prompt = list(range(100, 116))
    a = serve(allocator, prompt, "tenant-a")
    b = serve(allocator, prompt, "tenant-b")
    again = serve(allocator, prompt, "tenant-a")
    assert not set(a) & set(b)
    assert again == a  # the same tenant does hit its own prefix
    assert allocator.stats().num_hit_blocks == len(a)
    allocator.check_invariants()


@settings(max_examples=200, deadline=None)
@given(tokens=tokens_strategy, first=tenant_ids, second=tenant_ids)
def test_different_salts_give_disjoint_chains(tokens: list[int], first: str, second: str) -> None:
    if first.encode("utf-8", "surrogatepass") == second.encode("utf-8", "surrogatepass"):
        return
    allocator = KVBlockAllocator(
        total_count=8, block_size_tokens=BLOCK, hash_algo="sha256", hash_salt=SECRET, device="cpu"
    )
    assert not set(allocator.hash_tokens(tokens, salt=first)) & set(
        allocator.hash_tokens(tokens, salt=second)
    )


def test_without_the_secret_a_tenant_cannot_compute_the_hashes(
    make: Callable[..., KVBlockAllocator],
) -> None:
    prompt = list(range(16))
    allocator = make(total_count=8, hash_algo="sha256", hash_salt=SECRET)
    other = make(total_count=8, hash_algo="sha256", hash_salt=SECRET + b"-other deployment")
    stored = allocator.hash_tokens(prompt, salt="tenant-a")
    guesses = [
        compute_block_hashes(prompt, BLOCK, salt="tenant-a", algo="sha256"),
        compute_block_hashes(prompt, BLOCK, extra_keys=("tenant-a",), algo="sha256"),
        other.hash_tokens(prompt, salt="tenant-a"),
    ]
    for guess in guesses:
        assert not set(guess) & set(stored)
