"""Moving K/V between the device pool and the host tier: the plan, the host store, the copier.

:class:`TransferPlan` is what the bookkeeping (:class:`~prefixcache.tiers.tiered.TieredCache`)
decides: an ordered list of block copies, device -> host (a demotion) and
host -> device (a promotion). :class:`HostKVStore` holds the host tier's K/V
(pinned memory when the device is CUDA, so copies can be asynchronous), shaped
like a :class:`~prefixcache.serving.kv_cache.KVCache` with host slots in place of
block IDs. :class:`KVTransfer` runs plans: on CUDA on a side stream that first
waits for the work already queued on the compute stream (so a demotion reads
the K/V a forward pass wrote) and never blocks the host; :meth:`KVTransfer.wait`
makes the compute stream wait for the copies before attention reads them. On
the CPU the copies run at once. See DESIGN.md, "Tiers".
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from prefixcache.engine.validation import require_int
from prefixcache.errors import ConfigError, InvalidArgumentError
from prefixcache.serving.kv_cache import KVCache
from prefixcache.tiers.remote import RemoteTier

DEMOTE = 0
"""A copy device block -> host slot."""
PROMOTE = 1
"""A copy host slot -> device block."""
STORE = 2
"""A host slot's bytes -> the remote tier, under a hash."""
LOAD = 3
"""Bytes from the remote tier (``payloads[i]``) -> a host slot."""


@dataclass(frozen=True, slots=True)
class TransferPlan:
    """Block copies to run in order: ``(direction, source, destination)`` each.

    ``direction`` is :data:`DEMOTE` (source a device block, destination a host
    slot), :data:`PROMOTE` (source a host slot, destination a device block),
    :data:`STORE` (source a host slot, destination the hash it goes to the
    remote tier under) or :data:`LOAD` (source an index into ``payloads``,
    destination a host slot). Order matters: a demotion reads a device block
    before the block's new owner writes it, and a host slot may be reused by a
    later copy after an earlier one read it; run plans in the order they were taken.
    """

    ops: tuple[tuple[int, int, int], ...] = ()
    payloads: tuple[bytes, ...] = ()

    def __len__(self) -> int:
        return len(self.ops)

    @property
    def demotions(self) -> list[tuple[int, int]]:
        """``(device block, host slot)`` of every demotion, in order."""
        return [(src, dst) for kind, src, dst in self.ops if kind == DEMOTE]

    @property
    def promotions(self) -> list[tuple[int, int]]:
        """``(host slot, device block)`` of every promotion, in order."""
        return [(src, dst) for kind, src, dst in self.ops if kind == PROMOTE]

    @property
    def stores(self) -> list[tuple[int, int]]:
        """``(host slot, hash)`` of every write to the remote tier, in order."""
        return [(src, dst) for kind, src, dst in self.ops if kind == STORE]

    @property
    def loads(self) -> list[tuple[int, int]]:
        """``(payload index, host slot)`` of every read from the remote tier, in order."""
        return [(src, dst) for kind, src, dst in self.ops if kind == LOAD]

    def runs(self) -> Iterator[tuple[int, list[int], list[int]]]:
        """Maximal runs of one copy direction as ``(direction, sources, destinations)``.

        Demotions and promotions group; within such a run each destination
        appears once (a destination written twice keeps only its last copy:
        nothing in the run reads it between). Stores and loads come one op a run.
        Complexity: O(len(ops)).
        """
        start = 0
        ops = self.ops
        while start < len(ops):
            kind = ops[start][0]
            end = start + 1
            while kind in (DEMOTE, PROMOTE) and end < len(ops) and ops[end][0] == kind:
                end += 1
            last: dict[int, int] = {}
            for _, src, dst in ops[start:end]:
                last.pop(dst, None)
                last[dst] = src
            yield kind, list(last.values()), list(last)
            start = end


