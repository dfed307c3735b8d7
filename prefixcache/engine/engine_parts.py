"""What the Python engine's helpers read of it: its parts, typed below the engine.

``defragment.py`` and ``invariants.py`` work on the Python engine's parts (the
pool, the reference table, the registry, the partition ledger, the policy).
They are imported by ``python_engine.py``; naming ``PythonEngine`` in their
annotations would import it back, a circle a reader has to untangle.
:class:`EngineParts` is that same view as a protocol, so every import points
one way: ``python_engine`` -> ``defragment``/``invariants`` -> ``engine_parts``.
"""

from __future__ import annotations

from typing import Protocol

from prefixcache.engine.free_list import SortedFreeList
from prefixcache.engine.partitions import PartitionLedger
from prefixcache.engine.pool import BlockPool
from prefixcache.engine.references import ReferenceTable
from prefixcache.engine.registry import HashRegistry
from prefixcache.policies import EvictionPolicy

__all__ = ["EngineParts"]


class EngineParts(Protocol):
    """The Python engine as its helpers see it (``PythonEngine`` satisfies it)."""

    policy: EvictionPolicy
    retains_unreferenced: bool
    pool: BlockPool | SortedFreeList
    num_usable: int
    registry: HashRegistry
    refs: ReferenceTable
    ledger: PartitionLedger

    def leaf_args(self, block_id: int) -> tuple[int, int, int, int]:
        """What the policy is told of a leaf: hash, last access, hand-outs, depth."""
        ...

    def describe_state(self, block_id: int) -> str:
        """The block's state in words, for error messages."""
        ...
