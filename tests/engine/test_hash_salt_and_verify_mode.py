"""Hash salt and verify mode through the allocator.

The config's ``hash_salt`` separates hash chains; verify mode keeps the
fingerprints of blocks registered after a refused (already held) hash; hash
lists must hold ints.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from prefixcache import (
    InvalidTensorError,
    KVBlockAllocator,
    compute_block_hashes,
)

Make = Callable[..., KVBlockAllocator]
CachedChain = tuple[KVBlockAllocator, list[int]]


# ---------------------------------------------------------------------- hashing and verify mode


def test_the_configured_salt_separates_hash_chains(make_small: Make) -> None:
    tokens = [1, 2, 3, 4]
    salted = make_small(hash_salt="weights-v2").hash_tokens(tokens)
    assert salted != make_small().hash_tokens(tokens)
    assert salted == compute_block_hashes(tokens, 2, extra_keys=["weights-v2"])


def test_verify_mode_keeps_fingerprints_of_blocks_after_a_refused_hash(make_small: Make) -> None:
    allocator = make_small(verify_prefix_hits=True)
    first = allocator.allocate_memory_blocks(1)
    allocator.register_kv_block_hashes(first, [11], fingerprints=[111])
    # Block 0 of this chain repeats hash 11 (refused: another block holds it);
    # block 1 registers under it and must keep its own fingerprint.
    chain = allocator.allocate_memory_blocks(2)
    accepted = allocator.register_kv_block_hashes(chain, [11, 12], fingerprints=[111, 122])
    assert accepted.tolist() == [False, True]
    hit = allocator.match_prefix([11, 12], fingerprints=[111, 122]).tolist()
    assert hit == [int(first[0]), int(chain[1])]
    assert allocator.match_prefix([11, 12], fingerprints=[111, 999]).tolist() == [int(first[0])]


def test_hash_lists_must_hold_ints(cached_chain: CachedChain) -> None:
    allocator, _ = cached_chain
    assert allocator.match_prefix([np.int64(11), np.uint8(12)]).tolist() == [1, 2]
    with pytest.raises(InvalidTensorError, match="only ints"):
        allocator.match_prefix([11, 12.0])
