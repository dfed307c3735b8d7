"""PrefixHashingMethods: the allocator's hashing and fingerprint calls, and hash-list input."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from prefixcache.engine import hashing
from prefixcache.engine.block_ids import to_int_array
from prefixcache.engine.config import AllocatorConfig
from prefixcache.engine.validation import INT64_MAX, INT64_MIN, is_int
from prefixcache.errors import InvalidArgumentError, InvalidTensorError

_WIDEST_FINGERPRINT = hashing.MAX_HASH["sha256"]  # fingerprints are xxh3_128 or sha256


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
        values = to_hash_list(fingerprints, "fingerprints", _WIDEST_FINGERPRINT)
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


def max_hash_of(hash_algo: object) -> int:
    """Largest hash the facade accepts under ``hash_algo`` (DESIGN.md, "Hashing").

    Signed 64 bits for ``xxh3_64`` and for a custom hash function; the wide
    algorithms' own range (``2**128 - 1``, ``2**256 - 1``) for ``xxh3_128``
    and ``sha256``, whose hashes the Python engine keeps whole.
    """
    if isinstance(hash_algo, str):
        return max(INT64_MAX, hashing.MAX_HASH.get(hash_algo, INT64_MAX))
    return INT64_MAX


def _is_hash_like(value: object) -> bool:
    """An int by the library's rule (:func:`is_int`), or one wider than int64 (wide hashes)."""
    return type(value) is int or is_int(value) or isinstance(value, np.unsignedinteger)


def to_hash(value: object, what: str, max_hash: int = INT64_MAX) -> int:
    """One hash as a Python int in ``[-2**63, max_hash]``; bools refused, numpy integers taken.

    Raises:
        InvalidArgumentError: not an int, or out of range.
    """
    if type(value) is int and INT64_MIN <= value <= max_hash:  # the common case
        return value
    if not _is_hash_like(value):
        raise InvalidArgumentError(f"{what} must be an int, got {value!r}")
    number: int = int(value)  # type: ignore[call-overload]
    if not INT64_MIN <= number <= max_hash:
        raise InvalidArgumentError(f"{what} {number} is outside [-2**63, {max_hash}]")
    return number


def to_hash_list(block_hashes: Any, what: str, max_hash: int = INT64_MAX) -> list[int]:
    """Hashes as a list of Python ints in ``[-2**63, max_hash]``.

    From a sequence of ints (numpy integers taken, bools refused) or a 1-D
    integer tensor, array or memoryview (read as an array, so its shape is checked).

    Raises:
        InvalidTensorError: not a sequence or 1-D integer tensor/array, or an
            element that is not an int.
        InvalidArgumentError: a hash outside ``[-2**63, max_hash]``.
    """
    if isinstance(block_hashes, (torch.Tensor, np.ndarray, memoryview)):
        array = to_int_array(block_hashes, what)
        if array.dtype == np.uint64 and array.size and int(array.max()) > max_hash:
            raise InvalidArgumentError(f"{what} holds {int(array.max())}, above {max_hash}")
        return array.tolist()  # type: ignore[no-any-return]
    if isinstance(block_hashes, (str, bytes)) or not isinstance(block_hashes, Sequence):
        raise InvalidTensorError(
            f"{what} must be a sequence of ints or a 1-D integer tensor, "
            f"got {type(block_hashes).__name__}"
        )
    hashes = list(block_hashes)
    if not set(map(type, hashes)) <= {int}:  # the common case is checked at C speed
        for block_hash in hashes:
            if not _is_hash_like(block_hash):
                raise InvalidTensorError(f"{what} must contain only ints, got {block_hash!r}")
        hashes = [int(block_hash) for block_hash in hashes]
    if hashes and (min(hashes) < INT64_MIN or max(hashes) > max_hash):
        bad = next(h for h in hashes if not INT64_MIN <= h <= max_hash)
        raise InvalidArgumentError(f"{what} holds {bad}, outside [-2**63, {max_hash}]")
    return hashes
