"""What collision verification costs: serving prompts with and without ``verify_prefix_hits``.

Each request of a W2-like stream (20 shared system prompts of 2,048 tokens, 256 unique tokens
each, block size 16) is served the way an engine does it: hash, match and acquire, allocate
the rest, register, release. Verify mode also computes the second fingerprint chain
(``fingerprint_tokens``) and checks it on every matched block. Both modes run interleaved in
one process; the report gives min/median/max requests/s after a warm-up and the ratio.

Run: ``python benchmarks/bench_verify.py [--requests 2000] [--rounds 5]``
"""

from __future__ import annotations

import argparse
import gc
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

try:
    import prefixcache
except ImportError:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import prefixcache
from prefixcache import KVBlockAllocator

BLOCK_SIZE = 16


def make_prompts(num_requests: int, seed: int = 2) -> list[np.ndarray]:
    """W2-like prompts: one of 20 system prompts, then 256 unique tokens."""
    rng = np.random.default_rng(seed)
    systems = [np.arange(1 + p * 2048, 1 + (p + 1) * 2048, dtype=np.int32) for p in range(20)]
    return [
        np.concatenate(
            [systems[rng.integers(20)], rng.integers(50_000, 150_000, 256, dtype=np.int32)]
        )
        for _ in range(num_requests)
    ]


def serve_all(prompts: list[np.ndarray], verify: bool) -> float:
    """Serve every prompt on a fresh allocator; return requests per second."""
    allocator = KVBlockAllocator(
        total_count=65_536, block_size_tokens=BLOCK_SIZE, device="cpu", verify_prefix_hits=verify
    )
    gc.collect()
    start = time.perf_counter()
    for tokens in prompts:
        hashes = allocator.hash_tokens(tokens)
        checks = allocator.fingerprint_tokens(tokens) if verify else None
        query = (len(tokens) - 1) // BLOCK_SIZE
        hit = allocator.match_prefix(
            hashes[:query], acquire=True, fingerprints=checks[:query] if verify else None
        )
        num_hit = len(hit)
        fresh = allocator.allocate_memory_blocks(len(hashes) - num_hit)
        allocator.register_kv_block_hashes(
            fresh,
            hashes[num_hit:],
            parent_hash=hashes[num_hit - 1] if num_hit else None,
            fingerprints=checks[num_hit:] if verify else None,
        )
        allocator.release_memory_blocks(hit)
        allocator.release_memory_blocks(fresh)
    return len(prompts) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print(
        f"machine: {platform.platform()}, {platform.processor() or '?'}; Python "
        f"{platform.python_version()}; torch {torch.__version__}; numpy {np.__version__}; "
        f"prefixcache {prefixcache.__version__}"
    )
    prompts = make_prompts(args.requests)
    serve_all(prompts[:200], False)
    serve_all(prompts[:200], True)
    rates: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.rounds):
        for verify in (False, True):
            rates[verify].append(serve_all(prompts, verify))
    print("\n| mode | req/s min | median | max |\n|---|---:|---:|---:|")
    for verify, label in ((False, "default"), (True, "verify_prefix_hits")):
        values = rates[verify]
        print(
            f"| {label} | {min(values):,.0f} | {statistics.median(values):,.0f} "
            f"| {max(values):,.0f} |"
        )
    ratio = statistics.median(rates[True]) / statistics.median(rates[False])
    print(f"\nverify / default (medians): {ratio:.2f}")


if __name__ == "__main__":
    main()
