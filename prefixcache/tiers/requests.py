"""RequestCache: requests admitted through a tiered cache, with their own cache numbers.

One object per scheduler that ties the pieces of the tiers package together
for a request's life: hash its prompt (weight epoch, tenant salt, range keys),
match it on the device and in the host tier, allocate the rest, register the
new full blocks, grow it during decode, preempt and resume it, finish it.
Each admission reports the request's cached tokens (vLLM's
``num_cached_tokens``), split by tier, and counters per label (model or
tenant) count queried and hit tokens for ``rate(hits) / rate(queries)``
dashboards. A preempted request that comes back finds its own blocks cached:
that is not a prefix hit, so its readmission counts nothing (vLLM once
reported a 30% hit rate where the truth was 0.2% for this reason). See
DESIGN.md, "Tiers".
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from prefixcache.engine.block_ids import to_int_array
from prefixcache.engine.validation import require_hashable
from prefixcache.errors import InvalidArgumentError
from prefixcache.tiers.range_keys import RangeKey, range_keyed_hashes
from prefixcache.tiers.tiered import TieredCache


@dataclass(frozen=True, slots=True)
class Admission:
    """What :meth:`RequestCache.admit` did for one request.

    Attributes:
        block_ids: int32 block IDs of the prompt, in order (hits first).
        num_cached_tokens: prompt tokens whose K/V was already cached
            (device and host hits), as vLLM's ``num_cached_tokens``.
        num_device_cached_tokens: of those, found on the device.
        num_host_cached_tokens: of those, promoted from the host tier.
        num_remote_cached_tokens: of those, loaded from the remote tier.
        resumed: the request was preempted before; it was not counted again.
        epoch: the weight epoch the request hashes and computes in.
    """

    block_ids: np.ndarray
    num_cached_tokens: int
    num_device_cached_tokens: int
    num_host_cached_tokens: int
    resumed: bool
    epoch: int
    num_remote_cached_tokens: int = 0


@dataclass(slots=True)
class LabelCounters:
    """Cumulative token counters of one label; only ever increase."""

    num_requests: int = 0
    num_queried_tokens: int = 0  # vLLM's prefix_cache_queries
    num_hit_tokens: int = 0  # vLLM's prefix_cache_hits, both tiers
    num_device_hit_tokens: int = 0
    num_host_hit_tokens: int = 0
    num_remote_hit_tokens: int = 0
    num_resumed_requests: int = 0  # readmissions after preemption, not counted above

    def as_dict(self) -> dict[str, int]:
        """The counters as a plain dict."""
        return {name: getattr(self, name) for name in self.__slots__}


@dataclass(slots=True)
class _Request:
    """A request's state between admission and finish. Only :class:`RequestCache` changes it."""

    label: str
    epoch: int
    tokens: list[int]
    ranges: tuple[RangeKey, ...]
    salt: str | bytes | None
    block_ids: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)  # registered full blocks, in order
    running: bool = True


