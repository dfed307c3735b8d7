"""Chained block hashes: equal hashes mean equal prefixes.

A prompt is cut into blocks of ``block_size`` tokens; only full blocks get a
hash. The hash of block ``i`` covers the hash of block ``i - 1`` (its parent)
and the tokens of block ``i``, so two prompts share the hash of block ``k``
exactly when they agree on every token of blocks ``0..k`` (up to collisions).
Block 0's parent is the *root*, derived from the salt and the extra keys
(tenant ``cache_salt``, LoRA name, weight epoch, ...): a different salt gives a
different root and a disjoint hash chain, so two tenants or two weight versions
never share a block.

Tokens are canonicalised to little-endian int32 bytes before hashing, so a
list, an int64 tensor and an int32 array holding the same values hash alike.

Algorithms (``HASH_ALGORITHMS``):

- ``"xxh3_64"`` (default): XXH3-64 of the block's bytes, seeded with the parent
  hash; the digest is folded to a positive 63-bit int (``& (2**63 - 1)``, 0
  mapped to 1), which seeds the next block. 0 and -1 stay free as sentinels and
  every hash fits an int64 tensor. Fast, but not collision resistant: someone
  who controls prompt text can craft colliding blocks.
- ``"xxh3_128"``: XXH3-128 of the parent's 16 bytes followed by the block's
  bytes; positive ints below ``2**128``.
- ``"sha256"``: SHA-256 of the parent's 32 bytes followed by the block's bytes;
  positive ints below ``2**256``. For deployments that fear crafted collisions.

All functions here are pure and thread-safe.
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING

import numpy as np
import xxhash

from prefixcache.engine.token_bytes import int32_le_buffer
from prefixcache.engine.validation import is_int, require_int
from prefixcache.errors import InvalidArgumentError

if TYPE_CHECKING:
    import torch

__all__ = ["HASH_ALGORITHMS", "MAX_HASH", "compute_block_hashes", "root_hash"]

HASH_ALGORITHMS: tuple[str, ...] = ("xxh3_64", "xxh3_128", "sha256")
"""Names accepted by the ``algo`` argument; the first is the default."""

_MASK63 = (1 << 63) - 1
# Largest hash each algorithm returns; every hash is in [1, _MAX_HASH[algo]].
_MAX_HASH = {"xxh3_64": _MASK63, "xxh3_128": (1 << 128) - 1, "sha256": (1 << 256) - 1}
MAX_HASH: Mapping[str, int] = MappingProxyType(_MAX_HASH)
"""Largest hash of each algorithm; every hash it returns is in ``[1, MAX_HASH[algo]]``."""
# Digest bytes of 0 and of 1, for the xxh3_128 and sha256 chains.
_ZERO_16, _ONE_16 = bytes(16), (1).to_bytes(16, "big")
_ZERO_32, _ONE_32 = bytes(32), (1).to_bytes(32, "big")

# Root material: a domain tag, then the salt and the extra keys, each
# length-prefixed (see _encode_key), so no two (salt, extra_keys) share bytes.
_ROOT_TAG = b"prefixcache.hashing.root.v1\x00"
_LENGTH = struct.Struct("<Q")
# How blocks are cut out of the token buffer (_hash_full_blocks), tuned with
# benchmarks/bench_hashing.py ("variants"): blocks of at least _SLICE_FROM_BYTES,
# and calls of at most _SLICE_UP_TO_BLOCKS blocks, are memoryview slices (numpy's
# copies were no faster at block size 256 and slower at 1024); otherwise numpy
# copies the blocks out, _CHUNK_BYTES of tokens at a time. Chunks bound the
# transient bytes objects (~0.4 MB): one pass over 128k tokens at block size 16
# took ~250 page faults a call in a fresh process and ran 1.9x slower (heap
# history decides; not every process shows it). 2**16 was 5-10% slower.
_SLICE_FROM_BYTES = 1024
_SLICE_UP_TO_BLOCKS = 8  # numpy's split costs ~0.5 us a call; slicing ~0.1 us a block
_CHUNK_BYTES = 1 << 18


def root_hash(
    salt: str | bytes | None = None,
    extra_keys: Sequence[object] | None = None,
    algo: str = "xxh3_64",
) -> int:
    """The parent value of block 0 for a salt and extra keys.

    ``compute_block_hashes(t, n, salt=s, extra_keys=k)`` equals
    ``compute_block_hashes(t, n, parent=root_hash(s, k))``.

    >>> root_hash("tenant-a") == root_hash(b"tenant-a") != root_hash("tenant-b")
    True
    >>> root_hash(extra_keys=("lora", "sql-adapter")) != root_hash()
    True

    Args:
        salt: tenant or request salt. A ``str`` is taken as its UTF-8 bytes,
            so ``"a"`` and ``b"a"`` are the same salt. ``None`` means no salt;
            an empty salt is refused, so a tenant ID that came out empty
            fails loudly instead of sharing the unsalted chains.
        extra_keys: further keys separating hash chains (LoRA name, weight
            epoch, ...). Each is a ``str``, ``bytes``, an int (a numpy
            integer is the same key as the equal Python int; bools are
            refused) or a tuple of those, encoded with type
            tags and length prefixes, so ``"1"``, ``b"1"``, ``1`` and
            ``(1,)`` are all different keys. Order
            matters. ``None`` and an empty sequence are the same.
        algo: one of ``HASH_ALGORITHMS``.

    Returns:
        A positive int in the range of ``algo``'s hashes.

    Raises:
        InvalidArgumentError: unknown ``algo``; ``salt`` not str/bytes, or
            empty; ``extra_keys`` not a sequence, or a key of another type (bools,
            floats, None and lists are refused rather than guessed at).

    Complexity: O(size of salt and keys); O(1) without them.
    """
    _check_algo(algo)
    if salt is None and extra_keys is None:
        return _DEFAULT_ROOT[algo]
    return _root_from_material(_root_material(salt, extra_keys), algo)


def compute_block_hashes(
    tokens: torch.Tensor | np.ndarray | Sequence[int],
    block_size: int,
    *,
    parent: int | np.integer | None = None,
    salt: str | bytes | None = None,
    extra_keys: Sequence[object] | None = None,
    algo: str = "xxh3_64",
) -> list[int]:
    """Chained hashes of the full blocks of ``tokens``, in order.

    A trailing partial block gets no hash (its tokens are still validated).
    To continue a chain, pass the last hash as ``parent``:

    >>> tokens = list(range(100, 164))
    >>> head = compute_block_hashes(tokens[:40], 16)  # 2 full blocks, 8 tokens left over
    >>> len(head)
    2
    >>> tail = compute_block_hashes(tokens[32:], 16, parent=head[-1])
    >>> head + tail == compute_block_hashes(tokens, 16)
    True

    Args:
        tokens: token IDs, one of: a 1-D CPU ``torch.Tensor`` of an integer
            dtype, a 1-D numpy integer array, or a sequence of ints. Every
            value must fit in int32.
        block_size: tokens per block, a positive int.
        parent: hash of the block before ``tokens[0]``, to continue a chain
            (an int, or a numpy integer read back from an array). When
            given, ``salt`` and ``extra_keys`` are type-checked but not
            hashed: the parent already encodes the chain's root.
        salt: see ``root_hash``; used only when ``parent`` is None.
        extra_keys: see ``root_hash``; used only when ``parent`` is None.
        algo: one of ``HASH_ALGORITHMS``.

    Returns:
        ``len(tokens) // block_size`` positive ints, each in
        ``[1, 2**63 - 1]`` (xxh3_64), ``[1, 2**128 - 1]`` (xxh3_128) or
        ``[1, 2**256 - 1]`` (sha256).

    Raises:
        InvalidTensorError: a tensor not on the CPU (it is never copied from
            the device here), not 1-D, or of a non-integer dtype; a numpy
            array not 1-D or of a non-integer dtype.
        InvalidArgumentError: ``block_size`` not a positive int; unknown
            ``algo``; ``parent`` not an int in the algorithm's range; a token
            outside int32 or not an int; ``tokens`` of an unsupported type
            (str, bytes, a scalar); bad ``salt`` or ``extra_keys`` (see
            ``root_hash``).

    Complexity: O(len(tokens)), one hash call per full block.
    """
    block_size = require_int(block_size, "block_size", minimum=1)
    _check_algo(algo)
    if parent is None:
        seed = root_hash(salt, extra_keys, algo)
    else:
        if salt is not None or extra_keys is not None:
            _root_material(salt, extra_keys)  # type-check only; the parent carries the root
        seed = _check_parent(parent, algo)
    buffer, num_tokens = int32_le_buffer(tokens)
    return _hash_full_blocks(buffer, num_tokens // block_size, block_size, seed, algo)


def _hash_full_blocks(
    buffer: memoryview, num_blocks: int, block_size: int, seed: int, algo: str
) -> list[int]:
    """Chained hashes of the first ``num_blocks`` blocks of the byte ``buffer``."""
    chain = _CHAINS[algo]
    step = 4 * block_size
    if step >= _SLICE_FROM_BYTES or num_blocks <= _SLICE_UP_TO_BLOCKS:
        # Large blocks, or a few blocks (as after a decode step): slicing a
        # memoryview copies nothing, and its cost per block is small against
        # the hashing, or against numpy's fixed cost per call.
        return chain([buffer[o : o + step] for o in range(0, num_blocks * step, step)], seed)
    block_dtype = _block_dtype(block_size)
    chunk_blocks = max(1, _CHUNK_BYTES // step)
    hashes: list[int] = []
    for start in range(0, num_blocks, chunk_blocks):
        # Small blocks: numpy cuts the buffer into one bytes object per block
        # in C, faster than slicing in the Python loop. Chunking bounds those
        # transient objects, so pymalloc reuses its pools instead of mapping
        # fresh pages on every call.
        count = min(chunk_blocks, num_blocks - start)
        blocks = np.frombuffer(buffer, dtype=block_dtype, count=count, offset=start * step)
        hashes += chain(blocks.tolist(), seed)
        seed = hashes[-1]
    return hashes


# --------------------------------------------------------------------------
# Chains: list of block bytes + parent value -> list of hashes
# --------------------------------------------------------------------------

_Block = bytes | memoryview  # one block's little-endian int32 token bytes


def _chain_xxh3_64(blocks: list[_Block], seed: int) -> list[int]:
    digest = xxhash.xxh3_64_intdigest
    mask = _MASK63
    h = seed
    # The chain runs through the seed. A comprehension with := is a few per cent
    # faster than a loop with a bound append (bench_hashing.py, "variants").
    return [(h := digest(block, h) & mask or 1) for block in blocks]


def _chain_xxh3_128(blocks: list[_Block], seed: int) -> list[int]:
    digest = xxhash.xxh3_128_digest
    from_bytes = int.from_bytes
    parent = seed.to_bytes(16, "big")
    hashes: list[int] = []
    append = hashes.append
    for block in blocks:
        parent = digest(parent + block)
        if parent == _ZERO_16:  # 0 is a sentinel; go on from 1, as a caller's chain would
            parent = _ONE_16
        append(from_bytes(parent, "big"))
    return hashes


def _chain_sha256(blocks: list[_Block], seed: int) -> list[int]:
    sha256 = hashlib.sha256
    from_bytes = int.from_bytes
    parent = seed.to_bytes(32, "big")
    hashes: list[int] = []
    append = hashes.append
    for block in blocks:
        parent = sha256(parent + block).digest()
        if parent == _ZERO_32:  # 0 is a sentinel; go on from 1, as a caller's chain would
            parent = _ONE_32
        append(from_bytes(parent, "big"))
    return hashes


_CHAINS = {"xxh3_64": _chain_xxh3_64, "xxh3_128": _chain_xxh3_128, "sha256": _chain_sha256}


@functools.lru_cache(maxsize=64)
def _block_dtype(block_size: int) -> np.dtype:
    """An opaque numpy dtype one block of int32 tokens wide."""
    return np.dtype((np.void, 4 * block_size))


# --------------------------------------------------------------------------
# Roots, parents, algorithms
# --------------------------------------------------------------------------


def _check_algo(algo: str) -> None:
    # The str test comes first: an unhashable algo (a list, a dict, an array)
    # would make the dict lookup raise a bare TypeError.
    if not isinstance(algo, str):
        raise InvalidArgumentError(
            f"hash algo must be a str, one of {', '.join(HASH_ALGORITHMS)}; "
            f"got {type(algo).__name__}"
        )
    if algo not in _MAX_HASH:
        raise InvalidArgumentError(
            f"unknown hash algo {algo!r}; valid: {', '.join(HASH_ALGORITHMS)}"
        )


def _check_parent(parent: object, algo: str) -> int:
    if isinstance(parent, (bool, np.bool_)) or not isinstance(parent, (int, np.integer)):
        raise InvalidArgumentError(f"parent must be an int hash, got {type(parent).__name__}")
    value = int(parent)
    if not 1 <= value <= _MAX_HASH[algo]:
        raise InvalidArgumentError(
            f"parent {value} is not a {algo} hash (valid: 1 <= parent <= {_MAX_HASH[algo]})"
        )
    return value


def _root_material(salt: str | bytes | None, extra_keys: Sequence[object] | None) -> bytes:
    """Unambiguous bytes naming (salt, extra_keys); validates both."""
    out = bytearray(_ROOT_TAG)
    if salt is None:
        salt_bytes = b""
    elif isinstance(salt, str):
        salt_bytes = salt.encode("utf-8", "surrogatepass")
    elif isinstance(salt, (bytes, bytearray)):
        salt_bytes = bytes(salt)
    else:
        raise InvalidArgumentError(f"salt must be str, bytes or None, got {type(salt).__name__}")
    if salt is not None and not salt_bytes:
        raise InvalidArgumentError("salt is empty; pass None for no salt, or a non-empty salt")
    _encode_key(salt_bytes, out)
    if extra_keys is None:
        keys: tuple[object, ...] = ()
    elif isinstance(extra_keys, (str, bytes, bytearray)) or not isinstance(extra_keys, Sequence):
        raise InvalidArgumentError(
            f"extra_keys must be a sequence of keys (e.g. a tuple), got {type(extra_keys).__name__}"
        )
    else:
        keys = tuple(extra_keys)
    _encode_key(keys, out)
    return bytes(out)


def _encode_key(key: object, out: bytearray) -> None:
    """Append ``key`` as type tag + 8-byte length + payload (tuples: tag + count + items)."""
    if isinstance(key, tuple):
        out += b"t"
        out += _LENGTH.pack(len(key))
        for item in key:
            _encode_key(item, out)
        return
    if isinstance(key, str):
        tag, payload = b"s", key.encode("utf-8", "surrogatepass")
    elif isinstance(key, (bytes, bytearray)):
        tag, payload = b"b", bytes(key)
    elif type(key) is int or is_int(key):  # any Python int, a numpy integer, never a bool
        # Two's complement, one spare bit for the sign: one encoding per value.
        value = int(key)
        tag, payload = b"i", value.to_bytes(value.bit_length() // 8 + 1, "little", signed=True)
    else:
        raise InvalidArgumentError(
            f"extra key {key!r} has type {type(key).__name__}; "
            "use str, bytes, int or a tuple of those"
        )
    out += tag
    out += _LENGTH.pack(len(payload))
    out += payload


def _root_from_material(material: bytes, algo: str) -> int:
    if algo == "xxh3_64":
        return xxhash.xxh3_64_intdigest(material) & _MASK63 or 1
    if algo == "xxh3_128":
        return xxhash.xxh3_128_intdigest(material) or 1
    return int.from_bytes(hashlib.sha256(material).digest(), "big") or 1


_DEFAULT_ROOT = {algo: _root_from_material(_root_material(None, None), algo) for algo in _MAX_HASH}