class HostKVStore:
    """The host tier's K and V: per layer ``[num_slots, block_size, heads, head_dim]``.

    Same dtype and per-block shape as the device :class:`KVCache` it mirrors;
    on the CPU (pinned when that cache is on CUDA, so copies are asynchronous).

    Args:
        kv_cache: the device cache whose blocks this store receives.
        num_slots: host blocks, >= 1 (the :class:`~prefixcache.tiers.host.HostTier`'s).
    """

    def __init__(self, kv_cache: KVCache, num_slots: int) -> None:
        self.num_slots = require_int(num_slots, "num_slots", minimum=1, error=ConfigError)
        pin = kv_cache.device.type == "cuda"
        self.k_caches: tuple[torch.Tensor, ...] = tuple(
            torch.zeros((self.num_slots, *k.shape[1:]), dtype=k.dtype, pin_memory=pin)
            for k in kv_cache.k_caches
        )
        self.v_caches: tuple[torch.Tensor, ...] = tuple(
            torch.zeros((self.num_slots, *v.shape[1:]), dtype=v.dtype, pin_memory=pin)
            for v in kv_cache.v_caches
        )

    def slot_bytes(self, slot: int) -> bytes:
        """The slot's K and V of every layer as one bytes object (the remote tier's value).

        Complexity: O(bytes per slot).
        """
        parts = [t[slot].reshape(-1).view(torch.uint8) for t in (*self.k_caches, *self.v_caches)]
        return bytes(torch.cat(parts).numpy().tobytes())

    def load_slot(self, slot: int, payload: bytes) -> None:
        """Write ``payload`` (as :meth:`slot_bytes` made it) into ``slot``.

        Raises:
            InvalidArgumentError: the payload's size is not :meth:`bytes_per_slot`.

        Complexity: O(bytes per slot).
        """
        if len(payload) != self.bytes_per_slot():
            raise InvalidArgumentError(
                f"payload of {len(payload)} bytes; a slot holds {self.bytes_per_slot()}"
            )
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        offset = 0
        for tensor in (*self.k_caches, *self.v_caches):
            row = tensor[slot]
            size = row.numel() * row.element_size()
            row.copy_(data[offset : offset + size].view(row.dtype).view(row.shape))
            offset += size

    def bytes_per_slot(self) -> int:
        """Bytes one host slot takes over all layers, K and V. Complexity: O(layers)."""
        tensors = (*self.k_caches, *self.v_caches)
        return sum(t[0].numel() * t.element_size() for t in tensors)


