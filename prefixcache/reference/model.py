"""A tiny reference decoder whose attention reads and writes K/V through prefixcache.

The model is small on purpose (a few MB of seeded random weights, no download)
and ordinary in shape, so that serving it through the block manager exercises
what a real engine does:

- token embedding, ``num_layers`` pre-norm blocks, a final norm and an output head;
- grouped-query attention (``num_heads`` query heads share ``num_kv_heads`` K/V
  heads) with rotary positions applied to queries and keys before caching;
- a SwiGLU MLP in every block but one, whose MLP is a mixture of experts with a
  top-``top_k`` router; the experts each token was routed to are returned, so a
  serving loop can store them per block and replay them on a prefix hit.

Two forwards compute the same function:

- :meth:`TinyDecoder.forward_dense` runs a whole sequence with causal attention
  over its own keys, no cache: the reference;
- :meth:`TinyDecoder.forward_paged` runs one serving step (decode tokens of many
  requests, plus prefill chunks) and reads and writes K/V only through a
  :class:`~prefixcache.serving.kv_cache.KVCache` indexed by the block IDs of a
  :class:`~prefixcache.serving.block_table.BlockTable`: it writes the step's
  K/V with :meth:`KVCache.write`, then gathers each request's blocks and attends
  over them with a mask (gather-based paged attention). The step's layout is
  host metadata (:class:`~prefixcache.reference.paged_batch.PagedBatch`), so
  the forward never reads a device value back: the same code runs on CUDA
  without a host sync.

The two agree to rounding (different reduction shapes); in float64 the greedy
tokens and the routed experts are identical. See DESIGN.md, "Serving a model".

The config and the two outputs are records in ``model_types.py``, importable from here.

>>> model = TinyDecoder(TinyDecoderConfig(vocab_size=32, hidden_size=16, num_heads=2,
...     num_kv_heads=1, head_dim=8, mlp_hidden=32, num_experts=4, expert_hidden=16))
>>> out = model.forward_dense(torch.tensor([1, 2, 3]))
>>> tuple(out.logits.shape), tuple(out.routing.shape)
((3, 32), (3, 1, 2))
"""

from __future__ import annotations

import math

import torch

from prefixcache.engine.pool import resolve_device
from prefixcache.errors import ConfigError, InvalidArgumentError
from prefixcache.reference.model_types import DenseOutput, PagedOutput, TinyDecoderConfig
from prefixcache.reference.paged_batch import PagedBatch, PrefillChunk
from prefixcache.serving.kv_cache import KVCache

__all__ = ["DenseOutput", "PagedOutput", "TinyDecoder", "TinyDecoderConfig"]


class _Layer:
    """Weights of one transformer block (plain tensors, ``x @ w`` layout)."""

    def __init__(self, config: TinyDecoderConfig, index: int, draw: _Draw) -> None:
        width, kv_width = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        hidden = config.hidden_size
        self.attn_norm = draw.ones(hidden)
        self.wq = draw.matrix(hidden, width)
        self.wk = draw.matrix(hidden, kv_width)
        self.wv = draw.matrix(hidden, kv_width)
        self.wo = draw.matrix(width, hidden)
        self.mlp_norm = draw.ones(hidden)
        self.is_moe = index == config.moe_layer
        if self.is_moe:
            experts, inner = config.num_experts, config.expert_hidden
            self.router = draw.matrix(hidden, experts)
            self.w_gate = draw.matrix(hidden, inner, batch=experts)  # [E, hidden, inner]
            self.w_up = draw.matrix(hidden, inner, batch=experts)
            self.w_down = draw.matrix(inner, hidden, batch=experts)  # [E, inner, hidden]
        else:
            self.w_gate = draw.matrix(hidden, config.mlp_hidden)
            self.w_up = draw.matrix(hidden, config.mlp_hidden)
            self.w_down = draw.matrix(config.mlp_hidden, hidden)


