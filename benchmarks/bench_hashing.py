"""Time chained block hashing: prefixcache against the raw-hash floor and against peers.

Run from the repository root::

    PYTHONPATH=. python benchmarks/bench_hashing.py            # full run
    PYTHONPATH=. python benchmarks/bench_hashing.py --quick    # ~10 s; ~40 s with peers

Reports nanoseconds per token, min / median / max over the timed samples after
a warm-up, for prompts of 1k, 32k and 128k tokens at block sizes 16 and 256:

- prefixcache ``compute_block_hashes`` with xxh3_64, xxh3_128 and sha256, fed
  a list (what vLLM holds), an int64 tensor (what Megatron-core holds) and an
  int32 numpy array;
- the floor: one ``xxhash.xxh3_64_intdigest`` call over the whole int32 buffer;
- Megatron-core ``compute_block_hashes_batched`` and vLLM's request block
  hasher (``get_request_block_hasher`` -> ``hash_block_tokens``, pickle +
  SHA-256), when they are importable; otherwise they are skipped.

The "variants" section times the alternatives the implementation chose between,
so the speed claims in prefixcache/hashing.py can be checked here.

Each sample runs enough calls to hash at least ``--sample-tokens`` tokens; the
garbage collector is off while samples run (as in ``timeit``). Not a test: pytest
never collects this file.
"""

from __future__ import annotations

import argparse
import array
import functools
import gc
import importlib.metadata
import os
import platform
import statistics
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import xxhash
from machine import cpu_model  # benchmarks/machine.py, beside this script

from prefixcache.engine import hashing as hashing_module
from prefixcache.engine.hashing import compute_block_hashes

try:
    import resource
except ImportError:  # not on Windows; page-fault counts are then left out
    resource = None  # type: ignore[assignment]

PROMPT_TOKENS = (1024, 32 * 1024, 128 * 1024)
BLOCK_SIZES = (16, 256)
VARIANT_BLOCK_SIZES = (16, 64, 256, 1024)
MASK63 = (1 << 63) - 1

Hasher = Callable[[], object]


@dataclass(frozen=True)
class Candidate:
    """One hashing implementation: ``make(tokens, block_size)`` prepares the
    input (untimed) and returns the zero-argument call that is timed."""

    name: str
    input_kind: str
    make: Callable[[list[int], int], Hasher]
    hashes_blocks: bool = True  # False for the floor, which returns one digest


@dataclass(frozen=True)
class Timing:
    """Nanoseconds per unit (token or call) over the timed samples."""

    low: float
    median: float
    high: float
    faults_per_call: float | None = None


# --------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt if resource else 0


