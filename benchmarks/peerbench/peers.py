"""The libraries the peer benchmark times, each behind the same small adapter interface.

An adapter has ``name``, ``version()``, and per workload kind:

- W1 (churn): ``churn_init(pool_blocks, block_size)`` builds a fresh pool with
  prefix caching off, then ``churn_alloc(k) -> handle``, ``churn_free(handle)``,
  ``churn_num_free()`` (the conservation check after teardown).
- W2/W3 (prefix): ``prefix_init(pool_blocks, block_size)``, ``prepare(tokens)``
  (untimed: the prompt as the library's own input), ``serve(prepared) -> hit
  blocks`` (hash, look up, pin, allocate with eviction, register, release), and
  ``hash_s``, the seconds spent hashing since ``prefix_init`` (0 where hashing is
  not separable).

prefixcache's adapter is :class:`peer_adapter.PrefixCacheAdapter` (``benchmarks/
peer_adapter.py``), the one the shared harness runs. The peers here call each library's
own classes in the order its serving engine does; the request steps reuse the test kit
(:mod:`prefixcache.testing.vllm_pool`, :mod:`prefixcache.testing.megatron_requests`),
which the integration tests already hold to those engines' behaviour; SGLang's Rust radix
tree is in :mod:`peerbench.sglang_rust`. A library that does not import raises
:class:`NotInstalled` from :func:`load`, and the table says ``n/a (not installed)``: nothing
stands in for it. A workload a library has no API for raises :class:`NoMapping` from its
``*_init`` (the table says ``n/a`` and why).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import time
from collections.abc import Callable
from typing import Any

PEERS = ("prefixcache", "vllm", "megatron", "megatron-dropin", "sglang-rust")


class NotInstalled(Exception):
    """The library (or a module on its import path) is not importable here."""


class NoMapping(Exception):
    """The library imports, but this benchmark has no mapping of the workload onto it."""


def version_of(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "?"


def require_module(module: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as error:  # the library, or something its import chain needs
        raise NotInstalled(f"{module}: {error}") from error


class VllmPeer:
    """vLLM's ``BlockPool`` (v1), hashing with its default ``sha256`` block hasher.

    W1: ``BlockPool(P, enable_caching=False)``; ``get_new_blocks(k)``;
    ``free_blocks(reversed(blocks))``. W2/W3: ``get_request_block_hasher(16, sha256)``
    over a request stand-in (what ``Request.__init__`` runs); the longest cached prefix
    by ``get_cached_block`` up to the first miss (``find_longest_cache_hit``'s loop for
    full attention), ``touch``, ``get_new_blocks`` (evicts from the free queue's head),
    ``cache_full_blocks``, ``free_blocks(reversed(blocks))``.
    """

    name = "vllm"

    def __init__(self) -> None:
        self._pool_module = require_module("vllm.v1.core.block_pool")
        self._utils = require_module("vllm.v1.core.kv_cache_utils")
        self._sha256 = require_module("vllm.utils.hashing").sha256
        self._serve = require_module("prefixcache.testing.vllm_pool").serve
        self.hash_s = 0.0

    def version(self) -> str:
        """vLLM's installed version."""
        return version_of("vllm")

    def churn_init(self, pool_blocks: int, block_size: int) -> None:
        """A fresh pool without prefix caching (its null block is the reserved one)."""
        self._pool = pool = self._pool_module.BlockPool(pool_blocks, False, block_size)
        self.churn_alloc = pool.get_new_blocks

    def churn_free(self, blocks: list[Any]) -> None:
        """Free one request's blocks in reverse, as vLLM's manager does."""
        self._pool.free_blocks(reversed(blocks))

    def churn_num_free(self) -> int:
        """Blocks in the free queue."""
        num_free: int = self._pool.get_num_free_blocks()
        return num_free

    def prefix_init(self, pool_blocks: int, block_size: int) -> None:
        """A fresh pool with prefix caching, and vLLM's default block hasher."""
        self._pool = self._pool_module.BlockPool(pool_blocks, True, block_size)
        self._utils.init_none_hash(self._sha256)
        self._hasher = self._utils.get_request_block_hasher(block_size, self._sha256)
        self.hash_s = 0.0

    @staticmethod
    def prepare(tokens: list[int]) -> list[int]:
        """vLLM's requests carry their prompt as a list of ints."""
        return tokens

    def serve(self, tokens: list[int]) -> int:
        """Hash (timed apart), then the manager's steps; the number of hit blocks."""
        start = time.perf_counter()
        hashes = self._hasher(_VllmRequest(tokens))
        self.hash_s += time.perf_counter() - start
        num_hit: int = self._serve(self._pool, hashes)
        return num_hit


class _VllmRequest:
    """What vLLM's block hasher reads of a ``Request``: tokens and no extra keys."""

    def __init__(self, tokens: list[int]) -> None:
        self.all_token_ids = tokens
        self.num_tokens = len(tokens)
        self.block_hashes: list[bytes] = []
        self.mm_features: list[Any] = []
        self.lora_request = None
        self.cache_salt = None
        self.prompt_embeds = None


class _Clock:
    """The one context attribute Megatron's allocator reads: the LRU clock."""

    prefix_cache_lru_clock = 0


class MegatronPeer:
    """Megatron-core's ``KVBlockAllocator``, with its ``LRU`` prefix-caching policy.

    W1: ``KVBlockAllocator(ctx, P, 0, enable_prefix_caching=False)``;
    ``allocate_memory_blocks(k).clone()`` (the result is a view into the free stack,
    which the engine copies); ``release_memory_blocks(ids)``. W2/W3:
    ``compute_block_hashes_batched(tokens, 16)`` (SHA-256 chain), then what
    ``DynamicInferenceContext.add_request`` does (match through ``kv_hash_to_block_id``,
    pin, ``allocate_memory_blocks`` with LRU eviction inside, ``register_kv_block_hashes``,
    tick the clock), and ``release_memory_blocks`` of all the request's blocks. The
    default policy ``REF_ZERO`` forgets a block at ref count 0 and would never hit.
    """

    name = "megatron"

    def __init__(self) -> None:
        self._allocator_class = require_module(
            "megatron.core.inference.contexts.kv_block_allocator"
        ).KVBlockAllocator
        self._lru = require_module("megatron.core.inference.config").PrefixCachingEvictionPolicy.LRU
        self._hash = require_module(
            "megatron.core.inference.inference_request"
        ).compute_block_hashes_batched
        self._admit = require_module("prefixcache.testing.megatron_requests").admit
        self._torch = require_module("torch")
        self.hash_s = 0.0

    def version(self) -> str:
        """megatron-core's installed version."""
        return version_of("megatron-core")

    def churn_init(self, pool_blocks: int, block_size: int) -> None:
        """A fresh allocator with prefix caching off (its dummy block is the reserved one)."""
        self._allocator = self._allocator_class(_Clock(), pool_blocks, 0, False)
        allocate = self._allocator.allocate_memory_blocks
        self.churn_alloc: Callable[[int], Any] = lambda k: allocate(k).clone()
        self.churn_free = self._allocator.release_memory_blocks

    def churn_num_free(self) -> int:
        """Blocks on the free stack."""
        num_free: int = self._allocator.total_avail
        return num_free

    def prefix_init(self, pool_blocks: int, block_size: int) -> None:
        """A fresh allocator with prefix caching and the ``LRU`` policy."""
        self._allocator = self._allocator_class(_Clock(), pool_blocks, 0, True, self._lru)
        self._block_size = block_size
        self.hash_s = 0.0

    def prepare(self, tokens: list[int]) -> Any:
        """Megatron's requests carry their prompt as an int64 tensor."""
        return self._torch.tensor(tokens, dtype=self._torch.int64)

    def serve(self, tokens: Any) -> int:
        """Hash (timed apart), admit, release; the number of hit blocks."""
        start = time.perf_counter()
        hashes = self._hash(tokens, self._block_size)
        self.hash_s += time.perf_counter() - start
        block_ids, num_hit = self._admit(self._allocator, hashes)
        if block_ids is None:
            raise RuntimeError(f"megatron: cannot allocate {len(hashes) - num_hit} blocks")
        self._allocator.release_memory_blocks(block_ids)
        return num_hit


class MegatronDropInPeer(MegatronPeer):
    """Megatron's calls, in Megatron's order, on prefixcache's drop-in allocator.

    :class:`prefixcache.integrations.megatron.MegatronKVBlockAllocator` in place of
    ``KVBlockAllocator`` (what ``install()`` does): what a Megatron user gets, and
    how it compares with Megatron's own allocator in the same run.
    """

    name = "megatron-dropin"

    def __init__(self) -> None:
        super().__init__()
        megatron = require_module("prefixcache.integrations.megatron")
        megatron.check_version()
        self._allocator_class = megatron.MegatronKVBlockAllocator

    def version(self) -> str:
        """megatron-core's version, then the drop-in's prefixcache version."""
        prefixcache = require_module("prefixcache")
        return f"{super().version()} + prefixcache {prefixcache.__version__}"


def _prefixcache() -> Any:
    return require_module("peer_adapter").PrefixCacheAdapter()


def _sglang_rust() -> Any:
    from peerbench.sglang_rust import SglangRustPeer  # imports SGLang only when asked

    return SglangRustPeer()


_FACTORIES: dict[str, Callable[[], Any]] = {
    "prefixcache": _prefixcache,
    "vllm": VllmPeer,
    "megatron": MegatronPeer,
    "megatron-dropin": MegatronDropInPeer,
    "sglang-rust": _sglang_rust,
}


POLICY_PREFIX = "prefixcache-"  # prefixcache-<policy>: W2/W3 with that eviction policy


def is_known(name: str) -> bool:
    """Whether :func:`load` knows ``name``: one of :data:`PEERS`, or ``prefixcache-<policy>``."""
    return name in _FACTORIES or (name.startswith(POLICY_PREFIX) and len(name) > len(POLICY_PREFIX))


def load(name: str) -> Any:
    """The adapter for library ``name`` (one of :data:`PEERS`, or ``prefixcache-<policy>``).

    ``prefixcache-<policy>`` is ``peer_adapter.PrefixCacheAdapter_<policy>``: prefixcache
    with that eviction policy on W2/W3 (W1 has no prefix caching, so no policy);
    ``prefixcache-<policy>@python`` the same on the Python engine.

    Raises:
        NotInstalled: the library does not import here.
        NoMapping: it imports, but the workloads have no mapping onto it.
    """
    if name.startswith(POLICY_PREFIX):  # prefixcache-<policy>[@python]
        policy, _, engine = name[len(POLICY_PREFIX) :].partition("@")
        kind = "PrefixCachePythonAdapter" if engine == "python" else "PrefixCacheAdapter"
        return getattr(require_module("peer_adapter"), f"{kind}_{policy}")()
    return _FACTORIES[name]()
