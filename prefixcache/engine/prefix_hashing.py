"""PrefixHashingMethods: the allocator's hashing and fingerprint calls, and hash-list input."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from prefixcache.engine import hashing
from prefixcache.engine.block_ids import to_int_array
from prefixcache.engine.config import AllocatorConfig
from prefixcache.errors import InvalidArgumentError, InvalidTensorError


class PrefixHashingMethods:
    """Chained block hashes and verification fingerprints with the allocator's settings.

    Mixed into :class:`~prefixcache.KVBlockAllocator`; a collaborator above
    the engine (the engine sees hashes only as ints). Fingerprints (verify
    mode, DESIGN.md "Collision defence") are kept per block by the facade.
    """

    config: AllocatorConfig
    block_size_tokens: int
    verify_prefix_hits: bool
    _fingerprint_of_block: list[int]
    _num_rejected: int

    def hash_tokens(
        self,
        tokens: Any,
        *,
        parent: int | None = None,
        salt: str | bytes | None = None,
        extra_keys: Sequence[object] | None = None,
    ) -> list[int]:
        """Chained hashes of the full blocks of ``tokens`` with this allocator's settings.

        Uses ``block_size_tokens`` and ``hash_algo`` from the config; the
        config's ``hash_salt`` comes first among the extra keys, so a new
        weight version never shares blocks with the old one.

        Raises:
            InvalidArgumentError: ``extra_keys`` is not a list or tuple, or as
                :func:`~prefixcache.engine.hashing.compute_block_hashes` raises.

        Complexity: O(tokens), one hash call per block.
        """
        keys = self._chain_keys([], extra_keys)
        algo = self.config.hash_algo
        if callable(algo):
            return algo(tokens, self.block_size_tokens, parent=parent, salt=salt, extra_keys=keys)
        return hashing.compute_block_hashes(
            tokens,
            self.block_size_tokens,
            parent=parent,
            salt=salt,
            extra_keys=keys or None,
            algo=algo,
        )

    def _chain_keys(self, keys: list[object], extra_keys: Sequence[object] | None) -> list[object]:
        """``keys``, then the config's ``hash_salt``, then the caller's extra keys."""
        if extra_keys is not None and not isinstance(extra_keys, (list, tuple)):
            raise InvalidArgumentError(
                f"extra_keys must be a list or tuple of keys, got {type(extra_keys).__name__}"
            )
        if self.config.hash_salt is not None:
            keys.append(self.config.hash_salt)
        if extra_keys is not None:
            keys.extend(extra_keys)
        return keys

    def fingerprint_tokens(
        self,
        tokens: Any,
        *,
        parent: int | None = None,
        salt: str | bytes | None = None,
        extra_keys: Sequence[object] | None = None,
    ) -> list[int]:
        """Verification fingerprints of the full blocks of ``tokens`` (verify mode).

        A second chain, independent of :meth:`hash_tokens`: another algorithm
        (``xxh3_128``, or ``sha256`` when hashing with ``xxh3_128``) under its
        own root, so a collision of one chain is not a collision of the other.
        ``parent`` is the previous block's fingerprint when continuing a chain.

        Raises:
            InvalidArgumentError: ``extra_keys`` is not a list or tuple, or as
                :func:`~prefixcache.engine.hashing.compute_block_hashes` raises.

        Complexity: O(tokens).
        """
        algo = "sha256" if self.config.hash_algo == "xxh3_128" else "xxh3_128"
        keys = self._chain_keys(["prefixcache-fingerprint"], extra_keys)
        return hashing.compute_block_hashes(
            tokens, self.block_size_tokens, parent=parent, salt=salt, extra_keys=keys, algo=algo
        )

    def _fingerprint_list(self, fingerprints: Any, num_hashes: int) -> list[int] | None:
        """Validate ``fingerprints``; required in verify mode, ignored otherwise."""
        if not self.verify_prefix_hits:
            return None
        if fingerprints is None:
            raise InvalidArgumentError(
                "verify_prefix_hits is on: pass fingerprints (see fingerprint_tokens)"
            )
        values = to_hash_list(fingerprints, "fingerprints")
        if len(values) != num_hashes:
            raise InvalidArgumentError(f"{num_hashes} hashes but {len(values)} fingerprints")
        return values

    def _verified_prefix(self, matched: np.ndarray, checks: list[int]) -> np.ndarray:
        stored = self._fingerprint_of_block
        for index, block_id in enumerate(matched.tolist()):
            if stored[block_id] != checks[index]:
                self._num_rejected += 1
                return matched[:index]
        return matched


def to_hash_list(block_hashes: Any, what: str) -> list[int]:
    """Hashes as a list of ints, from a sequence of ints or a 1-D integer tensor/array."""
    if isinstance(block_hashes, (torch.Tensor, np.ndarray)):
        return to_int_array(block_hashes, what).tolist()
    if isinstance(block_hashes, (str, bytes)) or not isinstance(block_hashes, Sequence):
        raise InvalidTensorError(
            f"{what} must be a sequence of ints or a 1-D integer tensor, "
            f"got {type(block_hashes).__name__}"
        )
    hashes = list(block_hashes)
    if set(map(type, hashes)) <= {int}:  # the common case, checked at C speed
        return hashes
    for block_hash in hashes:
        if isinstance(block_hash, bool) or not isinstance(block_hash, (int, np.integer)):
            raise InvalidTensorError(f"{what} must contain only ints, got {block_hash!r}")
    return [int(block_hash) for block_hash in hashes]
