"""W1-W3 of ``../shared/bench/WORKLOADS.md``, generated here from the spec's text.

The spec fixes a SplitMix64 generator per workload and the exact order of its
draws, so every library sees the same operations. This module turns the spec
into plain data, untimed:

- :func:`churn_ops`: W1's operations, ``("A", k)`` (allocate ``k`` blocks for a
  new request) or ``("R", i)`` (release ``live[i]``, then swap-remove it).
- :func:`prefix_requests`: W2/W3's prompts, a system prompt of 2,048 tokens
  followed by 256 unique tokens, as lists of ints (each library converts them
  to its own input, untimed).
- :func:`check_vectors`: the spec's test vectors; an empty list means the
  generators match the reference harness draw for draw.

``scale`` shortens a workload (``N`` operations, ``R`` requests) and keeps its
pool, as the reference harness's ``--scale`` does.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass

MASK64 = (1 << 64) - 1
BLOCK_SIZE = 16

# W1: allocator churn
CHURN_POOL = 65_536
CHURN_OPS = 200_000
CHURN_K_MAX = 64
CHURN_SEED = 1

# W2/W3: prefix reuse, without and with eviction pressure
PREFIX_POOL = {"W2": 65_536, "W3": 2_048}
PREFIX_REQUESTS = 2_000
NUM_SYSTEM_PROMPTS = 20
SYSTEM_PROMPT_TOKENS = 2_048
UNIQUE_TOKENS = 256
PREFIX_SEED = 2


def splitmix64(seed: int) -> Iterator[int]:
    """The spec's SplitMix64 generator: unsigned 64-bit outputs, forever."""
    state = seed
    while True:
        state = (state + 0x9E3779B97F4A7C15) & MASK64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
        yield z ^ (z >> 31)


@dataclass(frozen=True)
class ChurnTrace:
    """W1's operations and what the harness counted while generating them.

    Attributes:
        ops: ``("A", k)`` or ``("R", index into live)`` per operation, in order.
        blocks_allocated, blocks_released: blocks moved by the ``N`` operations
            (the teardown's releases are not counted).
        peak_used, mean_used: blocks held by live requests, after each operation.
        live_at_end: requests still live after the last operation.
    """

    ops: list[tuple[str, int]]
    blocks_allocated: int
    blocks_released: int
    peak_used: int
    mean_used: float
    live_at_end: int


def churn_ops(scale: float = 1.0, pool_blocks: int = CHURN_POOL) -> ChurnTrace:
    """W1's ``N = round(200,000 * scale)`` operations (seed 1, ``k`` in 1..64).

    The harness, not the library, keeps ``used + k <= C`` (``C = pool_blocks - 1``),
    so no allocation ever fails.
    """
    draws = splitmix64(CHURN_SEED)
    capacity = pool_blocks - 1
    sizes: list[int] = []  # the live requests' block counts, in live order
    ops: list[tuple[str, int]] = []
    used = allocated = released = peak = used_sum = 0
    for _ in range(max(1, round(CHURN_OPS * scale))):
        k = 1 + next(draws) % CHURN_K_MAX
        coin = next(draws) % 2
        if sizes and (coin == 1 or used + k > capacity):
            index = next(draws) % len(sizes)
            size = sizes[index]
            sizes[index] = sizes[-1]
            sizes.pop()
            used -= size
            released += size
            ops.append(("R", index))
        else:
            sizes.append(k)
            used += k
            allocated += k
            ops.append(("A", k))
        peak = max(peak, used)
        used_sum += used
    return ChurnTrace(ops, allocated, released, peak, used_sum / len(ops), len(sizes))


def system_prompt(index: int) -> list[int]:
    """System prompt ``index``: tokens ``1 + index * 2048 + j``, disjoint between prompts."""
    first = 1 + index * SYSTEM_PROMPT_TOKENS
    return list(range(first, first + SYSTEM_PROMPT_TOKENS))


def prefix_requests(scale: float = 1.0) -> tuple[list[list[int]], list[int]]:
    """W2/W3's prompts (2,304 tokens, 144 full blocks each) and their system prompt ids.

    ``R = round(2,000 * scale)`` requests, seed 2: per request, first the
    system prompt ``below(20)``, then 256 tokens ``50,000 + below(100,000)``.
    """
    draws = splitmix64(PREFIX_SEED)
    prompts = [system_prompt(p) for p in range(NUM_SYSTEM_PROMPTS)]
    requests, prompt_ids = [], []
    for _ in range(max(1, round(PREFIX_REQUESTS * scale))):
        prompt_id = next(draws) % NUM_SYSTEM_PROMPTS
        unique = [50_000 + next(draws) % 100_000 for _ in range(UNIQUE_TOKENS)]
        prompt_ids.append(prompt_id)
        requests.append(prompts[prompt_id] + unique)
    return requests, prompt_ids


