"""Names for the integers the allocator deals in.

Block IDs and block hashes are plain ints at run time; the ``NewType``s let a
type checker tell them apart in signatures.
"""

from __future__ import annotations

from typing import NewType

BlockId = NewType("BlockId", int)
"""Index of a KV-cache block in the pool, ``0 <= id < total_count``."""

BlockHash = NewType("BlockHash", int)
"""Chained content hash of a full block: a positive int (0 and -1 are sentinels)."""

NO_HASH: int = 0
"""Sentinel stored for a block that carries no hash."""
