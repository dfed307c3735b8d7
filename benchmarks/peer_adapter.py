"""prefixcache adapter for the shared peer harness (``../shared/bench/run_peers.py``).

The harness times the KV-cache block managers of Megatron-core, vLLM and
SGLang on the workloads of ``WORKLOADS.md`` (W1 allocator churn, W2 prefix
reuse, W3 prefix reuse under eviction pressure). This file plugs
:class:`prefixcache.KVBlockAllocator` into it, so that prefixcache is timed in
the same run, on the same interleaved schedule, as the peers::

    /root/.venv-peers/bin/python /work/shared/bench/run_peers.py \\
        --adapter /work/main/benchmarks/peer_adapter.py:PrefixCacheAdapter --check

The class follows the harness's duck-typed ``Adapter`` interface (see the
``Adapter`` docstring and ``RefPyAdapter`` in ``run_peers.py``); it does not
import the harness, so it also loads on its own (for profiling, see
``benchmarks/README.md``).

Mapping (what a serving engine calls, in the order it calls it):

- W1: ``KVBlockAllocator(total_count=P, enable_prefix_caching=False)``;
  ``allocate_memory_blocks(k)`` (a fresh tensor, no copy needed) /
  ``release_memory_blocks(ids)``.
- W2/W3: ``hash_tokens`` (default xxh3_64 chain) ; ``match_prefix(hashes[:m],
  acquire=True)`` with ``m = (n_tokens - 1) // B`` so the whole prompt is never
  served from cache; ``allocate_memory_blocks(n - h)`` (evicts through the
  default LRU policy); ``register_kv_block_hashes(new, hashes[h:n_full],
  parent_hash=hashes[h - 1])``; ``release_memory_blocks(hit + new)``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import ClassVar

import numpy as np

try:
    import prefixcache
except ImportError:  # run from the peers' venv, where prefixcache is not installed
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import prefixcache

from prefixcache import KVBlockAllocator


class PrefixCacheAdapter:
    """Runs W1-W3 of the shared harness through prefixcache's public API.

    Attributes:
        name: peer name shown in the harness table.
        api: the calls used per workload kind, copied into the JSON records.
        hash_s: seconds spent in ``hash_tokens`` since ``prefix_init`` (the
            harness reads it for the "hash share" column).
        churn_alloc, churn_free: set by :meth:`churn_init` to the allocator's own
            bound ``allocate_memory_blocks`` / ``release_memory_blocks``, so W1
            times the library's calls with no adapter frame in between (the
            returned tensor is already a fresh copy, unlike Megatron's view).
    """

    name = "prefixcache"
    api: ClassVar[dict[str, str]] = {
        "churn": "KVBlockAllocator(enable_prefix_caching=False, device='cpu'): "
        "allocate_memory_blocks(k) (fresh tensor) / release_memory_blocks(ids)",
        "prefix": "hash_tokens (xxh3_64 chain, int32 numpy input); "
        "match_prefix(hashes[:(n_tokens-1)//B], acquire=True); allocate_memory_blocks(n-h) "
        "(LRU eviction inside); register_kv_block_hashes(new, hashes[h:n_full], "
        "parent_hash=hashes[h-1]); release_memory_blocks(hit+new)",
    }
    patches: ClassVar[list[str]] = []
    hash_s = 0.0

    def __init__(self) -> None:
        self._allocator: KVBlockAllocator | None = None
        self._block_size = 16

    def version(self) -> str:
        """The prefixcache version string."""
        return prefixcache.__version__

    # ------------------------------------------------------------------ W1

    def churn_init(self, pool_blocks: int, block_size: int) -> None:
        """Build a fresh allocator with prefix caching off (``pool_blocks`` counts the dummy)."""
        self._allocator = KVBlockAllocator(
            total_count=pool_blocks,
            block_size_tokens=block_size,
            enable_prefix_caching=False,
            device="cpu",
        )
        self.churn_alloc = self._allocator.allocate_memory_blocks
        self.churn_free = self._allocator.release_memory_blocks

    def churn_num_free(self) -> int:
        """Blocks on the free stack (conservation check after teardown)."""
        allocator = self._require_allocator()
        return allocator.num_usable - allocator.get_total_used()

    @staticmethod
    def churn_ids(handle: object) -> list[int]:
        """The IDs of one allocation, for the harness's ``--check`` pass."""
        return handle.tolist()  # type: ignore[attr-defined]

    # ------------------------------------------------------------------ W2/W3

    def prefix_init(self, pool_blocks: int, block_size: int) -> None:
        """Build a fresh allocator with the defaults: prefix caching on, LRU, xxh3_64."""
        self._allocator = KVBlockAllocator(
            total_count=pool_blocks, block_size_tokens=block_size, device="cpu"
        )
        self._block_size = block_size
        self.hash_s = 0.0

    @staticmethod
    def prepare(tokens: list[int]) -> np.ndarray:
        """Untimed: the prompt as the int32 array an engine's tokenizer output would be."""
        return np.asarray(tokens, dtype=np.int32)

    def serve(self, tokens: np.ndarray) -> int:
        """Serve one request start to finish; return how many blocks came from cache.

        Hash the full blocks, match and pin the longest cached prefix, allocate
        the rest (evicting if needed), register the new full blocks, release.

        Raises:
            RuntimeError: the pool cannot hold the request even after eviction.
        """
        allocator = self._require_allocator()
        block_size = self._block_size
        num_tokens = len(tokens)
        start = time.perf_counter()
        hashes = allocator.hash_tokens(tokens)
        self.hash_s += time.perf_counter() - start
        # Never serve the whole prompt from cache: the last token must be computed.
        hit_ids = allocator.match_prefix(hashes[: (num_tokens - 1) // block_size], acquire=True)
        num_hit = len(hit_ids)
        num_blocks = -(-num_tokens // block_size)
        new_ids = allocator.allocate_memory_blocks(num_blocks - num_hit)
        if new_ids is None:
            raise RuntimeError(f"prefixcache: cannot allocate {num_blocks - num_hit} blocks")
        # One numpy view of the new IDs serves both calls below: slicing it is
        # cheaper than slicing the tensor, and the library takes arrays as they are.
        new_array = new_ids.numpy()
        num_full = len(hashes)
        if num_full > num_hit:
            allocator.register_kv_block_hashes(
                new_array[: num_full - num_hit],
                hashes[num_hit:num_full],
                parent_hash=hashes[num_hit - 1] if num_hit else None,
            )
        if num_hit:
            allocator.release_memory_blocks(np.concatenate((hit_ids.numpy(), new_array)))
        else:
            allocator.release_memory_blocks(new_array)
        return num_hit

    def _require_allocator(self) -> KVBlockAllocator:
        if self._allocator is None:
            raise RuntimeError("call churn_init or prefix_init first")
        return self._allocator
