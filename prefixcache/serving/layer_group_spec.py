"""LayerGroupSpec: one group of a model's attention layers and its kind of cache.

What :class:`~prefixcache.serving.layer_groups.LayerGroups` is built from, and the
sliding-window arithmetic it and the toy model share. See DESIGN.md, "Hybrid models".
"""

from __future__ import annotations

from dataclasses import dataclass

from prefixcache.engine.validation import require_int
from prefixcache.errors import ConfigError

GROUP_KINDS = ("full", "sliding_window", "indexer")
"""What a group's layers attend to: every past token, the last ``window``, or every past
token through a small per-token key cache (a sparse-attention indexer)."""


@dataclass(frozen=True, slots=True)
class LayerGroupSpec:
    """One group of layers with the same kind of cache and the same KV shape.

    Attributes:
        name: unique name of the group.
        kind: one of :data:`GROUP_KINDS`.
        num_layers: layers in the group, >= 1.
        k_heads, k_head_dim: K heads and width per token, >= 1.
        v_heads, v_head_dim: V heads and width (default: K's; an indexer
            defaults to ``v_head_dim=0``, keys only).
        window: tokens a sliding-window layer attends to, itself included;
            required for ``"sliding_window"``, refused otherwise.
        pool: name of the block pool; groups naming the same pool share one
            allocator (and aliased KV storage). Default: the group's own name.
    """

    name: str
    kind: str
    num_layers: int
    k_heads: int
    k_head_dim: int
    v_heads: int | None = None
    v_head_dim: int | None = None
    window: int | None = None
    pool: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"group name must be a non-empty string, got {self.name!r}")
        if self.kind not in GROUP_KINDS:
            raise ConfigError(f"group {self.name!r}: kind must be one of {GROUP_KINDS}")
        for attribute in ("num_layers", "k_heads", "k_head_dim"):
            require_int(getattr(self, attribute), attribute, minimum=1, error=ConfigError)
        if (self.kind == "sliding_window") != (self.window is not None):
            raise ConfigError(f"group {self.name!r}: window is for sliding_window groups only")
        if self.window is not None:
            require_int(self.window, "window", minimum=1, error=ConfigError)
        if self.pool is not None and (not isinstance(self.pool, str) or not self.pool):
            raise ConfigError(f"group {self.name!r}: pool must be a non-empty string or None")

    @property
    def pool_name(self) -> str:
        """The pool this group takes blocks from."""
        return self.pool or self.name

    @property
    def kv_shape(self) -> tuple[int, int, int, int]:
        """``(k_heads, k_head_dim, v_heads, v_head_dim)`` with the defaults applied."""
        v_dim = self.v_head_dim
        if v_dim is None:
            v_dim = 0 if self.kind == "indexer" else self.k_head_dim
        v_heads = self.k_heads if self.v_heads is None else self.v_heads
        return (self.k_heads, self.k_head_dim, v_heads, v_dim)


def first_needed_block(num_tokens: int, window: int, block_size: int) -> int:
    """Index of the oldest block the next token's window reaches, ``num_tokens`` computed.

    The token at position ``num_tokens`` attends to positions
    ``num_tokens - window + 1 .. num_tokens``; every block before the one
    holding the first of them is outside the window for good.

    >>> first_needed_block(20, window=8, block_size=4)
    3
    """
    return max(0, num_tokens - window + 1) // block_size


__all__ = ["GROUP_KINDS", "LayerGroupSpec", "first_needed_block"]
