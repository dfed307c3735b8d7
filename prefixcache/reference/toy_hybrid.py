"""A toy hybrid model that reads and writes its caches only through a HybridMemory.

It exists to check the cache, not to model language: every layer reads the token's
embedding (no residual stream), and the weights are seeded random. But each kind of
layer uses its cache as a real one does:

- full-attention and sliding-window layers write each token's K and V into the
  :class:`~prefixcache.serving.kv_cache.KVCache` of their group's pool at the block
  the group's table row names, and attend over K/V gathered back through that row
  (a sliding-window layer only over its window);
- indexer layers write keys only and score every past key (the max score per head);
- linear-attention layers run a causal convolution over the conv state and a decaying
  outer-product recurrence (a Gated-DeltaNet-like update, without the delta rule)
  in the request's :class:`~prefixcache.serving.state_pool.StatePool` slot.

:meth:`ToyHybridModel.forward_cached` computes a request's next tokens through the
memory; :meth:`ToyHybridModel.forward_reference` computes a whole sequence with
private dense storage and no cache. Both run the same per-token arithmetic on the same
values, so a correct cache gives identical outputs: a wrong block, a block given back
too early, or a state not restored, gives different ones. See DESIGN.md, "Hybrid models".
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from prefixcache.engine.validation import require_int
from prefixcache.errors import InvalidArgumentError
from prefixcache.serving.hybrid import HybridMemory, HybridRequest, build_hybrid_memory
from prefixcache.serving.layer_groups import LayerGroupSpec
from prefixcache.serving.state_pool import StateShape

_DECAY = 0.9


class ToyHybridModel:
    """Seeded random weights for every layer of a :class:`HybridMemory`'s groups and state.

    Args:
        memory: the memory whose shapes the model takes (KV dtype float32 or
            float64 gives exact comparisons).
        vocab_size: token IDs lie in ``[0, vocab_size)``.
        hidden_size: embedding width.
        seed: weight seed.
    """

    def __init__(
        self, memory: HybridMemory, *, vocab_size: int = 64, hidden_size: int = 8, seed: int = 0
    ) -> None:
        self.memory = memory
        self.vocab_size = vocab_size
        generator = torch.Generator().manual_seed(seed)

        def weights(*shape: int) -> torch.Tensor:
            return torch.randn(shape, generator=generator) / math.sqrt(shape[0])

        self.embedding = weights(vocab_size, hidden_size)
        # Per group and layer: Q, K, V projections and the output projection.
        self.attention: list[list[tuple[torch.Tensor, ...]]] = []
        for spec in memory.groups.specs:
            k_heads, k_dim, v_heads, v_dim = spec.kv_shape
            self.attention.append(
                [
                    (
                        weights(hidden_size, k_heads * k_dim),
                        weights(hidden_size, k_heads * k_dim),
                        weights(hidden_size, max(1, v_heads * v_dim)),
                        weights(max(k_heads, v_heads * v_dim), hidden_size),
                    )
                    for _ in range(spec.num_layers)
                ]
            )
        self.linear: list[tuple[torch.Tensor, ...]] = []
        pool = memory.state_pool
        if pool is not None:
            shape = pool.shape
            for _ in range(shape.num_layers):
                self.linear.append(
                    (
                        weights(hidden_size, shape.conv_dim),  # input to conv channels
                        weights(shape.conv_dim, shape.conv_kernel),  # depthwise conv taps
                        weights(shape.conv_dim, shape.num_heads * shape.k_dim),  # q
                        weights(shape.conv_dim, shape.num_heads * shape.k_dim),  # k
                        weights(shape.conv_dim, shape.num_heads * shape.v_dim),  # v
                        weights(shape.num_heads * shape.v_dim, hidden_size),  # out
                    )
                )

    # ------------------------------------------------------------------ forwards

    def forward_cached(
        self, request: HybridRequest, tokens: Sequence[int], stop: int
    ) -> list[torch.Tensor]:
        """Outputs of positions ``request.num_computed_tokens .. stop`` through the memory.

        The caller has reserved blocks up to ``stop`` and commits ``stop``
        afterwards; ``tokens`` is the whole sequence so far.

        Raises:
            InvalidArgumentError: ``stop`` outside the sequence or before the start.

        Complexity: O((stop - start) * context * layers).
        """
        start = request.num_computed_tokens
        if not start <= stop <= len(tokens):
            raise InvalidArgumentError(f"stop {stop} outside [{start}, {len(tokens)}]")
        memory = self.memory
        outputs = []
        for position in range(start, stop):
            x = self.embedding[tokens[position]]
            out = torch.zeros_like(x)
            for group, spec in enumerate(memory.groups.specs):
                cache = memory.groups.kv_caches[spec.pool_name]
                row = memory.groups.blocks_of(spec.name, request.slot).tolist()
                block, offset = row[position // cache.block_size], position % cache.block_size
                for layer, params in enumerate(self.attention[group]):
                    k, v = self._kv(spec, params, x, cache.dtype)
                    cache.write(layer, [block], [offset], k[None], v[None])
                    low = self._low(spec, position)
                    first = low // cache.block_size
                    keys, values = cache.gather(
                        layer, row[first : position // cache.block_size + 1]
                    )
                    span = slice(
                        low - first * cache.block_size, position - first * cache.block_size + 1
                    )
                    out += self._attend(spec, params, x, keys[span], values[span])
            if memory.state_pool is not None and request.state_slot is not None:
                pool, slot = memory.state_pool, request.state_slot
                for layer, params in enumerate(self.linear):
                    out += self._linear_step(
                        params, x, pool.conv_states[layer, slot], pool.recurrent_states[layer, slot]
                    )
            outputs.append(out)
        return outputs

    def forward_reference(self, tokens: Sequence[int]) -> list[torch.Tensor]:
        """Outputs of every position of ``tokens`` with private dense storage, no cache.

        Complexity: O(len(tokens)^2 * layers).
        """
        memory = self.memory
        kv: list[list[list[tuple[torch.Tensor, torch.Tensor]]]] = [
            [[] for _ in range(spec.num_layers)] for spec in memory.groups.specs
        ]
        conv: list[torch.Tensor] = []
        recurrent: list[torch.Tensor] = []
        pool = memory.state_pool
        if pool is not None:
            conv = [
                torch.zeros_like(pool.conv_states[layer, 0]) for layer in range(len(self.linear))
            ]
            recurrent = [
                torch.zeros_like(pool.recurrent_states[layer, 0])
                for layer in range(len(self.linear))
            ]
        outputs = []
        for position, token in enumerate(tokens):
            x = self.embedding[token]
            out = torch.zeros_like(x)
            for group, spec in enumerate(memory.groups.specs):
                dtype = memory.groups.kv_caches[spec.pool_name].dtype
                for layer, params in enumerate(self.attention[group]):
                    kv[group][layer].append(self._kv(spec, params, x, dtype))
                    window = kv[group][layer][self._low(spec, position) :]
                    keys = torch.stack([k for k, _ in window])
                    values = torch.stack([v for _, v in window])
                    out += self._attend(spec, params, x, keys, values)
            for layer, params in enumerate(self.linear):
                out += self._linear_step(params, x, conv[layer], recurrent[layer])
            outputs.append(out)
        return outputs

    def next_token(self, output: torch.Tensor, rank: int = 0) -> int:
        """The token ranked ``rank`` (0: the greedy choice) by ``output``'s logits.

        Logits are the output against every token's embedding; ties go to the
        lower token ID, so equal outputs always give equal tokens. A fork that
        samples another rank diverges from its parent at its first token.

        Raises:
            InvalidArgumentError: ``rank`` outside ``[0, vocab_size)``.

        Complexity: O(vocab_size * hidden_size).
        """
        rank = require_int(rank, "rank", minimum=0, maximum=self.vocab_size - 1)
        logits = (self.embedding @ output).tolist()
        order = sorted(range(self.vocab_size), key=lambda token: (-logits[token], token))
        return order[rank]

    # ------------------------------------------------------------------ arithmetic

    @staticmethod
    def _low(spec: LayerGroupSpec, position: int) -> int:
        return 0 if spec.window is None else max(0, position - spec.window + 1)

    @staticmethod
    def _kv(
        spec: LayerGroupSpec, params: tuple[torch.Tensor, ...], x: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        k_heads, k_dim, v_heads, v_dim = spec.kv_shape
        k = (x @ params[1]).view(k_heads, k_dim).to(dtype)
        v = (x @ params[2])[: v_heads * v_dim].view(v_heads, v_dim).to(dtype)
        return k, v

    @staticmethod
    def _attend(
        spec: LayerGroupSpec,
        params: tuple[torch.Tensor, ...],
        x: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
    ) -> torch.Tensor:
        k_heads, k_dim, v_heads, v_dim = spec.kv_shape
        q = (x @ params[0]).view(k_heads, k_dim)
        # Broadcast products and sums, not einsum: ~6x faster on these tiny tensors.
        scores = (keys.float() * q).sum(dim=2).T / math.sqrt(k_dim)  # [heads, tokens]
        if v_dim == 0:  # an indexer: the best score of each head
            return scores.amax(dim=1) @ params[3][:k_heads]
        # Softmax by hand, with amax: on tiny CPU tensors torch.softmax and max(dim) took
        # about 2-7 ms a call on the shared 2-core test machine, amax and exp microseconds.
        weights = (scores - scores.amax(dim=1, keepdim=True)).exp()
        weights = weights / weights.sum(dim=1, keepdim=True)
        if v_heads != k_heads:
            weights = weights.mean(dim=0, keepdim=True).expand(v_heads, -1)
        mixed = (weights.T[:, :, None] * values.float()).sum(dim=0).reshape(-1)
        return mixed @ params[3][: v_heads * v_dim]

    @staticmethod
    def _linear_step(
        params: tuple[torch.Tensor, ...], x: torch.Tensor, conv: torch.Tensor, state: torch.Tensor
    ) -> torch.Tensor:
        """One token through a linear-attention layer; updates ``conv`` and ``state`` in place."""
        to_conv, taps, w_q, w_k, w_v, w_out = params
        heads, k_dim, v_dim = state.shape
        u = x @ to_conv
        window = torch.cat([conv.float(), u[:, None]], dim=1)  # oldest input first
        c = (window * taps).sum(dim=1)
        conv.copy_(window[:, 1:].to(conv.dtype))
        q, k = (c @ w_q).view(heads, k_dim), (c @ w_k).view(heads, k_dim)
        v = (c @ w_v).view(heads, v_dim)
        state.mul_(_DECAY).add_(k[:, :, None] * v[:, None, :])
        return (q[:, :, None] * state).sum(dim=1).reshape(-1) @ w_out


def build_toy_hybrid(
    *,
    num_blocks: int,
    block_size: int,
    window: int,
    max_requests: int,
    num_checkpoints: int,
    vocab_size: int,
    max_blocks_per_request: int = 16,
) -> ToyHybridModel:
    """A :class:`ToyHybridModel` over a fresh CPU float32 memory with every kind of layer.

    Two full-attention layers, two sliding-window layers over ``window`` tokens sharing
    the full-attention pool, one indexer layer, four linear-attention layers (a state
    checkpoint every 2 blocks, ``num_checkpoints`` of them): the mix the hybrid serving
    example and ``benchmarks/bench_sim_hybrid.py`` run. Same weights every time (seed 0).
    """
    memory = build_hybrid_memory(
        [
            LayerGroupSpec("full", "full", num_layers=2, k_heads=2, k_head_dim=8),
            LayerGroupSpec("swa", "sliding_window", 2, 2, 8, window=window, pool="full"),
            LayerGroupSpec("indexer", "indexer", num_layers=1, k_heads=1, k_head_dim=8),
        ],
        num_blocks=num_blocks,
        block_size=block_size,
        max_requests=max_requests,
        max_blocks_per_request=max_blocks_per_request,
        linear=StateShape(num_layers=4, num_heads=2, k_dim=8, v_dim=8, conv_dim=16, conv_kernel=4),
        num_checkpoints=num_checkpoints,
        checkpoint_every=2,
        dtype=torch.float32,
        device="cpu",
    )
    return ToyHybridModel(memory, vocab_size=vocab_size)
