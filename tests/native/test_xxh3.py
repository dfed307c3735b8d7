"""The C++ XXH3-64 and block-hash chain are bit-identical to their Python references.

``prefixcache/engine/native/xxh3.h`` is our own XXH3-64 (issue 14: no vendored
source); ``block_hashing.h`` chains it as ``prefixcache.engine.hashing`` does.
A module fixture compiles ``xxh3_check.cpp`` (a stdin/stdout driver over both
headers) with ``g++ -O2`` into a temporary directory, once with AddressSanitizer
and UndefinedBehaviorSanitizer where the toolchain has them (so a read past the
input fails the test), and once with ``-mavx2`` (the base build reaches AVX2 through its run-time
dispatch). Every kernel compiled in (scalar, SSE2, AVX2, the stripe-source
path) must give
``xxhash.xxh3_64_intdigest(data, seed=seed)`` for every length class
(0, 1-3, 4-8, 9-16, 17-128, 129-240, > 240 with whole and partial 1,024-byte
blocks) and every seed. When the extension ``prefixcache.engine._native``
exposes ``xxh3_64``, the same comparison runs through it.

Skipped, with the reason, when there is no C++ compiler.
"""

from __future__ import annotations

import importlib
import os
import platform
import random
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from prefixcache.engine.hashing import compute_block_hashes, root_hash
from prefixcache.errors import InvalidArgumentError

NATIVE_DIR = Path(__file__).resolve().parents[2] / "prefixcache" / "engine" / "native"
CHECK_SOURCE = Path(__file__).with_name("xxh3_check.cpp")
CXX_FLAGS = ("-O2", "-std=c++17", "-Wall", "-Wextra", "-Werror")
SANITIZE = ("-fsanitize=address,undefined", "-fno-sanitize-recover=all")

U64_MAX = (1 << 64) - 1
MAX_HASH = (1 << 63) - 1
INT32_MIN, INT32_MAX = -(1 << 31), (1 << 31) - 1
# Lengths on both sides of every class boundary of XXH3-64, and of the long
# path's 64-byte stripes and 1,024-byte blocks (scramble after each block).
BOUNDARY_LENGTHS = sorted(
    {n + d for n in (0, 4, 8, 16, 32, 64, 96, 128, 240) for d in (-1, 0, 1) if n + d >= 0}
    | {n + d for n in (256, 1024, 1088, 2048, 3072) for d in (-1, 0, 1)}
    | {1, 2, 3, 143, 144, 145, 1025 + 15 * 64}
)
EDGE_SEEDS = (0, 1, 2, (1 << 32) - 1, 1 << 32, MAX_HASH, 1 << 63, U64_MAX)
# ChainError codes of block_hashing.h.
ZERO_BLOCK_SIZE, PARENT_OUT_OF_RANGE, TOKEN_OUT_OF_RANGE = 1, 2, 3


