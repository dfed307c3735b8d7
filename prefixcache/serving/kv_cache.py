"""KVCache: the per-layer K and V storage that block IDs index, and sizing it from memory."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from prefixcache.engine.block_ids import to_int_array
from prefixcache.engine.pool import resolve_device
from prefixcache.engine.validation import require_int
from prefixcache.errors import (
    CapacityError,
    ConfigError,
    InvalidArgumentError,
    InvalidTensorError,
)

IndexLike = torch.Tensor | np.ndarray | Sequence[int]
"""Block IDs or in-block offsets: host ints, or an integer tensor already on the cache's device."""


def _require_float_dtype(dtype: object) -> torch.dtype:
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ConfigError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    return dtype


def blocks_for_memory_budget(
    budget_bytes: int,
    *,
    num_layers: int,
    block_size: int,
    k_heads: int,
    k_head_dim: int,
    v_heads: int | None = None,
    v_head_dim: int | None = None,
    dtype: torch.dtype = torch.float16,
) -> int:
    """How many blocks (the dummy included) a KV cache of this shape fits in ``budget_bytes``.

    The result is meant as both ``KVBlockAllocator(total_count=...)`` and
    ``KVCache(num_blocks=...)``: the dummy block is storage too.

    >>> blocks_for_memory_budget(
    ...     2**30, num_layers=32, block_size=16, k_heads=8, k_head_dim=128, dtype=torch.bfloat16
    ... )
    512

    Args:
        budget_bytes: bytes available for K and V of every layer, >= 0.
        num_layers, block_size, k_heads, k_head_dim: as for :class:`KVCache`.
        v_heads, v_head_dim: as for :class:`KVCache` (default: the K values).
        dtype: element type of the cache.

    Returns:
        ``budget_bytes // bytes_per_block``, at least 2.

    Raises:
        ConfigError: a shape argument is not a positive int, or ``dtype`` is
            not a floating dtype.
        InvalidArgumentError: ``budget_bytes`` is not an int >= 0.
        CapacityError: the budget holds fewer than 2 blocks (one usable plus the dummy).

    Complexity: O(1).
    """
    budget_bytes = require_int(budget_bytes, "budget_bytes", minimum=0)
    shape = _KVShape.build(num_layers, block_size, k_heads, k_head_dim, v_heads, v_head_dim)
    per_block = shape.bytes_per_block(_require_float_dtype(dtype))
    num_blocks = int(budget_bytes) // per_block
    if num_blocks < 2:
        raise CapacityError(
            f"{budget_bytes} bytes hold {num_blocks} block(s) of {per_block} bytes; "
            "need at least 2 (one usable and the dummy)"
        )
    return num_blocks


@dataclass(frozen=True, slots=True)
class _KVShape:
    """Validated dimensions shared by :class:`KVCache` and :func:`blocks_for_memory_budget`."""

    num_layers: int
    block_size: int
    k_heads: int
    k_head_dim: int
    v_heads: int
    v_head_dim: int

    @classmethod
    def build(
        cls,
        num_layers: int,
        block_size: int,
        k_heads: int,
        k_head_dim: int,
        v_heads: int | None,
        v_head_dim: int | None,
    ) -> _KVShape:
        def size(value: object, name: str, minimum: int = 1) -> int:
            return require_int(value, name, minimum=minimum, error=ConfigError)

        k_heads = size(k_heads, "k_heads")
        k_head_dim = size(k_head_dim, "k_head_dim")
        return cls(
            size(num_layers, "num_layers"),
            size(block_size, "block_size"),
            k_heads,
            k_head_dim,
            k_heads if v_heads is None else size(v_heads, "v_heads"),
            k_head_dim if v_head_dim is None else size(v_head_dim, "v_head_dim", minimum=0),
        )

    def bytes_per_block(self, dtype: torch.dtype) -> int:
        values_per_token = self.k_heads * self.k_head_dim + self.v_heads * self.v_head_dim
        return self.num_layers * self.block_size * values_per_token * dtype.itemsize


