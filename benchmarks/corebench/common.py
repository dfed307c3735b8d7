"""What the sections of ``bench_core.py`` share: paths, timing, printing, filling a pool."""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
from machine import cpu_model  # benchmarks/machine.py, beside this script

REPO_ROOT = Path(__file__).resolve().parents[2]
BENCH_CORE = Path(__file__).resolve().parents[1] / "bench_core.py"
"""The script the Megatron-core children run (``--child``)."""
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


def import_prefixcache() -> ModuleType:
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


def min_med_max(samples: list[float]) -> tuple[float, float, float]:
    return min(samples), statistics.median(samples), max(samples)


def fmt3(samples: list[float], scale: float = 1.0, digits: int = 2) -> str:
    """``min / median / max`` of ``samples`` times ``scale``."""
    low, mid, high = min_med_max(samples)
    return " / ".join(f"{v * scale:,.{digits}f}" for v in (low, mid, high))


def time_each(
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
    with frozen_gc():
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
def frozen_gc() -> Iterator[None]:
    """``gc.collect(); gc.freeze()`` for the block, as before every timed loop of the harness."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def table(header: list[str], rows: list[list[str]]) -> None:
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

    prefixcache = import_prefixcache()
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
    prefixcache = import_prefixcache()
    allocator = prefixcache.KVBlockAllocator(total_count=num_blocks + 1, device="cpu")
    allocator.release_memory_blocks(fill_registered(allocator, num_blocks, chain_blocks))
    return allocator


def run_peer_child(args: argparse.Namespace, child_args: list[str]) -> dict[str, Any] | None:
    """Run ``--child ...`` of this file under the peers' Python; None (and a note) if absent."""
    python = args.peers_python
    if not python or not Path(python).exists():
        print(f"(Megatron-core part skipped: no peers' Python at {python!r})\n")
        return None
    command = [python, "-W", "ignore", str(BENCH_CORE), "--child", *child_args]
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
