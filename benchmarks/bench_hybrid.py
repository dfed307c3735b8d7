"""Per-operation cost of the hybrid-model pieces at several sizes: a scaling table.

Three tables, each in ns per call (min / median / max of the timed rounds, after one
warm-up round):

- (a) ``StatePool``: ``allocate`` (which zeroes the slot's state) and ``free``, at
  10^3 .. 10^6 slots. The state is one layer of a 1x1 recurrence and a 1-wide conv
  window, so the table shows the bookkeeping plus the two zero-fills, not memory traffic.
- (b) ``StateCheckpoints`` holding 10^2 .. 10^5 checkpoints (full): ``lookup`` of a held
  hash and of a missing one, ``restore``, and ``save`` of a new hash (which evicts the
  policy's victim, LRU by default).
- (c) ``HybridMemory.match_prefix`` on a prompt of 16 .. 1,024 cached blocks with a
  checkpoint every 4 blocks, then with only the first checkpoint left (every shorter
  length is tried), in ns per call and per prompt block: the allocator's prefix match
  plus one checkpoint lookup per candidate length.

Run: ``python benchmarks/bench_hybrid.py [--rounds 5] [--ops 2000] [--policy lru]``.
"""

from __future__ import annotations

import argparse
import itertools
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from machine import cpu_model  # benchmarks/machine.py, beside this script

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from prefixcache.engine.hashing import compute_block_hashes
from prefixcache.serving.checkpoints import StateCheckpoints
from prefixcache.serving.hybrid import build_hybrid_memory
from prefixcache.serving.layer_groups import LayerGroupSpec
from prefixcache.serving.state_pool import StatePool, StateShape

TINY = StateShape(num_layers=1, num_heads=1, k_dim=1, v_dim=1, conv_dim=1, conv_kernel=2)
POOL_SIZES = (1_000, 10_000, 100_000, 1_000_000)
CHECKPOINT_SIZES = (100, 1_000, 10_000, 100_000)
PROMPT_BLOCKS = (16, 64, 256, 1_024)


def time_rounds(step: Callable[[], object], ops: int, rounds: int) -> list[float]:
    """ns per call of ``step`` over ``rounds`` rounds of ``ops`` calls, the warm-up dropped."""
    samples = []
    for _ in range(rounds + 1):
        start = time.perf_counter_ns()
        for _ in range(ops):
            step()
        samples.append((time.perf_counter_ns() - start) / ops)
    return samples[1:]


def row(*cells: object, samples: list[float]) -> str:
    """A table row: the cells, then min / median / max of ``samples``."""
    low, mid, high = min(samples), statistics.median(samples), max(samples)
    return "| " + " | ".join(str(c) for c in cells) + f" | {low:,.0f} | {mid:,.0f} | {high:,.0f} |"


def one_round(step: Callable[[], object], calls: int) -> float:
    """ns per call of ``calls`` calls of ``step``."""
    start = time.perf_counter_ns()
    for _ in range(calls):
        step()
    return (time.perf_counter_ns() - start) / calls


