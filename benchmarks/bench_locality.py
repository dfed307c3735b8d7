"""Locality and defragmentation benchmarks (issue 17 parts 4 and 5; DESIGN.md, "Locality").

Sections (pick any; none picked runs all):

- ``--sorting``: what keeping the free list sorted costs per operation. A
  pool of N blocks (10^3 .. 10^6) half held at random positions; each timed
  step allocates 16 blocks and releases them again. Nanoseconds per block
  (one hand-out plus one release), the stack (``free_list="stack"``) beside
  lowest-first (``free_list="lowest"``), on each engine, through the
  allocator; and the bare Python free lists (``BlockPool``,
  ``SortedFreeList``) without the allocator.
- ``--fragmentation``: what the order buys. A churn of requests (2..32
  blocks, random lengths, finishing in random order) on 10^4 blocks; after
  the warm-up, the mean fragmentation figure (``stats().fragmentation``: share
  of free blocks outside the largest free run) and the share of requests
  whose blocks are one contiguous ascending run, stack vs lowest.
- ``--page-eviction``: memory actually freed. A pool of 4,096 blocks in
  pages of 8 (``free_list="lowest"``, ``page_size_blocks=8``) filled by
  requests of 1..8 blocks (each prompt its own hash chain), a quarter of
  them still running, the rest cached; then 512 blocks evicted, 64 at a
  time. Whole free pages (memory a paged KV store can unmap) after each
  step, plain LRU beside ``PageAwarePolicy`` (LRU inside), over 5 seeds.
- ``--defrag``: ``plan_defragment()`` and ``apply_defragment()`` on pools of
  10^3 .. 10^6 blocks, half live (a quarter running, a quarter cached in
  chains of 8), scattered; time of each, per engine, and per moved block.

Every timing is min / median over repeats after a warm-up, with the machine
first. ``--quick`` shrinks sizes and repeats. Run from the repo root::

    PYTHONPATH=. python benchmarks/bench_locality.py
    PYTHONPATH=. python benchmarks/bench_locality.py --defrag --quick
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from machine import cpu_model
from prefixcache.policies.page_aware import PageAwarePolicy

from prefixcache import KVBlockAllocator
from prefixcache.engine.free_list import SortedFreeList
from prefixcache.engine.native_engine import native_available
from prefixcache.engine.pool import BlockPool
from prefixcache.testing.pages import fragmented_pool, whole_free_pages

BATCH = 16


def engines() -> list[str]:
    return ["python", "native"] if native_available() else ["python"]


def timed(step: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Min and median seconds of ``step`` over ``repeats`` runs after one warm-up."""
    step()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return min(times), statistics.median(times)