class RequestCache:
    """Admit, grow, preempt and finish requests over a :class:`TieredCache`.

    Methods: :meth:`admit`, :meth:`append`, :meth:`preempt`, :meth:`finish`,
    :meth:`counters`, :meth:`begin_weight_epoch`, :meth:`hashes_of`,
    :meth:`block_ids_of`, :meth:`epoch_of`.

    Not thread-safe: the scheduler thread owns it.

    Args:
        tiered: the device allocator with its host tier.
    """

    def __init__(self, tiered: TieredCache) -> None:
        self.tiered = tiered
        self.block_size = tiered.allocator.block_size_tokens
        self._requests: dict[Hashable, _Request] = {}
        self._counters: dict[str, LabelCounters] = {}

    def admit(
        self,
        request_id: Hashable,
        tokens: Any,
        *,
        label: str = "default",
        salt: str | bytes | None = None,
        ranges: Sequence[RangeKey] = (),
    ) -> Admission | None:
        """Give a prompt its blocks: cached prefix first (device, then host), then fresh ones.

        A request preempted earlier (:meth:`preempt`) is admitted again with
        ``tokens`` None or its tokens so far; it is hashed in the current
        epoch (its old K/V may be from older weights) and counts nothing.

        Returns:
            The admission, or None when the device pool cannot hold the
            prompt (its prefix blocks are given back; promoted ones stay cached).

        Raises:
            InvalidArgumentError: the request is running, an unknown request
                resumes without tokens, a malformed prompt, label or range.

        Complexity: O(prompt tokens) hashing plus O(blocks) bookkeeping.
        """
        old = self._requests.get(require_hashable(request_id, "request_id"))
        if isinstance(ranges, (str, bytes)) or not isinstance(ranges, Iterable):
            raise InvalidArgumentError(
                f"ranges must be a sequence of RangeKey, got {type(ranges).__name__}"
            )
        if old is not None and old.running:
            raise InvalidArgumentError(f"request {request_id!r} is already running")
        if tokens is None:
            if old is None:
                raise InvalidArgumentError(f"request {request_id!r} has no tokens to resume")
            prompt, label, salt, ranges = old.tokens, old.label, old.salt, old.ranges
        else:
            prompt = to_int_array(tokens, "tokens").tolist()
        if not isinstance(label, str) or not label:
            raise InvalidArgumentError(f"label must be a non-empty str, got {label!r}")
        epoch = self.tiered.epochs.current
        hashes = range_keyed_hashes(
            self.tiered.allocator,
            prompt,
            tuple(ranges),
            salt=salt,
            extra_keys=self.tiered.epochs.hash_keys(epoch),
        )
        match = self.tiered.match(hashes, num_tokens=len(prompt), resumed=old is not None)
        num_hit = len(match.block_ids)
        fresh = self.tiered.allocate(-(-len(prompt) // self.block_size) - num_hit)
        if fresh is None:
            self.tiered.release(match.block_ids)
            return None
        block_ids = np.concatenate([match.block_ids, fresh]).astype(np.int32)
        parent = hashes[num_hit - 1] if num_hit else None
        new_full = len(hashes) - num_hit
        if new_full:
            self.tiered.register(fresh[:new_full], hashes[num_hit:], parent_hash=parent)
        self._requests[request_id] = _Request(
            label, epoch, prompt, tuple(ranges), salt, block_ids.tolist(), hashes
        )
        resumed = old is not None
        size = self.block_size
        tiers = (match.num_device_blocks, match.num_host_blocks, match.num_remote_blocks)
        self._count(label, len(prompt), tiers, resumed)
        return Admission(
            block_ids=block_ids,
            num_cached_tokens=num_hit * size,
            num_device_cached_tokens=match.num_device_blocks * size,
            num_host_cached_tokens=match.num_host_blocks * size,
            resumed=resumed,
            epoch=epoch,
            num_remote_cached_tokens=match.num_remote_blocks * size,
        )

    def append(self, request_id: Hashable, tokens: Any) -> np.ndarray | None:
        """Add generated ``tokens``: allocate blocks as needed, register blocks that filled.

        New blocks hash in the request's own epoch, so a request running
        across a weight update keeps extending its own chain.

        Returns:
            The request's whole block list (int32), or None when the pool is
            full (nothing changes; preempt something and try again).

        Raises:
            InvalidArgumentError: the request is not running; malformed tokens.

        Complexity: O(new tokens).
        """
        request = self._running(request_id)
        new = to_int_array(tokens, "tokens").tolist()
        size = self.block_size
        total = len(request.tokens) + len(new)
        need = -(-total // size) - len(request.block_ids)
        fresh = self.tiered.allocate(max(need, 0))
        if fresh is None:
            return None
        request.block_ids.extend(fresh.tolist())
        request.tokens.extend(new)
        done = len(request.hashes)
        if total // size > done:
            more = range_keyed_hashes(
                self.tiered.allocator,
                request.tokens[done * size : (total // size) * size],
                request.ranges,
                first_token=done * size,
                parent=request.hashes[-1] if done else None,
                salt=request.salt,
                extra_keys=self.tiered.epochs.hash_keys(request.epoch),
            )
            self.tiered.register(
                request.block_ids[done : done + len(more)],
                more,
                parent_hash=request.hashes[-1] if done else None,
                epoch=request.epoch,
            )
            request.hashes.extend(more)
        return np.asarray(request.block_ids, dtype=np.int32)

    def preempt(self, request_id: Hashable) -> None:
        """Give the request's blocks back (they stay cached); it may be admitted again.

        Raises:
            InvalidArgumentError: the request is not running.
        """
        request = self._running(request_id)
        self.tiered.release(request.block_ids)
        request.block_ids, request.hashes, request.running = [], [], False

    def finish(self, request_id: Hashable) -> None:
        """Give the request's blocks back and forget it.

        Raises:
            InvalidArgumentError: the request is unknown.
        """
        request = self._known(request_id)
        if request.running:
            self.tiered.release(request.block_ids)
        del self._requests[request_id]

    def begin_weight_epoch(self, tag: str | int) -> int:
        """New weights (see :meth:`TieredCache.begin_weight_epoch`). Complexity: O(1)."""
        return self.tiered.begin_weight_epoch(tag)

    def counters(self) -> dict[str, dict[str, int]]:
        """Token counters per label, plain dicts. Complexity: O(labels)."""
        return {label: c.as_dict() for label, c in sorted(self._counters.items())}

    def epoch_of(self, request_id: Hashable) -> int:
        """The weight epoch a request computes in.

        Raises:
            InvalidArgumentError: the request is unknown.
        """
        return self._known(request_id).epoch

    def block_ids_of(self, request_id: Hashable) -> np.ndarray:
        """The running request's block IDs, in order (int32, a copy).

        Raises:
            InvalidArgumentError: the request is not running.
        """
        return np.asarray(self._running(request_id).block_ids, dtype=np.int32)

    def hashes_of(self, request_id: Hashable) -> list[int]:
        """Chained hashes of the running request's full blocks, in order (a copy).

        Raises:
            InvalidArgumentError: the request is not running.
        """
        return list(self._running(request_id).hashes)

    def _known(self, request_id: Hashable) -> _Request:
        request = self._requests.get(require_hashable(request_id, "request_id"))
        if request is None:
            raise InvalidArgumentError(f"request {request_id!r} is unknown")
        return request

    def _running(self, request_id: Hashable) -> _Request:
        request = self._requests.get(require_hashable(request_id, "request_id"))
        if request is None or not request.running:
            raise InvalidArgumentError(f"request {request_id!r} is not running")
        return request

    def _count(
        self, label: str, num_tokens: int, tiers: tuple[int, int, int], resumed: bool
    ) -> None:
        counters = self._counters.setdefault(label, LabelCounters())
        if resumed:
            counters.num_resumed_requests += 1
            return
        size = self.block_size
        device, host, remote = tiers
        counters.num_requests += 1
        counters.num_queried_tokens += num_tokens
        counters.num_device_hit_tokens += device * size
        counters.num_host_hit_tokens += host * size
        counters.num_remote_hit_tokens += remote * size
        counters.num_hit_tokens += (device + host + remote) * size


__all__ = ["Admission", "LabelCounters", "RequestCache"]
