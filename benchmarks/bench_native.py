"""Native engine benchmarks: per-request latency, hashing against raw XXH3, eviction scaling.

Sections (all by default; pick with flags):

- ``--latency``: the W2 and W3 request streams of ``../shared/bench/WORKLOADS.md``
  (generated here with the spec's SplitMix64, checked against its test
  vectors), each request timed on its own: p50 / p99 / max in µs and the hit
  rate, for the fused call (``admit_request`` + ``release_request``), the
  composed calls on the native engine, and the composed calls on the Python
  engine.
- ``--hashing``: the native block-hash chain against raw XXH3 over the same
  bytes, in C++ (``benchmarks/native_hash_bench.cpp``, built here with the
  system compiler), and the Python-visible calls.
- ``--eviction``: the native engine's ``evict(1)`` (direct, no facade) with 10^3
  to 10^6 cached blocks, one block re-cached untimed after each call.

Every timing is min / median / max over repeats after a warm-up, with the
machine and versions first. Run from the repository root after building the
extension (``pip install -e .``)::

    python benchmarks/bench_native.py            # ~2 min
    python benchmarks/bench_native.py --latency --quick
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from machine import cpu_model  # noqa: E402  (benchmarks/machine.py, beside this script)

import prefixcache  # noqa: E402
from prefixcache import KVBlockAllocator  # noqa: E402
from prefixcache.engine import hashing  # noqa: E402
from prefixcache.engine.native_engine import native_available, native_module  # noqa: E402

MASK64 = (1 << 64) - 1
BLOCK_SIZE = 16


# --------------------------------------------------------------------------
# WORKLOADS.md request stream
# --------------------------------------------------------------------------


def splitmix64(seed: int) -> Iterator[int]:
    """The spec's SplitMix64 generator."""
    state = seed
    while True:
        state = (state + 0x9E3779B97F4A7C15) & MASK64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
        yield z ^ (z >> 31)


def prefix_requests(num_requests: int = 2000) -> list[np.ndarray]:
    """W2/W3's requests as int32 arrays: system prompt ``p`` then 256 unique tokens."""
    draws = splitmix64(2)
    prompts = [np.arange(1 + p * 2048, 1 + (p + 1) * 2048, dtype=np.int32) for p in range(20)]
    requests, ids = [], []
    for _ in range(num_requests):
        p = next(draws) % 20
        unique = [50_000 + next(draws) % 100_000 for _ in range(256)]
        ids.append(p)
        requests.append(np.concatenate((prompts[p], np.array(unique, dtype=np.int32))))
    assert ids[:12] == [10, 13, 0, 15, 0, 13, 19, 12, 10, 10, 10, 13], "SplitMix64 test vector"
    return requests


# --------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------


def _fmt3(samples: list[float], scale: float, digits: int = 2) -> str:
    low, mid, high = min(samples), statistics.median(samples), max(samples)
    return f"{low * scale:,.{digits}f} / {mid * scale:,.{digits}f} / {high * scale:,.{digits}f}"


def _table(header: list[str], rows: list[list[str]]) -> None:
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print()


