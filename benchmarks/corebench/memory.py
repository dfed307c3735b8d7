"""(c) Host memory per block, beside Megatron-core's allocator, each in a fresh process."""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tracemalloc
from collections.abc import Callable
from typing import Any

import numpy as np

from corebench.common import (
    BATCH,
    BENCH_CORE,
    HASH_BASE,
    fill_registered,
    import_prefixcache,
    run_peer_child,
    table,
    time_each,
)

# --------------------------------------------------------------------------
# (c) host memory per block
# --------------------------------------------------------------------------


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure_memory(build: Callable[[], Any], fill: Callable[[Any], None], mode: str) -> dict:
    """Bytes used by ``build()`` (empty allocator) and by ``fill`` on top of it."""
    gc.collect()
    if mode == "tracemalloc":
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
    else:
        base = rss_bytes()
    allocator = build()
    gc.collect()
    empty = tracemalloc.get_traced_memory()[0] if mode == "tracemalloc" else rss_bytes()
    fill(allocator)
    gc.collect()
    full = tracemalloc.get_traced_memory()[0] if mode == "tracemalloc" else rss_bytes()
    return {"empty": empty - base, "full": full - base}


def child_prefixcache_memory(size: int, chain_blocks: int, mode: str) -> dict:
    prefixcache = import_prefixcache()
    import torch  # noqa: F401  (imported before the baseline, as an engine would have it)

    def build() -> Any:
        return prefixcache.KVBlockAllocator(total_count=size + 1, device="cpu")

    def fill(allocator: Any) -> None:
        allocator.release_memory_blocks(fill_registered(allocator, size, chain_blocks))
        assert allocator.get_evictable_block_count() == size

    result = measure_memory(build, fill, mode)
    result["version"] = prefixcache.__version__
    return result


class MegatronContextStandIn:
    """What Megatron's ``KVBlockAllocator`` reads of its context on this path."""

    prefix_cache_lru_clock = 0


def megatron_fill(allocator: Any, size: int, chain_blocks: int) -> None:
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


def megatron_new(size: int) -> Any:
    from megatron.core.inference.config import PrefixCachingEvictionPolicy
    from megatron.core.inference.contexts.kv_block_allocator import KVBlockAllocator

    return KVBlockAllocator(
        MegatronContextStandIn(),
        total_count=size + 1,
        paused_count=0,
        enable_prefix_caching=True,
        prefix_caching_eviction_policy=PrefixCachingEvictionPolicy.LRU,
    )


def megatron_version() -> str:
    from importlib.metadata import version

    return version("megatron-core")


def child_megatron_memory(size: int, chain_blocks: int, mode: str) -> dict:
    import torch

    megatron_new(16)  # import Megatron before the baseline, as prefixcache is
    result = measure_memory(
        lambda: megatron_new(size), lambda a: megatron_fill(a, size, chain_blocks), mode
    )
    allocator = megatron_new(16)
    tensors = [v for v in vars(allocator).values() if isinstance(v, torch.Tensor)]
    result["tensor_bytes_per_block"] = sum(t.element_size() for t in tensors)
    result["version"] = megatron_version()
    return result


def child_megatron_evict(sizes: list[int], chain_blocks: int, quick: bool) -> dict:
    rows = []
    for size in sizes:
        allocator = megatron_new(size)
        megatron_fill(allocator, size, chain_blocks)
        repeats = 3 if size >= 10**6 else (5 if quick else 20)
        samples = time_each(lambda a=allocator: a.evict_lru_blocks(1), 1, repeats)
        rows.append({"size": size, "samples": samples})
    return {"version": megatron_version(), "rows": rows}


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
        command = [sys.executable, str(BENCH_CORE), "--child", "memory", mode]
        command += [str(size), "--chain-blocks", str(args.chain_blocks)]
        command += ["--threads", str(args.threads)]
        proc = subprocess.run(command, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            print(f"(prefixcache {mode} child failed: {proc.stderr.strip()[-300:]})\n")
            continue
        result = json.loads(proc.stdout.splitlines()[-1])
        rows.append(memory_row(f"prefixcache {result['version']}", mode, result, size))
    tensor_bytes = None
    for mode in ("rss", "tracemalloc"):
        peer = run_peer_child(args, ["megatron-memory", mode, str(size)])
        if peer is not None:
            rows.append(memory_row(f"Megatron-core {peer['version']} (LRU)", mode, peer, size))
            tensor_bytes = peer["tensor_bytes_per_block"]
    table(["allocator", "measure", "empty (B/block)", "registry full (B/block)"], rows)
    if tensor_bytes is not None:
        print(
            f"Megatron-core's per-block tensors (LRU mode) add up to {tensor_bytes} B/block "
            "(block_bag int32, block_hashes/timestamps/parent_id/child_count int64, "
            "ref_counts int32); the rest is its hash -> block dict.\n"
        )


def memory_row(label: str, mode: str, result: dict, size: int) -> list[str]:
    return [label, mode, f"{result['empty'] / size:,.1f}", f"{result['full'] / size:,.1f}"]