class Driver:
    """A running xxh3_check program: one request line in, one answer line out."""

    def __init__(self, executable: Path) -> None:
        self._process = subprocess.Popen(
            [str(executable)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def ask(self, request: str) -> str:
        """Send one request; return its answer (fails the test if the program died)."""
        return self.ask_many([request])[0]

    def ask_many(self, requests: Sequence[str]) -> list[str]:
        """Send requests in chunks small enough that neither pipe fills up."""
        process = self._process
        assert process.stdin is not None and process.stdout is not None
        answers: list[str] = []
        for start in range(0, len(requests), 64):
            chunk = requests[start : start + 64]
            process.stdin.write("".join(r + "\n" for r in chunk))
            process.stdin.flush()
            for _ in chunk:
                line = process.stdout.readline()
                if not line:
                    process.wait(timeout=10)
                    stderr = process.stderr.read() if process.stderr else ""
                    pytest.fail(f"xxh3_check died (exit {process.returncode}):\n{stderr}")
                answers.append(line.rstrip("\n"))
        return answers

    def close(self) -> None:
        """Close stdin and wait for the program to exit."""
        try:
            if self._process.stdin is not None:
                self._process.stdin.close()
        except BrokenPipeError:  # it died already; the failing test has said why
            pass
        self._process.wait(timeout=10)


def _compile_all(out_dir: Path) -> dict[str, Path]:
    """Build the drivers (two at a time); return the ones that compiled, base build first."""
    compiler = os.environ.get("CXX", "g++")
    if shutil.which(compiler) is None:
        pytest.skip(f"no C++ compiler ({compiler!r} not on PATH): cannot build xxh3_check.cpp")
    common = (*CXX_FLAGS, f"-I{NATIVE_DIR}", str(CHECK_SOURCE), "-o")

    def start(name: str, flags: tuple[str, ...]) -> subprocess.Popen[str]:
        command = [compiler, *flags, *common, str(out_dir / name)]
        return subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )

    def finish(process: subprocess.Popen[str]) -> tuple[bool, str]:
        output, _ = process.communicate(timeout=300)
        return process.returncode == 0, output

    # The avx2 build fails to compile off x86; the sanitized one where the
    # toolchain lacks the sanitizer runtimes: then a plain build stands in.
    sanitized, avx2 = start("sanitized", SANITIZE), start("avx2", ("-mavx2",))
    built: dict[str, Path] = {}
    ok, _ = finish(sanitized)
    if ok:
        built["sanitized"] = out_dir / "sanitized"
    else:
        ok, output = finish(start("plain", ()))
        if not ok:
            pytest.fail(f"xxh3_check.cpp does not compile:\n{output}")
        built["plain"] = out_dir / "plain"
    if finish(avx2)[0]:
        built["avx2"] = out_dir / "avx2"
    return built


@pytest.fixture(scope="module")
def drivers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[tuple[Driver, str]]]:
    """(driver, kernel) pairs: every kernel of every build that runs on this CPU."""
    built = _compile_all(tmp_path_factory.mktemp("xxh3_check"))
    running: list[Driver] = []
    pairs: list[tuple[Driver, str]] = []
    for name, executable in built.items():
        driver = Driver(executable)
        running.append(driver)
        kernels = driver.ask("kernels")
        if kernels == "no-avx2":
            continue
        if name == "avx2":
            kernels = "avx2 source"  # the rest is covered by the base build
        pairs += [(driver, kernel) for kernel in kernels.split()]
    yield pairs
    for driver in running:
        driver.close()


@pytest.fixture(scope="module")
def driver(drivers: list[tuple[Driver, str]]) -> Driver:
    """The base build's driver (sanitized where possible)."""
    return drivers[0][0]


def _hash_requests(data: bytes, seed: int, skew: int, kernels: Sequence[str]) -> list[str]:
    return [f"x {kernel} {seed} {skew} {data.hex()}" for kernel in kernels]


def _check_hashes(
    drivers: list[tuple[Driver, str]], cases: Sequence[tuple[bytes, int, int]]
) -> None:
    """Every (data, seed, skew) case through every kernel equals xxhash's digest."""
    by_driver: dict[Driver, list[str]] = {}
    for driver, kernel in drivers:
        by_driver.setdefault(driver, []).append(kernel)
    for driver, kernels in by_driver.items():
        requests = [r for d, s, k in cases for r in _hash_requests(d, s, k, kernels)]
        answers = iter(driver.ask_many(requests))
        for data, seed, skew in cases:
            want = xxhash.xxh3_64_intdigest(data, seed=seed)
            for kernel in kernels:
                got = next(answers)
                if got == "na":  # int32 source on a length that is not 4k
                    assert kernel == "int32" and len(data) % 4
                    continue
                assert int(got) == want, (
                    f"kernel {kernel}: len {len(data)} seed {seed} skew {skew}: {got} != {want}"
                )


# --------------------------------------------------------------------------
# XXH3-64
# --------------------------------------------------------------------------


@pytest.mark.slow  # the full suite (--full)
def test_drivers_cover_the_kernels(drivers: list[tuple[Driver, str]]) -> None:
    kernels = {kernel for _, kernel in drivers}
    assert {"default", "scalar", "source", "int32"} <= kernels
    if platform.machine().lower() in ("x86_64", "amd64"):
        assert "sse2" in kernels
    if _cpu_flags() & {"avx2"}:
        # The base build (no -mavx2) chooses AVX2 at run time: it lists it itself.
        base_kernels = {kernel for driver, kernel in drivers if driver is drivers[0][0]}
        assert "avx2" in base_kernels


def _cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def test_every_length_to_2100_with_edge_seeds(drivers: list[tuple[Driver, str]]) -> None:
    rng = random.Random(14)
    data = rng.randbytes(2100)
    cases = [(data[:n], EDGE_SEEDS[n % len(EDGE_SEEDS)], n % 8) for n in range(2101)]
    cases += [(data[:n], seed, 0) for n in BOUNDARY_LENGTHS for seed in EDGE_SEEDS]
    _check_hashes(drivers, cases)


