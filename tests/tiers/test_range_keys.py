"""Range keys: prompts that differ only in an image or a LoRA span share what precedes it."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixcache import KVBlockAllocator
from prefixcache.engine.hashing import root_hash
from prefixcache.errors import InvalidArgumentError
from prefixcache.tiers import RangeKey, range_keyed_hashes
from prefixcache.tiers.range_keys import block_keys

BLOCK = 4
ALLOCATOR = KVBlockAllocator(total_count=4, block_size_tokens=BLOCK, device="cpu")


def reference(tokens: list[int], ranges: list[RangeKey]) -> list[int]:
    """One block at a time, overlaps found token by token: the obviously right version."""
    hashes: list[int] = []
    for block in range(len(tokens) // BLOCK):
        covered = range(block * BLOCK, (block + 1) * BLOCK)
        keys = tuple(
            r.key
            for r in ranges
            if any(r.start <= t and (r.end is None or t < r.end) for t in covered)
        )
        parent = hashes[-1] if hashes else None
        plain = ALLOCATOR.hash_tokens(tokens[covered.start : covered.stop], parent=parent)[0]
        hashes.append(
            root_hash(extra_keys=("prefixcache.range_key", plain, keys)) if keys else plain
        )
    return hashes


range_keys = st.builds(
    lambda start, length, key: RangeKey(start, None if length == 0 else start + length, key),
    st.integers(0, 30),
    st.integers(0, 9),
    st.sampled_from(["img-a", "img-b", ("lora", "sql"), 7, b"\x01"]),
)


@settings(max_examples=60, deadline=None)
@given(tokens=st.lists(st.integers(0, 50), max_size=36), ranges=st.lists(range_keys, max_size=3))
def test_hashes_match_the_block_by_block_reference(tokens, ranges):
    assert range_keyed_hashes(ALLOCATOR, tokens, ranges) == reference(tokens, ranges)


@settings(max_examples=60, deadline=None)
@given(
    text=st.integers(0, 20),
    image=st.integers(1, 12),
    tail=st.integers(0, 12),
)
def test_prompts_differing_only_in_an_image_share_only_the_blocks_before_it(text, image, tail):
    placeholder = [9] * image
    tokens = list(range(text)) + placeholder + list(range(100, 100 + tail))
    a = range_keyed_hashes(ALLOCATOR, tokens, [RangeKey(text, text + image, "image-a")])
    b = range_keyed_hashes(ALLOCATOR, tokens, [RangeKey(text, text + image, "image-b")])
    plain = range_keyed_hashes(ALLOCATOR, tokens)
    shared = text // BLOCK  # blocks wholly before the image
    assert a[:shared] == b[:shared] == plain[:shared]
    assert all(x != y for x, y in zip(a[shared:], b[shared:], strict=True))
    assert not set(a[shared:]) & set(plain)


def test_a_lora_span_from_a_position_on_covers_decode_too():
    tokens = list(range(24))
    lora = [RangeKey(8, None, ("lora", "sql"))]
    whole = range_keyed_hashes(ALLOCATOR, tokens, lora)
    head = range_keyed_hashes(ALLOCATOR, tokens[:12], lora)
    rest = range_keyed_hashes(ALLOCATOR, tokens[12:], lora, first_token=12, parent=head[-1])
    assert head + rest == whole
    assert (
        whole[:2] == ALLOCATOR.hash_tokens(tokens)[:2]
        and whole[2] != ALLOCATOR.hash_tokens(tokens)[2]
    )


def test_salt_and_extra_keys_go_to_the_root():
    tokens = list(range(8))
    assert range_keyed_hashes(ALLOCATOR, tokens, salt="t") == ALLOCATOR.hash_tokens(
        tokens, salt="t"
    )
    assert range_keyed_hashes(ALLOCATOR, tokens, extra_keys=(1,)) == ALLOCATOR.hash_tokens(
        tokens, extra_keys=(1,)
    )


def test_block_keys_lists_overlaps_in_range_order():
    ranges = [RangeKey(2, 6, "x"), RangeKey(5, None, "y")]
    assert block_keys(ranges, 0, 3, BLOCK) == [("x",), ("x", "y"), ("y",)]
    assert block_keys(ranges, 2, 1, BLOCK) == [("y",)]


@pytest.mark.parametrize(
    "build",
    [
        lambda: RangeKey(-1, None, "k"),
        lambda: RangeKey(3, 3, "k"),
        lambda: RangeKey(0, None, 1.5),
        lambda: RangeKey(True, None, "k"),
    ],
)
def test_a_malformed_range_is_refused(build):
    with pytest.raises(InvalidArgumentError):
        build()


def test_bad_arguments_are_refused():
    with pytest.raises(InvalidArgumentError):
        range_keyed_hashes(ALLOCATOR, [1] * 8, [("not", "a", "range")])  # type: ignore[list-item]
    with pytest.raises(InvalidArgumentError):
        range_keyed_hashes(ALLOCATOR, [1] * 8, first_token=3, parent=5)


def test_requests_with_different_images_never_share_the_image_blocks(make_loop):
    loop = make_loop(17, 8)
    tokens = list(range(6)) + [9] * 8 + [1, 2, 3, 4]
    image_a = [RangeKey(6, 14, "sha-of-image-a")]
    image_b = [RangeKey(6, 14, "sha-of-image-b")]
    assert loop.admit("a", tokens, ranges=image_a) == 0
    assert loop.admit("b", tokens, ranges=image_b) == BLOCK  # the text before the image
    assert loop.admit("c", tokens, ranges=image_a) == 4 * BLOCK
    ids = {name: loop.block_ids[name] for name in "abc"}
    assert ids["a"][0] == ids["b"][0] and not set(ids["a"][1:4]) & set(ids["b"][1:4])
    assert ids["a"][:4] == ids["c"][:4]


def test_a_custom_hash_function_mixes_with_xxh3(make_loop):
    def weak(tokens, block_size, *, parent=None, salt=None, extra_keys=None):
        seed = parent or 1
        out = []
        for start in range(0, len(tokens) // block_size * block_size, block_size):
            seed = (seed * 31 + sum(tokens[start : start + block_size])) % (1 << 40) + 1
            out.append(seed)
        return out

    custom = KVBlockAllocator(total_count=4, block_size_tokens=BLOCK, device="cpu", hash_algo=weak)
    keyed = range_keyed_hashes(custom, list(range(8)), [RangeKey(4, None, "k")])
    assert keyed[0] == weak(list(range(8)), BLOCK)[0] and keyed[1] != weak(list(range(8)), BLOCK)[1]
