"""Tests of prefixcache.engine.hashing: chained block hashes, roots, input canonicalisation."""

from __future__ import annotations

import hashlib
import struct
from typing import Any

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache.engine import token_bytes
from prefixcache.engine.hashing import HASH_ALGORITHMS, compute_block_hashes, root_hash
from prefixcache.errors import InvalidArgumentError, InvalidTensorError

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
MAX_HASH = {"xxh3_64": 2**63 - 1, "xxh3_128": 2**128 - 1, "sha256": 2**256 - 1}


@pytest.fixture
def tokens() -> list[int]:
    """200 tokens: 12 full blocks of 16 and a partial block of 8."""
    return np.random.default_rng(1234).integers(0, 150_000, 200).tolist()


@pytest.fixture(params=["same-value-cast", "min-max"])
def range_check(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run a test with both int32 range checks: numpy >= 2.4's cast and the fallback."""
    if request.param == "min-max":
        monkeypatch.setattr(token_bytes, "_HAS_SAME_VALUE_CAST", False)


def _packed(block: list[int]) -> bytes:
    return struct.pack(f"<{len(block)}i", *block)


# --------------------------------------------------------------------------
# The definition
# --------------------------------------------------------------------------


def test_algorithms_listed() -> None:
    assert HASH_ALGORITHMS == ("xxh3_64", "xxh3_128", "sha256")


@pytest.mark.parametrize("block_size", [16, 256, 300])
def test_xxh3_64_chains_through_the_seed(block_size: int) -> None:
    tokens = np.random.default_rng(7).integers(0, 150_000, 1000).tolist()
    expected, seed = [], root_hash()
    for start in range(0, 1000 - block_size + 1, block_size):
        data = _packed(tokens[start : start + block_size])
        seed = xxhash.xxh3_64_intdigest(data, seed) & MAX_HASH["xxh3_64"] or 1
        expected.append(seed)
    assert compute_block_hashes(tokens, block_size) == expected
    assert compute_block_hashes(np.array(tokens), block_size) == expected


@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize(
    ("algo", "size", "digest"),
    [
        ("xxh3_128", 16, lambda data: xxhash.xxh3_128_digest(data)),
        ("sha256", 32, lambda data: hashlib.sha256(data).digest()),
    ],
)
def test_wide_algorithms_chain_through_parent_bytes(block_size, algo, size, digest) -> None:
    tokens = np.random.default_rng(8).integers(0, 150_000, 1000).tolist()
    expected, parent = [], root_hash(algo=algo)
    for start in range(0, 1000 - block_size + 1, block_size):
        data = parent.to_bytes(size, "big") + _packed(tokens[start : start + block_size])
        parent = int.from_bytes(digest(data), "big") or 1
        expected.append(parent)
    assert compute_block_hashes(tokens, block_size, algo=algo) == expected
    assert compute_block_hashes(torch.tensor(tokens), block_size, algo=algo) == expected


def test_golden_values_are_stable() -> None:
    # Change only on purpose: hashes may be persisted or shared between processes.
    assert root_hash() == 3577246476861048014
    assert root_hash("tenant", ("lora", 1)) == 712232033379911308
    assert compute_block_hashes(list(range(32)), 16) == [3651985381454547737, 1969914982736790458]
    assert compute_block_hashes(list(range(16)), 16, algo="xxh3_128") == [
        330196148048269128418627637750652455688
    ]
    assert compute_block_hashes(list(range(16)), 16, algo="sha256") == [
        0xCBC1D406A5CBA8C7E80C91718B69D10FCF110AA90AAD5B71C828C1A4268BEF21
    ]


def test_deterministic(tokens: list[int]) -> None:
    assert compute_block_hashes(tokens, 16) == compute_block_hashes(list(tokens), 16)


@pytest.mark.parametrize("algo", HASH_ALGORITHMS)
def test_hashes_are_positive_and_in_range(tokens: list[int], algo: str) -> None:
    hashes = compute_block_hashes(tokens, 4, algo=algo)
    assert len(hashes) == 50
    assert all(isinstance(h, int) and 0 < h <= MAX_HASH[algo] for h in hashes)
    assert len(set(hashes)) == 50
    # The wide modes really are wide: 50 values below 2**64 would be a bug.
    if algo != "xxh3_64":
        assert max(hashes) >= 2**64
    root = root_hash(algo=algo)
    assert 0 < root <= MAX_HASH[algo]


# --------------------------------------------------------------------------
# Input types
# --------------------------------------------------------------------------


@pytest.mark.usefixtures("range_check")
def test_input_types_hash_alike(tokens: list[int]) -> None:
    expected = compute_block_hashes(tokens, 16)
    array = np.array(tokens)
    same: list[Any] = [
        tuple(tokens),
        array.astype(np.int32),
        array.astype(np.int64),
        array.astype(np.uint32),
        array.astype(">i4"),  # big-endian storage, same values
        array.astype(">i8"),
        torch.tensor(tokens, dtype=torch.int32),
        torch.tensor(tokens, dtype=torch.int64),
    ]
    for candidate in same:
        assert compute_block_hashes(candidate, 16) == expected, type(candidate)


def test_small_dtypes_and_ranges() -> None:
    values = list(range(0, 250, 3))
    expected = compute_block_hashes(values, 8)
    assert compute_block_hashes(np.array(values, dtype=np.uint8), 8) == expected
    assert compute_block_hashes(torch.tensor(values, dtype=torch.int16), 8) == expected
    assert compute_block_hashes(range(0, 250, 3), 8) == expected


def test_strided_inputs(tokens: list[int]) -> None:
    expected = compute_block_hashes(tokens[::2], 8)
    assert compute_block_hashes(torch.tensor(tokens)[::2], 8) == expected
    assert compute_block_hashes(np.array(tokens)[::2], 8) == expected


@pytest.mark.usefixtures("range_check")
def test_int32_bounds_are_accepted() -> None:
    edge = [INT32_MIN, INT32_MAX] * 8
    expected = compute_block_hashes(edge, 16)
    assert compute_block_hashes(np.array(edge, dtype=np.int64), 16) == expected
    assert compute_block_hashes(torch.tensor(edge, dtype=torch.int64), 16) == expected


def test_value_not_bytes_pattern_matters() -> None:
    # 1 as int32 is 01 00 00 00; as the list [1, 0, 0, 0] of bytes it must differ.
    assert compute_block_hashes([1], 1) != compute_block_hashes([1, 0, 0, 0], 4)
    assert compute_block_hashes([-1], 1) != compute_block_hashes([INT32_MAX], 1)


# --------------------------------------------------------------------------
# Blocks, prefixes, chains
# --------------------------------------------------------------------------


def test_partial_block_is_ignored(tokens: list[int]) -> None:
    assert len(compute_block_hashes(tokens, 16)) == 12
    assert compute_block_hashes(tokens[:47], 16) == compute_block_hashes(tokens[:32], 16)
    assert compute_block_hashes(tokens[:15], 16) == []
    assert compute_block_hashes([], 16) == []
    assert compute_block_hashes(np.array([], dtype=np.int64), 16) == []


@pytest.mark.parametrize("algo", HASH_ALGORITHMS)
def test_changed_token_changes_its_block_and_later_only(tokens: list[int], algo: str) -> None:
    before = compute_block_hashes(tokens, 16, algo=algo)
    for position in (0, 15, 16, 100, 191):
        changed = list(tokens)
        changed[position] += 1
        after = compute_block_hashes(changed, 16, algo=algo)
        k = position // 16
        assert after[:k] == before[:k]
        assert all(a != b for a, b in zip(after[k:], before[k:], strict=True))


def test_change_in_partial_block_changes_nothing(tokens: list[int]) -> None:
    changed = [*tokens[:-1], tokens[-1] + 1]
    assert compute_block_hashes(changed, 16) == compute_block_hashes(tokens, 16)


def test_block_position_matters() -> None:
    # Same block content at block 0 and block 1 gives different hashes.
    hashes = compute_block_hashes([7] * 32, 16)
    assert hashes[0] != hashes[1]


@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("algo", HASH_ALGORITHMS)
def test_continuation_equals_one_call(algo: str, block_size: int) -> None:
    tokens = list(range(5000, 5000 + 4 * block_size))
    whole = compute_block_hashes(tokens, block_size, algo=algo)
    first = compute_block_hashes(tokens[: 2 * block_size], block_size, algo=algo)
    rest = compute_block_hashes(tokens[2 * block_size :], block_size, parent=first[-1], algo=algo)
    assert len(whole) == 4
    assert first + rest == whole


def test_continuation_keeps_the_salt(tokens: list[int]) -> None:
    whole = compute_block_hashes(tokens, 16, salt="tenant-a", extra_keys=("lora-x",))
    first = compute_block_hashes(tokens[:48], 16, salt="tenant-a", extra_keys=("lora-x",))
    # Salt and extra keys are not hashed again when a parent is given.
    rest = compute_block_hashes(tokens[48:], 16, parent=first[-1], salt="other")
    assert first + rest == whole


def test_parent_accepts_numpy_integers(tokens: list[int]) -> None:
    first = compute_block_hashes(tokens[:16], 16)
    rest = compute_block_hashes(tokens[16:32], 16, parent=np.int64(first[0]))
    assert first + rest == compute_block_hashes(tokens[:32], 16)


def test_long_prompt_spans_chunks() -> None:
    # Long enough to be hashed in several chunks; chunking must not break the chain.
    long = np.random.default_rng(5).integers(0, 2**31 - 1, 300_000, dtype=np.int64)
    hashes = compute_block_hashes(long, 16)
    assert len(hashes) == 300_000 // 16
    tail = compute_block_hashes(long[16 * 9000 :], 16, parent=hashes[8999])
    assert hashes[9000:] == tail


# --------------------------------------------------------------------------
# Roots: salts and extra keys
# --------------------------------------------------------------------------


@pytest.mark.parametrize("algo", HASH_ALGORITHMS)
def test_salts_give_disjoint_chains(tokens: list[int], algo: str) -> None:
    plain = compute_block_hashes(tokens, 16, algo=algo)
    salted_a = compute_block_hashes(tokens, 16, salt="a", algo=algo)
    salted_b = compute_block_hashes(tokens, 16, salt="b", algo=algo)
    assert not set(plain) & set(salted_a)
    assert not set(salted_a) & set(salted_b)
    assert salted_a == compute_block_hashes(tokens, 16, parent=root_hash("a", algo=algo), algo=algo)


def test_extra_keys_give_disjoint_chains(tokens: list[int]) -> None:
    plain = compute_block_hashes(tokens, 16)
    lora = compute_block_hashes(tokens, 16, extra_keys=("lora", "adapter-1"))
    epoch = compute_block_hashes(tokens, 16, extra_keys=("lora", "adapter-1", 2))
    assert not set(plain) & set(lora)
    assert not set(lora) & set(epoch)


def test_salt_spellings() -> None:
    assert root_hash("tenant") == root_hash(b"tenant")
    assert root_hash(None) == root_hash()
    for empty in ("", b""):  # an empty salt is refused, not taken for "no salt"
        with pytest.raises(InvalidArgumentError, match="salt"):
            root_hash(empty)
    assert root_hash(extra_keys=()) == root_hash(extra_keys=[]) == root_hash()
    assert root_hash(extra_keys=["a", 1]) == root_hash(extra_keys=("a", 1))
    assert root_hash("a") != root_hash(extra_keys=("a",))


def test_extra_keys_are_unambiguous() -> None:
    roots = [
        root_hash(extra_keys=keys)
        for keys in [
            ("1",),
            (b"1",),
            (1,),
            ((1,),),
            (("1",),),
            ("ab", "c"),
            ("a", "bc"),
            ("abc",),
            ("c", "ab"),
            (-1,),
            (255,),
            (0,),
            (2**70,),
            ((),),
            ((), ()),
        ]
    ]
    assert len(set(roots)) == len(roots)


@pytest.mark.parametrize("algo", HASH_ALGORITHMS)
def test_roots_differ_by_algorithm_range(algo: str) -> None:
    assert 0 < root_hash("x", ("k", 3), algo) <= MAX_HASH[algo]
    assert root_hash("x", algo=algo) != root_hash("y", algo=algo)


# --------------------------------------------------------------------------
# The 0 sentinel: a zero digest becomes 1, and the chain goes on from 1
# --------------------------------------------------------------------------


def test_xxh3_64_zero_digest_maps_to_one(monkeypatch: pytest.MonkeyPatch) -> None:
    seeds: list[int] = []

    def fake(data: bytes, seed: int = 0) -> int:
        seeds.append(seed)
        return 2**63  # folds to 0

    monkeypatch.setattr(xxhash, "xxh3_64_intdigest", fake)
    assert compute_block_hashes([1] * 48, 16, parent=42) == [1, 1, 1]
    assert seeds == [42, 1, 1]


@pytest.mark.parametrize(
    ("algo", "module", "name", "size"),
    [("xxh3_128", xxhash, "xxh3_128_digest", 16), ("sha256", hashlib, "sha256", 32)],
)
def test_wide_zero_digest_maps_to_one(monkeypatch, algo, module, name, size) -> None:
    inputs: list[bytes] = []

    class _Zero:
        def digest(self) -> bytes:
            return bytes(size)

    def fake(data: bytes) -> object:
        inputs.append(bytes(data))
        return bytes(size) if algo == "xxh3_128" else _Zero()

    monkeypatch.setattr(module, name, fake)
    assert compute_block_hashes([1] * 32, 16, parent=42, algo=algo) == [1, 1]
    assert inputs[0][:size] == (42).to_bytes(size, "big")
    assert inputs[1][:size] == (1).to_bytes(size, "big")


# --------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [0, -16, 1.5, 16.0, True, "16", None])
def test_bad_block_size(block_size: object) -> None:
    with pytest.raises(InvalidArgumentError, match="block_size"):
        compute_block_hashes([1, 2, 3, 4], block_size)  # type: ignore[arg-type]


def test_unknown_algo_lists_valid_ones() -> None:
    with pytest.raises(InvalidArgumentError, match="xxh3_64, xxh3_128, sha256"):
        compute_block_hashes([1, 2], 1, algo="md5")
    with pytest.raises(InvalidArgumentError, match="md5"):
        root_hash(algo="md5")


@pytest.mark.parametrize(
    "algo",
    [["xxh3_64"], {}, np.array(["xxh3_64"]), None, b"xxh3_64", 64],
    ids=["list", "dict", "array", "none", "bytes", "int"],
)
def test_non_str_algo_is_refused(algo: object) -> None:
    # Unhashable ones once escaped as a bare TypeError from the algorithm lookup.
    with pytest.raises(InvalidArgumentError, match=f"must be a str.*got {type(algo).__name__}"):
        compute_block_hashes([1, 2], 2, algo=algo)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="must be a str"):
        root_hash(algo=algo)  # type: ignore[arg-type]