def test_patterned_inputs(drivers: list[tuple[Driver, str]]) -> None:
    # All-zero and all-0xff bytes push the multiply-fold and scramble to their edges.
    cases = [
        (bytes([fill]) * n, seed, 0)
        for fill in (0, 0xFF)
        for n in BOUNDARY_LENGTHS
        for seed in (0, U64_MAX)
    ]
    _check_hashes(drivers, cases)


@st.composite
def _inputs(draw: st.DrawFn) -> tuple[bytes, int, int]:
    length = draw(st.one_of(st.sampled_from(BOUNDARY_LENGTHS), st.integers(0, 2100)))
    data = draw(st.binary(min_size=length, max_size=length))
    seed = draw(st.one_of(st.sampled_from(EDGE_SEEDS), st.integers(0, U64_MAX)))
    return data, seed, draw(st.integers(0, 7))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=_inputs())
def test_matches_xxhash(drivers: list[tuple[Driver, str]], case: tuple[bytes, int, int]) -> None:
    _check_hashes(drivers, [case])


@settings(max_examples=200, deadline=None)
@given(a=st.integers(0, U64_MAX), b=st.integers(0, U64_MAX))
def test_mul128_fold(driver: Driver, a: int, b: int) -> None:
    product = a * b
    want = (product & U64_MAX) ^ (product >> 64)
    native, portable = map(int, driver.ask(f"mul {a} {b}").split())
    assert native == want
    assert portable == want


def _native_module() -> object:
    try:
        module = importlib.import_module("prefixcache.engine._native")
    except ImportError as error:
        pytest.skip(f"prefixcache.engine._native is not built ({error})")
    if not hasattr(module, "xxh3_64"):
        pytest.skip("prefixcache.engine._native does not expose xxh3_64")
    return module


@settings(max_examples=200, deadline=None)
@given(case=_inputs())
def test_extension_matches_xxhash(case: tuple[bytes, int, int]) -> None:
    module = _native_module()
    data, seed, _ = case
    assert module.xxh3_64(data, seed) == xxhash.xxh3_64_intdigest(data, seed=seed)  # type: ignore[attr-defined]


def test_extension_default_root() -> None:
    module = _native_module()
    if not hasattr(module, "default_root"):
        pytest.skip("prefixcache.engine._native does not expose default_root")
    assert module.default_root() == root_hash()


# --------------------------------------------------------------------------
# Block-hash chains
# --------------------------------------------------------------------------


def _chain(driver: Driver, width: int, tokens: Sequence[int], block_size: int, parent: int) -> str:
    words = " ".join(map(str, tokens))
    return driver.ask(f"c{width} {parent} {block_size} {len(tokens)} {words}")


def _chain_hashes(
    driver: Driver, width: int, tokens: Sequence[int], block_size: int, parent: int
) -> list[int]:
    status, *hashes = _chain(driver, width, tokens, block_size, parent).split()
    assert status == "ok", status
    return [int(h) for h in hashes]


def test_default_root(driver: Driver) -> None:
    assert int(driver.ask("root")) == root_hash()


@st.composite
def _chains(draw: st.DrawFn) -> tuple[list[int], int, int]:
    # Block sizes across the hash's classes: 1-4 tokens (4-16 bytes), up to 32
    # (128), up to 60 (240), then the long path with one or more 1,024-byte blocks.
    block_size = draw(
        st.one_of(st.integers(1, 70), st.sampled_from((128, 255, 256, 257, 512, 600)))
    )
    num_tokens = draw(st.integers(0, min(4 * block_size + 3, 1500)))
    # Token values from a drawn seed (drawing 1,500 list elements one by one is
    # slow), a tenth of them the int32 extremes and -1.
    rng = random.Random(draw(st.integers(0, U64_MAX)))
    specials = (INT32_MIN, INT32_MAX, -1, 0)
    tokens = [
        rng.choice(specials) if rng.random() < 0.1 else rng.randint(INT32_MIN, INT32_MAX)
        for _ in range(num_tokens)
    ]
    parent = draw(
        st.one_of(st.just(root_hash()), st.sampled_from((1, MAX_HASH)), st.integers(1, MAX_HASH))
    )
    return tokens, block_size, parent


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=_chains())
def test_chain_matches_compute_block_hashes(
    drivers: list[tuple[Driver, str]], case: tuple[list[int], int, int]
) -> None:
    tokens, block_size, parent = case
    want = compute_block_hashes(tokens, block_size, parent=parent)
    for driver in {d for d, _ in drivers}:
        assert _chain_hashes(driver, 32, tokens, block_size, parent) == want
        assert _chain_hashes(driver, 64, tokens, block_size, parent) == want