class KVTransfer:
    """Runs :class:`TransferPlan` copies between a :class:`KVCache` and a :class:`HostKVStore`.

    Methods: :meth:`run` (queue a plan's copies), :meth:`wait` (the compute
    stream waits for them, the host does not), :meth:`synchronize` (the host
    waits; tests and shutdown).

    On CUDA, copies are queued on a side stream with ``non_blocking=True``
    from and to pinned memory, one ``copy_`` per block and layer; the host
    never reads device memory. On the CPU, each run of one direction is one
    indexed copy per layer (``batched``) or one copy per block.

    Args:
        kv_cache: the device pool's storage.
        host: the host tier's storage (same layers, dtype and block shape).
        batched: copy whole runs with indexed copies (CPU caches only; the default there).
        remote: where :data:`STORE` copies go (their bytes are queued, never awaited).

    Raises:
        ConfigError: the two stores do not match, or ``batched`` for a device cache.
    """

    def __init__(
        self,
        kv_cache: KVCache,
        host: HostKVStore,
        *,
        batched: bool | None = None,
        remote: RemoteTier | None = None,
    ) -> None:
        if len(host.k_caches) != kv_cache.num_layers:
            raise ConfigError(
                f"host store has {len(host.k_caches)} layers, the cache {kv_cache.num_layers}"
            )
        pairs = zip(
            (*kv_cache.k_caches, *kv_cache.v_caches), (*host.k_caches, *host.v_caches), strict=True
        )
        for device_tensor, host_tensor in pairs:
            if device_tensor.shape[1:] != host_tensor.shape[1:]:
                raise ConfigError("host store and cache differ in block shape")
            if device_tensor.dtype != host_tensor.dtype:
                raise ConfigError("host store and cache differ in dtype")
        self.kv_cache = kv_cache
        self.host = host
        self.remote = remote
        on_cpu = kv_cache.device.type == "cpu"
        if batched and not on_cpu:
            raise ConfigError("batched copies read device memory on the host; CPU caches only")
        self.batched = on_cpu if batched is None else bool(batched)
        self._stream: Any = None
        if kv_cache.device.type == "cuda":  # pragma: no cover - CUDA only
            self._stream = torch.cuda.Stream(device=kv_cache.device)
        self.num_demoted = 0
        self.num_promoted = 0

    def run(self, plan: TransferPlan) -> None:
        """Queue (CUDA) or run (CPU) ``plan``'s copies, in order.

        Raises:
            InvalidArgumentError: a block ID or host slot out of range (nothing is copied).

        Complexity: O(copies * layers) copy calls (per-block mode) or
        O(runs * layers) (batched).
        """
        self._check(plan)
        stream = self._stream
        context: Any = nullcontext()
        if stream is not None:  # pragma: no cover - CUDA only
            stream.wait_stream(torch.cuda.current_stream(self.kv_cache.device))
            context = torch.cuda.stream(stream)
        with context:
            for kind, sources, destinations in plan.runs():
                if kind in (STORE, LOAD):
                    self._remote_op(kind, sources[0], destinations[0], plan)
                    continue
                if self.batched:
                    self._copy_run(kind, sources, destinations)
                else:
                    for src, dst in zip(sources, destinations, strict=True):
                        self._copy_block(kind, src, dst)
                if kind == DEMOTE:
                    self.num_demoted += len(sources)
                else:
                    self.num_promoted += len(sources)

    def wait(self) -> None:
        """Make the compute stream wait for every queued copy (the host does not wait).

        Call before attention reads promoted blocks or a forward pass writes
        blocks a demotion reads. A no-op on the CPU, where copies ran in
        :meth:`run`. Complexity: O(1).
        """
        if self._stream is not None:  # pragma: no cover - CUDA only
            torch.cuda.current_stream(self.kv_cache.device).wait_stream(self._stream)

    def synchronize(self) -> None:
        """Block the host until every queued copy is done (tests, shutdown). Complexity: O(1)."""
        if self._stream is not None:  # pragma: no cover - CUDA only
            self._stream.synchronize()

    # ------------------------------------------------------------------ internals

    def _pairs(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        cache, host = self.kv_cache, self.host
        yield from zip(cache.k_caches, host.k_caches, strict=True)
        yield from zip(cache.v_caches, host.v_caches, strict=True)

    def _copy_run(self, kind: int, sources: list[int], destinations: list[int]) -> None:
        src = torch.tensor(sources, dtype=torch.long)
        dst = torch.tensor(destinations, dtype=torch.long)
        device = self.kv_cache.device
        for device_tensor, host_tensor in self._pairs():
            if kind == DEMOTE:
                host_tensor[dst] = device_tensor[src.to(device)].to("cpu")
            else:
                device_tensor[dst.to(device)] = host_tensor[src].to(device)

    def _copy_block(self, kind: int, src: int, dst: int) -> None:
        for device_tensor, host_tensor in self._pairs():
            if kind == DEMOTE:
                host_tensor[dst].copy_(device_tensor[src], non_blocking=True)
            else:
                device_tensor[dst].copy_(host_tensor[src], non_blocking=True)

    def _remote_op(self, kind: int, src: int, dst: int, plan: TransferPlan) -> None:
        """A store or load: host memory on the host, after the copies queued before it."""
        if self._stream is not None:  # pragma: no cover - CUDA only
            self._stream.synchronize()  # earlier copies write or read this slot
        if kind == STORE:
            assert self.remote is not None  # checked in _check
            self.remote.submit(dst, self.host.slot_bytes(src))
        else:
            self.host.load_slot(dst, plan.payloads[src])

    def _check(self, plan: TransferPlan) -> None:
        if not isinstance(plan, TransferPlan):
            raise InvalidArgumentError(f"plan must be a TransferPlan, got {type(plan).__name__}")
        num_blocks, num_slots = self.kv_cache.num_blocks, self.host.num_slots
        size = self.host.bytes_per_slot()
        for kind, src, dst in plan.ops:
            if kind == STORE:
                if self.remote is None:
                    raise InvalidArgumentError("a plan stores to a remote tier this copier lacks")
                src, dst = 0, src  # only the slot to check
            elif kind == LOAD:
                if not 0 <= src < len(plan.payloads) or len(plan.payloads[src]) != size:
                    raise InvalidArgumentError(f"load {src}: no payload of {size} bytes")
                src = 0
            elif kind not in (DEMOTE, PROMOTE):
                raise InvalidArgumentError(f"unknown copy direction {kind}")
            block, slot = (dst, src) if kind == PROMOTE else (src, dst)
            if not 0 <= block < num_blocks:
                raise InvalidArgumentError(f"block {block} is outside [0, {num_blocks})")
            if not 0 <= slot < num_slots:
                raise InvalidArgumentError(f"host slot {slot} is outside [0, {num_slots})")


__all__ = ["DEMOTE", "LOAD", "PROMOTE", "STORE", "HostKVStore", "KVTransfer", "TransferPlan"]