def test_numpy_str_algo_is_a_name() -> None:
    assert root_hash(algo=np.str_("sha256")) == root_hash(algo="sha256")


@pytest.mark.parametrize(
    "tokens",
    [
        torch.zeros(2, 16, dtype=torch.int64),
        torch.tensor(5),
        np.zeros((2, 16), dtype=np.int32),
        np.array(5),
    ],
    ids=["tensor-2d", "tensor-0d", "array-2d", "array-0d"],
)
def test_not_1d_tensor_or_array(tokens: object) -> None:
    with pytest.raises(InvalidTensorError, match="1-D"):
        compute_block_hashes(tokens, 16)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "tokens",
    [
        torch.ones(16, dtype=torch.float32),
        torch.ones(16, dtype=torch.bool),
        torch.ones(16, dtype=torch.complex64),
        np.ones(16, dtype=np.float64),
        np.ones(16, dtype=bool),
        np.array([1] * 16, dtype=object),
    ],
    ids=["tensor-float", "tensor-bool", "tensor-complex", "array-float", "array-bool", "object"],
)
def test_non_integer_dtype(tokens: object) -> None:
    with pytest.raises(InvalidTensorError, match="integer dtype"):
        compute_block_hashes(tokens, 16)  # type: ignore[arg-type]


def test_non_cpu_tensor_raises_without_copying() -> None:
    # A meta tensor holds no values: any attempt to read it would fail differently.
    with pytest.raises(InvalidTensorError, match="meta"):
        compute_block_hashes(torch.ones(32, dtype=torch.int32, device="meta"), 16)