class _Draw:
    """Seeded weight factory: draws in float64 on the CPU, then casts and moves.

    So a config gives the same weights in every dtype and on every device.
    """

    def __init__(self, seed: int, dtype: torch.dtype, device: torch.device) -> None:
        self._generator = torch.Generator().manual_seed(seed)
        self._dtype, self._device = dtype, device

    def matrix(
        self, rows: int, cols: int, *, batch: int | None = None, scale: float | None = None
    ) -> torch.Tensor:
        """Normal entries of standard deviation ``scale`` (default ``1 / sqrt(rows)``)."""
        shape = (rows, cols) if batch is None else (batch, rows, cols)
        values = torch.randn(shape, generator=self._generator, dtype=torch.float64)
        values *= 1 / math.sqrt(rows) if scale is None else scale
        return values.to(self._dtype).to(self._device)

    def ones(self, size: int) -> torch.Tensor:
        return torch.ones(size, dtype=self._dtype, device=self._device)


class TinyDecoder:
    """A seeded decoder-only transformer with a dense and a paged forward.

    Methods: :meth:`forward_dense` (the reference), :meth:`forward_paged` (one
    serving step through a :class:`KVCache`), :meth:`new_kv_cache`,
    :meth:`check_kv_cache`. Runs under
    ``torch.inference_mode``; holds no state between calls. Not thread-safe
    only in the sense that the KV cache it writes is not.

    Args:
        config: the shape and seed.
        dtype: a floating dtype for weights and activations (float64 makes the
            dense and paged forwards agree to ~1e-12).
        device: where the weights live; ``None`` picks CUDA when available.

    Raises:
        ConfigError: ``dtype`` is not a floating dtype.
    """

    def __init__(
        self,
        config: TinyDecoderConfig | None = None,
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device | None = "cpu",
    ) -> None:
        self.config = config = config or TinyDecoderConfig()
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ConfigError(f"dtype must be a floating torch.dtype, got {dtype!r}")
        self.dtype = dtype
        self.device = resolve_device(device)
        draw = _Draw(config.seed, dtype, self.device)
        self.embedding = draw.matrix(config.vocab_size, config.hidden_size, scale=1.0)
        self.layers = tuple(_Layer(config, index, draw) for index in range(config.num_layers))
        self.final_norm = draw.ones(config.hidden_size)
        self.lm_head = draw.matrix(config.hidden_size, config.vocab_size)
        half = config.head_dim // 2
        exponents = torch.arange(half, dtype=torch.float64) / half
        self._inv_freq = (config.rope_theta**-exponents).to(dtype).to(self.device)

    @property
    def num_parameters(self) -> int:
        """Weights in the model (for "a few MB"). Complexity: O(layers)."""
        tensors = [self.embedding, self.final_norm, self.lm_head]
        for layer in self.layers:
            tensors += [value for value in vars(layer).values() if isinstance(value, torch.Tensor)]
        return sum(tensor.numel() for tensor in tensors)

    def new_kv_cache(self, num_blocks: int, block_size: int) -> KVCache:
        """A zeroed :class:`KVCache` shaped for this model (its layers, K/V heads, dtype, device).

        Complexity: O(num_blocks * block_size * layers * K/V width).
        """
        config = self.config
        return KVCache(
            config.num_layers,
            num_blocks,
            block_size,
            config.num_kv_heads,
            config.head_dim,
            dtype=self.dtype,
            device=self.device,
        )

    def check_kv_cache(self, cache: KVCache) -> None:
        """Refuse a cache whose shape, dtype or device this model cannot use.

        Raises:
            ConfigError: naming the first field that differs.
        """
        config = self.config
        expected = {
            "num_layers": config.num_layers,
            "k_heads": config.num_kv_heads,
            "k_head_dim": config.head_dim,
            "v_heads": config.num_kv_heads,
            "v_head_dim": config.head_dim,
            "dtype": self.dtype,
            "device": self.device,
        }
        for name, value in expected.items():
            if getattr(cache, name) != value:
                raise ConfigError(
                    f"kv_cache has {name}={getattr(cache, name)}; the model needs {value}"
                )

    # ------------------------------------------------------------------ forwards

    @torch.inference_mode()
    def forward_dense(self, token_ids: torch.Tensor) -> DenseOutput:
        """Run a whole sequence with causal attention over its own keys; no cache.

        Args:
            token_ids: ``[n]`` integer tokens in ``[0, vocab_size)``, n >= 1.

        Returns:
            Logits of every position, the routing and the K/V of every layer.

        Raises:
            InvalidArgumentError: an empty or out-of-vocabulary sequence.

        Complexity: O(layers * n^2 * heads * head_dim) plus the matmuls.
        """
        tokens = self._check_tokens(token_ids)
        num_tokens = len(tokens)
        positions = torch.arange(num_tokens, device=self.device)
        causal = positions[None, :] <= positions[:, None]  # [n, n]: key j visible to query i
        x = self.embedding[tokens]
        keys, values, routing = [], [], None
        for layer in self.layers:
            q, k, v = self._qkv(layer, x, positions)
            keys.append(k)
            values.append(v)
            attended = _attend(q[None], k[None], v[None], causal[None])[0]
            x, layer_routing = self._finish_layer(layer, x, attended)
            routing = layer_routing if layer_routing is not None else routing
        assert routing is not None  # exactly one layer is the MoE layer
        logits = self._logits(x)
        return DenseOutput(logits, routing[:, None, :], tuple(keys), tuple(values))

    @torch.inference_mode()
    def forward_paged(self, batch: PagedBatch, cache: KVCache) -> PagedOutput:
        """Run one serving step; K/V are written to and read from ``cache`` by block ID.

        Writes every computed token's K and V at ``(write_block_ids,
        write_offsets)`` first, then each decode token attends over its
        request's gathered blocks up to its context length, and each prefill
        chunk over its request's blocks with a causal mask. Nothing is read
        back to the host.

        Args:
            batch: the step's layout (see :class:`PagedBatch`); the caller
                guarantees its indices are in range (they come from the allocator).
            cache: a cache accepted by :meth:`check_kv_cache`.

        Returns:
            Logits of ``batch.logit_rows`` and the routing of every token.

        Complexity: O(layers * sum over requests of tokens * context) plus the matmuls.
        """
        positions = batch.positions
        x = self.embedding[batch.token_ids]
        routing = None
        for index, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x, positions)
            cache.write(index, batch.write_block_ids, batch.write_offsets, k, v)
            parts = []
            if batch.num_decode:
                parts.append(self._attend_decode(batch, cache, index, q[: batch.num_decode]))
            for chunk in batch.prefills:
                parts.append(self._attend_prefill(chunk, cache, index, q, positions))
            x, layer_routing = self._finish_layer(layer, x, torch.cat(parts))
            routing = layer_routing if layer_routing is not None else routing
        assert routing is not None
        return PagedOutput(self._logits(x[batch.logit_rows]), routing[:, None, :])

    # ------------------------------------------------------------------ pieces

    def _check_tokens(self, token_ids: torch.Tensor) -> torch.Tensor:
        if not isinstance(token_ids, torch.Tensor) or token_ids.dim() != 1 or not len(token_ids):
            raise InvalidArgumentError("token_ids must be a non-empty 1-D tensor")
        if token_ids.is_floating_point() or token_ids.dtype == torch.bool:
            raise InvalidArgumentError(f"token_ids must be integers, got {token_ids.dtype}")
        tokens = token_ids.to(self.device, torch.int64)
        if tokens.device.type == "cpu" and (
            tokens.min() < 0 or tokens.max() >= self.config.vocab_size
        ):
            raise InvalidArgumentError(f"token_ids must lie in [0, {self.config.vocab_size})")
        return tokens

    def _qkv(
        self, layer: _Layer, x: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries ``[T, heads, d]`` and keys/values ``[T, kv_heads, d]``, rotary applied."""
        config = self.config
        h = _rms_norm(x, layer.attn_norm)
        q = (h @ layer.wq).view(-1, config.num_heads, config.head_dim)
        k = (h @ layer.wk).view(-1, config.num_kv_heads, config.head_dim)
        v = (h @ layer.wv).view(-1, config.num_kv_heads, config.head_dim)
        angles = positions.to(self.dtype)[:, None] * self._inv_freq[None, :]  # [T, d/2]
        cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
        return _rotate(q, cos, sin), _rotate(k, cos, sin), v

    def _attend_decode(
        self, batch: PagedBatch, cache: KVCache, layer: int, q: torch.Tensor
    ) -> torch.Tensor:
        """One query per decoding request over its gathered blocks: ``[num_decode, heads * d]``."""
        assert batch.decode_block_ids is not None and batch.decode_context_lengths is not None
        blocks = batch.decode_block_ids.long()  # [B, nb]
        num_blocks = blocks.shape[1]
        keys = cache.k_caches[layer][blocks].flatten(1, 2)  # [B, nb * block_size, kv_heads, d]
        values = cache.v_caches[layer][blocks].flatten(1, 2)
        key_positions = torch.arange(num_blocks * cache.block_size, device=q.device)
        visible = key_positions[None, :] < batch.decode_context_lengths[:, None]  # [B, L]
        return _attend(q[:, None], keys, values, visible[:, None, :])[:, 0]

    def _attend_prefill(
        self,
        chunk: PrefillChunk,
        cache: KVCache,
        layer: int,
        q: torch.Tensor,
        positions: torch.Tensor,
    ) -> torch.Tensor:
        """A request's prefill chunk over its gathered blocks, causally: ``[chunk, heads * d]``."""
        blocks = chunk.block_ids.long()
        keys = cache.k_caches[layer][blocks].flatten(0, 1)  # [nb * block_size, kv_heads, d]
        values = cache.v_caches[layer][blocks].flatten(0, 1)
        key_positions = torch.arange(len(keys), device=q.device)
        visible = key_positions[None, :] <= positions[chunk.start : chunk.stop, None]  # [Q, L]
        return _attend(q[None, chunk.start : chunk.stop], keys[None], values[None], visible[None])[
            0
        ]

    def _finish_layer(
        self, layer: _Layer, x: torch.Tensor, attended: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Output projection, residual, then the MLP (or MoE) and its residual."""
        x = x + attended @ layer.wo
        h = _rms_norm(x, layer.mlp_norm)
        if not layer.is_moe:
            return x + (
                torch.nn.functional.silu(h @ layer.w_gate) * (h @ layer.w_up)
            ) @ layer.w_down, None
        out, routing = self._moe(layer, h)
        return x + out, routing

    def _moe(self, layer: _Layer, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k routing; every expert runs on every token and the chosen ones are mixed.

        Dense over experts: no data-dependent shapes, so no host sync; fine at this size.
        """
        scores, experts = torch.topk(h @ layer.router, self.config.top_k, dim=-1)  # [T, k]
        weights = torch.softmax(scores, dim=-1)
        gate = torch.einsum("td,edf->tef", h, layer.w_gate)
        up = torch.einsum("td,edf->tef", h, layer.w_up)
        outputs = torch.einsum("tef,efd->ted", torch.nn.functional.silu(gate) * up, layer.w_down)
        index = experts[:, :, None].expand(-1, -1, outputs.shape[-1])
        chosen = outputs.gather(1, index)  # [T, k, hidden]
        return (chosen * weights[:, :, None]).sum(dim=1), experts

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return _rms_norm(x, self.final_norm) @ self.lm_head


def _rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + 1e-6) * weight


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, halves layout: ``(x[i], x[i + d/2])`` turns by the position's angle."""
    first, second = x.chunk(2, dim=-1)
    return torch.cat([first * cos - second * sin, first * sin + second * cos], dim=-1)


def _attend(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor
) -> torch.Tensor:
    """Masked softmax attention with grouped K/V heads (torch's fused kernel where it has one).

    Args:
        q: ``[B, Q, heads, d]``.
        keys, values: ``[B, L, kv_heads, d]``.
        visible: ``[B, Q, L]`` bool, True where the query may see the key; every
            query sees at least one key (itself).

    Returns:
        ``[B, Q, heads * d]``.
    """
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2),
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=visible[:, None],
        enable_gqa=True,
    )
    return out.transpose(1, 2).flatten(2)
