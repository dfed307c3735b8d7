"""What the facade's mixins call of the facade, typed below it.

``request_path.py`` and ``sessions.py`` are mixed into ``KVBlockAllocator``
(``python_session.py``'s Session is handed it), which imports them; naming
``KVBlockAllocator`` in their annotations would import it back.
:class:`FacadeView` names what they call, so every import points one way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import torch

from prefixcache.engine.block_ids import BlockIdsLike
from prefixcache.engine.core import EngineCore
from prefixcache.engine.events import KVEventLog

__all__ = ["FacadeView"]


class FacadeView(Protocol):
    """The members of ``KVBlockAllocator`` its request path and sessions call."""

    _engine: EngineCore
    events: KVEventLog | None
    _num_rejected: int
    _track_changes: bool
    block_size_tokens: int
    enable_prefix_caching: bool
    verify_prefix_hits: bool

    def hash_tokens(
        self,
        tokens: Any,
        *,
        parent: int | None = None,
        salt: str | bytes | None = None,
        extra_keys: Sequence[object] | None = None,
    ) -> list[int]: ...

    def fingerprint_tokens(
        self,
        tokens: Any,
        *,
        parent: int | None = None,
        salt: str | bytes | None = None,
        extra_keys: Sequence[object] | None = None,
    ) -> list[int]: ...

    def _verified_prefix(self, matched: np.ndarray, checks: list[int]) -> np.ndarray: ...

    def allocate_memory_blocks(self, num_blocks: int) -> torch.Tensor | None: ...

    def release_memory_blocks(self, block_ids: BlockIdsLike, *, paused: bool = False) -> None: ...

    def register_kv_block_hashes(
        self,
        block_ids: BlockIdsLike,
        block_hashes: Any,
        *,
        parent_hash: int | None = None,
        token_ids: Any = None,
        lora_name: str | None = None,
        fingerprints: Any = None,
    ) -> torch.Tensor: ...

    def evict_blocks(self, block_ids: BlockIdsLike) -> int: ...

    def _structure_key(self) -> tuple[int, int, int]: ...

    def _yield_hints(self, needed: int, hit: np.ndarray = ...) -> bool: ...