@pytest.mark.parametrize(
    "tokens",
    [
        [1, 2, 3, INT32_MAX + 1],
        [1, 2, 3, INT32_MIN - 1],
        np.array([1, 2, 3, 2**31], dtype=np.int64),
        np.array([1, 2, 3, -(2**31) - 1], dtype=np.int64),
        np.array([1, 2, 3, 2**31], dtype=np.uint32),
        np.array([1, 2, 3, 2**64 - 1], dtype=np.uint64),
        torch.tensor([1, 2, 3, 2**40]),
    ],
    ids=["list-high", "list-low", "int64-high", "int64-low", "uint32", "uint64", "tensor"],
)
@pytest.mark.usefixtures("range_check")
def test_out_of_int32_range(tokens: object) -> None:
    with pytest.raises(InvalidArgumentError, match="index 3 is outside the int32 range"):
        compute_block_hashes(tokens, 2)  # type: ignore[arg-type]


def test_out_of_range_in_partial_block_still_raises() -> None:
    with pytest.raises(InvalidArgumentError, match="int32"):
        compute_block_hashes([1] * 16 + [2**40], 16)


@pytest.mark.parametrize(
    ("tokens", "match"),
    [
        ([1, 2, 1.5], "index 2 is 1.5"),
        ([1, "2"], "must be ints"),
        ([[1, 2], [3, 4]], "1-D"),
        ([1, None], "must be ints"),
        ("abcd", "got str"),
        (b"abcd", "got bytes"),
        (bytearray(b"ab"), "got bytearray"),
        (7, "got int"),
        ({1, 2}, "got set"),
        (None, "got NoneType"),
    ],
)
def test_bad_token_sequences(tokens: object, match: str) -> None:
    with pytest.raises(InvalidArgumentError, match=match):
        compute_block_hashes(tokens, 1)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("parent", "algo"),
    [
        (0, "xxh3_64"),
        (-1, "xxh3_64"),
        (2**63, "xxh3_64"),
        (2**128, "xxh3_128"),
        (2**256, "sha256"),
        (True, "xxh3_64"),
        (1.0, "xxh3_64"),
        ("5", "xxh3_64"),
    ],
)
def test_bad_parent(parent: object, algo: str) -> None:
    with pytest.raises(InvalidArgumentError, match="parent"):
        compute_block_hashes([1, 2], 1, parent=parent, algo=algo)  # type: ignore[arg-type]


