"""The device mirror of the free block IDs: kept above the engine, so both engines run anywhere.

Bookkeeping lives on the host in both engines (DESIGN.md, "Device and host"); a
kernel that picks free blocks on the device reads a copy of the free IDs there.
:class:`FreeIdsMirror` owns that copy: one int32 tensor on the allocator's
device, created once so its address never changes (a CUDA graph may capture
it), refreshed when asked (:meth:`DeviceMirrorMethods.device_free_ids`) from
the engine's free IDs through pinned host memory with a non-blocking copy.
Refreshing on request rather than after every call keeps the hot paths free of
device work (and of O(free) copies), and means the engine needs no device
code: the native engine serves ``device="cuda"`` exactly as it serves ``"cpu"``.
"""

from __future__ import annotations

import numpy as np
import torch

from prefixcache.engine.core import EngineCore

__all__ = ["DeviceMirrorMethods", "FreeIdsMirror"]


class FreeIdsMirror:
    """The free block IDs on ``device``, refreshed on request (see the module docstring).

    Args:
        num_usable: blocks that can be free at once (the dummy block is never free).
        device: where the mirror lives; the CPU has none (the host IDs are the truth).
    """

    def __init__(self, num_usable: int, device: torch.device) -> None:
        self.device = device
        self._pin = device.type == "cuda" and torch.cuda.is_available()
        self.tensor: torch.Tensor | None = None
        if device.type != "cpu":
            self.tensor = torch.empty(num_usable, dtype=torch.int32, device=device)

    def refresh(self, free_ids: np.ndarray) -> torch.Tensor | None:
        """Copy ``free_ids`` into the first ``len(free_ids)`` entries; return the mirror.

        The copy is queued on the current stream and not waited for. A fresh pinned
        buffer per refresh (torch's caching host allocator keeps it until the copy
        has run), so a later refresh never overwrites a buffer still being read.
        Complexity: O(len(free_ids)) host work.
        """
        if self.tensor is None:
            return None
        staged = torch.from_numpy(np.ascontiguousarray(free_ids, dtype=np.int32))
        if self._pin:
            staged = staged.pin_memory()
        self.tensor[: len(free_ids)].copy_(staged, non_blocking=True)
        return self.tensor


class DeviceMirrorMethods:
    """``device_free_ids`` of :class:`~prefixcache.KVBlockAllocator`."""

    _engine: EngineCore
    _free_ids_mirror: FreeIdsMirror

    def device_free_ids(self) -> torch.Tensor | None:
        """The free block IDs on the allocator's device, refreshed now; None on the CPU.

        The first ``stats().num_free`` entries are the free IDs in the engine's
        order (the next to go out last); the rest are stale. The tensor is the same
        object at the same address on every call, so a CUDA graph can capture
        it; refresh it between captures, as allocation happens between them.
        Nothing waits for the device: the copy is queued non-blocking from pinned
        memory. Complexity: O(num_free) host work; the allocator's other calls
        never touch the device.
        """
        return self._free_ids_mirror.refresh(self._engine.free_ids())
