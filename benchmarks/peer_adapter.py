"""prefixcache adapter for the shared peer harness (``../shared/bench/run_peers.py``).

The harness times the KV-cache block managers of Megatron-core, vLLM and
SGLang on the workloads of ``WORKLOADS.md`` (W1 allocator churn, W2 prefix
reuse, W3 prefix reuse under eviction pressure). This file plugs
:class:`prefixcache.KVBlockAllocator` into it, so that prefixcache is timed in
the same run, on the same interleaved schedule, as the peers. From the
repository root, with the peers' virtual environment in ``$PEERS_VENV``::

    cd ../shared/bench && $PEERS_VENV/bin/python run_peers.py \\
        --adapter <repository>/benchmarks/peer_adapter.py:PrefixCacheAdapter --check

(``<repository>`` is this checkout's path; the harness imports the adapter
file by path, and the adapter puts the checkout on ``sys.path`` when
prefixcache is not installed in that environment. Build the extension first,
``pip install -e .`` in the project's venv, so the checkout holds it.)

The class follows the harness's duck-typed ``Adapter`` interface (see the
``Adapter`` docstring and ``RefPyAdapter`` in ``run_peers.py``); it does not
import the harness, so it also loads on its own: ``benchmarks/bench_peers.py``, the
repository's own peer benchmark, times prefixcache through it (and profiling, see
``benchmarks/README.md``). ``PrefixCacheAdapter`` runs whichever engine the
allocator picks (the native one when it is built; ``PREFIXCACHE_ENGINE``
overrides); ``PrefixCacheComposedAdapter`` runs W2/W3 through the separate
calls instead of the fused one, and ``PrefixCachePythonAdapter`` forces the
Python engine, both for comparison in the same run.

``MegatronDropInAdapter`` (peer ``megatron-dropin``) is the harness's own
``megatron-core`` peer, the same calls in the same order, with Megatron's
``KVBlockAllocator`` replaced by the drop-in
(:class:`prefixcache.integrations.megatron.MegatronKVBlockAllocator`): what a
Megatron user gets from ``install(strict=True)``. It subclasses the harness's
``MegatronAdapter``, so it is built on first access (a module
``__getattr__``) and only where the harness and megatron-core import::

    $PEERS_VENV/bin/python run_peers.py --peers megatron \
        --adapter <repository>/benchmarks/peer_adapter.py:MegatronDropInAdapter

Mapping (what a serving engine calls, in the order it calls it):

- W1: ``KVBlockAllocator(total_count=P, enable_prefix_caching=False)``;
  ``allocate_block_ids(k)`` (an int32 buffer, no tensor) / ``release_request(ids)``.
- W2/W3: ``admit_request(tokens, row)`` (hashes the full blocks with the
  default xxh3_64 chain, matches and pins at most ``(n_tokens - 1) // B``
  blocks, allocates the rest with LRU eviction, registers the new full blocks,
  writes the request's block IDs into a preallocated int32 block-table row
  as long as the pool), then ``release_request(row[:n])``.
- W4: ``serve_turn`` through one session per conversation (``open_session()``: on
  the native engine the extension's): ``turn(prompt, response, start)``, one native call
  for ``admit(prompt[start:])``, ``append(response)``, ``release()``.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import time
from functools import cache
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

try:
    import prefixcache
except ImportError:  # run from the peers' venv, where prefixcache is not installed
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import prefixcache

from prefixcache import KVBlockAllocator, policies
from prefixcache.engine.native_engine import native_available
from prefixcache.engine.sessions import SessionHandle


class PrefixCacheAdapter:
    """Runs W1-W3 of the shared harness through prefixcache's fastest public calls.

    Attributes:
        name: peer name shown in the harness table.
        api: the calls used per workload kind, copied into the JSON records.
        hash_s: seconds spent hashing since ``prefix_init``; 0 on the fused
            path, where hashing is inside ``admit_request`` (the harness reads
            it for the "hash share" column).
        churn_alloc, churn_free: set by :meth:`churn_init` to the allocator's
            own ``allocate_block_ids`` / ``release_request``, so W1 times the
            library's calls with no adapter frame in between.
    """

    name = "prefixcache"
    policy = "lru"  # W2/W3's eviction policy; PrefixCacheAdapter_<policy> sets another
    engine: str | None = None  # None: PREFIXCACHE_ENGINE, else native when it is built
    api: ClassVar[dict[str, str]] = {
        "churn": "KVBlockAllocator(enable_prefix_caching=False, device='cpu'): "
        "allocate_block_ids(k) (int32 buffer) / release_request(ids)",
        "prefix": "admit_request(tokens, row) (xxh3_64 chain, match and pin at most "
        "(n_tokens-1)//B blocks, allocate with LRU eviction, register, write the block-table "
        "row); release_request(row[:n])",
    }
    patches: ClassVar[list[str]] = []
    hash_s = 0.0

    def __init__(self) -> None:
        self._allocator: KVBlockAllocator | None = None
        self._block_size = 16
        self._row = np.zeros(0, dtype=np.int32)  # sized by prefix_init
        self._sessions: dict[int | None, SessionHandle] = {}

    def version(self) -> str:
        """The prefixcache version string, with the engine that runs."""
        return f"{prefixcache.__version__} ({self._engine_name()} engine)"

    def _engine_name(self) -> str:
        if self.engine is not None:
            return self.engine
        return os.environ.get("PREFIXCACHE_ENGINE") or (
            "native" if native_available() else "python"
        )

    def _build(self, **config: Any) -> KVBlockAllocator:
        self._allocator = KVBlockAllocator(device="cpu", engine=self._engine_name(), **config)
        return self._allocator

    # ------------------------------------------------------------------ W1

    def churn_init(self, pool_blocks: int, block_size: int) -> None:
        """Build a fresh allocator with prefix caching off (``pool_blocks`` counts the dummy)."""
        allocator = self._build(
            total_count=pool_blocks, block_size_tokens=block_size, enable_prefix_caching=False
        )
        self.churn_alloc = allocator.allocate_block_ids
        self.churn_free = allocator.release_request

    def churn_num_free(self) -> int:
        """Blocks on the free stack (conservation check after teardown)."""
        allocator = self._require_allocator()
        return allocator.num_usable - allocator.get_total_used()

    @staticmethod
    def churn_ids(handle: Any) -> list[int]:
        """The IDs of one allocation, for the harness's ``--check`` pass."""
        ids: list[int] = handle.tolist()
        return ids

    # ------------------------------------------------------------------ W2/W3

    def prefix_init(self, pool_blocks: int, block_size: int) -> None:
        """Build a fresh allocator: prefix caching on, xxh3_64, the class's ``policy``."""
        allocator = self._build(
            total_count=pool_blocks, block_size_tokens=block_size, eviction_policy=self.policy
        )
        self._block_size = block_size
        self._admit = allocator.admit_request
        self._release = allocator.release_request
        self._row = np.zeros(pool_blocks, dtype=np.int32)  # no request outgrows the pool
        self._sessions: dict[int | None, SessionHandle] = {}
        self.hash_s = 0.0

    @staticmethod
    def prepare(tokens: list[int]) -> np.ndarray:
        """Untimed: the prompt as the int32 array an engine's tokenizer output would be."""
        return np.asarray(tokens, dtype=np.int32)

    def serve(self, tokens: np.ndarray) -> int:
        """Serve one request start to finish; return how many blocks came from cache.

        Raises:
            CapacityError: the pool cannot hold the request even after eviction.
        """
        row = self._row
        num_hit: int = self._admit(tokens, row)
        self._release(row[: -(-len(tokens) // self._block_size)])
        return num_hit

    def serve_turn(
        self,
        prompt: np.ndarray,
        response: np.ndarray,
        session: int | None = None,
        last: bool = False,
    ) -> int:
        """W4: one turn of conversation ``session`` through its session (``open_session``).

        One call a turn (``turn``): the session hashes and matches only the tokens
        after its chain's end (``prompt`` is the whole conversation so far plus the
        new user part; ``start`` skips the rest without a slice), appends
        ``response`` as decode does (registering the blocks it fills), then
        releases the turn; an idle session holds no block. ``last`` ends it. The
        harness converts the whole context just before (``prepare``), which leaves
        the caches cold: the fewer objects and calls a turn touches, the less that
        costs (DESIGN.md, "Sessions").
        """
        sessions = self._sessions
        conversation = sessions.get(session)
        if conversation is None:
            conversation = sessions[session] = self._require_allocator().open_session()
        num_hit = conversation.turn(prompt, response, conversation.num_tokens)
        if last:
            del sessions[session]
        return num_hit

    def _require_allocator(self) -> KVBlockAllocator:
        if self._allocator is None:
            raise RuntimeError("call churn_init or prefix_init first")
        return self._allocator


class PrefixCacheComposedAdapter(PrefixCacheAdapter):
    """W2/W3 through the separate calls an engine without the fused path makes.

    ``hash_tokens``; ``match_prefix(hashes[:(n-1)//B], acquire=True)``;
    ``allocate_memory_blocks(n - h)``; ``register_kv_block_hashes(new,
    hashes[h:n_full], parent_hash=hashes[h-1])``; ``release_memory_blocks(hit + new)``.
    """

    name = "prefixcache-composed"
    api: ClassVar[dict[str, str]] = {
        "churn": PrefixCacheAdapter.api["churn"],
        "prefix": "hash_tokens; match_prefix(hashes[:(n_tokens-1)//B], acquire=True); "
        "allocate_memory_blocks(n-h); register_kv_block_hashes(new, hashes[h:n_full], "
        "parent_hash=hashes[h-1]); release_memory_blocks(hit+new)",
    }

    def serve(self, tokens: np.ndarray) -> int:
        """Serve one request with the separate calls; return the blocks served from cache."""
        allocator = self._require_allocator()
        block_size = self._block_size
        num_tokens = len(tokens)
        start = time.perf_counter()
        hashes = allocator.hash_tokens(tokens)
        self.hash_s += time.perf_counter() - start
        hit_ids = allocator.match_prefix(hashes[: (num_tokens - 1) // block_size], acquire=True)
        num_hit = len(hit_ids)
        num_blocks = -(-num_tokens // block_size)
        new_ids = allocator.allocate_memory_blocks(num_blocks - num_hit)
        if new_ids is None:
            raise RuntimeError(f"prefixcache: cannot allocate {num_blocks - num_hit} blocks")
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


class PrefixCachePythonAdapter(PrefixCacheComposedAdapter):
    """The composed calls on the pure-Python engine (the reference), for comparison."""

    name = "prefixcache-python"
    engine = "python"


# ---------------------------------------------------------------------- Megatron drop-in


@cache
def _megatron_dropin_adapter() -> type:
    """The harness's ``MegatronAdapter`` with the drop-in as its allocator class."""
    harness: Any = sys.modules.get("__main__")
    if not hasattr(harness, "MegatronAdapter"):  # not run by run_peers.py: import it
        harness = importlib.import_module("run_peers")
    from prefixcache.integrations.megatron import MegatronKVBlockAllocator, check_version

    megatron_adapter: Any = harness.MegatronAdapter

    class MegatronDropInAdapter(megatron_adapter):
        """Megatron's calls on prefixcache's drop-in (LRU, the allocator's default engine)."""

        name = "megatron-dropin"
        patches: ClassVar[list[str]] = [
            *megatron_adapter.patches,
            "KVBlockAllocator -> prefixcache.integrations.megatron.MegatronKVBlockAllocator",
        ]

        def __init__(self) -> None:
            super().__init__()
            check_version()
            self.KVBlockAllocator = MegatronKVBlockAllocator

        def version(self) -> str:
            """megatron-core's version and prefixcache's, with the engine that runs."""
            engine = os.environ.get("PREFIXCACHE_ENGINE") or (
                "native" if native_available() else "python"
            )
            return f"{super().version()} + prefixcache {prefixcache.__version__} ({engine})"

    return MegatronDropInAdapter


_POLICY_ADAPTER = "PrefixCacheAdapter_"
_PYTHON_POLICY_ADAPTER = "PrefixCachePythonAdapter_"  # the same on the Python engine
_EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "custom_policy.py"


def _register_example_policy(policy: str) -> None:
    """Register ``examples/custom_policy.py``'s ``deepest_first`` when it is asked for."""
    if policy != "deepest_first" or policy in policies.available():
        return
    spec = importlib.util.spec_from_file_location("custom_policy_example", _EXAMPLE)
    assert spec is not None and spec.loader is not None
    spec.loader.exec_module(importlib.util.module_from_spec(spec))


def __getattr__(name: str) -> Any:
    """Adapters made on first access.

    ``MegatronDropInAdapter`` (it needs the harness and megatron-core), and
    ``PrefixCacheAdapter_<policy>`` for any policy name (W2/W3 with that eviction
    policy, e.g. ``--adapter benchmarks/peer_adapter.py:PrefixCacheAdapter_s3fifo``), so
    one harness run times every policy side by side; ``PrefixCachePythonAdapter_<policy>``
    the same on the Python engine. ``deepest_first`` is ``examples/custom_policy.py``'s.
    """
    if name == "MegatronDropInAdapter":
        return _megatron_dropin_adapter()
    for prefix, engine in ((_POLICY_ADAPTER, None), (_PYTHON_POLICY_ADAPTER, "python")):
        if name.startswith(prefix) and len(name) > len(prefix):
            policy = name[len(prefix) :]
            _register_example_policy(policy)
            label = f"prefixcache-{policy}" + ("@python" if engine else "")
            return type(
                name, (PrefixCacheAdapter,), {"name": label, "policy": policy, "engine": engine}
            )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
