"""Core speed and memory benchmarks of prefixcache: what the peer harness does not cover.

Sections (pick any; none picked runs all but ``--profile``):

- ``--eviction``: cost of evicting ONE block with 10^3 .. 10^6 cached blocks,
  through ``evict_cached_blocks(1)`` and through ``allocate_memory_blocks(1)``
  on a pool whose free stack is empty; Megatron-core's ``evict_lru_blocks(1)``
  beside it when the peers' venv is there.
- ``--counters``: the partition and stats counters at 10^6 blocks vs 10^3.
- ``--memory``: host bytes per block at 10^6 blocks with every block
  registered and cached (RSS delta and tracemalloc, each in a fresh process),
  beside Megatron-core's ``KVBlockAllocator`` (LRU) filled the same way.
- ``--batched``: one dynamic-batching step: 256 requests allocate, then all
  256 release, per request, inside one ``free_group()``, or as one call.
- ``--request``: per-call cost of hash / match+acquire / allocate / register /
  release on a W2-like request (large pool) and a W3-like one (evicting).
- ``--profile W1,W2,W3``: cProfile of the peer adapter on the shared
  harness's workloads (needs ``run_peers.py``; not part of the default run);
  with ``--profiler none`` it only runs them, for an outside sampler (py-spy).

Every timing is printed as min / median / max after an untimed warm-up, with
the machine, Python, torch and numpy versions first. ``--quick`` shrinks sizes
and repeats for a smoke run (about 20 s). Run from the repo root::

    PYTHONPATH=. python benchmarks/bench_core.py            # all sections, ~2-3 min
    PYTHONPATH=. python benchmarks/bench_core.py --eviction --quick
    PYTHONPATH=. python benchmarks/bench_core.py --profile W2

The Megatron parts run this same file under ``--peers-python`` (default
``$PEERS_VENV/bin/python``, ``PEERS_VENV`` defaulting to ``~/.venv-peers``, see
``../shared/bench/README.md``) in child processes; they are skipped with a
note when it is missing. ``PREFIXCACHE_ENGINE=native`` (or ``python``) picks
the engine the sections run on.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import gc
import importlib.util
import itertools
import json
import os
import platform
import pstats
import statistics
import subprocess
import sys
import time
import timeit
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
from machine import cpu_model  # benchmarks/machine.py, beside this script

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PEERS_PYTHON = str(
    Path(os.environ.get("PEERS_VENV", Path.home() / ".venv-peers")) / "bin" / "python"
)
DEFAULT_HARNESS = str(REPO_ROOT.parent / "shared" / "bench" / "run_peers.py")
HASH_BASE = 1 << 62
"""Hashes used to fill the registry: ``HASH_BASE + i``, unique, positive, 63-bit
wide like real xxh3_64 hashes (so each takes a real hash's 32 bytes)."""
FRESH_HASH_BASE = HASH_BASE + (1 << 61)
"""First hash of the blocks re-cached between timed evictions (above every fill hash)."""
BATCH = 65_536
"""Blocks per ``allocate_memory_blocks`` call while filling a pool."""


def _import_prefixcache() -> ModuleType:
    """Import prefixcache, adding the repo root to sys.path when it is not installed."""
    try:
        import prefixcache
    except ImportError:
        sys.path.insert(0, str(REPO_ROOT))
        import prefixcache
    return prefixcache


# --------------------------------------------------------------------------
# Timing and printing
# --------------------------------------------------------------------------


def _min_med_max(samples: list[float]) -> tuple[float, float, float]:
    return min(samples), statistics.median(samples), max(samples)


def _fmt3(samples: list[float], scale: float = 1.0, digits: int = 2) -> str:
    """``min / median / max`` of ``samples`` times ``scale``."""
    low, mid, high = _min_med_max(samples)
    return " / ".join(f"{v * scale:,.{digits}f}" for v in (low, mid, high))


def _time_each(
    call: Callable[[], object],
    warmup: int,
    repeats: int,
    after: Callable[[], object] | None = None,
) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``call``, after ``warmup`` untimed ones.

    ``after`` (untimed) runs after every call, to restore the state being
    measured. The garbage collector is frozen over the loop (``gc.freeze()``,
    as the peer harness and vLLM's engine do), so a full collection of the
    millions of objects a large registry holds does not land in one sample.
    """
    clock = time.perf_counter
    samples = []
    with _frozen_gc():
        for index in range(warmup + repeats):
            start = clock()
            call()
            seconds = clock() - start
            if index >= warmup:
                samples.append(seconds)
            if after is not None:
                after()
    return samples


@contextmanager
def _frozen_gc() -> Iterator[None]:
    """``gc.collect(); gc.freeze()`` for the block, as before every timed loop of the harness."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _table(header: list[str], rows: list[list[str]]) -> None:
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print()


def print_environment() -> None:
    """Machine and library versions: numbers mean nothing without them."""
    import sortedcontainers
    import torch
    import xxhash

    prefixcache = _import_prefixcache()
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print("## Environment\n")
    print(f"- machine: {cpu_model()}, {os.cpu_count()} CPUs, {platform.platform()}")
    print(f"- load average at start: {load}")
    print(f"- Python {platform.python_version()} ({platform.python_implementation()})")
    print(
        f"- torch {torch.__version__} (intra-op threads: {torch.get_num_threads()}), numpy "
        f"{np.__version__}, xxhash {xxhash.VERSION}, sortedcontainers "
        f"{sortedcontainers.__version__}, prefixcache {prefixcache.__version__}"
    )
    print()


# --------------------------------------------------------------------------
# Filling a pool with registered blocks
# --------------------------------------------------------------------------


def fill_registered(allocator: Any, num_blocks: int, chain_blocks: int) -> np.ndarray:
    """Allocate ``num_blocks`` and register them as chains of ``chain_blocks``.

    The blocks stay active; the caller releases what should become cached.
    Allocation goes in batches of ``BATCH``; each chain is one
    ``register_kv_block_hashes`` call (the API registers one chain a call).

    Returns:
        The block IDs in allocation order (int32).
    """
    parts = []
    for start in range(0, num_blocks, BATCH):
        parts.append(allocator.allocate_memory_blocks(min(BATCH, num_blocks - start)).numpy())
    block_ids = np.concatenate(parts)
    hashes = (np.arange(num_blocks, dtype=np.int64) + HASH_BASE).tolist()
    register = allocator.register_kv_block_hashes
    for start in range(0, num_blocks, chain_blocks):
        stop = start + chain_blocks
        register(block_ids[start:stop], hashes[start:stop])
    return block_ids


def build_cached(num_blocks: int, chain_blocks: int) -> Any:
    """A default (LRU) allocator of exactly ``num_blocks`` usable blocks, all cached."""
    prefixcache = _import_prefixcache()
    allocator = prefixcache.KVBlockAllocator(total_count=num_blocks + 1, device="cpu")
    allocator.release_memory_blocks(fill_registered(allocator, num_blocks, chain_blocks))
    return allocator


# --------------------------------------------------------------------------
# (a) eviction scaling
# --------------------------------------------------------------------------


class _ConstantCache:
    """Evicts one block per timed call and refills one untimed, so the cache size holds."""

    def __init__(self, allocator: Any) -> None:
        self.allocator = allocator
        self._fresh_hashes = itertools.count(FRESH_HASH_BASE)
        self._held: list[Any] = []

    def evict_one(self) -> None:
        self.allocator.evict_cached_blocks(1)

    def allocate_one(self) -> None:
        self._held.append(self.allocator.allocate_memory_blocks(1))

    def refill_after_evict(self) -> None:
        self._cache(self.allocator.allocate_memory_blocks(1))

    def refill_after_allocate(self) -> None:
        self._cache(self._held.pop())

    def _cache(self, block_ids: Any) -> None:
        """Register a held block as a new one-block chain and release it: cached again."""
        self.allocator.register_kv_block_hashes(block_ids, [next(self._fresh_hashes)])
        self.allocator.release_memory_blocks(block_ids)


def bench_eviction(args: argparse.Namespace) -> None:
    """Cost of evicting one block as the number of cached blocks grows."""
    sizes = [10**3, 10**4, 10**5] if args.quick else [10**3, 10**4, 10**5, 10**6]
    warmup, repeats = (20, 200) if args.quick else (100, 2000)
    print(f"## (a) Evicting one block (chains of {args.chain_blocks} blocks, all cached)\n")
    print(
        f"Per-call µs, min / median / max over {repeats} calls after {warmup} warm-up calls. "
        "`evict_cached_blocks(1)`: the LRU leaf is freed (its parent becomes a leaf). "
        "`allocate_memory_blocks(1)`: the free stack is empty, so each call evicts one "
        "block and hands it out. After each call (untimed) one block is registered and "
        "released again, so the number of cached blocks stays constant.\n"
    )
    rows, medians = [], []
    for size in sizes:
        start = time.perf_counter()
        allocator = build_cached(size, args.chain_blocks)
        build_s = time.perf_counter() - start
        cache = _ConstantCache(allocator)
        evict = _time_each(cache.evict_one, warmup, repeats, cache.refill_after_evict)
        assert allocator.stats().num_free == 0 and allocator.stats().num_cached == size
        alloc = _time_each(cache.allocate_one, warmup, repeats, cache.refill_after_allocate)
        assert allocator.stats().num_cached == size
        allocator.check_invariants()
        medians.append(statistics.median(evict))
        rows.append(
            [
                f"{size:,}",
                _fmt3(evict, 1e6),
                _fmt3(alloc, 1e6),
                f"{build_s:.2f} s ({build_s / size * 1e9:,.0f} ns/block)",
            ]
        )
        del allocator, cache
        gc.collect()
    _table(
        ["cached blocks", "evict_cached_blocks(1) µs", "allocate(1) with eviction µs", "fill"],
        rows,
    )
    print(
        f"Median evict cost at {sizes[-1]:,} / at {sizes[0]:,} cached blocks: "
        f"{medians[-1] / medians[0]:.2f}x (target: within 2x).\n"
    )
    megatron_sizes = [s for s in sizes if s <= 10**5] if args.quick else sizes
    result = _run_peer_child(args, ["megatron-evict", *map(str, megatron_sizes)])
    if result is None:
        return
    print(
        "Megatron-core "
        f"{result['version']} `KVBlockAllocator` (LRU) `evict_lru_blocks(1)`, same fill "
        "(chains registered with parent hashes, released), ms per call min / median / max:\n"
    )
    _table(
        ["cached blocks", "evict_lru_blocks(1) ms", "calls"],
        [
            [f"{r['size']:,}", _fmt3(r["samples"], 1e3), str(len(r["samples"]))]
            for r in result["rows"]
        ],
    )


def _run_peer_child(args: argparse.Namespace, child_args: list[str]) -> dict[str, Any] | None:
    """Run ``--child ...`` of this file under the peers' Python; None (and a note) if absent."""
    python = args.peers_python
    if not python or not Path(python).exists():
        print(f"(Megatron-core part skipped: no peers' Python at {python!r})\n")
        return None
    command = [python, "-W", "ignore", str(Path(__file__).resolve()), "--child", *child_args]
    command += ["--chain-blocks", str(args.chain_blocks), "--threads", str(args.threads)]
    if args.quick:
        command.append("--quick")
    proc = subprocess.run(command, capture_output=True, text=True, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
        print(f"(Megatron-core part failed: exit {proc.returncode}: {tail})\n")
        return None
    return json.loads(lines[-1])


# --------------------------------------------------------------------------
# (b) partition and stats counters
# --------------------------------------------------------------------------


def build_mixed(num_blocks: int, chain_blocks: int) -> Any:
    """An allocator with every block used: 1/2 cached, 1/4 paused, 1/4 active."""
    prefixcache = _import_prefixcache()
    allocator = prefixcache.KVBlockAllocator(
        total_count=num_blocks + 1, paused_count=num_blocks // 4, device="cpu"
    )
    block_ids = fill_registered(allocator, num_blocks, chain_blocks)
    half, three_quarters = num_blocks // 2, 3 * num_blocks // 4
    allocator.release_memory_blocks(block_ids[half:])
    allocator.acquire_blocks(block_ids[half:])  # the second half is active again, not cached
    allocator.release_memory_blocks(block_ids[:half])
    allocator.pause(block_ids[half:three_quarters])
    return allocator


def bench_counters(args: argparse.Namespace) -> None:
    """The partition and stats counters must not depend on the pool size."""
    small, large = 10**3, (10**5 if args.quick else 10**6)
    number, repeats = (2_000, 5) if args.quick else (20_000, 15)
    print(f"## (b) Partition and stats counters at {large:,} blocks vs {small:,}\n")
    print(
        "Every block used: 1/2 cached, 1/4 paused, 1/4 active. ns per call (timeit, "
        f"{number:,} calls a sample, {repeats} samples after one warm-up sample), "
        "min / median / max.\n"
    )
    allocators = {size: build_mixed(size, args.chain_blocks) for size in (small, large)}
    calls: list[tuple[str, str]] = [
        ("get_active_used()", "get_active_used"),
        ("get_paused_used()", "get_paused_used"),
        ("get_active_avail()", "get_active_avail"),
        ("get_evictable_block_count()", "get_evictable_block_count"),
        ("get_total_used()", "get_total_used"),
        ("stats()", "stats"),
        ("is_memory_available(64)", "is_memory_available"),
    ]
    rows = []
    for label, method in calls:
        medians = []
        cells = [label]
        for size in (small, large):
            bound = getattr(allocators[size], method)
            call = (lambda f=bound: f(64)) if method == "is_memory_available" else bound
            timer = timeit.Timer(call)
            timer.timeit(number)
            samples = [t / number for t in timer.repeat(repeats, number)]
            medians.append(statistics.median(samples))
            cells.append(_fmt3(samples, 1e9, 0))
        cells.append(f"{medians[1] / medians[0]:.2f}")
        rows.append(cells)
    _table(["call", f"{small:,} blocks ns", f"{large:,} blocks ns", "ratio"], rows)
    print(f"State check at {large:,}: {allocators[large]}\n")


# --------------------------------------------------------------------------
# (c) host memory per block
# --------------------------------------------------------------------------


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _measure_memory(build: Callable[[], Any], fill: Callable[[Any], None], mode: str) -> dict:
    """Bytes used by ``build()`` (empty allocator) and by ``fill`` on top of it."""
    gc.collect()
    if mode == "tracemalloc":
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
    else:
        base = _rss_bytes()
    allocator = build()
    gc.collect()
    empty = tracemalloc.get_traced_memory()[0] if mode == "tracemalloc" else _rss_bytes()
    fill(allocator)
    gc.collect()
    full = tracemalloc.get_traced_memory()[0] if mode == "tracemalloc" else _rss_bytes()
    return {"empty": empty - base, "full": full - base}


def _child_prefixcache_memory(size: int, chain_blocks: int, mode: str) -> dict:
    prefixcache = _import_prefixcache()
    import torch  # noqa: F401  (imported before the baseline, as an engine would have it)

    def build() -> Any:
        return prefixcache.KVBlockAllocator(total_count=size + 1, device="cpu")

    def fill(allocator: Any) -> None:
        allocator.release_memory_blocks(fill_registered(allocator, size, chain_blocks))
        assert allocator.get_evictable_block_count() == size

    result = _measure_memory(build, fill, mode)
    result["version"] = prefixcache.__version__
    return result


class _MegatronContextStandIn:
    """What Megatron's ``KVBlockAllocator`` reads of its context on this path."""

    prefix_cache_lru_clock = 0


def _megatron_fill(allocator: Any, size: int, chain_blocks: int) -> None:
    """Register ``size`` blocks as chains (parents = previous hash, 0 at a root), release."""
    block_ids = allocator.allocate_memory_blocks(size).clone()
    id_list = block_ids.tolist()
    hashes = (np.arange(size, dtype=np.int64) + HASH_BASE).tolist()
    parents = [0 if i % chain_blocks == 0 else hashes[i - 1] for i in range(size)]
    for start in range(0, size, BATCH):
        stop = start + BATCH
        allocator.register_kv_block_hashes(
            id_list[start:stop], hashes[start:stop], parents[start:stop]
        )
    allocator.release_memory_blocks(block_ids)


def _megatron_new(size: int) -> Any:
    from megatron.core.inference.config import PrefixCachingEvictionPolicy
    from megatron.core.inference.contexts.kv_block_allocator import KVBlockAllocator

    return KVBlockAllocator(
        _MegatronContextStandIn(),
        total_count=size + 1,
        paused_count=0,
        enable_prefix_caching=True,
        prefix_caching_eviction_policy=PrefixCachingEvictionPolicy.LRU,
    )


def _megatron_version() -> str:
    from importlib.metadata import version

    return version("megatron-core")


def _child_megatron_memory(size: int, chain_blocks: int, mode: str) -> dict:
    import torch

    _megatron_new(16)  # import Megatron before the baseline, as prefixcache is
    result = _measure_memory(
        lambda: _megatron_new(size), lambda a: _megatron_fill(a, size, chain_blocks), mode
    )
    allocator = _megatron_new(16)
    tensors = [v for v in vars(allocator).values() if isinstance(v, torch.Tensor)]
    result["tensor_bytes_per_block"] = sum(t.element_size() for t in tensors)
    result["version"] = _megatron_version()
    return result


def _child_megatron_evict(sizes: list[int], chain_blocks: int, quick: bool) -> dict:
    rows = []
    for size in sizes:
        allocator = _megatron_new(size)
        _megatron_fill(allocator, size, chain_blocks)
        repeats = 3 if size >= 10**6 else (5 if quick else 20)
        samples = _time_each(lambda a=allocator: a.evict_lru_blocks(1), 1, repeats)
        rows.append({"size": size, "samples": samples})
    return {"version": _megatron_version(), "rows": rows}


def bench_memory(args: argparse.Namespace) -> None:
    """Host bytes per block, each measurement in a fresh process."""
    size = 10**5 if args.quick else 10**6
    print(f"## (c) Host memory per block at {size:,} blocks, registry full\n")
    print(
        f"Every block allocated, registered (chains of {args.chain_blocks}, 63-bit hashes) and "
        "released, so all are cached. Bytes per block = delta / blocks, each number from a "
        "fresh process after imports. RSS sees everything; tracemalloc sees Python objects "
        "and numpy arrays but not torch tensors.\n"
    )
    rows = []
    for mode in ("rss", "tracemalloc"):
        command = [sys.executable, str(Path(__file__).resolve()), "--child", "memory", mode]
        command += [str(size), "--chain-blocks", str(args.chain_blocks)]
        command += ["--threads", str(args.threads)]
        proc = subprocess.run(command, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            print(f"(prefixcache {mode} child failed: {proc.stderr.strip()[-300:]})\n")
            continue
        result = json.loads(proc.stdout.splitlines()[-1])
        rows.append(_memory_row(f"prefixcache {result['version']}", mode, result, size))
    tensor_bytes = None
    for mode in ("rss", "tracemalloc"):
        peer = _run_peer_child(args, ["megatron-memory", mode, str(size)])
        if peer is not None:
            rows.append(_memory_row(f"Megatron-core {peer['version']} (LRU)", mode, peer, size))
            tensor_bytes = peer["tensor_bytes_per_block"]
    _table(["allocator", "measure", "empty (B/block)", "registry full (B/block)"], rows)
    if tensor_bytes is not None:
        print(
            f"Megatron-core's per-block tensors (LRU mode) add up to {tensor_bytes} B/block "
            "(block_bag int32, block_hashes/timestamps/parent_id/child_count int64, "
            "ref_counts int32); the rest is its hash -> block dict.\n"
        )


def _memory_row(label: str, mode: str, result: dict, size: int) -> list[str]:
    return [label, mode, f"{result['empty'] / size:,.1f}", f"{result['full'] / size:,.1f}"]


# --------------------------------------------------------------------------
# (d) batched step
# --------------------------------------------------------------------------


def _step_per_request(allocator: Any, sizes: list[int]) -> None:
    held = [allocator.allocate_memory_blocks(k) for k in sizes]
    for block_ids in held:
        allocator.release_memory_blocks(block_ids)


def _step_free_group(allocator: Any, sizes: list[int]) -> None:
    held = [allocator.allocate_memory_blocks(k) for k in sizes]
    with allocator.free_group():
        for block_ids in held:
            allocator.release_memory_blocks(block_ids)


def _step_one_release(allocator: Any, sizes: list[int]) -> None:
    held = [allocator.allocate_memory_blocks(k) for k in sizes]
    allocator.release_memory_blocks(np.concatenate([block_ids.numpy() for block_ids in held]))


_STEPS: list[tuple[str, Callable[[Any, list[int]], None], bool]] = [
    ("per-request release", _step_per_request, False),
    ("free_group() release", _step_free_group, False),
    ("one release call (cat)", _step_one_release, True),
]
"""(label, step, whether the step releases in a single call)."""


def bench_batched(args: argparse.Namespace) -> None:
    """One engine step: 256 requests allocate, then all 256 release."""
    prefixcache = _import_prefixcache()
    num_requests = 256
    warmup, repeats = (5, 30) if args.quick else (20, 200)
    sizes = (np.random.default_rng(0).integers(1, 17, size=num_requests)).tolist()
    total_blocks = sum(sizes)
    print(f"## (d) Batched step: {num_requests} requests allocate, then release\n")
    print(
        f"Pool of 65,536 blocks; request i asks for 1-16 blocks ({total_blocks:,} blocks a "
        f"step). Allocation is one call per request, as a dynamic-batching context adds "
        "requests. Release: one call per request; the same calls inside one `free_group()` "
        "(SGLang's `free_group_begin/end`); or one call on the concatenated IDs (Megatron's "
        f"context). µs per step and calls/s ({2 * num_requests} calls a step; one call for the "
        f"single release), min / median / max over {repeats} steps after {warmup}.\n"
    )
    rows = []
    for caching in (False, True):
        allocator = prefixcache.KVBlockAllocator(
            total_count=65_536, enable_prefix_caching=caching, device="cpu"
        )
        for label, step, single_release in _STEPS:
            samples = _time_each(functools.partial(step, allocator, sizes), warmup, repeats)
            num_calls = num_requests + (1 if single_release else num_requests)
            rates = [num_calls / s for s in samples]
            rows.append(
                [
                    f"{'on' if caching else 'off'}: {label}",
                    _fmt3(samples, 1e6, 0),
                    _fmt3(rates, 1e-3, 0),
                    f"{total_blocks * 2 / statistics.median(samples) / 1e6:,.1f}",
                ]
            )
        allocator.check_invariants()
    _table(["prefix caching: release style", "µs / step", "k calls/s", "M blocks/s"], rows)


# --------------------------------------------------------------------------
# (e) per-call costs of one request
# --------------------------------------------------------------------------


def _w2_like_prompts(num_requests: int, seed: int) -> list[np.ndarray]:
    """20 system prompts of 2,048 tokens, each request adding 256 unique tokens (int32)."""
    rng = np.random.default_rng(seed)
    prompts = [np.arange(1 + p * 2048, 1 + (p + 1) * 2048, dtype=np.int32) for p in range(20)]
    choice = rng.integers(0, 20, size=num_requests)
    unique = rng.integers(50_000, 150_000, size=(num_requests, 256), dtype=np.int32)
    return [np.concatenate((prompts[p], u)) for p, u in zip(choice.tolist(), unique, strict=True)]


def _unpreempted(request_seconds: list[float]) -> list[int]:
    """Indices of the requests not hit by a scheduler preemption.

    On a shared VM a request now and then loses the CPU for a time slice
    (about 4 ms here), which dwarfs the 0.1-1 ms a request costs and would
    dominate the means. A request slower than ``max(2 ms, 10 x median)`` is
    taken as preempted; even a full miss that evicts 144 blocks stays below.
    """
    limit = max(2e-3, 10 * statistics.median(request_seconds))
    return [i for i, seconds in enumerate(request_seconds) if seconds <= limit]


def bench_request(args: argparse.Namespace) -> None:
    """Where one prefix-caching request spends its time, call by call."""
    prefixcache = _import_prefixcache()
    num_warm, num_timed = (100, 200) if args.quick else (200, 1000)
    requests = _w2_like_prompts(num_warm + num_timed, seed=2)
    print("## (e) Per-call cost of one request (2,304 tokens = 144 blocks)\n")
    print(
        "W2-like: 20 system prompts of 128 blocks, 16 unique blocks a request, pool 65,536 "
        "(hit 128 of 144). W3-like: the same with a pool of 2,048, so allocation evicts. "
        f"µs per call min / median / max and mean over {num_timed} requests after {num_warm} "
        "untimed ones; share of the mean request (means add up; requests that miss evict "
        "up to 144 blocks, so the mean is what a throughput run sees; requests preempted by "
        "the OS are left out of the means); ns per block the call handles (mean).\n"
    )
    stages = ["hash_tokens", "match_prefix(acquire)", "allocate", "register", "release"]
    for label, pool in (("W2-like", 65_536), ("W3-like", 2_048)):
        allocator = prefixcache.KVBlockAllocator(total_count=pool, device="cpu")
        samples: dict[str, list[float]] = {stage: [] for stage in [*stages, "request"]}
        blocks: dict[str, list[int]] = {stage: [] for stage in stages}
        clock = time.perf_counter
        with _frozen_gc():
            for index, tokens in enumerate(requests):
                t0 = clock()
                hashes = allocator.hash_tokens(tokens)
                t1 = clock()
                hit = allocator.match_prefix(hashes[: (len(tokens) - 1) // 16], acquire=True)
                t2 = clock()
                num_hit = len(hit)
                new = allocator.allocate_memory_blocks(len(hashes) - num_hit)
                t3 = clock()
                allocator.register_kv_block_hashes(
                    new, hashes[num_hit:], parent_hash=hashes[num_hit - 1] if num_hit else None
                )
                t4 = clock()
                allocator.release_memory_blocks(np.concatenate((hit.numpy(), new.numpy())))
                t5 = clock()
                if index < num_warm:
                    continue
                for stage, seconds, count in zip(
                    stages,
                    (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4),
                    (len(hashes), max(num_hit, 1), len(new), len(new), len(hashes)),
                    strict=True,
                ):
                    samples[stage].append(seconds)
                    blocks[stage].append(count)
                samples["request"].append(t5 - t0)
        allocator.check_invariants()
        kept = _unpreempted(samples["request"])
        total = statistics.fmean(samples["request"][i] for i in kept)
        rows = []
        for stage in stages:
            mean = statistics.fmean(samples[stage][i] for i in kept)
            per_block = mean / statistics.fmean(blocks[stage][i] for i in kept) * 1e9
            rows.append(
                [
                    stage,
                    _fmt3(samples[stage], 1e6),
                    f"{mean * 1e6:,.2f}",
                    f"{mean / total:.0%}",
                    f"{per_block:,.0f}",
                ]
            )
        rows.append(
            ["whole request", _fmt3(samples["request"], 1e6), f"{total * 1e6:,.2f}", "100%", ""]
        )
        stats = allocator.stats()
        print(
            f"**{label}** (pool {pool:,}; hit rate {stats.hit_rate:.4f}, "
            f"{stats.num_evicted_blocks:,} blocks evicted; {1 / total:,.0f} requests/s "
            f"from the mean; {num_timed - len(kept)} preempted requests left out of the means)\n"
        )
        _table(["call", "µs min / median / max", "µs mean", "share", "ns / block"], rows)


# --------------------------------------------------------------------------
# --profile: cProfile of the harness workloads through the adapter
# --------------------------------------------------------------------------


def _load_module(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _run_churn(adapter: Any, pool_blocks: int, trace: list[int]) -> None:
    """W1's operation loop (WORKLOADS.md) on a fresh pool: allocate k > 0, or
    release and swap-remove ``live[~op]``."""
    adapter.churn_init(pool_blocks, 16)
    allocate, release = adapter.churn_alloc, adapter.churn_free
    live: list[Any] = []
    for op in trace:
        if op > 0:
            live.append(allocate(op))
        else:
            index = ~op
            handle = live[index]
            last = live.pop()
            if index < len(live):
                live[index] = last
            release(handle)


def _run_prefix(adapter: Any, pool_blocks: int, prepared: list[Any]) -> None:
    """W2/W3's request loop on a fresh pool: serve each prepared prompt in turn."""
    adapter.prefix_init(pool_blocks, 16)
    serve = adapter.serve
    for tokens in prepared:
        serve(tokens)


def _workload_runner(harness: ModuleType, adapter: Any, workload: str) -> Callable[[], None]:
    """One untimed-setup, timed-loop run of ``workload`` built from the harness's generators."""
    spec = harness.WORKLOADS[workload]
    if spec["kind"] == "churn":
        trace, _ = harness.churn_trace(
            spec["ops"], spec["pool_blocks"], spec["k_max"], spec["seed"]
        )
        return functools.partial(_run_churn, adapter, spec["pool_blocks"], trace)
    requests = harness.prefix_requests(
        spec["requests"],
        spec["prompts"],
        spec["prompt_tokens"],
        spec["unique_tokens"],
        spec["seed"],
    )
    prepared = [adapter.prepare(tokens) for _, tokens in requests]
    return functools.partial(_run_prefix, adapter, spec["pool_blocks"], prepared)


def bench_profile(args: argparse.Namespace) -> None:
    """cProfile the adapter on the harness's own W1/W2/W3 operations.

    The traces come from ``run_peers.py`` (imported, not copied). The profile
    covers the operation loop plus building the fresh allocator (a few ms),
    after one warm-up run.
    """
    harness = _load_module(Path(args.harness), "run_peers")
    adapter_module = _load_module(Path(__file__).with_name("peer_adapter.py"), "peer_adapter")
    for workload in args.profile.split(","):
        run = _workload_runner(harness, adapter_module.PrefixCacheAdapter(), workload)
        run()  # warm-up
        gc.collect()
        if args.profiler == "none":  # for an outside sampler: py-spy record -- python ...
            samples = _time_each(run, 0, args.profile_runs)
            print(f"## {workload}: {_fmt3(samples, 1.0, 3)} s per run (min / median / max)\n")
            continue
        profiler = cProfile.Profile()
        start = time.perf_counter()
        with profiler:
            run()
        seconds = time.perf_counter() - start
        print(f"## cProfile of {workload} ({seconds:.3f} s under the profiler)\n")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(args.profile_top)


# --------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------


def _set_threads(threads: int) -> None:
    """Pin torch (and OpenMP in children) to ``threads`` intra-op threads, as the harness does."""
    os.environ["OMP_NUM_THREADS"] = str(threads)
    import torch

    torch.set_num_threads(threads)


def _child(argv: list[str], chain_blocks: int, quick: bool) -> None:
    kind, rest = argv[0], argv[1:]
    if kind == "memory":
        result = _child_prefixcache_memory(int(rest[1]), chain_blocks, rest[0])
    elif kind == "megatron-memory":
        result = _child_megatron_memory(int(rest[1]), chain_blocks, rest[0])
    elif kind == "megatron-evict":
        result = _child_megatron_evict([int(x) for x in rest], chain_blocks, quick)
    else:
        raise SystemExit(f"unknown child {kind}")
    print(json.dumps(result))


SECTIONS = {
    "eviction": bench_eviction,
    "counters": bench_counters,
    "memory": bench_memory,
    "batched": bench_batched,
    "request": bench_request,
}


def main() -> None:
    """Parse the flags and run the chosen sections."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    for name, function in SECTIONS.items():
        parser.add_argument(f"--{name}", action="store_true", help=function.__doc__)
    parser.add_argument("--quick", action="store_true", help="smaller sizes, fewer repeats")
    parser.add_argument(
        "--chain-blocks", type=int, default=16, help="blocks per registered chain (default 16)"
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads (default 1, as the harness)"
    )
    parser.add_argument("--peers-python", default=DEFAULT_PEERS_PYTHON)
    parser.add_argument("--profile", metavar="W1,W2,W3", help="cProfile these harness workloads")
    parser.add_argument("--harness", default=DEFAULT_HARNESS, help="path of run_peers.py")
    parser.add_argument("--profile-top", type=int, default=25, help="rows of the profile")
    parser.add_argument(
        "--profiler",
        choices=("cprofile", "none"),
        default="cprofile",
        help="'none': only run the workloads (to sample them with py-spy)",
    )
    parser.add_argument(
        "--profile-runs", type=int, default=5, help="runs per workload with --profiler none"
    )
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    _set_threads(args.threads)
    if args.child:
        _child(args.child, args.chain_blocks, args.quick)
        return
    print_environment()
    if args.profile:
        bench_profile(args)
        return
    chosen = [name for name in SECTIONS if getattr(args, name)] or list(SECTIONS)
    print(f"Command: `{' '.join(['python', *sys.argv])}`\n")
    for name in chosen:
        start = time.perf_counter()
        SECTIONS[name](args)
        print(f"({name}: {time.perf_counter() - start:.1f} s)\n")


if __name__ == "__main__":
    main()