def test_wide_parent_is_accepted_by_wide_algorithms() -> None:
    assert len(compute_block_hashes([1, 2], 1, parent=2**63, algo="xxh3_128")) == 2
    assert len(compute_block_hashes([1, 2], 1, parent=2**255, algo="sha256")) == 2


@pytest.mark.parametrize("salt", [5, ["a"], ("a",), 1.5])
def test_bad_salt(salt: object) -> None:
    with pytest.raises(InvalidArgumentError, match="salt"):
        compute_block_hashes([1], 1, salt=salt)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="salt"):
        root_hash(salt)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "extra_keys",
    [
        "lora",
        b"lora",
        5,
        (1.5,),
        (True,),
        (None,),
        ([1],),
        (("a", 2.0),),
        ({"a": 1},),
    ],
)
def test_bad_extra_keys(extra_keys: object) -> None:
    with pytest.raises(InvalidArgumentError, match="extra"):
        compute_block_hashes([1], 1, extra_keys=extra_keys)  # type: ignore[arg-type]
    # Checked even when a parent makes them unused.
    with pytest.raises(InvalidArgumentError, match="extra"):
        compute_block_hashes([1], 1, parent=5, extra_keys=extra_keys)  # type: ignore[arg-type]


def test_errors_are_value_errors() -> None:
    with pytest.raises(ValueError):
        compute_block_hashes([1], 0)


