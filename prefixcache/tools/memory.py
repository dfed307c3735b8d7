"""Cache capacities in bytes: sizes like ``8GiB``, a model's KV shape, and the blocks they make.

A user sizes a cache in memory, the replay counts blocks. One block of a
trace holds ``block_tokens`` tokens of keys and values for every layer::

    bytes per block = 2 (K and V) * layers * kv_heads * head_dim * dtype bytes * block_tokens

and a capacity of ``B`` bytes holds ``B // bytes per block`` blocks (rounded
down: a part block cannot be cached). The shape is written the way a model's
config reads, ``layers=32,kv_heads=8,head_dim=128,dtype=bf16`` (Llama-3-8B).

>>> shape = parse_model_shape("layers=32,kv_heads=8,head_dim=128,dtype=bf16")
>>> shape.bytes_per_block(512)
67108864
>>> parse_size("8GiB") // shape.bytes_per_block(512)
128
>>> format_bytes(67108864)
'64 MiB'
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = [
    "DTYPE_BYTES",
    "ByteSize",
    "ModelShape",
    "format_bytes",
    "parse_capacity",
    "parse_model_shape",
    "parse_size",
]

DTYPE_BYTES = {
    "fp32": 4,
    "float32": 4,
    "fp16": 2,
    "float16": 2,
    "bf16": 2,
    "bfloat16": 2,
    "fp8": 1,
    "float8": 1,
    "int8": 1,
}
"""Bytes per element of each KV-cache dtype the shape accepts."""

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*")
_SHAPE_KEYS = ("layers", "kv_heads", "head_dim", "dtype")


class ByteSize(int):
    """A capacity given in bytes (``8GiB``), told apart from a count of blocks (``5000``)."""

    def __repr__(self) -> str:
        return f"ByteSize({int(self)})"


def parse_size(text: str) -> int:
    """Bytes in ``text``: a number with an optional unit, ``B``, ``KB``..``TB`` (powers of
    1000) or ``KiB``..``TiB`` (powers of 1024), any case: ``8GiB``, ``1.5 GB``, ``4096``.

    Raises:
        ValueError: not a size, or below one byte.

    Complexity: O(len(text)).
    """
    match = _SIZE.fullmatch(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ValueError(f"expected a size such as 8GiB or 500MB, got {text!r}")
    value = float(match.group(1)) * _UNITS[unit]
    if value < 1:
        raise ValueError(f"expected a size of at least 1 byte, got {text!r}")
    return int(value)


def parse_capacity(text: str) -> int:
    """A capacity: blocks (a plain int ``>= 1``) or bytes (with a unit: a :class:`ByteSize`).

    Raises:
        ValueError: neither.

    Complexity: O(len(text)).
    """
    stripped = text.strip()
    if stripped.isdigit():
        blocks = int(stripped)
        if blocks < 1:
            raise ValueError(f"expected an int >= 1 or a size such as 8GiB, got {text!r}")
        return blocks
    try:
        return ByteSize(parse_size(stripped))
    except ValueError:
        raise ValueError(
            f"expected blocks (an int >= 1) or a size such as 8GiB, got {text!r}"
        ) from None


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The KV-cache shape of a model: what one token costs in every layer.

    Attributes:
        layers: attention layers holding a KV cache.
        kv_heads: key/value heads per layer (after grouped-query sharing).
        head_dim: elements per head.
        dtype: the cache's element type, a key of :data:`DTYPE_BYTES`.
    """

    layers: int
    kv_heads: int
    head_dim: int
    dtype: str

    def bytes_per_token(self) -> int:
        """Keys and values of one token in every layer."""
        return 2 * self.layers * self.kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    def bytes_per_block(self, block_tokens: int) -> int:
        """Keys and values of one ``block_tokens``-token block in every layer."""
        return self.bytes_per_token() * block_tokens

    def describe(self, block_tokens: int) -> str:
        """The arithmetic, spelled out: ``2 (K, V) x 32 layers x ... = 64 MiB``."""
        return (
            f"2 (K, V) x {self.layers} layers x {self.kv_heads} kv heads x {self.head_dim} "
            f"head dim x {DTYPE_BYTES[self.dtype]} bytes ({self.dtype}) x {block_tokens} "
            f"tokens = {format_bytes(self.bytes_per_block(block_tokens))}"
        )


def parse_model_shape(text: str) -> ModelShape:
    """``layers=32,kv_heads=8,head_dim=128,dtype=bf16`` as a :class:`ModelShape`.

    All four keys, once each, in any order; counts are ints >= 1; dtype one of
    :data:`DTYPE_BYTES` (any case).

    Raises:
        ValueError: naming the key that is missing, repeated, unknown or bad.

    Complexity: O(len(text)).
    """
    values: dict[str, str] = {}
    for part in text.split(","):
        key, equals, value = (item.strip() for item in part.partition("="))
        if not equals or key not in _SHAPE_KEYS:
            raise ValueError(f"expected key=value with keys {', '.join(_SHAPE_KEYS)}; got {part!r}")
        if key in values:
            raise ValueError(f"{key} given twice")
        values[key] = value
    missing = [key for key in _SHAPE_KEYS if key not in values]
    if missing:
        raise ValueError(f"missing {', '.join(missing)} (e.g. {_EXAMPLE_SHAPE})")
    counts = {}
    for key in _SHAPE_KEYS[:3]:
        if not values[key].isdigit() or int(values[key]) < 1:
            raise ValueError(f"{key} must be an int >= 1, got {values[key]!r}")
        counts[key] = int(values[key])
    dtype = values["dtype"].lower()
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_BYTES)}, got {values['dtype']!r}")
    return ModelShape(counts["layers"], counts["kv_heads"], counts["head_dim"], dtype)


_EXAMPLE_SHAPE = "layers=32,kv_heads=8,head_dim=128,dtype=bf16"


def format_bytes(num_bytes: float) -> str:
    """``num_bytes`` in the largest binary unit it fills: ``64 MiB``, ``1.5 GiB``, ``512 B``.

    Complexity: O(1).
    """
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= size:
            return f"{num_bytes / size:.4g} {unit}"
    return f"{num_bytes:.0f} B"
