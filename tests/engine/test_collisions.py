"""Collision defence: verify mode never shares a block whose hash merely collides."""

from __future__ import annotations

import pytest

from prefixcache import InvalidArgumentError, KVBlockAllocator


def weak_hash(tokens, block_size, *, parent=None, salt=None, extra_keys=None) -> list[int]:
    """A deliberately terrible chained hash: only the parity of each block's token sum counts."""
    hashes, previous = [], parent or 1
    for start in range(0, len(tokens) - block_size + 1, block_size):
        previous = previous * 2 + sum(tokens[start : start + block_size]) % 2 + 1
        hashes.append(previous)
    return hashes


PROMPT_A = [1, 2, 3, 4, 5, 6, 7, 8]
PROMPT_B = [2, 1, 4, 3, 6, 5, 8, 7]  # different tokens, same weak hashes


def serve(allocator: KVBlockAllocator, tokens: list[int], verify: bool) -> tuple[list, list]:
    """Match, allocate the rest, register; return (hit block IDs, fresh block IDs)."""
    hashes = allocator.hash_tokens(tokens)
    fingerprints = allocator.fingerprint_tokens(tokens) if verify else None
    hit = allocator.match_prefix(hashes, acquire=True, fingerprints=fingerprints).tolist()
    fresh = allocator.allocate_memory_blocks(len(hashes) - len(hit))
    assert fresh is not None
    rest = slice(len(hit), None)
    allocator.register_kv_block_hashes(
        fresh,
        hashes[rest],
        parent_hash=hashes[len(hit) - 1] if hit else None,
        fingerprints=fingerprints[rest] if verify else None,
    )
    return hit, fresh.tolist()


def make(verify: bool) -> KVBlockAllocator:
    return KVBlockAllocator(
        total_count=16,
        block_size_tokens=4,
        device="cpu",
        hash_algo=weak_hash,
        verify_prefix_hits=verify,
    )


def test_the_weak_hash_really_collides() -> None:
    assert weak_hash(PROMPT_A, 4) == weak_hash(PROMPT_B, 4)


def test_default_mode_shares_blocks_of_a_colliding_prompt() -> None:
    allocator = make(verify=False)
    _, blocks_a = serve(allocator, PROMPT_A, verify=False)
    hit_b, _ = serve(allocator, PROMPT_B, verify=False)
    assert hit_b == blocks_a  # wrong sharing: B would read A's KV


def test_verify_mode_refuses_blocks_of_a_colliding_prompt() -> None:
    allocator = make(verify=True)
    _, blocks_a = serve(allocator, PROMPT_A, verify=True)
    hit_b, fresh_b = serve(allocator, PROMPT_B, verify=True)
    assert hit_b == []
    assert not set(fresh_b) & set(blocks_a)
    assert allocator.stats().num_rejected_hits == 1
    allocator.check_invariants()


def test_verify_mode_still_shares_a_true_prefix() -> None:
    allocator = make(verify=True)
    _, blocks_a = serve(allocator, PROMPT_A, verify=True)
    hit, _ = serve(allocator, [*PROMPT_A[:4], 9, 9, 9, 8], verify=True)  # no collision
    assert hit == blocks_a[:1]
    assert allocator.stats().num_rejected_hits == 0


def test_verify_mode_cuts_the_match_at_the_first_colliding_block() -> None:
    allocator = make(verify=True)
    _, blocks_a = serve(allocator, PROMPT_A, verify=True)
    hit, _ = serve(allocator, [*PROMPT_A[:4], *PROMPT_B[4:]], verify=True)
    assert hit == blocks_a[:1]
    assert allocator.stats().num_rejected_hits == 1


def test_verify_mode_requires_fingerprints() -> None:
    allocator = make(verify=True)
    hashes = allocator.hash_tokens(PROMPT_A)
    with pytest.raises(InvalidArgumentError, match="fingerprints"):
        allocator.match_prefix(hashes)
    blocks = allocator.allocate_memory_blocks(2)
    with pytest.raises(InvalidArgumentError, match="fingerprints"):
        allocator.register_kv_block_hashes(blocks, hashes)
    with pytest.raises(InvalidArgumentError, match="fingerprints"):
        allocator.register_kv_block_hashes(blocks, hashes, fingerprints=[1])
    assert len(allocator.registry) == 0


def test_fingerprints_are_independent_of_the_primary_hashes() -> None:
    allocator = KVBlockAllocator(total_count=8, block_size_tokens=4, device="cpu")
    tokens = list(range(16))
    assert allocator.fingerprint_tokens(tokens) != allocator.hash_tokens(tokens)
    continued = allocator.fingerprint_tokens(
        tokens[8:], parent=allocator.fingerprint_tokens(tokens[:8])[-1]
    )
    assert continued == allocator.fingerprint_tokens(tokens)[2:]