def measure(
    fn: Hasher, units_per_call: int, repeats: int, warmup: int, sample_units: int
) -> Timing:
    """Time ``fn``; each sample makes enough calls to cover ``sample_units`` units."""
    calls = max(1, sample_units // units_per_call)
    for _ in range(warmup):
        fn()
    samples = []
    gc.collect()
    gc.disable()
    faults_before = _minor_faults()
    try:
        for _ in range(repeats):
            start = time.perf_counter_ns()
            for _ in range(calls):
                fn()
            samples.append((time.perf_counter_ns() - start) / (calls * units_per_call))
    finally:
        gc.enable()
    faults = (_minor_faults() - faults_before) / (repeats * calls) if resource else None
    return Timing(min(samples), statistics.median(samples), max(samples), faults)


# --------------------------------------------------------------------------
# Candidates
# --------------------------------------------------------------------------


def _floor(tokens: list[int], block_size: int) -> Hasher:
    buffer = np.asarray(tokens, dtype="<i4").tobytes()
    return lambda: xxhash.xxh3_64_intdigest(buffer)


def _ours(algo: str, kind: str) -> Callable[[list[int], int], Hasher]:
    def make(tokens: list[int], block_size: int) -> Hasher:
        data: object = tokens
        if kind == "int64 tensor":
            import torch

            data = torch.tensor(tokens, dtype=torch.int64)
        elif kind == "int32 numpy":
            data = np.asarray(tokens, dtype=np.int32)
        return lambda: compute_block_hashes(data, block_size, algo=algo)  # type: ignore[arg-type]

    return make


def prefixcache_candidates() -> list[Candidate]:
    found = [Candidate("floor: one xxh3_64 call, whole buffer", "int32 bytes", _floor, False)]
    for kind in ("list", "int64 tensor", "int32 numpy"):
        found.append(Candidate("prefixcache xxh3_64", kind, _ours("xxh3_64", kind)))
    for algo in ("xxh3_128", "sha256"):
        found.append(Candidate(f"prefixcache {algo}", "list", _ours(algo, "list")))
    return found


def megatron_candidates() -> tuple[list[Candidate], str | None]:
    try:
        import torch
        from megatron.core.inference.inference_request import compute_block_hashes_batched
    except (ImportError, OSError, RuntimeError, AttributeError) as exc:  # skip this peer
        return [], f"megatron-core skipped: {type(exc).__name__}: {exc}"[:200]
    version = importlib.metadata.version("megatron-core")

    def make(tokens: list[int], block_size: int) -> Hasher:
        data = torch.tensor(tokens, dtype=torch.int64)
        return lambda: compute_block_hashes_batched(data, block_size)

    name = f"megatron-core {version} compute_block_hashes_batched (sha256)"
    return [Candidate(name, "int64 tensor", make)], None


def vllm_candidates() -> tuple[list[Candidate], str | None]:
    try:
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core import kv_cache_utils
    except (ImportError, OSError, RuntimeError, AttributeError) as exc:  # skip this peer
        return [], f"vllm skipped: {type(exc).__name__}: {exc}"[:200]
    version = importlib.metadata.version("vllm")

    def make(tokens: list[int], block_size: int) -> Hasher:
        hash_fn = get_hash_fn_by_name("sha256")
        kv_cache_utils.init_none_hash(hash_fn)
        hasher = kv_cache_utils.get_request_block_hasher(block_size, hash_fn)

        def run() -> object:
            # The attributes of vllm.v1.request.Request the hasher reads: a plain
            # text request (no multimodal inputs, LoRA, salt or prompt embeds).
            request = SimpleNamespace(
                all_token_ids=tokens,
                num_tokens=len(tokens),
                block_hashes=[],
                mm_features=[],
                lora_request=None,
                cache_salt=None,
                prompt_embeds=None,
            )
            return hasher(request)

        return run

    name = f"vllm {version} get_request_block_hasher (pickle + sha256)"
    return [Candidate(name, "list", make)], None


# --------------------------------------------------------------------------
# Variants behind the choices in prefixcache/hashing.py
# --------------------------------------------------------------------------


def _split_variants(block_size: int) -> dict[str, Callable[[np.ndarray], list[int]]]:
    """Ways to cut the int32 buffer into blocks and chain xxh3_64 through them."""
    step = 4 * block_size
    block_dtype = np.dtype((np.void, step))
    digest = xxhash.xxh3_64_intdigest

    def memoryview_slices(tokens: np.ndarray) -> list[int]:
        view = tokens.view(np.uint8).data
        h = 1
        return [
            (h := digest(view[o : o + step], h) & MASK63 or 1) for o in range(0, len(view), step)
        ]

    def numpy_split_loop(tokens: np.ndarray, chunk_bytes: int) -> list[int]:
        hashes: list[int] = []
        append = hashes.append
        h = 1
        num_blocks = len(tokens) // block_size
        chunk = max(1, chunk_bytes // step)
        for start in range(0, num_blocks, chunk):
            count = min(chunk, num_blocks - start)
            blocks = np.frombuffer(tokens, dtype=block_dtype, count=count, offset=start * step)
            for block in blocks.tolist():
                h = digest(block, h) & MASK63 or 1
                append(h)
        return hashes

    def numpy_split_comprehension(tokens: np.ndarray, chunk_bytes: int) -> list[int]:
        hashes: list[int] = []
        h = 1
        num_blocks = len(tokens) // block_size
        chunk = max(1, chunk_bytes // step)
        for start in range(0, num_blocks, chunk):
            count = min(chunk, num_blocks - start)
            blocks = np.frombuffer(tokens, dtype=block_dtype, count=count, offset=start * step)
            hashes += [(h := digest(block, h) & MASK63 or 1) for block in blocks.tolist()]
        return hashes

    return {
        "memoryview slice per block": memoryview_slices,
        "numpy split, loop + bound append": lambda t: numpy_split_loop(t, 1 << 18),
        "numpy split, := comprehension": lambda t: numpy_split_comprehension(t, 1 << 18),
        "shipped: compute_block_hashes": lambda t: compute_block_hashes(t, block_size, parent=1),
    }


# A minimal interpreter, as a serving process has when its first long prompt
# arrives: page faults depend on the heap's history, so the bench's own imports
# must not be there.
_CHUNKING_CHILD = """
import gc, resource, sys, time
import numpy as np
from prefixcache.engine import hashing
block_size, chunk_bytes, repeats, warmup = map(int, sys.argv[1:])
hashing._CHUNK_BYTES = chunk_bytes  # the knob under test
tokens = np.random.default_rng(1).integers(0, 150_000, 128 * 1024).astype(np.int32)
for _ in range(warmup):
    hashing.compute_block_hashes(tokens, block_size)
gc.disable()
samples = []
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(repeats):
    start = time.perf_counter_ns()
    hashing.compute_block_hashes(tokens, block_size)
    samples.append((time.perf_counter_ns() - start) / len(tokens))
faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / repeats
samples.sort()
print(samples[0], samples[len(samples) // 2], samples[-1], faults)
"""


def fresh_process_chunking(args: argparse.Namespace) -> list[str]:
    """Chunked against one-pass splitting, each configuration in a new interpreter."""
    if resource is None:
        return []
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(hashing_module.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    rows = []
    for block_size in (16, 64):
        for label, chunk_bytes in (("shipped 256 KiB chunks", 1 << 18), ("one pass", 1 << 40)):
            cmd = [sys.executable, "-c", _CHUNKING_CHILD, str(block_size), str(chunk_bytes)]
            cmd += [str(max(args.repeats, 5)), str(args.warmup)]
            done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
            config = f"128k int32, bs {block_size}"
            if done.returncode != 0:
                rows.append(f"| fresh process: {label} | {config} | failed | | | |")
                continue
            low, median, high, faults = (float(x) for x in done.stdout.split())
            rows.append(_row(f"fresh process: {label}", config, Timing(low, median, high, faults)))
    return rows


def _list_to_int32_variants() -> dict[str, Callable[[list[int]], object]]:
    return {
        'array.array("i", tokens)': lambda t: array.array("i", t),
        "np.fromiter(tokens, int32)": lambda t: np.fromiter(t, dtype=np.int32, count=len(t)),
        "np.array(tokens, dtype=int32)": lambda t: np.array(t, dtype=np.int32),
        'struct.pack(f"<{n}i", *tokens)': lambda t: struct.pack(f"<{len(t)}i", *t),
        'shipped: struct.Struct(f"<{n}i").pack(*tokens)': lambda t: struct.Struct(
            f"<{len(t)}i"
        ).pack(*t),
    }


def _range_check_variants() -> dict[str, Callable[[np.ndarray], object]]:
    def min_max_then_cast(a: np.ndarray) -> object:
        if int(a.min()) < -(2**31) or int(a.max()) > 2**31 - 1:
            raise ValueError("out of range")
        return a.astype("<i4")

    variants: dict[str, Callable[[np.ndarray], object]] = {
        "min() + max(), then astype": min_max_then_cast
    }
    try:
        np.zeros(1, dtype=np.int64).astype(np.int32, casting="same_value")
        variants['shipped: astype(casting="same_value")'] = lambda a: a.astype(
            "<i4", casting="same_value"
        )
    except (TypeError, ValueError):
        pass  # numpy < 2.4: the shipped code falls back to min() + max()
    return variants


def run_variants(args: argparse.Namespace, tokens: list[int]) -> list[str]:
    rows = ["| variant | input | ns/token min | median | max | page faults/call |"]
    rows.append("|---|---|---:|---:|---:|---:|")
    big = np.asarray(tokens, dtype=np.int32)
    for block_size in VARIANT_BLOCK_SIZES:
        variants = _split_variants(block_size)
        expected = variants["shipped: compute_block_hashes"](big)
        for name, fn in variants.items():
            assert fn(big) == expected, name
            t = measure(functools.partial(fn, big), len(big), args.repeats, args.warmup, len(big))
            rows.append(_row(f"split: {name}", f"{len(big) // 1024}k int32, bs {block_size}", t))
    variants = _split_variants(16)
    for num_blocks in (1, 8, 32):
        few = big[: 16 * num_blocks]
        for name in ("memoryview slice per block", "numpy split, := comprehension"):
            fn = variants[name]
            t = measure(functools.partial(fn, few), 1, args.repeats, args.warmup, 20_000)
            rows.append(_row(f"split: {name} (ns/call)", f"{num_blocks} x 16 tokens", t))
    for name, convert in _list_to_int32_variants().items():
        t = measure(
            functools.partial(convert, tokens), len(tokens), args.repeats, args.warmup, len(tokens)
        )
        rows.append(_row(f"list -> int32: {name}", f"{len(tokens) // 1024}k list", t))
    decode = np.asarray(tokens[:16], dtype=np.int64)
    for name, check in _range_check_variants().items():
        t = measure(functools.partial(check, decode), 1, args.repeats, args.warmup, 20_000)
        rows.append(_row(f"int64 range check: {name} (ns/call)", "16 int64", t))
    return rows


def run_decode_calls(args: argparse.Namespace, candidates: list[Candidate]) -> list[str]:
    """Per-call cost of hashing one new block of 16 tokens, as after decode."""
    rows = ["| implementation | input | ns/call min | median | max |", "|---|---|---:|---:|---:|"]
    block = list(range(1000, 1016))
    for cand in candidates:
        if not cand.hashes_blocks:
            continue
        fn = cand.make(block, 16)
        t = measure(fn, 1, args.repeats, args.warmup, 20_000)
        rows.append(
            f"| {cand.name} | {cand.input_kind} | {t.low:,.0f} | {t.median:,.0f} | {t.high:,.0f} |"
        )
    return rows


# --------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------


def _row(name: str, config: str, t: Timing) -> str:
    faults = "" if t.faults_per_call is None else f"{t.faults_per_call:.0f}"
    return f"| {name} | {config} | {t.low:.2f} | {t.median:.2f} | {t.high:.2f} | {faults} |"


def _version(module: str) -> str:
    try:
        return importlib.metadata.version(module)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def print_machine() -> None:
    print(f"- machine: {platform.platform()}; {cpu_model()}; {os.cpu_count()} CPUs")
    print(f"- python {platform.python_version()} ({sys.executable})")
    print(
        f"- torch {_version('torch')}, numpy {np.__version__}, xxhash {xxhash.VERSION}, "
        f"megatron-core {_version('megatron-core')}, vllm {_version('vllm')}"
    )


def run_main_table(args: argparse.Namespace, candidates: list[Candidate]) -> list[str]:
    rows = [
        "| implementation | input | prompt tokens | block size | ns/token min | median | max |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    rng = np.random.default_rng(0)
    for num_tokens in PROMPT_TOKENS:
        tokens = rng.integers(0, 150_000, num_tokens).tolist()
        for block_size in BLOCK_SIZES:
            for cand in candidates:
                fn = cand.make(tokens, block_size)
                if cand.hashes_blocks:  # sanity: one hash per full block, untimed
                    assert len(fn()) == num_tokens // block_size, cand.name  # type: ignore[arg-type]
                t = measure(fn, num_tokens, args.repeats, args.warmup, args.sample_tokens)
                rows.append(
                    f"| {cand.name} | {cand.input_kind} | {num_tokens:,} | {block_size} | "
                    f"{t.low:.2f} | {t.median:.2f} | {t.high:.2f} |"
                )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 samples, 1 warm-up, short samples")
    parser.add_argument("--repeats", type=int, default=11, help="timed samples (default 11)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls first (default 2)")
    parser.add_argument(
        "--sample-tokens", type=int, default=1 << 18, help="tokens hashed per sample"
    )
    parser.add_argument("--no-peers", action="store_true", help="skip Megatron-core and vLLM")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.warmup, args.sample_tokens = 3, 1, 1 << 15

    print("# Block hashing benchmark\n")
    print_machine()
    print(
        f"- {args.repeats} samples after {args.warmup} warm-up calls, >= {args.sample_tokens:,} "
        "tokens per sample, gc off while timing\n"
    )

    # Variants first, in a young process: page faults depend on the heap's history.
    variant_tokens = np.random.default_rng(1).integers(0, 150_000, 128 * 1024).tolist()
    variant_rows = run_variants(args, variant_tokens) + fresh_process_chunking(args)

    candidates = prefixcache_candidates()
    notes = []
    if not args.no_peers:
        for finder in (megatron_candidates, vllm_candidates):
            found, note = finder()
            candidates += found
            if note:
                notes.append(note)
    print("## Whole prompts\n")
    print("\n".join(run_main_table(args, candidates)))
    for note in notes:
        print(f"\n{note}")
    print("\n## One new block of 16 tokens per call (decode)\n")
    print("\n".join(run_decode_calls(args, candidates)))
    print("\n## Variants (behind the choices in prefixcache/hashing.py)\n")
    print("\n".join(variant_rows))


if __name__ == "__main__":
    main()
