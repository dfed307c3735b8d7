"""Hash keys for token ranges: a multimodal item or a LoRA span changes only the blocks it covers.

A salt for the whole request (``cache_salt``, the weight epoch) goes into
the chain's root. An image is different: its placeholder tokens are the same
for every image, so the blocks they fall in must also hash the image's
content hash, while the text before the first image should still be shared
with every prompt that starts the same. A :class:`RangeKey` names a token
range ``[start, end)`` (``end=None``: to the end of the sequence, as a LoRA
adapter that applies from a position on) and a key. Each block's hash covers
the keys of every range overlapping the block, in the order the ranges are
given; a block no range overlaps hashes exactly as without keys. Chaining
does the rest: a block after a keyed one differs because its parent does.

A keyed block's hash is derived from its plain chained hash and its keys by
:func:`~prefixcache.engine.hashing.root_hash` (a domain tag, the plain hash,
the keys, length-prefixed), so it never equals a plain hash by construction
of the encoding. See DESIGN.md, "Tiers".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from prefixcache.engine.allocator import KVBlockAllocator
from prefixcache.engine.hashing import root_hash
from prefixcache.engine.validation import require_int
from prefixcache.errors import InvalidArgumentError

_TAG = "prefixcache.range_key"


@dataclass(frozen=True, slots=True)
class RangeKey:
    """A key that applies to the tokens ``[start, end)`` (``end=None``: from ``start`` on).

    Attributes:
        start: first token position covered, >= 0.
        end: one past the last covered position (> ``start``), or None.
        key: a hash key: ``str``, ``bytes``, an int or a tuple of those (an
            image's content hash, ``("lora", name)``).
    """

    start: int
    end: int | None
    key: object

    def __post_init__(self) -> None:
        require_int(self.start, "start", minimum=0)
        if self.end is not None:
            require_int(self.end, "end", minimum=int(self.start) + 1)
        root_hash(extra_keys=(self.key,))  # type-checks the key


def block_keys(
    ranges: Sequence[RangeKey], first_block: int, num_blocks: int, block_size: int
) -> list[tuple[object, ...]]:
    """The keys of each block ``first_block .. first_block + num_blocks - 1``, in range order.

    Complexity: O(num_blocks + blocks covered by the ranges).
    """
    keys: list[list[object]] = [[] for _ in range(num_blocks)]
    for item in ranges:
        first = max(item.start // block_size, first_block)
        stop = first_block + num_blocks
        if item.end is not None:
            stop = min(stop, (item.end - 1) // block_size + 1)
        for block in range(first, stop):
            keys[block - first_block].append(item.key)
    return [tuple(k) for k in keys]


def range_keyed_hashes(
    allocator: KVBlockAllocator,
    tokens: Any,
    ranges: Sequence[RangeKey] = (),
    *,
    first_token: int = 0,
    parent: int | None = None,
    salt: str | bytes | None = None,
    extra_keys: Sequence[object] | None = None,
) -> list[int]:
    """Chained hashes of the full blocks of ``tokens`` with the keys of ``ranges``.

    With no range overlapping a block, its hash is what
    :meth:`KVBlockAllocator.hash_tokens` gives; runs of such blocks are hashed
    in one call.

    Args:
        allocator: whose block size, hash algorithm and ``hash_salt`` apply.
        tokens: token IDs (a sequence, array or CPU tensor).
        ranges: the range keys, positions counted from the sequence's start.
        first_token: absolute position of ``tokens[0]`` (a multiple of the
            block size), to continue a chain with ``parent`` during decode.
        parent: hash of the block before ``tokens[0]``; None starts at the
            root made of ``salt`` and ``extra_keys``.
        salt, extra_keys: as for :meth:`KVBlockAllocator.hash_tokens`.

    Raises:
        InvalidArgumentError: a range that is not a :class:`RangeKey`, a
            ``first_token`` not on a block boundary, or as ``hash_tokens`` raises.

    Complexity: O(len(tokens)) hashing plus O(blocks covered by the ranges).
    """
    size = allocator.block_size_tokens
    first_token = require_int(first_token, "first_token", minimum=0)
    if first_token % size:
        raise InvalidArgumentError(f"first_token {first_token} is not a multiple of {size}")
    for item in ranges:
        if not isinstance(item, RangeKey):
            raise InvalidArgumentError(f"ranges must hold RangeKey, got {type(item).__name__}")
    algo = allocator.config.hash_algo
    mix_algo = algo if isinstance(algo, str) else "xxh3_64"
    num_blocks = len(tokens) // size
    keys = block_keys(ranges, first_token // size, num_blocks, size)
    hashes: list[int] = []
    start = 0
    while start < num_blocks:
        end = start + 1
        while end < num_blocks and bool(keys[end]) == bool(keys[start]):
            end += 1
        if keys[start]:
            end = start + 1  # keyed blocks one at a time
        prev = hashes[-1] if hashes else parent
        plain = allocator.hash_tokens(
            tokens[start * size : end * size],
            parent=prev,
            salt=salt if prev is None else None,
            extra_keys=extra_keys if prev is None else None,
        )
        if keys[start]:
            plain = [root_hash(extra_keys=(_TAG, plain[0], keys[start]), algo=mix_algo)]
        hashes.extend(plain)
        start = end
    return hashes


__all__ = ["RangeKey", "block_keys", "range_keyed_hashes"]
