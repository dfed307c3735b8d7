"""MoERoutingMethods: the allocator's public MoE routing calls, validated, over a RoutingStore."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from prefixcache.engine.block_ids import BlockIdsLike, to_block_ids, to_int_array
from prefixcache.engine.routing import RoutingStore
from prefixcache.errors import ConfigError, InvalidArgumentError, InvalidTensorError


class MoERoutingMethods:
    """Per-block MoE routing storage, a collaborator above the engine (DESIGN.md, "MoE routing").

    Mixed into :class:`~prefixcache.KVBlockAllocator`: validates the routing
    calls and delegates to its :class:`RoutingStore`. The engine never sees
    routing; the facade clears a block's rows when the engine reports it
    freed or hands it out fresh.
    """

    routing: RoutingStore | None
    num_usable: int
    dummy_block_id: int
    block_size_tokens: int

    def _check_referenced(self, ids: np.ndarray, what: str) -> None:
        raise NotImplementedError  # the facade's: it asks the engine

    def _routing_store(self) -> RoutingStore:
        if self.routing is None:
            raise ConfigError(
                "MoE routing is not configured (set routing_num_layers and routing_top_k)"
            )
        return self.routing

    def store_routing_per_block(
        self, flat_routing: Any, token_block_ids: BlockIdsLike, token_positions: BlockIdsLike
    ) -> None:
        """Store each token's routed experts at its block and position.

        Tokens pointing at the dummy block (padding) are skipped.

        Args:
            flat_routing: ``[tokens, layers, top_k]`` integer CPU tensor or array.
            token_block_ids: ``[tokens]`` block of each token (dummy allowed).
            token_positions: ``[tokens]`` position of each token in its block.

        Raises:
            ConfigError: routing is not configured.
            InvalidTensorError, InvalidArgumentError, InvalidBlockIdError: bad input.
            BlockStateError: a target block is not referenced.

        Complexity: O(tokens) vectorised.
        """
        store = self._routing_store()
        routing = self._routing_array(flat_routing)
        store.validate_routing(routing)
        blocks = to_int_array(token_block_ids, "token_block_ids")
        positions = to_int_array(token_positions, "token_positions")
        if not (len(blocks) == len(positions) == routing.shape[0]):
            raise InvalidTensorError(
                f"lengths differ: {routing.shape[0]} routing rows, {len(blocks)} block IDs, "
                f"{len(positions)} positions"
            )
        keep = blocks != self.dummy_block_id
        blocks = to_block_ids(blocks[keep], self.num_usable, "token_block_ids")
        positions = positions[keep]
        if positions.size and (positions.min() < 0 or positions.max() >= self.block_size_tokens):
            raise InvalidArgumentError(
                f"token_positions must lie in [0, {self.block_size_tokens}), "
                f"got [{positions.min()}, {positions.max()}]"
            )
        if blocks.size:
            self._check_referenced(blocks, "store_routing_per_block")
            store.store_tokens(routing[keep], blocks, positions)

    def store_block_routing(self, block_id: int, routing: Any) -> None:
        """Store the routing of one block's first ``len(routing)`` tokens.

        Raises:
            ConfigError, InvalidTensorError, InvalidArgumentError,
            InvalidBlockIdError, BlockStateError: as for :meth:`store_routing_per_block`.
        """
        store = self._routing_store()
        ids = to_block_ids([block_id], self.num_usable, "block_id")
        array = self._routing_array(routing)
        store.validate_routing(array)
        if array.shape[0] > self.block_size_tokens:
            raise InvalidTensorError(
                f"routing has {array.shape[0]} rows; a block holds {self.block_size_tokens} tokens"
            )
        self._check_referenced(ids, "store_block_routing")
        store.store_block(int(ids[0]), array)

    def get_block_routing(self, block_id: int) -> torch.Tensor | None:
        """A copy of one block's routing ``[block_size, layers, top_k]``, or None if incomplete."""
        store = self._routing_store()
        ids = to_block_ids([block_id], self.num_usable, "block_id")
        routing = store.get_block(int(ids[0]))
        return None if routing is None else torch.from_numpy(routing)

    def reconstruct_routing_from_blocks(
        self, block_ids: BlockIdsLike, total_tokens: int
    ) -> torch.Tensor | None:
        """Routing ``[total_tokens, layers, top_k]`` of a request's blocks, in order.

        Returns None when any of the first ``total_tokens`` tokens has no routing.

        Complexity: O(total_tokens) vectorised.
        """
        store = self._routing_store()
        ids = to_block_ids(block_ids, self.num_usable)
        if isinstance(total_tokens, bool) or not isinstance(total_tokens, int):
            raise InvalidArgumentError(f"total_tokens must be an int, got {total_tokens!r}")
        if not 0 <= total_tokens <= len(ids) * self.block_size_tokens:
            raise InvalidArgumentError(
                f"total_tokens {total_tokens} outside [0, {len(ids) * self.block_size_tokens}] "
                f"for {len(ids)} blocks"
            )
        routing = store.reconstruct(ids, total_tokens)
        return None if routing is None else torch.from_numpy(routing)

    @staticmethod
    def _routing_array(routing: Any) -> np.ndarray:
        if isinstance(routing, torch.Tensor):
            if routing.device.type != "cpu":
                raise InvalidTensorError(
                    f"routing must be on the CPU (copy it off the device first), "
                    f"got {routing.device}"
                )
            if routing.dtype.is_floating_point or routing.dtype.is_complex:
                # numpy has no bfloat16 (its .numpy() raises a bare TypeError); every float
                # dtype is refused alike: expert IDs are integers.
                raise InvalidTensorError(f"routing must have an integer dtype, got {routing.dtype}")
            return routing.detach().numpy()
        if isinstance(routing, np.ndarray):
            return routing
        raise InvalidTensorError(
            f"routing must be a tensor or an array, got {type(routing).__name__}"
        )