class KVCache:
    """Per-layer K and V tensors indexed by block ID and position in the block.

    Layer ``l`` holds ``k_caches[l]`` of shape ``[num_blocks, block_size,
    k_heads, k_head_dim]`` and ``v_caches[l]`` of shape ``[num_blocks,
    block_size, v_heads, v_head_dim]``. K and V shapes are independent, which
    covers multi-head attention, grouped/multi-query attention (fewer KV heads
    than query heads: this cache only sees KV heads) and MLA-like layouts (one
    latent "head" in K and ``v_head_dim=0``, or a V narrower than K).
    ``num_blocks`` is the allocator's ``total_count``: the dummy block has
    storage too, and padded tokens write there harmlessly.

    This class stores; it does not allocate. Block IDs come from a
    :class:`~prefixcache.KVBlockAllocator` and the tensors start zeroed.

    Methods: :meth:`write`, :meth:`gather`, :meth:`bytes_per_block`; the
    tensors themselves for kernels: :attr:`k_caches`, :attr:`v_caches`.

    Index arguments are validated on the host when they come from the host
    (sequences, arrays, CPU tensors). An integer tensor already on the cache's
    device is used as is, without a range check, since checking it would read
    device memory and wait for the device. Not thread-safe.

    Args:
        num_layers: layers, >= 1.
        num_blocks: blocks per layer, the dummy included, >= 1.
        block_size: tokens per block, >= 1.
        k_heads, k_head_dim: K heads and their width, >= 1.
        v_heads: V heads, >= 1 (default: ``k_heads``).
        v_head_dim: V width, >= 0 (default: ``k_head_dim``; 0 stores no V).
        dtype: a floating dtype (default float16).
        device: where the tensors live; ``None`` picks CUDA when available.

    >>> cache = KVCache(1, num_blocks=4, block_size=2, k_heads=1, k_head_dim=2, device="cpu",
    ...                 dtype=torch.float32)
    >>> k = torch.tensor([[[1.0, 2.0]], [[3.0, 4.0]]])
    >>> cache.write(0, [3, 1], [1, 0], k, k)
    >>> cache.gather(0, [1])[0].flatten().tolist()
    [3.0, 4.0, 0.0, 0.0]
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        k_heads: int,
        k_head_dim: int,
        *,
        v_heads: int | None = None,
        v_head_dim: int | None = None,
        dtype: torch.dtype = torch.float16,
        device: str | torch.device | None = None,
    ) -> None:
        self._shape = _KVShape.build(
            num_layers, block_size, k_heads, k_head_dim, v_heads, v_head_dim
        )
        self.num_layers = self._shape.num_layers
        self.num_blocks = require_int(num_blocks, "num_blocks", minimum=1, error=ConfigError)
        self.block_size = self._shape.block_size
        self.k_heads, self.k_head_dim = self._shape.k_heads, self._shape.k_head_dim
        self.v_heads, self.v_head_dim = self._shape.v_heads, self._shape.v_head_dim
        self.dtype = _require_float_dtype(dtype)
        self.device = resolve_device(device)
        k_shape = (self.num_blocks, self.block_size, self.k_heads, self.k_head_dim)
        v_shape = (self.num_blocks, self.block_size, self.v_heads, self.v_head_dim)
        # One K and one V tensor per layer, of self.dtype on self.device.
        self.k_caches: tuple[torch.Tensor, ...] = tuple(
            torch.zeros(k_shape, dtype=self.dtype, device=self.device)
            for _ in range(self.num_layers)
        )
        self.v_caches: tuple[torch.Tensor, ...] = tuple(
            torch.zeros(v_shape, dtype=self.dtype, device=self.device)
            for _ in range(self.num_layers)
        )

    def bytes_per_block(self) -> int:
        """Bytes one block takes over all layers, K and V. Complexity: O(1)."""
        return self._shape.bytes_per_block(self.dtype)

    def write(
        self,
        layer: int,
        block_ids: IndexLike,
        offsets: IndexLike,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> None:
        """Store one K and one V row per token at ``(block_ids[i], offsets[i])``.

        Two tokens aimed at the same slot in one call leave either value.

        Args:
            layer: the layer, in ``[0, num_layers)``.
            block_ids: ``[n]`` block of each token, in ``[0, num_blocks)``.
            offsets: ``[n]`` position of each token in its block, in ``[0, block_size)``.
            k: ``[n, k_heads, k_head_dim]`` of this cache's dtype and device.
            v: ``[n, v_heads, v_head_dim]`` of this cache's dtype and device.

        Raises:
            InvalidArgumentError: bad layer, or an index out of range.
            InvalidTensorError: a shape, dtype or device that does not match.

        Complexity: O(n * (k_heads * k_head_dim + v_heads * v_head_dim)), one
        ``index_put_`` per tensor.
        """
        self._check_layer(layer)
        blocks = self._index(block_ids, "block_ids", self.num_blocks)
        positions = self._index(offsets, "offsets", self.block_size)
        num_tokens = len(blocks)
        if len(positions) != num_tokens:
            raise InvalidTensorError(f"{num_tokens} block IDs but {len(positions)} offsets")
        self._check_values(k, "k", (num_tokens, self.k_heads, self.k_head_dim))
        self._check_values(v, "v", (num_tokens, self.v_heads, self.v_head_dim))
        self.k_caches[layer][blocks, positions] = k
        self.v_caches[layer][blocks, positions] = v

    def gather(self, layer: int, block_ids: IndexLike) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of whole blocks, concatenated in the order given.

        Returns:
            Fresh tensors ``[len(block_ids) * block_size, k_heads, k_head_dim]``
            and ``[len(block_ids) * block_size, v_heads, v_head_dim]``.

        Raises:
            InvalidArgumentError: bad layer, or a block ID out of range.
            InvalidTensorError: malformed ``block_ids``.

        Complexity: O(len(block_ids) * block_size * row width).
        """
        self._check_layer(layer)
        blocks = self._index(block_ids, "block_ids", self.num_blocks)
        num_tokens = len(blocks) * self.block_size
        k = self.k_caches[layer][blocks].reshape(num_tokens, self.k_heads, self.k_head_dim)
        v = self.v_caches[layer][blocks].reshape(num_tokens, self.v_heads, self.v_head_dim)
        return k, v

    def __repr__(self) -> str:
        return (
            f"KVCache(num_layers={self.num_layers}, num_blocks={self.num_blocks}, "
            f"block_size={self.block_size}, k=({self.k_heads}, {self.k_head_dim}), "
            f"v=({self.v_heads}, {self.v_head_dim}), dtype={self.dtype}, device={self.device})"
        )

    # ------------------------------------------------------------------ validation

    def _check_layer(self, layer: int) -> None:
        layer = require_int(layer, "layer")
        if not 0 <= layer < self.num_layers:
            raise InvalidArgumentError(f"layer {layer} is outside [0, {self.num_layers})")

    def _index(self, values: IndexLike, what: str, bound: int) -> torch.Tensor:
        """``values`` as an int64 index tensor on the cache's device, range-checked on the host."""
        if isinstance(values, torch.Tensor) and values.device.type != "cpu":
            if values.device != self.device:
                raise InvalidTensorError(
                    f"{what} is on {values.device}; the cache is on {self.device}"
                )
            if values.dim() != 1 or values.is_floating_point() or values.dtype == torch.bool:
                raise InvalidTensorError(f"{what} must be a 1-D integer tensor")
            return values.long()
        array = to_int_array(values, what)
        if array.size and (array.min() < 0 or array.max() >= bound):
            bad = int(array.min()) if array.min() < 0 else int(array.max())
            raise InvalidArgumentError(f"{what} holds {bad}, outside [0, {bound})")
        return torch.from_numpy(array.astype(np.int64)).to(self.device)

    def _check_values(self, values: torch.Tensor, what: str, shape: tuple[int, ...]) -> None:
        if not isinstance(values, torch.Tensor):
            raise InvalidTensorError(f"{what} must be a tensor, got {type(values).__name__}")
        if tuple(values.shape) != shape:
            raise InvalidTensorError(f"{what} has shape {tuple(values.shape)}, expected {shape}")
        if values.dtype != self.dtype:
            raise InvalidTensorError(
                f"{what} has dtype {values.dtype}; the cache holds {self.dtype}"
            )
        if values.device != self.device:
            raise InvalidTensorError(f"{what} is on {values.device}; the cache is on {self.device}")

    # ------------------------------------------------------------------ copies

    def copy_tokens(self, src: int, dst: int, num_tokens: int) -> None:
        """Copy the first ``num_tokens`` token slots of block ``src`` into ``dst``, every layer.

        Runs a copy-on-write instruction
        (:class:`~prefixcache.serving.cow.CopyInstruction`): the writer's fresh
        block gets the shared tokens before its own are written. Stays on the
        device (no host wait).

        Raises:
            InvalidArgumentError: a block outside ``[0, num_blocks)`` or a
                count outside ``[0, block_size]``.

        Complexity: O(layers * num_tokens * row width).
        """
        src = require_int(src, "src", minimum=0, maximum=self.num_blocks - 1)
        dst = require_int(dst, "dst", minimum=0, maximum=self.num_blocks - 1)
        num_tokens = require_int(num_tokens, "num_tokens", minimum=0, maximum=self.block_size)
        for k_cache, v_cache in zip(self.k_caches, self.v_caches, strict=True):
            k_cache[dst, :num_tokens] = k_cache[src, :num_tokens]
            v_cache[dst, :num_tokens] = v_cache[src, :num_tokens]

    def copy_blocks(self, sources: IndexLike, destinations: IndexLike) -> None:
        """Copy whole blocks ``sources[i] -> destinations[i]``, every layer, K and V.

        The copy callback of :meth:`KVBlockAllocator.apply_defragment`
        (``allocator.apply_defragment(plan, copy=cache.copy_blocks)``): the
        allocator calls it after checking the plan and before moving any
        state, with free destinations. Each layer's gather happens before its
        scatter, so a destination that is also a source reads the old data.
        Stays on the device (no host wait).

        Raises:
            InvalidArgumentError: an ID outside ``[0, num_blocks)`` or lists of
                different lengths.
            InvalidTensorError: malformed index tensors.

        Complexity: O(layers * len(sources) * block bytes).
        """
        src = self._index(sources, "sources", self.num_blocks)
        dst = self._index(destinations, "destinations", self.num_blocks)
        if src.shape != dst.shape:
            raise InvalidArgumentError(f"{src.shape[0]} sources but {dst.shape[0]} destinations")
        for k_cache, v_cache in zip(self.k_caches, self.v_caches, strict=True):
            k_cache[dst] = k_cache[src]
            v_cache[dst] = v_cache[src]
