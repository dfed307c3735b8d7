"""Eviction cost at 10^4-10^5 cached blocks: Megatron-core's allocator vs the drop-in.

Both allocators get the same pool, filled the same way: every usable block
registered (chains of ``--chain`` blocks, as prompts register them) and then
released, so the free stack is empty and every block is cached. One timed
operation is ``allocate_memory_blocks(k)``, which must evict ``k`` blocks:
Megatron-core 0.19's ``evict_lru_blocks`` scans the whole pool (a mask, a
``nonzero``, a heap over every cached block), the drop-in
(``prefixcache.integrations.megatron``) asks its policy for ``k`` victims.
Between timed calls the handed-out blocks are registered under fresh hashes
and released, so the pool stays full of cached blocks. Reports min / median /
max microseconds per call after a warm-up, with the machine and versions.

Megatron's side needs megatron-core 0.19 (see ``../shared/bench/README.md``);
without it only the drop-in runs. From the repository root::

    PYTHONPATH=. $PEERS_VENV/bin/python benchmarks/bench_megatron.py --policies lru,s3fifo,auto
    .venv/bin/python benchmarks/bench_megatron.py --blocks 10000   # drop-in only
"""

from __future__ import annotations

import argparse
import importlib.metadata
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout, if not installed
sys.path.insert(0, str(Path(__file__).resolve().parent))

from machine import cpu_model

from prefixcache.integrations.megatron import MegatronKVBlockAllocator, PrefixCachePolicy


class Clock:
    """The context attribute Megatron's allocator reads for LRU timestamps."""

    prefix_cache_lru_clock = 0
    block_size_tokens = 16


def fill(allocator: Any, num_usable: int, chain: int, next_hash: list[int]) -> None:
    """Register every usable block in chains of ``chain`` blocks, then release them all."""
    clock = allocator.context
    for start in range(0, num_usable, chain):
        count = min(chain, num_usable - start)
        ids = allocator.allocate_memory_blocks(count)
        hashes = list(range(next_hash[0], next_hash[0] + count))
        next_hash[0] += count
        allocator.register_kv_block_hashes(ids.tolist(), hashes, [0, *hashes[:-1]])
        allocator.release_memory_blocks(ids)
        clock.prefix_cache_lru_clock += 1


def time_evictions(
    allocator: Any, num_evict: int, repeats: int, warmup: int, next_hash: list[int]
) -> list[float]:
    """Microseconds per ``allocate_memory_blocks(num_evict)`` on a pool of cached blocks."""
    samples = []
    for index in range(warmup + repeats):
        assert allocator.total_avail == 0
        start = time.perf_counter()
        ids = allocator.allocate_memory_blocks(num_evict)
        elapsed = time.perf_counter() - start
        assert ids is not None
        hashes = list(range(next_hash[0], next_hash[0] + num_evict))
        next_hash[0] += num_evict
        allocator.register_kv_block_hashes(ids.tolist(), hashes, [0] * num_evict)
        allocator.release_memory_blocks(ids)
        allocator.context.prefix_cache_lru_clock += 1
        if index >= warmup:
            samples.append(elapsed * 1e6)
    return samples


def builders(engine: str, policies: list[str]) -> dict[str, Callable[[int], Any]]:
    """Allocator factories by row name: Megatron's (when megatron-core imports), then the
    drop-in with each of ``policies``."""
    rows: dict[str, Callable[[int], Any]] = {}
    try:
        from megatron.core.inference.config import PrefixCachingEvictionPolicy
        from megatron.core.inference.contexts.kv_block_allocator import KVBlockAllocator
    except ImportError:
        print("megatron-core not importable: the drop-in only", file=sys.stderr)
    else:
        rows["megatron-core KVBlockAllocator"] = lambda total: KVBlockAllocator(
            Clock(), total, 0, True, PrefixCachingEvictionPolicy.LRU
        )
    for policy in policies:
        rows[f"prefixcache drop-in ({policy}, {engine})"] = lambda total, policy=policy: (
            MegatronKVBlockAllocator(
                Clock(), total, 0, True, PrefixCachePolicy(policy), engine=engine
            )
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--evict", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--chain", type=int, default=8, help="blocks per registered chain")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--engine", default="auto", choices=["auto", "python", "native"])
    parser.add_argument(
        "--policies", default="lru,s3fifo,auto", help="the drop-in's policies, comma-separated"
    )
    args = parser.parse_args(argv)
    try:
        megatron_version = importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        megatron_version = "not installed"
    print(
        f"# {cpu_model()}; Python {platform.python_version()}; torch {torch.__version__}; "
        f"megatron-core {megatron_version}"
    )
    print("| allocator | cached blocks | evicted per call | min us | median us | max us |")
    print("|---|---:|---:|---:|---:|---:|")
    for num_blocks in args.blocks:
        for name, build in builders(args.engine, args.policies.split(",")).items():
            for num_evict in args.evict:
                allocator = build(num_blocks + 1)
                next_hash = [1]
                fill(allocator, num_blocks, args.chain, next_hash)
                samples = time_evictions(allocator, num_evict, args.repeats, args.warmup, next_hash)
                print(
                    f"| {name} | {num_blocks:,} | {num_evict} | {min(samples):.1f} "
                    f"| {statistics.median(samples):.1f} | {max(samples):.1f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
