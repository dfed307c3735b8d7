"""The records of :class:`~prefixcache.reference.model.TinyDecoder`: its config and its outputs.

:class:`TinyDecoderConfig` (shape and seed, checked on construction),
:class:`DenseOutput` and :class:`PagedOutput` (what the two forwards return).
Apart from the model so its module holds only the weights and the forwards;
every name is importable from :mod:`prefixcache.reference.model` too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from prefixcache.engine.validation import require_int
from prefixcache.errors import ConfigError


@dataclass(frozen=True)
class TinyDecoderConfig:
    """Shape and seed of a :class:`TinyDecoder`.

    Attributes:
        vocab_size: tokens the model reads and writes, ``[0, vocab_size)``.
        hidden_size: width of the residual stream.
        num_layers: transformer blocks, >= 1.
        num_heads: query heads per attention layer.
        num_kv_heads: K/V heads (grouped-query attention); divides ``num_heads``.
        head_dim: width of each head, even (rotary pairs).
        mlp_hidden: hidden width of the dense MLPs.
        moe_layer: index of the block whose MLP is a mixture of experts.
        num_experts: experts of that layer.
        top_k: experts each token is routed to, <= ``num_experts``.
        expert_hidden: hidden width of each expert.
        rope_theta: rotary base.
        seed: seed of the random weights; equal configs give equal weights.

    Raises:
        ConfigError: a size that is not a positive int, or inconsistent sizes.
    """

    vocab_size: int = 512
    hidden_size: int = 128
    num_layers: int = 3
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 16
    mlp_hidden: int = 256
    moe_layer: int = 1
    num_experts: int = 8
    top_k: int = 2
    expert_hidden: int = 128
    rope_theta: float = 10_000.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "mlp_hidden",
            "num_experts",
            "top_k",
            "expert_hidden",
        ):
            value = require_int(getattr(self, name), name, minimum=1, error=ConfigError)
            object.__setattr__(self, name, value)
        seed = require_int(self.seed, "seed", minimum=0, error=ConfigError)
        object.__setattr__(self, "seed", seed)
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_kv_heads {self.num_kv_heads} must divide num_heads {self.num_heads}"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even (rotary pairs), got {self.head_dim}")
        if self.top_k > self.num_experts:
            raise ConfigError(f"top_k {self.top_k} exceeds num_experts {self.num_experts}")
        layer = require_int(
            self.moe_layer, "moe_layer", minimum=0, maximum=self.num_layers - 1, error=ConfigError
        )
        object.__setattr__(self, "moe_layer", layer)
        if not isinstance(self.rope_theta, (int, float)) or not self.rope_theta > 1:
            raise ConfigError(f"rope_theta must be > 1, got {self.rope_theta!r}")


@dataclass(frozen=True)
class DenseOutput:
    """What :meth:`TinyDecoder.forward_dense` computes for a sequence of ``n`` tokens.

    Attributes:
        logits: ``[n, vocab_size]``; row ``i`` scores the token after position ``i``.
        routing: ``[n, 1, top_k]`` int64, the experts each token was routed to.
        keys, values: per layer ``[n, num_kv_heads, head_dim]``, what a cache would hold.
    """

    logits: torch.Tensor
    routing: torch.Tensor
    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class PagedOutput:
    """What :meth:`TinyDecoder.forward_paged` computes for one step.

    Attributes:
        logits: ``[R, vocab_size]``, one row per entry of ``batch.logit_rows``.
        routing: ``[T, 1, top_k]`` int64 experts of every computed token.
    """

    logits: torch.Tensor
    routing: torch.Tensor