# --------------------------------------------------------------------------
# Properties
# --------------------------------------------------------------------------

token_lists = st.lists(st.integers(INT32_MIN, INT32_MAX), max_size=120)
block_sizes = st.integers(1, 20)
algos = st.sampled_from(HASH_ALGORITHMS)


@settings(deadline=None)
@given(tokens=token_lists, other=token_lists, block_size=block_sizes, algo=algos)
def test_prefix_property(tokens, other, block_size, algo) -> None:
    """Blocks before the first differing token agree; that block and all later ones differ."""
    first = compute_block_hashes(tokens, block_size, algo=algo)
    second = compute_block_hashes(other, block_size, algo=algo)
    common = next(
        (i for i, (a, b) in enumerate(zip(tokens, other, strict=False)) if a != b),
        min(len(tokens), len(other)),
    )
    same_blocks = common // block_size
    assert first[:same_blocks] == second[:same_blocks]
    for a, b in zip(first[same_blocks:], second[same_blocks:], strict=False):
        assert a != b


@settings(deadline=None)
@given(
    tokens=token_lists,
    block_size=block_sizes,
    split=st.integers(0, 10),
    algo=algos,
    salt=st.one_of(st.none(), st.text(min_size=1, max_size=5), st.binary(min_size=1, max_size=5)),
)
def test_continuation_property(tokens, block_size, split, algo, salt) -> None:
    """Hashing a prefix of whole blocks, then the rest with parent=last, equals one call."""
    cut = min(split, len(tokens) // block_size) * block_size
    whole = compute_block_hashes(tokens, block_size, salt=salt, algo=algo)
    head = compute_block_hashes(tokens[:cut], block_size, salt=salt, algo=algo)
    parent = head[-1] if head else root_hash(salt, algo=algo)
    tail = compute_block_hashes(tokens[cut:], block_size, parent=parent, algo=algo)
    assert head + tail == whole
    assert len(whole) == len(tokens) // block_size


@settings(deadline=None)
@given(tokens=token_lists, block_size=block_sizes)
def test_input_type_property(tokens, block_size) -> None:
    expected = compute_block_hashes(tokens, block_size)
    assert compute_block_hashes(np.array(tokens, dtype=np.int64), block_size) == expected
    assert compute_block_hashes(np.array(tokens, dtype=np.int32), block_size) == expected