def ideal_hit_rate(prompt_ids: list[int]) -> float:
    """The unbounded cache's block hit rate: each prompt's first occurrence misses."""
    shared = SYSTEM_PROMPT_TOKENS // BLOCK_SIZE
    total = (SYSTEM_PROMPT_TOKENS + UNIQUE_TOKENS) // BLOCK_SIZE
    repeats = len(prompt_ids) - len(set(prompt_ids))
    return repeats * shared / (len(prompt_ids) * total)


# ---------------------------------------------------------------------- test vectors

_W1_DIGEST = "672ceb572060b997ce9aaa614d48fbef6c62282be0392de551dfb6206e54f57d"
_W2_DIGEST = "cd5e4149ef59903c3216e314be1429157d4661e5a8fc76db7e31ec3d38d2b629"
_PROMPT_COUNTS = [93, 100, 86, 99, 102, 99, 92, 111, 86, 95]
_PROMPT_COUNTS += [84, 105, 92, 141, 124, 93, 104, 90, 88, 116]


def _expect(failures: list[str], what: str, got: object, want: object) -> None:
    if got != want:
        failures.append(f"{what}: got {got!r}, the spec says {want!r}")


def check_vectors() -> list[str]:
    """Every mismatch between these generators and the spec's test vectors (full scale)."""
    failures: list[str] = []
    for seed, want in (
        (1, [0x910A2DEC89025CC1, 0xBEEB8DA1658EEC67, 0xF893A2EEFB32555E]),
        (2, [0x975835DE1C9756CE, 0xBFC846100BFC1E42, 0x987BBCBFDD7E532F]),
    ):
        draws = splitmix64(seed)
        _expect(failures, f"SplitMix64 seed {seed}", [next(draws) for _ in range(3)], want)

    churn = churn_ops()
    words = [f"{kind}{value}" for kind, value in churn.ops]
    _expect(
        failures, "W1 first 12 ops", ",".join(words[:12]), "A2,R0,A1,A54,R0,A1,R1,A50,A9,R2,R1,R0"
    )
    num_alloc = sum(kind == "A" for kind, _ in churn.ops)
    _expect(
        failures,
        "W1 allocations / releases",
        (num_alloc, len(words) - num_alloc),
        (100_285, 99_715),
    )
    moved = (churn.blocks_allocated, churn.blocks_released)
    _expect(failures, "W1 blocks allocated / released", moved, (3_264_209, 3_246_080))
    _expect(failures, "W1 peak used", churn.peak_used, 24_067)
    _expect(failures, "W1 mean used", round(churn.mean_used, 1), 8_906.9)
    _expect(failures, "W1 live at end", churn.live_at_end, 570)
    digest = hashlib.sha256(",".join(words).encode()).hexdigest()
    _expect(failures, "W1 SHA-256 of the ops", digest, _W1_DIGEST)

    requests, prompt_ids = prefix_requests()
    _expect(
        failures,
        "W2 first 12 prompt ids",
        prompt_ids[:12],
        [10, 13, 0, 15, 0, 13, 19, 12, 10, 10, 10, 13],
    )
    first_unique = requests[0][SYSTEM_PROMPT_TOKENS : SYSTEM_PROMPT_TOKENS + 5]
    _expect(
        failures,
        "W2 request 0's unique tokens",
        first_unique,
        [110226, 125951, 89236, 106649, 109219],
    )
    counts = [prompt_ids.count(p) for p in range(NUM_SYSTEM_PROMPTS)]
    _expect(failures, "W2 prompt counts", counts, _PROMPT_COUNTS)
    text = "".join(",".join(map(str, tokens)) + ";" for tokens in requests)
    _expect(
        failures,
        "W2 SHA-256 of the requests",
        hashlib.sha256(text.encode()).hexdigest(),
        _W2_DIGEST,
    )
    _expect(failures, "W2 ideal hit rate", round(ideal_hit_rate(prompt_ids), 4), 0.88)
    return failures
