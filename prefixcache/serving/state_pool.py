"""StatePool: fixed-size recurrent states of linear-attention layers, one slot per request.

A linear-attention or state-space layer (Gated DeltaNet, Mamba) keeps no growing list
of past tokens: each request carries one recurrent state per layer, of a size that does
not depend on its length, plus a short convolution window of its last inputs. Those
states live here, in slots; the KV blocks of the model's attention layers live in a
:class:`~prefixcache.serving.kv_cache.KVCache` indexed by block ID. See DESIGN.md,
"Hybrid models".
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from prefixcache.engine.pool import resolve_device
from prefixcache.engine.validation import is_int, require_int
from prefixcache.errors import (
    CapacityError,
    ConfigError,
    InvalidArgumentError,
    InvalidTensorError,
    InvariantError,
    ReferenceCountError,
)

DUMMY_SLOT = 0
"""The slot a padded batch entry points at: never handed out, its contents are junk."""


@dataclass(frozen=True, slots=True)
class StateShape:
    """The per-layer state of one request in a linear-attention layer.

    Attributes:
        num_layers: linear-attention layers, >= 1.
        num_heads: heads of the recurrent state, >= 1.
        k_dim, v_dim: the recurrent state of a head is a ``k_dim x v_dim`` matrix.
        conv_dim: channels of the short causal convolution, >= 1.
        conv_kernel: its kernel width, >= 1; the state keeps ``conv_kernel - 1`` inputs.
    """

    num_layers: int
    num_heads: int
    k_dim: int
    v_dim: int
    conv_dim: int
    conv_kernel: int

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_heads", "k_dim", "v_dim", "conv_dim", "conv_kernel"):
            require_int(getattr(self, name), name, minimum=1, error=ConfigError)

    def bytes_per_slot(self, conv_dtype: torch.dtype) -> int:
        """Bytes of one slot over all layers: float32 recurrent state plus the conv window."""
        recurrent = self.num_heads * self.k_dim * self.v_dim * 4
        conv = self.conv_dim * (self.conv_kernel - 1) * conv_dtype.itemsize
        return self.num_layers * (recurrent + conv)


class StatePool:
    """Slots of recurrent and convolution state, handed out and taken back in O(1).

    :attr:`recurrent_states` is one float32 tensor ``[num_layers, num_slots,
    num_heads, k_dim, v_dim]`` (recurrences accumulate, so they stay in full
    precision whatever the model's dtype); :attr:`conv_states` is one tensor
    ``[num_layers, num_slots, conv_dim, conv_kernel - 1]`` of the model's
    ``dtype``. Both are allocated once and never replaced, so their addresses
    are stable for CUDA graphs. A kernel reads slot ``s`` of layer ``l`` as
    ``recurrent_states[l, s]``. Slot 0 is the dummy that padded batch entries
    point at; slots ``1 .. num_slots - 1`` are handed out.

    Free slots are a LIFO stack (a Python list: push and pop are O(1)) and a
    per-slot flag says which are held, so double frees are caught in O(1).
    A slot is zeroed when handed out: a new request starts from the zero
    state, never from its predecessor's.

    Methods:

    - Slots: :meth:`allocate`, :meth:`free`, :meth:`is_allocated`,
      :attr:`num_free`, :attr:`num_allocated`.
    - State: :meth:`copy_states`, :meth:`read_states`, :meth:`write_states`,
      the tensors :attr:`recurrent_states` and :attr:`conv_states`.
    - Memory: :meth:`bytes_per_slot`, :attr:`memory_bytes`.
    - Checks: :meth:`check_invariants`.

    Every method either completes or raises a
    :class:`~prefixcache.errors.PrefixCacheError` and changes nothing. Not
    thread-safe.

    Args:
        shape: the per-request state (:class:`StateShape`).
        num_slots: slots including the dummy, >= 2.
        dtype: element type of the conv state (the model's dtype; default bfloat16).
        device: where the tensors live; ``None`` picks CUDA when available.

    >>> pool = StatePool(StateShape(1, 1, 2, 2, 3, 4), num_slots=3, dtype=torch.float32,
    ...                  device="cpu")
    >>> a = pool.allocate()
    >>> pool.recurrent_states[0, a] += 1.0
    >>> b = pool.allocate()
    >>> pool.copy_states(a, b)
    >>> pool.read_states(b)[0].sum().item()
    4.0
    >>> pool.free(a); pool.num_free
    1
    """

    def __init__(
        self,
        shape: StateShape,
        num_slots: int,
        *,
        dtype: torch.dtype = torch.bfloat16,
        device: str | torch.device | None = None,
    ) -> None:
        if not isinstance(shape, StateShape):
            raise ConfigError(f"shape must be a StateShape, got {type(shape).__name__}")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ConfigError(f"dtype must be a floating torch.dtype, got {dtype!r}")
        self.shape = shape
        self.num_slots = require_int(num_slots, "num_slots", minimum=2, error=ConfigError)
        self.dtype = dtype
        self.device = resolve_device(device)
        layers, slots = shape.num_layers, self.num_slots
        # float32 [layers, slots, heads, k_dim, v_dim] on self.device; slot 0 is the dummy.
        self.recurrent_states = torch.zeros(
            (layers, slots, shape.num_heads, shape.k_dim, shape.v_dim),
            dtype=torch.float32,
            device=self.device,
        )
        # self.dtype [layers, slots, conv_dim, conv_kernel - 1] on self.device.
        self.conv_states = torch.zeros(
            (layers, slots, shape.conv_dim, shape.conv_kernel - 1),
            dtype=dtype,
            device=self.device,
        )
        # Host bookkeeping, changed only by this class: the free stack (top at the end,
        # slot 1 handed out first) and whether each slot is held.
        self._free: list[int] = list(range(slots - 1, DUMMY_SLOT, -1))
        self._held = np.zeros(slots, dtype=bool)

    # ------------------------------------------------------------------ slots

    @property
    def num_free(self) -> int:
        """Slots :meth:`allocate` can still hand out. O(1)."""
        return len(self._free)

    @property
    def num_allocated(self) -> int:
        """Slots held now. O(1)."""
        return self.num_slots - 1 - len(self._free)

    def is_allocated(self, slot: int) -> bool:
        """Whether ``slot`` is held (False for the dummy and any out-of-range value). O(1)."""
        if not is_int(slot):
            return False
        return 0 <= slot < self.num_slots and bool(self._held[slot])

    def allocate(self) -> int:
        """Hand out a free slot with every layer's state zeroed.

        Returns:
            The slot, in ``[1, num_slots)``.

        Raises:
            CapacityError: every slot is held.

        Complexity: O(1) bookkeeping plus one zero-fill of the slot's state
        (two device calls, asynchronous on an accelerator).
        """
        if not self._free:
            raise CapacityError(f"all {self.num_slots - 1} state slots are held")
        slot = self._free.pop()
        self._held[slot] = True
        self.recurrent_states[:, slot].zero_()
        self.conv_states[:, slot].zero_()
        return slot

    def free(self, slot: int) -> None:
        """Give ``slot`` back. Its contents stay until it is handed out again.

        Raises:
            InvalidArgumentError: not an int, out of range, or the dummy slot.
            ReferenceCountError: the slot is not held (double free).

        Complexity: O(1).
        """
        slot = self._check_held(slot, "slot")
        self._held[slot] = False
        self._free.append(slot)

    # ------------------------------------------------------------------ state

    def copy_states(self, src: int, dst: int) -> None:
        """Copy every layer's recurrent and conv state of slot ``src`` into slot ``dst``.

        Restores a prefix hit (checkpoint slot to request slot) or takes a
        checkpoint (request slot to checkpoint slot).

        Raises:
            InvalidArgumentError: a bad slot, or ``src == dst``.
            ReferenceCountError: a slot is not held.

        Complexity: O(state size of one slot), two device copies.
        """
        src = self._check_held(src, "src")
        dst = self._check_held(dst, "dst")
        if src == dst:
            raise InvalidArgumentError(f"copy_states from slot {src} to itself")
        self.recurrent_states[:, dst].copy_(self.recurrent_states[:, src])
        self.conv_states[:, dst].copy_(self.conv_states[:, src])

    def read_states(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Fresh copies of ``slot``'s recurrent and conv states (all layers), for checks.

        Returns:
            ``[num_layers, num_heads, k_dim, v_dim]`` float32 and
            ``[num_layers, conv_dim, conv_kernel - 1]`` of :attr:`dtype`.

        Raises:
            InvalidArgumentError, ReferenceCountError: as :meth:`copy_states`.

        Complexity: O(state size of one slot).
        """
        slot = self._check_held(slot, "slot")
        return self.recurrent_states[:, slot].clone(), self.conv_states[:, slot].clone()

    def write_states(self, slot: int, recurrent: torch.Tensor, conv: torch.Tensor) -> None:
        """Overwrite ``slot``'s states (all layers) with ``recurrent`` and ``conv``.

        Kernels write the tensors in place; this is the validated path for
        host code and tests.

        Raises:
            InvalidArgumentError, ReferenceCountError: as :meth:`copy_states`.
            InvalidTensorError: a shape, dtype or device that does not match
                :meth:`read_states`' results.

        Complexity: O(state size of one slot).
        """
        slot = self._check_held(slot, "slot")
        self._check_tensor(recurrent, "recurrent", self.recurrent_states, torch.float32)
        self._check_tensor(conv, "conv", self.conv_states, self.dtype)
        self.recurrent_states[:, slot].copy_(recurrent)
        self.conv_states[:, slot].copy_(conv)

    # ------------------------------------------------------------------ memory

    def bytes_per_slot(self) -> int:
        """Bytes one slot takes over all layers. Complexity: O(1)."""
        return self.shape.bytes_per_slot(self.dtype)

    @property
    def memory_bytes(self) -> int:
        """Bytes of both tensors, the dummy slot included. O(1)."""
        return self.num_slots * self.bytes_per_slot()

    # ------------------------------------------------------------------ checks

    def check_invariants(self) -> None:
        """Raise InvariantError unless the free stack and the held flags agree.

        Free slots are distinct, in ``[1, num_slots)``, and exactly the slots
        not held; the dummy is never held. Complexity: O(num_slots).
        """
        free = np.zeros(self.num_slots, dtype=bool)
        for slot in self._free:
            if not 0 < slot < self.num_slots or free[slot]:
                raise InvariantError(f"free stack holds slot {slot} twice or out of range")
            free[slot] = True
        if self._held[DUMMY_SLOT]:
            raise InvariantError("the dummy slot is held")
        both = np.flatnonzero(free[1:] == self._held[1:])
        if len(both):
            raise InvariantError(f"slot {int(both[0]) + 1} is both free and held, or neither")

    def __repr__(self) -> str:
        return (
            f"StatePool(num_slots={self.num_slots}, held={self.num_allocated}, "
            f"shape={self.shape}, dtype={self.dtype}, device={self.device})"
        )

    # ------------------------------------------------------------------ internals

    def _check_held(self, slot: object, what: str) -> int:
        if not is_int(slot):
            raise InvalidArgumentError(f"{what} must be an int, got {slot!r}")
        if not 0 < slot < self.num_slots:
            raise InvalidArgumentError(
                f"{what} {slot} is outside [1, {self.num_slots}) (slot 0 is the dummy)"
            )
        if not self._held[slot]:
            raise ReferenceCountError(f"{what} {slot} is not held")
        return int(slot)

    def _check_tensor(
        self, values: object, what: str, storage: torch.Tensor, dtype: torch.dtype
    ) -> None:
        if not isinstance(values, torch.Tensor):
            raise InvalidTensorError(f"{what} must be a tensor, got {type(values).__name__}")
        expected = (storage.shape[0], *storage.shape[2:])
        if tuple(values.shape) != expected:
            raise InvalidTensorError(f"{what} has shape {tuple(values.shape)}, expected {expected}")
        if values.dtype != dtype or values.device != self.device:
            raise InvalidTensorError(
                f"{what} is {values.dtype} on {values.device}; expected {dtype} on {self.device}"
            )