def test_chain_of_large_blocks(driver: Driver) -> None:
    # 5,000-token blocks (20,000 bytes: 19 scrambles each) continue a chain.
    rng = random.Random(7)
    tokens = [rng.randint(INT32_MIN, INT32_MAX) for _ in range(3 * 5000 + 17)]
    head = compute_block_hashes(tokens[:5000], 5000)
    want = compute_block_hashes(tokens, 5000)
    assert _chain_hashes(driver, 64, tokens[5000:], 5000, head[-1]) == want[1:]
    assert _chain_hashes(driver, 32, tokens, 5000, root_hash()) == want


def test_chain_folds_to_63_bits(driver: Driver) -> None:
    tokens = list(range(64 * 16))
    hashes = _chain_hashes(driver, 32, tokens, 16, MAX_HASH)
    assert hashes == compute_block_hashes(tokens, 16, parent=MAX_HASH)
    assert all(1 <= h <= MAX_HASH for h in hashes)


@pytest.mark.parametrize("width", [32, 64])
def test_chain_refuses_zero_block_size(driver: Driver, width: int) -> None:
    assert _chain(driver, width, [1, 2, 3], 0, 5) == f"err {ZERO_BLOCK_SIZE} 0"
    with pytest.raises(InvalidArgumentError):
        compute_block_hashes([1, 2, 3], 0, parent=5)


@pytest.mark.parametrize("width", [32, 64])
@pytest.mark.parametrize("parent", [0, MAX_HASH + 1, U64_MAX])
def test_chain_refuses_parent_outside_63_bits(driver: Driver, width: int, parent: int) -> None:
    assert _chain(driver, width, [1, 2, 3], 1, parent) == f"err {PARENT_OUT_OF_RANGE} 0"
    with pytest.raises(InvalidArgumentError):
        compute_block_hashes([1, 2, 3], 1, parent=parent)


@pytest.mark.parametrize("bad", [INT32_MAX + 1, INT32_MIN - 1, -(1 << 63), (1 << 63) - 1])
@pytest.mark.parametrize("index", [0, 5, 9])
def test_chain_refuses_int64_token_outside_int32(driver: Driver, bad: int, index: int) -> None:
    # Index 9 is in the trailing partial block: checked too, as in Python.
    tokens = list(range(10))
    tokens[index] = bad
    assert _chain(driver, 64, tokens, 4, 5) == f"err {TOKEN_OUT_OF_RANGE} {index}"
    with pytest.raises(InvalidArgumentError, match=f"index {index}"):
        compute_block_hashes(tokens, 4, parent=5)


@pytest.mark.parametrize("index", [0, 255, 256, 300, 511, 512, 767, 768, 1000, 1022])
def test_chain_finds_the_first_bad_int64_token_past_the_vector_chunks(
    driver: Driver, index: int
) -> None:
    # The range check tests 256 tokens at a time, then the tail one by one.
    tokens = [INT32_MAX] * 1023
    tokens[index] = INT32_MAX + 1
    tokens[-1] = INT32_MIN - 1  # a later bad token must not be the one reported
    expected = index if index < 1022 else 1022
    assert _chain(driver, 64, tokens, 16, 5) == f"err {TOKEN_OUT_OF_RANGE} {expected}"


@pytest.mark.parametrize("block_size", [1, 3, 341, 512, 1023, 1024, 1025, 2048])
def test_chain_around_the_int64_chunk_size(driver: Driver, block_size: int) -> None:
    # int64 blocks of up to 1,024 tokens are narrowed into a 4 KiB buffer,
    # several blocks at a time when they fit; longer ones 64 bytes at a time.
    rng = random.Random(block_size)
    tokens = [rng.randint(INT32_MIN, INT32_MAX) for _ in range(3 * max(block_size, 1024) + 5)]
    want = compute_block_hashes(tokens, block_size)
    assert _chain_hashes(driver, 64, tokens, block_size, root_hash()) == want
    assert _chain_hashes(driver, 32, tokens, block_size, root_hash()) == want
