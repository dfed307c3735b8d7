"""Hashing's inputs: what each refusal names, boundaries, surrogates, key byte order.

Each test pins a behaviour that a mutation run (mutmut, ``tests/MUTATION.md``)
showed no other test checked: the exact index and value an error names at the int32 boundaries,
lone surrogates in salts and keys, the byte order of multi-byte int keys, the
inclusive range of ``parent``, and the type names in error messages.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from prefixcache import KVBlockAllocator
from prefixcache.engine import token_bytes
from prefixcache.engine.hashing import HASH_ALGORITHMS, compute_block_hashes, root_hash
from prefixcache.errors import InvalidArgumentError, InvalidTensorError

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
MAX_HASH = {"xxh3_64": 2**63 - 1, "xxh3_128": 2**128 - 1, "sha256": 2**256 - 1}


# --------------------------------------------------------------------------
# Out-of-range tokens: the error names the first bad token, not a boundary value
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "bad_value"),
    [
        ([INT32_MIN, INT32_MIN - 1], INT32_MIN - 1),
        ([INT32_MAX, INT32_MAX + 1], INT32_MAX + 1),
        ([INT32_MIN, INT32_MAX + 1], INT32_MAX + 1),
    ],
    ids=["min-then-below", "max-then-above", "min-then-above"],
)
@pytest.mark.parametrize("container", ["list", "int64-array"])
def test_boundary_tokens_are_not_blamed(values: list[int], bad_value: int, container: str) -> None:
    tokens: object = values if container == "list" else np.array(values, dtype=np.int64)
    with pytest.raises(InvalidArgumentError, match=rf"token {bad_value} at index 1 is outside"):
        compute_block_hashes(tokens, 1)  # type: ignore[arg-type]


def test_bad_token_error_names_the_token_type() -> None:
    with pytest.raises(InvalidArgumentError, match=r"index 1 is 2\.5 \(float\); tokens must be"):
        compute_block_hashes([1, 2.5], 1)  # type: ignore[list-item]


# --------------------------------------------------------------------------
# Error messages name what was passed
# --------------------------------------------------------------------------


def test_unsupported_tokens_message_is_exact() -> None:
    with pytest.raises(
        InvalidArgumentError,
        match=r"^tokens must be a 1-D torch tensor, a 1-D numpy integer array or a sequence of",
    ):
        compute_block_hashes("abcd", 1)  # type: ignore[arg-type]


def test_device_tensor_message_asks_for_a_cpu_tensor() -> None:
    tokens = torch.ones(8, dtype=torch.int32, device="meta")
    with pytest.raises(InvalidTensorError, match=r"from the device itself: pass a CPU tensor$"):
        compute_block_hashes(tokens, 4)


def test_non_str_algo_message_lists_the_valid_names() -> None:
    with pytest.raises(InvalidArgumentError, match="one of xxh3_64, xxh3_128, sha256; got list"):
        root_hash(algo=["xxh3_64"])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"parent": "5"}, "parent must be an int hash, got str"),
        ({"salt": 5}, "salt must be str, bytes or None, got int"),
        ({"extra_keys": 5}, r"extra_keys must be a sequence of keys \(e\.g\. a tuple\), got int"),
        (
            {"extra_keys": (1.5,)},
            "extra key 1.5 has type float; use str, bytes, int or a tuple of those$",
        ),
    ],
)
def test_argument_errors_name_the_type(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        compute_block_hashes([1, 2], 1, **kwargs)  # type: ignore[arg-type]


def test_a_bad_salt_is_refused_even_when_a_parent_is_given() -> None:
    # The parent makes the salt unused, but a wrong type is still a caller's bug.
    with pytest.raises(InvalidArgumentError, match="salt must be str"):
        compute_block_hashes([1, 2], 1, parent=5, salt=5)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="salt must be str"):
        compute_block_hashes([1, 2], 1, parent=5, salt=5, extra_keys=("k",))  # type: ignore[arg-type]


# --------------------------------------------------------------------------
# The parent range is inclusive at both ends
# --------------------------------------------------------------------------


@pytest.mark.parametrize("algo", HASH_ALGORITHMS)
def test_parent_range_is_inclusive(algo: str) -> None:
    tokens = [7, 8, 9, 10]
    low = compute_block_hashes(tokens, 2, parent=1, algo=algo)
    high = compute_block_hashes(tokens, 2, parent=MAX_HASH[algo], algo=algo)
    assert len(low) == len(high) == 2
    assert low != high


# --------------------------------------------------------------------------
# Salts and keys: lone surrogates and multi-byte ints
# --------------------------------------------------------------------------


@pytest.mark.parametrize("algo", HASH_ALGORITHMS)
def test_lone_surrogates_in_a_salt_hash_as_their_surrogatepass_bytes(algo: str) -> None:
    # "\ud800" is not valid UTF-8; surrogatepass encodes it as ED A0 80, so a
    # str salt still equals its bytes spelling and differs from its neighbour.
    assert root_hash("\ud800", algo=algo) == root_hash(b"\xed\xa0\x80", algo=algo)
    assert root_hash("\ud800", algo=algo) != root_hash("\ud801", algo=algo)


def test_lone_surrogates_in_extra_keys_are_accepted_and_distinct() -> None:
    roots = {root_hash(extra_keys=(key,)) for key in ("\ud800", "\ud801", "\udfff", "a")}
    assert len(roots) == 4
    blocks = compute_block_hashes([1, 2], 1, extra_keys=("\ud800",))
    assert blocks == compute_block_hashes([1, 2], 1, parent=root_hash(extra_keys=("\ud800",)))


def test_multi_byte_int_keys_are_little_endian() -> None:
    # Change only on purpose: roots may be persisted or shared between processes,
    # and an int key's byte order is part of the encoding (256 is b"\x00\x01").
    assert root_hash(extra_keys=(256, -1000)) == 3049357448876529213


def test_the_same_value_cast_is_detected_from_numpy_2_4() -> None:
    # The detection runs once at import; called again it must agree with the
    # numpy version, or the one-pass range check would be silently skipped.
    major, minor = (int(part) for part in np.__version__.split(".")[:2])
    assert token_bytes._numpy_has_same_value_cast() is ((major, minor) >= (2, 4))


def test_a_byte_swapped_token_past_int32_is_refused_not_wrapped() -> None:
    """numpy 2.4's same_value cast missed the overflow from a big-endian source (-1 hashed)."""
    allocator = KVBlockAllocator(total_count=8, block_size_tokens=2, device="cpu", engine="python")
    for dtype in (">u4", ">u8", ">i8"):
        with pytest.raises(InvalidArgumentError, match="outside the int32 range"):
            allocator.hash_tokens(np.array([1, 4294967295], dtype=dtype))
