"""A step loop that serves a mixed workload through every part of the tiers package at once.

:class:`~prefixcache.reference.sim.DynamicBatchingSim` drives a bare allocator
and lives in a lower layer, so this driver is its tiers-level sibling, built
on the serving layer's public :class:`~prefixcache.serving.kv_cache.KVCache`
and on :class:`~prefixcache.tiers.requests.RequestCache`: each step it may
begin a new weight epoch, admits arrived requests (prompt with range keys
for images or LoRA spans, a label per tenant), runs the queued copies (host
demotions and promotions, remote stores and loads), decodes one token per
running request, preempts the youngest when the pool is full (it resumes
later and counts nothing), and finishes requests that are done.

K/V is real bytes: a block's K and V are a function of its chained hash and
of the weight epoch it was computed in, written when the block is computed
and checked on every admission against what the request's own epoch would
compute. Bytes from other weights, from another image, or copied to the
wrong block raise :class:`~prefixcache.errors.InvariantError`.

>>> requests = [MixedRequest(i, tuple(range(40)) + (i,), 4, arrival_step=i) for i in range(6)]
>>> report = run_mixed(requests, MixedSimConfig(device_blocks=16, host_slots=32, block_size=8))
>>> report.num_finished, report.counters["default"]["num_hit_tokens"] > 0
(6, True)
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from prefixcache.engine.allocator import KVBlockAllocator
from prefixcache.engine.validation import require_int
from prefixcache.errors import ConfigError, InvariantError
from prefixcache.serving.kv_cache import KVCache
from prefixcache.tiers.host import HostTier
from prefixcache.tiers.range_keys import RangeKey
from prefixcache.tiers.remote import RemoteTier
from prefixcache.tiers.requests import RequestCache
from prefixcache.tiers.tiered import TieredCache
from prefixcache.tiers.transfer import HostKVStore, KVTransfer

_HEADS, _HEAD_DIM = 1, 4


@dataclass(frozen=True, slots=True)
class MixedRequest:
    """One request of the mixed workload.

    Attributes:
        request_id: unique, hashable.
        tokens: the prompt.
        output_length: tokens to decode, >= 1.
        arrival_step: first step it may be admitted in, >= 0.
        label: tenant or model, for the per-label counters.
        ranges: range keys (an image over its placeholder tokens, a LoRA span).
    """

    request_id: Hashable
    tokens: tuple[int, ...]
    output_length: int
    arrival_step: int = 0
    label: str = "default"
    ranges: tuple[RangeKey, ...] = ()


@dataclass(frozen=True, slots=True)
class MixedSimConfig:
    """Sizes of the loop.

    Attributes:
        device_blocks: device pool blocks (``total_count``), >= 2.
        host_slots: host tier slots, >= 1.
        block_size: tokens per block, >= 1.
        max_running: requests decoding at once, >= 1.
        epoch_every: begin a new weight epoch every this many steps (0: never).
        max_steps: a bound on the run, >= 1.
    """

    device_blocks: int
    host_slots: int
    block_size: int = 16
    max_running: int = 8
    epoch_every: int = 0
    max_steps: int = 100_000

    def __post_init__(self) -> None:
        require_int(self.device_blocks, "device_blocks", minimum=2, error=ConfigError)
        require_int(self.host_slots, "host_slots", minimum=1, error=ConfigError)
        require_int(self.block_size, "block_size", minimum=1, error=ConfigError)
        require_int(self.max_running, "max_running", minimum=1, error=ConfigError)
        require_int(self.epoch_every, "epoch_every", minimum=0, error=ConfigError)
        require_int(self.max_steps, "max_steps", minimum=1, error=ConfigError)


@dataclass(frozen=True, slots=True)
class MixedSimReport:
    """What one run did.

    Attributes:
        num_steps, num_finished: steps run, requests finished.
        num_preemptions: requests preempted for room (each resumed later).
        num_epochs: weight epochs begun during the run.
        num_checked_blocks: cached blocks whose K/V was checked on admission.
        counters: :meth:`RequestCache.counters` at the end (per label).
        stats: :meth:`TieredCache.stats` at the end, as plain dicts.
    """

    num_steps: int
    num_finished: int
    num_preemptions: int
    num_epochs: int
    num_checked_blocks: int
    counters: dict[str, dict[str, int]]
    stats: dict[str, Any]


class MixedSim:
    """The loop's state: device pool, host tier, K/V, the requests. See :func:`run_mixed`.

    Args:
        config: sizes.
        remote: a remote tier behind the host tier (optional).
    """

    def __init__(self, config: MixedSimConfig, *, remote: RemoteTier | None = None) -> None:
        self.config = config
        size = config.block_size
        self.allocator = KVBlockAllocator(
            total_count=config.device_blocks, block_size_tokens=size, device="cpu"
        )
        self.kv = KVCache(
            1, config.device_blocks, size, _HEADS, _HEAD_DIM, dtype=torch.float32, device="cpu"
        )
        self.store = HostKVStore(self.kv, config.host_slots)
        host = HostTier(config.host_slots, block_size=size)
        self.tiered = TieredCache(self.allocator, host, remote=remote, store=self.store)
        self.requests = RequestCache(self.tiered)
        self.transfer = KVTransfer(self.kv, self.store, remote=remote)
        self.step_index = 0
        self.num_preemptions = self.num_epochs = self.num_checked = self.num_finished = 0
        self._pending: deque[MixedRequest] = deque()
        self._waiting: deque[MixedRequest] = deque()  # resumed requests go first
        self._running: dict[Hashable, MixedRequest] = {}  # in admission order
        self._decoded: dict[Hashable, int] = {}  # tokens decoded, kept across preemption

    def submit(self, requests: Sequence[MixedRequest]) -> None:
        """Queue requests; they arrive at their ``arrival_step``."""
        self._pending.extend(sorted(requests, key=lambda r: r.arrival_step))

    def is_done(self) -> bool:
        """Nothing pending, waiting or running."""
        return not (self._pending or self._waiting or self._running)

    def step(self) -> None:
        """One step: maybe new weights, arrivals, admissions, one decode token each, finishes."""
        every = self.config.epoch_every
        if every and self.step_index and self.step_index % every == 0:
            self.requests.begin_weight_epoch(f"step-{self.step_index}")
            self.num_epochs += 1
        while self._pending and self._pending[0].arrival_step <= self.step_index:
            self._waiting.append(self._pending.popleft())
        self._admit()
        self._decode()
        self.step_index += 1

    def report(self) -> MixedSimReport:
        """The numbers so far; checks every invariant first."""
        self.tiered.check()
        return MixedSimReport(
            num_steps=self.step_index,
            num_finished=self.num_finished,
            num_preemptions=self.num_preemptions,
            num_epochs=self.num_epochs,
            num_checked_blocks=self.num_checked,
            counters=self.requests.counters(),
            stats=self.tiered.stats().as_dict(),
        )

    # ------------------------------------------------------------------ internals

    def _admit(self) -> None:
        while self._waiting and len(self._running) < self.config.max_running:
            request = self._waiting[0]
            resumed = request.request_id in self._decoded
            admission = self.requests.admit(
                request.request_id,
                None if resumed else request.tokens,
                label=request.label,
                ranges=request.ranges,
            )
            if admission is None:
                if not self._running:
                    raise InvariantError(f"request {request.request_id!r} cannot fit the pool")
                return
            self._waiting.popleft()
            self._decoded.setdefault(request.request_id, 0)
            self._copy()
            cached = admission.num_cached_tokens // self.config.block_size
            self._check(request.request_id, cached)
            self._compute(request.request_id, cached)
            self._running[request.request_id] = request

    def _decode(self) -> None:
        for request_id in list(self._running):
            if request_id not in self._running:
                continue  # preempted for an older request this step
            request, decoded = self._running[request_id], self._decoded[request_id]
            done = len(self.requests.hashes_of(request_id))
            token = (len(request.tokens) * 31 + decoded * 7919) % 32749 + 1  # deterministic
            while self.requests.append(request_id, [token]) is None:
                self._preempt_youngest(request_id)
                if request_id not in self._running:
                    break
            else:
                self._copy()
                self._compute(request_id, done)
                self._decoded[request_id] = decoded + 1
                if decoded + 1 >= request.output_length:
                    self.requests.finish(request_id)
                    del self._running[request_id], self._decoded[request_id]
                    self.num_finished += 1

    def _preempt_youngest(self, keep: Hashable) -> None:
        """Preempt the most recently admitted request (``keep`` only when it is alone)."""
        others = [r for r in self._running if r != keep]
        victim = others[-1] if others else keep
        self._waiting.appendleft(self._running.pop(victim))
        self.requests.preempt(victim)
        self.num_preemptions += 1

    def _copy(self) -> None:
        self.transfer.run(self.tiered.take_transfer())
        self.transfer.wait()

    def _value(self, block_hash: int, epoch: int, which: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed((block_hash * 7 + epoch * 2 + which) % (1 << 62))
        return torch.randn((self.config.block_size, _HEADS, _HEAD_DIM), generator=generator)

    def _compute(self, request_id: Hashable, first: int) -> None:
        """Write the K/V of the request's full blocks from ``first`` on (a forward pass)."""
        epoch = self.requests.epoch_of(request_id)
        ids = self._block_ids(request_id)
        for index, block_hash in enumerate(self.requests.hashes_of(request_id)):
            if index >= first:
                self.kv.k_caches[0][ids[index]] = self._value(block_hash, epoch, 0)
                self.kv.v_caches[0][ids[index]] = self._value(block_hash, epoch, 1)

    def _check(self, request_id: Hashable, num_cached: int) -> None:
        """The cached blocks hold what this request's epoch computes for their hashes."""
        epoch = self.requests.epoch_of(request_id)
        ids = self._block_ids(request_id)
        for index, block_hash in enumerate(self.requests.hashes_of(request_id)[:num_cached]):
            block = ids[index]
            if not (
                torch.equal(self.kv.k_caches[0][block], self._value(block_hash, epoch, 0))
                and torch.equal(self.kv.v_caches[0][block], self._value(block_hash, epoch, 1))
            ):
                raise InvariantError(
                    f"request {request_id!r} (epoch {epoch}) got block {block} at position "
                    f"{index} whose K/V was computed for another prefix or weights"
                )
            self.num_checked += 1

    def _block_ids(self, request_id: Hashable) -> list[int]:
        return self.requests.block_ids_of(request_id).tolist()


def run_mixed(
    requests: Sequence[MixedRequest],
    config: MixedSimConfig,
    *,
    remote: RemoteTier | None = None,
) -> MixedSimReport:
    """Serve ``requests`` to completion (or ``config.max_steps``) and report.

    Raises:
        InvariantError: a request got K/V that is not its own prefix's under
            its own weights, a tier's invariant broke, or a request can
            never fit the device pool.
        ConfigError: a bad size.
    """
    sim = MixedSim(config, remote=remote)
    sim.submit(requests)
    while not sim.is_done() and sim.step_index < config.max_steps:
        sim.step()
    return sim.report()


__all__ = ["MixedRequest", "MixedSim", "MixedSimConfig", "MixedSimReport", "run_mixed"]
