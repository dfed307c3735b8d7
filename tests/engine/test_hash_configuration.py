"""The allocator passes its hash configuration on: parent, salt, keys, algorithm.

``hash_tokens`` gives the configured algorithm every argument, a callable
algorithm gets them all, and fingerprints use the other algorithm under
their own root.

``tests/MUTATION.md`` lists the mutants these tests kill and the survivors that are equivalent.
"""

from __future__ import annotations

from typing import Any

import pytest

from prefixcache import KVBlockAllocator, compute_block_hashes

# ---------------------------------------------------------------------- hashing


def test_hash_tokens_passes_parent_salt_and_keys_to_the_configured_algorithm() -> None:
    tokens = [1, 2, 3, 4]
    allocator = KVBlockAllocator(
        total_count=4, block_size_tokens=2, device="cpu", hash_algo="sha256", hash_salt="v2"
    )
    expected = compute_block_hashes(
        tokens, 2, parent=9, salt="s", extra_keys=["v2", "k"], algo="sha256"
    )
    assert allocator.hash_tokens(tokens, parent=9, salt="s", extra_keys=["k"]) == expected
    assert allocator.hash_tokens(tokens) == compute_block_hashes(
        tokens, 2, extra_keys=["v2"], algo="sha256"
    )
    assert allocator.hash_tokens(tokens, salt="s", extra_keys=["k"]) == compute_block_hashes(
        tokens, 2, salt="s", extra_keys=["v2", "k"], algo="sha256"
    )


def test_a_callable_hash_algorithm_gets_every_argument() -> None:
    seen: list[tuple[Any, ...]] = []

    def algo(
        tokens: Any,
        block_size: int,
        *,
        parent: int | None = None,
        salt: Any = None,
        extra_keys: Any = None,
    ) -> list[int]:
        seen.append((list(tokens), block_size, parent, salt, extra_keys))
        return [7]

    allocator = KVBlockAllocator(
        total_count=4, block_size_tokens=2, device="cpu", hash_algo=algo, hash_salt="v2"
    )
    seen.clear()  # the config may probe the function
    assert allocator.hash_tokens([1, 2], parent=5, salt="s", extra_keys=("k",)) == [7]
    assert seen == [([1, 2], 2, 5, "s", ["v2", "k"])]


@pytest.mark.parametrize(
    ("hash_algo", "fingerprint_algo"),
    [("xxh3_64", "xxh3_128"), ("sha256", "xxh3_128"), ("xxh3_128", "sha256")],
)
def test_fingerprints_use_the_other_algorithm_under_their_own_root(
    hash_algo: str, fingerprint_algo: str
) -> None:
    tokens = [1, 2, 3, 4]
    allocator = KVBlockAllocator(
        total_count=4, block_size_tokens=2, device="cpu", hash_algo=hash_algo, hash_salt="v2"
    )
    for parent in (None, 9):  # salt and keys seed a chain's root; a parent carries them
        got = allocator.fingerprint_tokens(tokens, parent=parent, salt="s", extra_keys=["k"])
        assert got == compute_block_hashes(
            tokens,
            2,
            parent=parent,
            salt="s",
            extra_keys=["prefixcache-fingerprint", "v2", "k"],
            algo=fingerprint_algo,
        )
