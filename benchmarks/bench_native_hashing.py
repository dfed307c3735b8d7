"""Time the C++ XXH3-64 of the native engine against xxHash's own C implementation.

Run from the repository root::

    python benchmarks/bench_native_hashing.py            # ~1 min
    python benchmarks/bench_native_hashing.py --quick    # ~10 s

Compiles ``benchmarks/bench_xxh3.cpp`` (which includes
``prefixcache/engine/native/xxh3.h`` and ``block_hashing.h``) into a temporary
directory twice: with the extension's flags (``-O3 -std=c++17``: on x86 the
AVX2 kernel chosen at run time, else SSE2) and, where the CPU has AVX2, with
``-mavx2`` (every instruction VEX-encoded). Each
build times, in nanoseconds per call (min / median / max over interleaved
samples after a warm-up):

- ``prefixcache::xxh3_64`` inlined into the loop, and called through a
  function pointer (the call shape of a shared library), with the build's
  kernel, the portable scalar kernel and (run-time-dispatch build) SSE2;
- xxHash's ``XXH3_64bits_withSeed`` and ``XXH3_64bits_withSeed_dispatch``
  (runtime choice of SSE2/AVX2/AVX-512) from the shared objects found: the
  ``xxhash`` Python package's extension module (loaded after libpython, whose
  symbols it needs) and the system ``libxxhash``, when present;
- ``prefixcache::chain_block_hashes`` per block, over int32 and int64 tokens.

"chain" rows seed each call with the previous digest folded to 63 bits, as the
block-hash chain does; "independent" rows use one seed, so calls can overlap.
The program checks that every implementation returns our digests first. Not a
test: pytest never collects this file.
"""

from __future__ import annotations

import argparse
import ctypes.util
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import xxhash
from machine import cpu_model  # benchmarks/machine.py, beside this script

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "benchmarks" / "bench_xxh3.cpp"
NATIVE_DIR = ROOT / "prefixcache" / "engine" / "native"
BASE_FLAGS = ("-O3", "-std=c++17")  # as setup.py builds the extension


def _cpu_has_avx2() -> bool:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return any(line.startswith("flags") and " avx2" in line for line in cpuinfo)
    except OSError:
        return False


def _libraries() -> tuple[list[str], list[str]]:
    """``--lib``/``--preload`` arguments for the xxHash libraries found, and notes."""
    args: list[str] = []
    notes: list[str] = []
    module = Path(xxhash._xxhash.__file__)  # type: ignore[attr-defined]
    libpython = Path(sysconfig.get_config_var("LIBDIR") or "") / (
        sysconfig.get_config_var("LDLIBRARY") or ""
    )
    if sysconfig.get_config_var("Py_ENABLE_SHARED") and libpython.is_file():
        args += ["--preload", str(libpython), "--lib", f"xxhash-py={module}"]
    else:
        notes.append("xxhash package's module skipped: this Python has no shared libpython")
    system = ctypes.util.find_library("xxhash")
    if system:
        args += ["--lib", f"libxxhash={system}"]
    else:
        notes.append("system libxxhash not found")
    return args, notes


def _compile(compiler: str, flags: tuple[str, ...], out: Path) -> None:
    command = [compiler, *flags, f"-I{NATIVE_DIR}", str(SOURCE), "-o", str(out), "-ldl"]
    subprocess.run(command, check=True)


def _run(executable: Path, args: argparse.Namespace, libs: list[str]) -> list[list[str]]:
    command = [str(executable), *libs, "--sizes", args.sizes]
    command += ["--calls", str(args.calls), "--repeats", str(args.repeats)]
    result = subprocess.run(command, check=True, capture_output=True, text=True)
    rows = [line.split("\t") for line in result.stdout.splitlines()]
    return rows[1:]  # past the header


def _table(build: str, rows: list[list[str]]) -> list[str]:
    lines = [
        f"\n### build: {build}\n",
        "| implementation | bytes | pattern | min ns | median ns | max ns |",
        "| --- | ---: | --- | ---: | ---: | ---: |",
    ]
    lines += [f"| {' | '.join(row)} |" for row in rows]
    return lines


def _ratios(rows: list[list[str]]) -> list[str]:
    """Ours (called) against xxHash's dispatching call, min over min, per size and pattern."""
    lines: list[str] = []
    mins = {(r[0], r[1], r[2]): float(r[3]) for r in rows}
    for name, size, pattern in mins:
        if not name.endswith("XXH3_64bits_withSeed_dispatch"):
            continue
        ours = [
            v
            for (n, s, p), v in mins.items()
            if s == size
            and p == pattern
            and n.startswith("prefixcache xxh3_64 (")
            and "scalar" not in n
        ]
        if ours:
            best = min(ours)
            theirs = mins[(name, size, pattern)]
            lines.append(
                f"- {size} B {pattern}: ours {best:.2f} ns, {name} {theirs:.2f} ns, "
                f"ratio {best / theirs:.2f}"
            )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="64,1024", help="input bytes (default 64,1024)")
    parser.add_argument("--calls", type=int, default=200_000, help="calls per sample")
    parser.add_argument("--repeats", type=int, default=21, help="timed samples (default 21)")
    parser.add_argument("--quick", action="store_true", help="5 samples of 50,000 calls")
    parser.add_argument("--cxx", default=os.environ.get("CXX", "g++"), help="C++ compiler")
    args = parser.parse_args()
    if args.quick:
        args.calls, args.repeats = 50_000, 5
    if shutil.which(args.cxx) is None:
        sys.exit(f"no C++ compiler {args.cxx!r} on PATH")
    compiler_version = subprocess.run(
        [args.cxx, "--version"], capture_output=True, text=True, check=True
    ).stdout.splitlines()[0]
    libs, notes = _libraries()
    print(f"CPU: {cpu_model()} ({os.cpu_count()} logical CPUs), {platform.system()}")
    print(f"Python {platform.python_version()}, compiler: {compiler_version}")
    print(f"xxhash package {xxhash.VERSION} (xxHash {xxhash.XXHASH_VERSION})")
    print(f"libraries: {' '.join(libs) or 'none'}")
    for note in notes:
        print(f"note: {note}")
    builds: dict[str, tuple[str, ...]] = {"-O3 (the extension's flags)": BASE_FLAGS}
    if _cpu_has_avx2():
        builds["-O3 -mavx2"] = (*BASE_FLAGS, "-mavx2")
    with tempfile.TemporaryDirectory() as tmp:
        for index, (build, flags) in enumerate(builds.items()):
            executable = Path(tmp) / f"bench_xxh3_{index}"
            _compile(args.cxx, flags, executable)
            rows = _run(executable, args, libs)
            print("\n".join(_table(build, rows)))
            print("\nours (best kernel, called or inlined) / xxHash dispatch, min ns:")
            print("\n".join(_ratios(rows)) or "- (no xxHash library)")
    print(f"\nsamples: {args.repeats} x {args.calls} calls after a warm-up, interleaved")


if __name__ == "__main__":
    main()