def _environment() -> None:
    import torch

    print("## Environment\n")
    print(f"- machine: {cpu_model()}, {os.cpu_count()} CPUs, {platform.platform()}")
    print(f"- load average at start: {', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    versions = f"numpy {np.__version__}, torch {torch.__version__}"
    print(f"- Python {platform.python_version()}, {versions}")
    print(f"- prefixcache {prefixcache.__version__}, native engine built: {native_available()}")
    print(f"\nCommand: `python benchmarks/bench_native.py {' '.join(sys.argv[1:])}`\n")


# --------------------------------------------------------------------------
# (a) per-request latency
# --------------------------------------------------------------------------


def _fused(allocator: KVBlockAllocator) -> Callable[[np.ndarray], int]:
    admit, release = allocator.admit_request, allocator.release_request
    row = np.zeros(256, dtype=np.int32)

    def serve(tokens: np.ndarray) -> int:
        hit: int = admit(tokens, row)
        release(row[: -(-len(tokens) // BLOCK_SIZE)])
        return hit

    return serve


def _composed(allocator: KVBlockAllocator) -> Callable[[np.ndarray], int]:
    def serve(tokens: np.ndarray) -> int:
        hashes = allocator.hash_tokens(tokens)
        hit = allocator.match_prefix(hashes[: (len(tokens) - 1) // BLOCK_SIZE], acquire=True)
        num_hit = len(hit)
        new = allocator.allocate_memory_blocks(-(-len(tokens) // BLOCK_SIZE) - num_hit)
        assert new is not None
        new_ids = new.numpy()
        allocator.register_kv_block_hashes(
            new_ids[: len(hashes) - num_hit],
            hashes[num_hit:],
            parent_hash=hashes[num_hit - 1] if num_hit else None,
        )
        allocator.release_memory_blocks(np.concatenate((hit.numpy(), new_ids)))
        return num_hit

    return serve


def bench_latency(args: argparse.Namespace) -> None:
    """Per-request latency on W2 and W3, fused and composed, native and Python."""
    requests = prefix_requests(400 if args.quick else 2000)
    print("## (a) Per-request latency, W2 and W3 request streams (WORKLOADS.md)\n")
    print(
        "Each request (hash, match and pin, allocate with LRU eviction, register, release) "
        "timed on its own with `perf_counter_ns`, over the whole stream on a fresh pool, "
        "after one untimed pass on another fresh pool. µs per request; hit rate = "
        "hit blocks / prompt blocks.\n"
    )
    variants: list[tuple[str, str, Callable[[KVBlockAllocator], Callable[[np.ndarray], int]]]]
    variants = [("python", "composed calls", _composed)]
    if native_available():
        variants = [
            ("native", "admit_request + release_request", _fused),
            ("native", "composed calls", _composed),
            *variants,
        ]
    rows = []
    for workload, pool in (("W2", 65_536), ("W3", 2_048)):
        for engine, calls, make in variants:
            make(KVBlockAllocator(total_count=pool, device="cpu", engine=engine))(requests[0])
            allocator = KVBlockAllocator(total_count=pool, device="cpu", engine=engine)
            serve = make(allocator)
            times, hits = [], 0
            clock = time.perf_counter_ns
            gc.collect()
            gc.freeze()
            for tokens in requests:
                start = clock()
                hits += serve(tokens)
                times.append(clock() - start)
            gc.unfreeze()
            us = sorted(t / 1000 for t in times)
            rows.append(
                [
                    workload,
                    engine,
                    calls,
                    f"{us[len(us) // 2]:.2f}",
                    f"{us[int(len(us) * 0.99)]:.2f}",
                    f"{us[-1]:.1f}",
                    f"{len(requests) / (sum(times) / 1e9):,.0f}",
                    f"{hits / (144 * len(requests)):.4f}",
                ]
            )
    _table(
        ["workload", "engine", "calls", "p50 µs", "p99 µs", "max µs", "requests/s", "hit rate"],
        rows,
    )


# --------------------------------------------------------------------------
# (b) hashing
# --------------------------------------------------------------------------


def bench_hashing(args: argparse.Namespace) -> None:
    """The native block-hash chain against raw XXH3 over the same bytes."""
    print("## (b) Hashing: the chain against raw XXH3 over the same bytes\n")
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    source = REPO_ROOT / "benchmarks" / "native_hash_bench.cpp"
    if compiler is None:
        print("(skipped: no C++ compiler)\n")
    else:
        with tempfile.TemporaryDirectory() as tmp:
            binary = Path(tmp) / "native_hash_bench"
            subprocess.run(
                [
                    compiler,
                    "-std=c++17",
                    "-O3",
                    f"-I{REPO_ROOT / 'prefixcache/engine/native'}",
                    str(source),
                    "-o",
                    str(binary),
                ],
                check=True,
            )
            repeats = "200" if args.quick else "2000"
            print(
                subprocess.run(
                    [str(binary), repeats], check=True, capture_output=True, text=True
                ).stdout
            )
    if not native_available():
        return
    tokens = prefix_requests(20)[0]
    engine = native_module().Engine(8, 0, "lru", False, BLOCK_SIZE)
    rows = []
    for name, call in (
        ("native `Engine.hash_tokens` (list of 144 ints out)", lambda: engine.hash_tokens(tokens)),
        (
            "`hashing.compute_block_hashes` (Python + xxhash)",
            lambda: hashing.compute_block_hashes(tokens, BLOCK_SIZE),
        ),
        (
            "`xxhash.xxh3_64_intdigest` of the 9,216 bytes, one call",
            lambda: __import__("xxhash").xxh3_64_intdigest(tokens.tobytes()),
        ),
    ):
        samples = []
        for _ in range(5 if args.quick else 20):
            start = time.perf_counter()
            for _ in range(200):
                call()
            samples.append((time.perf_counter() - start) / 200)
        rows.append([name, _fmt3(samples, 1e6)])
    print("From Python, one 2,304-token W2 prompt (144 blocks of 16 tokens), µs per call:\n")
    _table(["call", "µs min / median / max"], rows)


# --------------------------------------------------------------------------
# (c) eviction scaling, engine level
# --------------------------------------------------------------------------


def bench_eviction(args: argparse.Namespace) -> None:
    """The native engine's evict(1) with 10^3 to 10^6 cached blocks (no facade)."""
    if not native_available():
        print("(eviction: skipped, the native engine is not built)\n")
        return
    sizes = [10**3, 10**4, 10**5] if args.quick else [10**3, 10**4, 10**5, 10**6]
    repeats = 2_000 if args.quick else 20_000
    print("## (c) Native `Engine.evict(1)` against cached blocks (chains of 16)\n")
    print(
        f"ns per call, min / median / max over 10 rounds of {repeats:,} calls (at most half "
        "the cache); after each "
        "round the evicted blocks are registered as fresh one-block chains and released "
        "(untimed), so the number of cached blocks is the same at every round's start.\n"
    )
    rows, medians = [], []
    for size in sizes:
        engine = native_module().Engine(size + 1, 0, "lru", False, BLOCK_SIZE)
        ids = np.frombuffer(engine.allocate(size), dtype=np.int32)
        for start in range(0, size, 16):
            chain = ids[start : start + 16]
            engine.register(chain, list(range(start + 1, start + 1 + len(chain))))
        engine.release(ids)
        fresh = size + 1
        evict = engine.evict
        calls = min(repeats, size // 2)
        samples = []
        for _ in range(10):
            start = time.perf_counter()
            for _ in range(calls):
                evict(1)
            samples.append((time.perf_counter() - start) / calls)
            again = engine.allocate(calls)
            for block_id in again:
                engine.register([block_id], [fresh])
                fresh += 1
            engine.release(again)
        assert engine.num_cached == size and engine.find_problems() == []
        medians.append(statistics.median(samples))
        rows.append([f"{size:,}", _fmt3(samples, 1e9, 0), f"{engine.memory_bytes() / size:.0f}"])
    _table(["cached blocks", "evict(1) ns", "engine bytes/block"], rows)
    print(f"Median at {sizes[-1]:,} / at {sizes[0]:,}: {medians[-1] / medians[0]:.2f}x.\n")


def main() -> None:
    sections: dict[str, Callable[[argparse.Namespace], None]] = {
        "latency": bench_latency,
        "hashing": bench_hashing,
        "eviction": bench_eviction,
    }
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    for name, function in sections.items():
        parser.add_argument(f"--{name}", action="store_true", help=function.__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer requests and repeats")
    args = parser.parse_args()
    chosen = [f for name, f in sections.items() if getattr(args, name)] or list(sections.values())
    _environment()
    for function in chosen:
        start = time.perf_counter()
        function(args)
        print(f"({function.__name__[6:]}: {time.perf_counter() - start:.1f} s)\n")


if __name__ == "__main__":
    main()