def half_held(allocator: KVBlockAllocator, rng: np.random.Generator) -> None:
    """Hold a random half of the pool, so the free IDs are scattered."""
    ids = allocator.allocate_memory_blocks(allocator.num_usable)
    assert ids is not None
    freed = rng.permutation(ids.numpy())[: allocator.num_usable // 2]
    allocator.release_memory_blocks(freed)


def bench_sorting(sizes: list[int], steps: int, repeats: int) -> None:
    print(f"\n## Sorting cost: ns per block (allocate {BATCH} + release {BATCH}), min / median")
    print("| blocks | engine | stack | lowest | lowest / stack |")
    print("| ---: | --- | ---: | ---: | ---: |")
    for size in sizes:
        for engine in engines():
            row = []
            for free_list in ("stack", "lowest"):
                allocator = KVBlockAllocator(
                    total_count=size + 1, device="cpu", engine=engine, free_list=free_list
                )
                half_held(allocator, np.random.default_rng(0))

                def step(allocator: KVBlockAllocator = allocator) -> None:
                    allocate, release = (
                        allocator.allocate_memory_blocks,
                        allocator.release_memory_blocks,
                    )
                    for _ in range(steps):
                        release(allocate(BATCH))

                best, median = timed(step, repeats)
                row.append((best, median))
            per = [(b / (steps * BATCH) * 1e9, m / (steps * BATCH) * 1e9) for b, m in row]
            print(
                f"| {size:,} | {engine} | {per[0][0]:.0f} / {per[0][1]:.0f} | "
                f"{per[1][0]:.0f} / {per[1][1]:.0f} | {per[1][1] / per[0][1]:.2f} |"
            )
    print("\nBare Python free lists (no allocator): ns per block, acquire + release, median")
    print("| blocks | BlockPool (stack) | SortedFreeList | ratio |")
    print("| ---: | ---: | ---: | ---: |")
    for size in sizes:
        medians = []
        for make in (BlockPool, SortedFreeList):
            free_list = make(size + 1, "cpu")
            held = free_list.acquire(size)
            free_list.release(np.random.default_rng(0).permutation(held)[: size // 2])

            def step(free_list: BlockPool | SortedFreeList = free_list) -> None:
                for _ in range(steps):
                    free_list.release(free_list.acquire(BATCH))

            medians.append(timed(step, repeats)[1] / (steps * BATCH) * 1e9)
        print(f"| {size:,} | {medians[0]:.0f} | {medians[1]:.0f} | {medians[1] / medians[0]:.2f} |")


def bench_fragmentation(size: int, steps: int) -> None:
    print(f"\n## Fragmentation under churn: {size:,} blocks, {steps:,} requests, Python engine")
    print("| free list | mean fragmentation | contiguous requests |")
    print("| --- | ---: | ---: |")
    for free_list in ("stack", "lowest"):
        rng = np.random.default_rng(1)
        allocator = KVBlockAllocator(
            total_count=size + 1, device="cpu", engine="python", free_list=free_list
        )
        running: list[np.ndarray] = []
        fragmentation, contiguous, counted = [], 0, 0
        for step in range(steps):
            count = int(rng.integers(2, 33))
            while allocator.stats().num_free < count or (running and rng.random() < 0.3):
                allocator.release_memory_blocks(running.pop(int(rng.integers(len(running)))))
            ids = allocator.allocate_memory_blocks(count)
            assert ids is not None
            running.append(ids.numpy())
            if step >= steps // 5:  # after the warm-up
                counted += 1
                contiguous += bool(np.all(np.diff(ids.numpy()) == 1))
                if step % 10 == 0:
                    fragmentation.append(allocator.stats().fragmentation)
        print(
            f"| {free_list} | {statistics.mean(fragmentation):.3f} | {contiguous / counted:.1%} |"
        )


def bench_page_eviction(seeds: int) -> None:
    page_size, step, total = 8, 64, 512
    print(f"\n## Page-aware eviction: whole free pages of {page_size} blocks after each")
    print(f"{step} evictions (4,096 blocks, a quarter running), mean over {seeds} seeds")
    print("| evicted | LRU pages | page-aware pages | LRU memory freed | page-aware memory freed |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    pages: dict[str, list[list[int]]] = {"lru": [], "page": []}
    for seed in range(seeds):
        for name in pages:
            policy = "lru" if name == "lru" else PageAwarePolicy(page_size)
            allocator = fragmented_pool(policy, page_size, seed, total_count=4097)
            row = []
            for _ in range(total // step):
                assert allocator.evict_cached_blocks(step) == step
                row.append(whole_free_pages(allocator, page_size))
            pages[name].append(row)
    for index in range(total // step):
        evicted = (index + 1) * step
        lru = statistics.mean(row[index] for row in pages["lru"])
        aware = statistics.mean(row[index] for row in pages["page"])
        print(
            f"| {evicted} | {lru:.1f} | {aware:.1f} | {lru * page_size / evicted:.0%} | "
            f"{aware * page_size / evicted:.0%} |"
        )


def scattered_pool(size: int, engine: str, rng: np.random.Generator) -> KVBlockAllocator:
    """Half live at random IDs: a quarter running, a quarter cached in chains of 8."""
    allocator = KVBlockAllocator(
        total_count=size + 1, device="cpu", engine=engine, block_size_tokens=1
    )
    ids = rng.permutation(allocator.allocate_memory_blocks(size).numpy())
    cached = ids[: size // 4]
    chain = 8
    for start in range(0, len(cached) - chain + 1, chain):
        hashes = list(range(start + 1, start + chain + 1))
        allocator.register_kv_block_hashes(cached[start : start + chain], hashes)
    allocator.release_memory_blocks(cached)
    allocator.release_memory_blocks(ids[size // 2 :])
    return allocator


def bench_defrag(sizes: list[int], repeats: int) -> None:
    print("\n## Defragmentation: half live (running + cached chains), scattered; min / median")
    print("| blocks | engine | moves | plan ms | apply ms | apply ns per move (min) |")
    print("| ---: | --- | ---: | ---: | ---: | ---: |")
    for size in sizes:
        for engine in engines():
            plans, applies, moves = [], [], 0
            for repeat in range(repeats):
                allocator = scattered_pool(size, engine, np.random.default_rng(repeat))
                start = time.perf_counter()
                plan = allocator.plan_defragment()
                planned = time.perf_counter()
                allocator.apply_defragment(plan)
                done = time.perf_counter()
                assert allocator.stats().fragmentation == 0.0
                plans.append(planned - start)
                applies.append(done - planned)
                moves = len(plan)
            print(
                f"| {size:,} | {engine} | {moves:,} | {min(plans) * 1e3:.2f} / "
                f"{statistics.median(plans) * 1e3:.2f} | {min(applies) * 1e3:.2f} / "
                f"{statistics.median(applies) * 1e3:.2f} | "
                f"{min(applies) / max(moves, 1) * 1e9:.0f} |"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sorting", action="store_true")
    parser.add_argument("--fragmentation", action="store_true")
    parser.add_argument("--page-eviction", action="store_true")
    parser.add_argument("--defrag", action="store_true")
    parser.add_argument("--quick", action="store_true", help="small sizes, few repeats")
    args = parser.parse_args()
    everything = not (args.sorting or args.fragmentation or args.page_eviction or args.defrag)
    print(f"# bench_locality on {cpu_model()}, Python {platform.python_version()}")
    print(f"numpy {np.__version__}; native engine built: {native_available()}")
    sizes = [10**3, 10**4] if args.quick else [10**3, 10**4, 10**5, 10**6]
    if everything or args.sorting:
        bench_sorting(sizes, steps=50 if args.quick else 200, repeats=3 if args.quick else 7)
    if everything or args.fragmentation:
        bench_fragmentation(10**4, steps=2_000 if args.quick else 20_000)
    if everything or args.page_eviction:
        bench_page_eviction(seeds=2 if args.quick else 5)
    if everything or args.defrag:
        bench_defrag(sizes, repeats=2 if args.quick else 5)


if __name__ == "__main__":
    main()
