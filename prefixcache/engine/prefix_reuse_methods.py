"""The prefix-reuse calls of :class:`~prefixcache.KVBlockAllocator`: match, acquire, register.

The composable calls an engine makes for prefix caching one step at a time
(:meth:`~prefixcache.KVBlockAllocator.admit_request` fuses them). Each
validates its arguments and makes one engine call (DESIGN.md, "The engine").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from prefixcache.engine.block_ids import EMPTY_IDS, BlockIdsLike, to_block_ids, to_tensor
from prefixcache.engine.core import EngineCore
from prefixcache.engine.events import KVEventLog
from prefixcache.engine.prefix_hashing import to_hash, to_hash_list
from prefixcache.engine.registration import new_runs
from prefixcache.engine.validation import require_flag, require_int
from prefixcache.errors import BlockStateError, InvalidArgumentError

__all__ = ["PrefixReuseMethods"]

_SENTINEL_HASHES = (0, -1)


class PrefixReuseMethods:
    """Matching a prompt's cached prefix, pinning blocks, registering filled blocks."""

    _engine: EngineCore
    _max_hash: int
    _fingerprint_of_block: list[int]
    num_usable: int
    block_size_tokens: int
    enable_prefix_caching: bool
    events: KVEventLog | None
    _num_queried_tokens: int
    _num_hit_tokens: int
    _num_preempted_queried_tokens: int
    _num_preempted_hit_tokens: int

    if TYPE_CHECKING:  # the other mixins' members these calls use

        def _fingerprint_list(self, fingerprints: Any, num_hashes: int) -> list[int] | None: ...

        def _verified_prefix(self, matched: np.ndarray, checks: list[int]) -> np.ndarray: ...

        def _event_tokens(self, token_ids: Any, num_blocks: int) -> list[int] | None: ...

        def _record_stored_runs(
            self,
            stored_runs: list[tuple[int, list[int]]],
            hashes: list[int],
            parent_hash: int | None,
            tokens: list[int] | None,
            lora_name: str | None,
        ) -> None: ...

    def match_prefix(
        self,
        block_hashes: Any,
        *,
        acquire: bool = False,
        fingerprints: Any = None,
        num_tokens: int | None = None,
        resumed: bool = False,
    ) -> torch.Tensor:
        """IDs of the blocks holding the longest registered prefix of ``block_hashes``.

        Args:
            block_hashes: chained hashes of a prompt's full blocks, in order
                (a sequence of ints, or a 1-D integer tensor/array).
            acquire: also take one active reference on every matched block,
                atomically, so eviction cannot take them before the caller
                allocates the rest.
            fingerprints: in verify mode, the query's fingerprints
                (:meth:`fingerprint_tokens`); the match stops at the first
                block whose stored fingerprint differs. Ignored otherwise.
            num_tokens: the prompt's length in tokens, for the token hit
                counters (``stats().num_queried_tokens``, vLLM's
                ``prefix_cache_queries``): at least ``len(block_hashes) *
                block_size_tokens``; None counts the full blocks only.
            resumed: the request was preempted and comes back: its own blocks are
                no cache hit, so the tokens count in the preempted counters
                (``stats().num_preempted_queried_tokens`` / ``..._hit_tokens``).

        Returns:
            A fresh CPU int32 tensor, possibly empty.

        Raises:
            InvalidTensorError, InvalidArgumentError: malformed hashes or
                fingerprints, ``acquire`` not a bool, or ``num_tokens`` fewer
                than the hashed blocks' tokens.

        Complexity: O(matched blocks) dict lookups, plus vectorised reference updates.
        """
        is_acquire = require_flag(acquire, "acquire")
        is_resumed = require_flag(resumed, "resumed")
        hashes = to_hash_list(block_hashes, "block_hashes", self._max_hash)
        checks = self._fingerprint_list(fingerprints, len(hashes))
        full_tokens = len(hashes) * self.block_size_tokens
        if num_tokens is not None:
            full_tokens = require_int(num_tokens, "num_tokens", minimum=full_tokens)
        if not self.enable_prefix_caching:
            return to_tensor(EMPTY_IDS.copy())
        matched = self._engine.lookup(hashes)
        if checks is not None:
            matched = self._verified_prefix(matched, checks)
        self._engine.take_hit(matched, len(hashes), acquire=is_acquire)
        if is_resumed:
            self._num_preempted_queried_tokens += full_tokens
            self._num_preempted_hit_tokens += len(matched) * self.block_size_tokens
        else:
            self._count_prefix_tokens(full_tokens, len(matched))
        return to_tensor(matched.astype(np.int32))

    def _count_prefix_tokens(self, num_tokens: int, num_hit_blocks: int) -> None:
        """Count a prefix query of ``num_tokens`` prompt tokens that hit ``num_hit_blocks``."""
        self._num_queried_tokens += num_tokens
        self._num_hit_tokens += num_hit_blocks * self.block_size_tokens

    def is_hash_registered(self, block_hash: int) -> bool:
        """Whether some block holds ``block_hash`` now (a chain can continue from it).

        A registered hash can disappear while its request still runs: evicting
        a pinned cached ancestor, or a ref-zero release of a shared prefix,
        drops the hashes below it. A caller that continues a chain with
        ``parent_hash`` asks here first and re-registers from the root if not.

        Raises:
            InvalidArgumentError: ``block_hash`` is not an int, or outside the
                hash range (signed 64 bits; wider for ``xxh3_128``/``sha256``).

        Complexity: O(1).
        """
        return self._engine.block_of(to_hash(block_hash, "block_hash", self._max_hash)) is not None

    def acquire_blocks(self, block_ids: BlockIdsLike) -> None:
        """Take one active reference per occurrence on cached or referenced blocks.

        Raises:
            InvalidTensorError, InvalidBlockIdError: malformed IDs.
            BlockStateError: a block is free (neither cached nor referenced).

        Complexity: O(k log k) vectorised.
        """
        ids = to_block_ids(block_ids, self.num_usable)
        if ids.size:
            self._engine.acquire(ids)

    def register_kv_block_hashes(
        self,
        block_ids: BlockIdsLike,
        block_hashes: Any,
        *,
        parent_hash: int | None = None,
        token_ids: Any = None,
        lora_name: str | None = None,
        fingerprints: Any = None,
    ) -> torch.Tensor:
        """Register a chain of full blocks under their hashes so later prompts can hit them.

        ``block_hashes[i]`` is the hash of ``block_ids[i]``; the parent of
        ``block_hashes[0]`` is ``parent_hash`` (None: the chain starts at the
        root) and the parent of each later hash is the one before it.
        Idempotent: registering a block again under its own hash changes
        nothing. A hash already held by another block is refused (the block
        stays unhashed and is freed on release); the chain continues under the
        holder, so later blocks still register.

        Args:
            block_ids: referenced (active or paused) blocks, one per hash.
            block_hashes: their chained hashes (ints other than 0 and -1).
            parent_hash: registered hash the chain continues, or None.
            token_ids: the blocks' tokens, concatenated (``block_size_tokens``
                per block); only kept for KV cache events.
            lora_name: adapter the blocks belong to; only kept for events.
            fingerprints: in verify mode, the blocks' fingerprints
                (:meth:`fingerprint_tokens`), required; ignored otherwise.

        Returns:
            A CPU bool tensor: True where the block now carries its hash.

        Raises:
            InvalidTensorError, InvalidBlockIdError, InvalidArgumentError: malformed input.
            BlockStateError: a block is not referenced.
            HashConflictError: a block already carries another hash, or
                ``parent_hash`` is not registered.

        Complexity: O(k) dict operations.
        """
        ids = to_block_ids(block_ids, self.num_usable)
        hashes = to_hash_list(block_hashes, "block_hashes", self._max_hash)
        if parent_hash is not None:
            parent_hash = to_hash(parent_hash, "parent_hash", self._max_hash)
        if len(hashes) != len(ids):
            raise InvalidArgumentError(f"{len(ids)} block IDs but {len(hashes)} hashes")
        for sentinel in _SENTINEL_HASHES:
            if sentinel in hashes:
                raise InvalidArgumentError(f"hash {sentinel} is a reserved sentinel")
        tokens = self._event_tokens(token_ids, len(ids))
        checks = self._fingerprint_list(fingerprints, len(hashes))
        if lora_name is not None and not isinstance(lora_name, str):
            raise InvalidArgumentError(f"lora_name must be a string or None, got {lora_name!r}")
        if not self.enable_prefix_caching or not len(ids):
            return torch.zeros(len(ids), dtype=torch.bool)
        holds, new = self._engine.register(ids, hashes, parent_hash)
        if checks is not None:
            for index in np.flatnonzero(new).tolist():
                self._fingerprint_of_block[int(ids[index])] = checks[index]
        if self.events is not None:
            self._record_stored_runs(
                new_runs(new.tolist(), hashes), hashes, parent_hash, tokens, lora_name
            )
        return torch.from_numpy(holds)

    def _check_referenced(self, ids: np.ndarray, what: str) -> None:
        active, paused = self._engine.reference_counts(ids)
        unreferenced = (active + paused) == 0
        if unreferenced.any():
            block_id = int(ids[unreferenced][0])
            raise BlockStateError(
                f"{what}: block {block_id} ({self._engine.describe_state(block_id)}) "
                "is not referenced"
            )
