"""RoutingStore: the MoE expert IDs each cached token was routed to, per block."""

from __future__ import annotations

import numpy as np

from prefixcache.errors import InvalidArgumentError, InvalidTensorError

INT16_MAX_EXPERTS = 32_767


class RoutingStore:
    """Routed expert IDs per block: ``[num_blocks, block_size, num_layers, top_k]``.

    A prefix hit can replay the routing of the tokens it skips (routing
    replay keeps MoE training/RL rollouts consistent). The store keeps, per
    block and token position, whether routing was written; writes and reads
    are vectorised over tokens and blocks. The allocator clears a block's
    routing when the block is evicted or handed out fresh, so routing never
    outlives the KV it belongs to.

    Fields: ``_data`` numpy int16 (int32 past 32,767 experts) on the host,
    ``_written`` numpy bool ``[num_blocks, block_size]``. Only the allocator
    calls the mutating methods, after validating block IDs.

    Methods: :meth:`store_tokens`, :meth:`store_block`, :meth:`get_block`,
    :meth:`reconstruct`, :meth:`clear`, :meth:`clear_all`. Not thread-safe.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_layers: int,
        top_k: int,
        num_experts: int | None = None,
    ) -> None:
        wide = num_experts is not None and num_experts > INT16_MAX_EXPERTS
        self.dtype = np.dtype(np.int32 if wide else np.int16)
        self.max_expert_id = (num_experts - 1) if num_experts else int(np.iinfo(self.dtype).max)
        self.block_size = block_size
        self.num_layers = num_layers
        self.top_k = top_k
        self._data = np.zeros((num_blocks, block_size, num_layers, top_k), dtype=self.dtype)
        self._written = np.zeros((num_blocks, block_size), dtype=bool)

    def validate_routing(self, routing: np.ndarray, rows: int | None = None) -> None:
        """Check dtype, trailing shape and expert range of a ``[tokens, layers, top_k]`` array.

        Raises:
            InvalidTensorError: wrong dtype or shape.
            InvalidArgumentError: an expert ID outside ``[0, num_experts)``.
        """
        if routing.dtype.kind not in "iu":
            raise InvalidTensorError(f"routing must have an integer dtype, got {routing.dtype}")
        expected = (self.num_layers, self.top_k)
        if routing.ndim != 3 or routing.shape[1:] != expected:
            raise InvalidTensorError(
                f"routing must have shape [tokens, {expected[0]}, {expected[1]}], "
                f"got {tuple(routing.shape)}"
            )
        if rows is not None and routing.shape[0] != rows:
            raise InvalidTensorError(f"routing has {routing.shape[0]} rows, expected {rows}")
        if routing.size and (routing.min() < 0 or routing.max() > self.max_expert_id):
            raise InvalidArgumentError(
                f"expert IDs must lie in [0, {self.max_expert_id}], "
                f"got [{routing.min()}, {routing.max()}]"
            )

    def store_tokens(
        self, routing: np.ndarray, block_ids: np.ndarray, positions: np.ndarray
    ) -> None:
        """Write token ``i``'s routing at ``(block_ids[i], positions[i])``. O(tokens)."""
        self._data[block_ids, positions] = routing
        self._written[block_ids, positions] = True

    def store_block(self, block_id: int, routing: np.ndarray) -> None:
        """Write the routing of the block's first ``len(routing)`` token positions."""
        rows = len(routing)
        self._data[block_id, :rows] = routing
        self._written[block_id, :rows] = True

    def get_block(self, block_id: int) -> np.ndarray | None:
        """A copy of the block's routing, or None unless every position was written."""
        if not self._written[block_id].all():
            return None
        routing: np.ndarray = self._data[block_id].copy()
        return routing

    def reconstruct(self, block_ids: np.ndarray, total_tokens: int) -> np.ndarray | None:
        """Routing of the first ``total_tokens`` tokens held by ``block_ids``, in order.

        Returns None when any of those tokens has no routing. O(total_tokens), vectorised.
        """
        rows = self._data[block_ids].reshape(-1, self.num_layers, self.top_k)[:total_tokens]
        if not self._written[block_ids].reshape(-1)[:total_tokens].all():
            return None
        routing: np.ndarray = rows.copy()
        return routing

    def clear(self, block_ids: np.ndarray) -> None:
        """Forget the routing of ``block_ids`` (evicted or handed out fresh). Vectorised."""
        self._written[block_ids] = False

    def swap_rows(self, rows: np.ndarray, others: np.ndarray) -> None:
        """Give ``rows[i]`` the routing of ``others[i]`` (defragmentation moves). Vectorised."""
        self._data[rows] = self._data[others]
        self._written[rows] = self._written[others]

    def clear_all(self) -> None:
        """Forget all routing. O(num_blocks * block_size)."""
        self._written[:] = False

    def written_blocks(self) -> np.ndarray:
        """IDs of blocks with any routing written (for invariant checks)."""
        return np.flatnonzero(self._written.any(axis=1))