def bench_state_pool(size: int, ops: int, rounds: int) -> None:
    """Rows of table (a) for a pool of ``size`` slots, half of them held throughout."""
    pool = StatePool(TINY, size + 1, dtype=torch.float32, device="cpu")
    for _ in range(size // 2):
        pool.allocate()
    calls = min(ops, size - size // 2)
    held: list[int] = []
    allocate_samples, free_samples = [], []
    for _ in range(rounds + 1):  # a round allocates, then frees the same slots
        allocate_samples.append(one_round(lambda: held.append(pool.allocate()), calls))
        free_samples.append(one_round(lambda: pool.free(held.pop()), calls))
    pool.check_invariants()
    print(row(f"{size:,}", "allocate (zeroed)", samples=allocate_samples[1:]), flush=True)
    print(row(f"{size:,}", "free", samples=free_samples[1:]), flush=True)


def bench_checkpoints(size: int, ops: int, rounds: int, policy: str) -> None:
    """Rows of table (b) for a full set of ``size`` checkpoints."""
    pool = StatePool(TINY, size + 3, dtype=torch.float32, device="cpu")
    checkpoints = StateCheckpoints(pool, size, every=4, policy=policy)
    src, dst = pool.allocate(), pool.allocate()
    for block_hash in range(1, size + 1):
        checkpoints.save(block_hash, src)
    probes = itertools.cycle(np.random.default_rng(size).integers(1, size + 1, 4096).tolist())
    fresh = itertools.count(size + 1)
    steps: list[tuple[str, Callable[[], object]]] = [
        ("lookup (held)", lambda: checkpoints.lookup(next(probes))),
        ("lookup (missing)", lambda: checkpoints.lookup(-7)),
        ("restore", lambda: checkpoints.restore(next(probes), dst)),  # all held until saves
        ("save (evicts one)", lambda: checkpoints.save(next(fresh), src)),
    ]
    for name, step in steps:
        samples = [one_round(step, ops) for _ in range(rounds + 1)][1:]
        print(row(f"{size:,}", name, samples=samples), flush=True)
    checkpoints.check_invariants()


def bench_match(num_blocks: int, ops: int, rounds: int, *, only_first: bool) -> None:
    """Row of table (c): a prompt of ``num_blocks`` cached blocks, checkpoints every 4.

    With ``only_first`` every checkpoint but the first is dropped, so the
    match tries every shorter length down to block 4 (the longest scan).
    """
    memory = build_hybrid_memory(
        [LayerGroupSpec("attn", "full", num_layers=1, k_heads=1, k_head_dim=1)],
        num_blocks=num_blocks + 2,
        block_size=16,
        max_requests=1,
        max_blocks_per_request=num_blocks + 1,
        linear=TINY,
        num_checkpoints=num_blocks // 4 + 1,
        checkpoint_every=4,
        dtype=torch.float32,
        device="cpu",
    )
    tokens = list(range(num_blocks * 16 + 1))
    hashes = compute_block_hashes(tokens, 16)
    request = memory.admit([], len(tokens))
    memory.reserve(request, num_blocks * 16)
    for stop in range(4, num_blocks + 1, 4):
        memory.commit(request, stop * 16, hashes[:stop])
    memory.finish(request)
    if only_first:
        memory.checkpoints.prune(lambda block_hash: block_hash == hashes[3])
    hit = memory.match_prefix(hashes).num_blocks
    calls = max(10, ops // 8)
    samples = [one_round(lambda: memory.match_prefix(hashes), calls) for _ in range(rounds + 1)]
    samples = samples[1:]
    low, mid, high = min(samples), statistics.median(samples), max(samples)
    print(
        f"| {num_blocks:,} | {hit:,} | {low:,.0f} / {mid:,.0f} / {high:,.0f} "
        f"| {mid / num_blocks:,.0f} |",
        flush=True,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=2_000, help="calls per round")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds after the warm-up")
    parser.add_argument("--policy", default="lru", help="the checkpoints' eviction policy")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"- machine: {cpu_model()}, {os.cpu_count()} CPUs, {platform.platform()}")
    print(f"- load average at start: {load}")
    print(f"- Python {platform.python_version()}, torch {torch.__version__} "
          f"({torch.get_num_threads()} intra-op threads), numpy {np.__version__}")  # fmt: skip
    print(f"- {args.rounds} rounds of {args.ops} calls after one warm-up round\n")
    print("## (a) StatePool: one slot handed out and taken back, ns per call\n")
    print("| slots | operation | min | median | max |\n| ---: | --- | ---: | ---: | ---: |")
    for size in POOL_SIZES:
        bench_state_pool(size, args.ops, args.rounds)
    print(f"\n## (b) StateCheckpoints ({args.policy}), full, ns per call\n")
    print("| checkpoints | operation | min | median | max |\n| ---: | --- | ---: | ---: | ---: |")
    for size in CHECKPOINT_SIZES:
        bench_checkpoints(size, args.ops, args.rounds, args.policy)
    print("\n## (c) HybridMemory.match_prefix, KV of every block cached\n")
    print("Checkpoints every 4 blocks (the hit is the whole prompt), then only the first")
    print("(the match tries every length down to 4 blocks).\n")
    print("| prompt blocks | hit blocks | ns per call (min / median / max) | ns per block |")
    print("| ---: | ---: | --- | ---: |")
    for only_first in (False, True):
        for num_blocks in PROMPT_BLOCKS:
            bench_match(num_blocks, args.ops, args.rounds, only_first=only_first)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
