"""Megatron's per-block MoE routing storage on the drop-in (as Megatron's allocator keeps it)."""

from __future__ import annotations

from typing import Any

import numpy as np

from prefixcache.engine.block_ids import to_int_array
from prefixcache.engine.validation import require_int
from prefixcache.errors import InvalidArgumentError, InvalidTensorError


class RoutingMethods:
    """MoE routing, mixed into the drop-in: a dict of per-block arrays, as in Megatron."""

    context: Any
    dummy_block_idx: int
    block_routing: dict[int, np.ndarray]

    def store_routing_per_block(self, flat_routing: np.ndarray | None) -> None:
        """Scatter ``[active_token_count, layers, top_k]`` routing into per-block storage."""
        context = self.context
        num_tokens = context.active_token_count
        if flat_routing is None or num_tokens == 0:
            return
        if flat_routing.shape[0] != num_tokens:
            raise InvalidArgumentError(
                f"routing has {flat_routing.shape[0]} tokens, the context {num_tokens}"
            )
        block_ids = context.token_to_block_idx[:num_tokens].cpu().numpy()
        positions = context.token_to_local_position_within_kv_block[:num_tokens].cpu().numpy()
        for block_id in np.unique(block_ids).tolist():
            if block_id != self.dummy_block_idx:
                rows = block_ids == block_id
                self.store_block_routing(block_id, positions[rows], flat_routing[rows])

    def store_block_routing(
        self, block_id: int, positions: np.ndarray, routing: np.ndarray
    ) -> None:
        """Store routing ``[len(positions), layers, top_k]`` at ``positions`` of ``block_id``.

        Raises:
            InvalidArgumentError, InvalidTensorError: a bad ID, positions or routing shape.
        """
        block_id = require_int(block_id, "block_id", minimum=0)
        position_list = to_int_array(positions, "positions")
        if not isinstance(routing, np.ndarray) or routing.ndim != 3:
            raise InvalidTensorError("routing must be a [tokens, layers, top_k] array")
        if len(position_list) != len(routing) or (
            len(position_list)
            and not 0
            <= int(position_list.min())
            <= int(position_list.max())
            < self.context.block_size_tokens
        ):
            raise InvalidArgumentError("positions must index the routing rows within the block")
        if block_id not in self.block_routing:
            shape = (self.context.block_size_tokens, routing.shape[-2], routing.shape[-1])
            self.block_routing[block_id] = np.zeros(shape, dtype=routing.dtype)
        self.block_routing[block_id][positions] = routing

    def get_block_routing(self, block_id: int) -> np.ndarray | None:
        """The routing stored for ``block_id``, or None."""
        return self.block_routing.get(require_int(block_id, "block_id"))

    def reconstruct_routing_from_blocks(
        self, block_ids: list[int], total_routing_tokens: int
    ) -> np.ndarray | None:
        """The first ``total_routing_tokens`` routing rows of ``block_ids``, or None if missing."""
        ids: list[int] = to_int_array(block_ids, "block_ids").tolist()
        total_routing_tokens = require_int(total_routing_tokens, "total_routing_tokens", minimum=0)
        parts, collected = [], 0
        for block_id in ids:
            routing = self.get_block_routing(block_id)
            if routing is None:
                return None
            if collected >= total_routing_tokens:
                break
            take = min(self.context.block_size_tokens, total_routing_tokens - collected)
            parts.append(routing[:take])
            collected += take
        if not parts or collected != total_routing_tokens:
            return None
        return np.concatenate(parts, axis=0)
