"""Per-turn cost of long conversations: sessions against a new request per turn (issue 27).

W4 of ``../shared/bench/WORKLOADS.md``, implemented here from its text (SplitMix64, seed
4; sessions grow by user parts of 64-2,048 tokens and responses of 16-512 to a context
limit), run two ways on one allocator per run:

- ``requests``: each turn as the harness runs a library without a multi-turn entry
  point: ``admit_request(prompt)`` then ``admit_request(prompt + response)``, each
  released (the whole context hashed and matched twice per turn);
- ``sessions``: one session per conversation (``allocator.open_session()``: on the
  native engine the extension's, one native call a step): ``admit(new tokens)``,
  ``append(response)``, ``release()``;
- ``py-sessions`` (native engine only): the same through the Python reference
  :class:`~prefixcache.engine.sessions.Session` (what ``sessions`` ran before the
  native one: a dozen engine calls a step composed in Python).

Variants: ``w4`` (the spec: 8 sessions to 128k tokens, a pool that never fills),
``pressure`` (the same turns in a pool of a quarter of the blocks they need, so
eviction takes idle sessions' blocks and a turn looks up what its session lost) and
``1m`` (one session to 1,048,576 tokens). Prints mean us per turn by prompt length
and the growth (longest bucket / shortest), the hit rate, and the sessions/requests
ratio per bucket; every number is from this run on this machine (compare ratios).

    python benchmarks/bench_sessions.py                 # all variants, ~1 min
    python benchmarks/bench_sessions.py --variants w4 --scale 0.25 --repeats 1
    python benchmarks/bench_sessions.py --steps   # each step's cost by context, ~10 s
"""

from __future__ import annotations

import argparse
import gc
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
from peerbench.workloads import splitmix64  # the spec's generator, beside this file

from prefixcache import KVBlockAllocator
from prefixcache.engine.sessions import Session

BLOCK = 16
BUCKETS = [
    (0, 8_192, "<8k"),
    (8_192, 32_768, "8k-32k"),
    (32_768, 131_072, "32k-128k"),
    (131_072, 524_288, "128k-512k"),
    (524_288, 1 << 62, "512k-1M"),
]


@dataclass(frozen=True)
class Turn:
    session: int
    user: np.ndarray
    response: np.ndarray
    last: bool


def w4_turns(sessions: int, max_context: int, seed: int = 4) -> list[Turn]:
    """W4's turns in order (WORKLOADS.md, "W4"): draws in the spec's order."""
    draw = splitmix64(seed)

    def below(n: int) -> int:
        return next(draw) % n

    context = [0] * sessions
    active = list(range(sessions))
    turns: list[tuple[int, np.ndarray, np.ndarray]] = []
    while active:
        index = below(len(active))
        session = active[index]
        user, response = 64 + below(1985), 16 + below(497)
        if context[session] + user + response > max_context:
            del active[index]
            continue
        tokens = np.array([1 + below(128_000) for _ in range(user + response)], dtype=np.int32)
        turns.append((session, tokens[:user], tokens[user:]))
        context[session] += user + response
    last_turn = {session: i for i, (session, _, _) in enumerate(turns)}
    return [
        Turn(session, user, response, last_turn[session] == i)
        for i, (session, user, response) in enumerate(turns)
    ]


def run_requests(allocator: KVBlockAllocator, turns: list[Turn]) -> tuple[list[float], int]:
    """Each turn as two new requests over the whole conversation; seconds per turn, hits."""
    contexts: dict[int, np.ndarray] = {}
    row = np.zeros(allocator.num_usable, dtype=np.int32)
    seconds, hits = [], 0
    clock = time.perf_counter
    for turn in turns:
        prompt = np.concatenate([contexts.get(turn.session, turn.user[:0]), turn.user])
        full = np.concatenate([prompt, turn.response])
        start = clock()
        num_hit = allocator.admit_request(prompt, row)
        allocator.release_request(row[: -(-len(prompt) // BLOCK)])
        allocator.admit_request(full, row)
        allocator.release_request(row[: -(-len(full) // BLOCK)])
        seconds.append(clock() - start)
        hits += num_hit
        contexts[turn.session] = full
    return seconds, hits


def run_sessions(
    allocator: KVBlockAllocator, turns: list[Turn], reference: bool = False
) -> tuple[list[float], int]:
    """Each conversation through one session (``reference``: the Python one); seconds per
    turn, hits."""
    sessions: dict[int, Any] = {}
    seconds, hits = [], 0
    clock = time.perf_counter
    for turn in turns:
        session = sessions.get(turn.session)
        start = clock()
        if session is None:
            host: Any = allocator
            session = sessions[turn.session] = Session(host) if reference else host.open_session()
        num_hit = session.admit(turn.user)
        session.append(turn.response)
        session.release()
        seconds.append(clock() - start)
        hits += num_hit
    return seconds, hits


def prompt_lengths(turns: list[Turn]) -> list[int]:
    context: dict[int, int] = {}
    lengths = []
    for turn in turns:
        lengths.append(context.get(turn.session, 0) + len(turn.user))
        context[turn.session] = lengths[-1] + len(turn.response)
    return lengths


def by_bucket(seconds: list[float], lengths: list[int]) -> dict[str, float]:
    """Mean microseconds per turn in each prompt-length bucket that has turns."""
    means = {}
    for low, high, name in BUCKETS:
        chosen = [s for s, n in zip(seconds, lengths, strict=True) if low <= n < high]
        if chosen:
            means[name] = 1e6 * sum(chosen) / len(chosen)
    return means


VARIANTS = {
    # name: (sessions at scale 1, context limit, pool blocks as a share of what the turns need)
    "w4": (8, 131_072, None),
    "pressure": (8, 131_072, 0.25),
    "1m": (1, 1_048_576, None),
}


def run_steps() -> None:
    """Each step of a turn (200 new tokens, 100 decoded) by context length: the minimum of
    40 turns (the least disturbed by other load), the session object and the reference."""
    draw = np.random.default_rng(0)
    user = draw.integers(0, 50_000, 200, dtype=np.int32)
    response = draw.integers(0, 50_000, 100, dtype=np.int32)
    print("\nsteps: min us over 40 turns of 200 new tokens and 100 decoded")
    for context in (1_024, 32_768, 131_072, 1_048_576):
        for reference in (False, True):
            allocator: Any = KVBlockAllocator(
                total_count=context // BLOCK + 4_096, block_size_tokens=BLOCK, device="cpu"
            )
            session = Session(allocator) if reference else allocator.open_session()
            session.admit(draw.integers(0, 50_000, context, dtype=np.int32))
            session.release()
            best = [float("inf")] * 4
            clock = time.perf_counter
            for _ in range(40):
                t0 = clock()
                session.admit(user)
                t1 = clock()
                session.append(response)
                t2 = clock()
                session.release()
                t3 = clock()
                for i, value in enumerate((t1 - t0, t2 - t1, t3 - t2, t3 - t0)):
                    best[i] = min(best[i], 1e6 * value)
            name = "Session (Python)" if isinstance(session, Session) else "native Session"
            print(
                f"  context from {context:>9,} {name:18} admit {best[0]:7.1f}  "
                f"append {best[1]:5.1f}  release {best[2]:7.1f}  turn {best[3]:7.1f}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variants", default="w4,pressure,1m")
    parser.add_argument("--scale", type=float, default=0.25, help="sessions x scale (>= 1)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs; the median is shown")
    parser.add_argument("--steps", action="store_true", help="only each step's cost")
    args = parser.parse_args()
    if args.steps:
        run_steps()
        return
    for name in args.variants.split(","):
        num_sessions, limit, share = VARIANTS[name]
        sessions = max(1, round(num_sessions * args.scale)) if name != "1m" else 1
        turns = w4_turns(sessions, limit)
        lengths = prompt_lengths(turns)
        needed = sessions * limit // BLOCK + 16
        pool = needed if share is None else max(int(needed * share), limit // BLOCK + 64)
        blocks = sum(-(-n // BLOCK) for n in lengths)
        print(f"\n{name}: {sessions} session(s), {len(turns)} turns, pool {pool} blocks")
        results = {}
        ways = [("requests", run_requests), ("sessions", run_sessions)]
        if (
            KVBlockAllocator(total_count=2, block_size_tokens=BLOCK, device="cpu").engine
            == "native"
        ):
            ways.append(("py-sessions", lambda a, t: run_sessions(a, t, reference=True)))
        for way, run in ways:
            runs = []
            for _ in range(args.repeats):
                allocator = KVBlockAllocator(
                    total_count=pool + 1, block_size_tokens=BLOCK, device="cpu"
                )
                gc.collect()
                gc.freeze()
                seconds, hits = run(allocator, turns)
                gc.unfreeze()
                runs.append((sum(seconds), by_bucket(seconds, lengths), hits))
            runs.sort(key=lambda r: r[0])
            _, means, hits = runs[len(runs) // 2]
            results[way] = means
            growth = max(means.values()) / next(iter(means.values()))
            cells = "  ".join(f"{k} {v:8.1f}" for k, v in means.items())
            print(
                f"  {way:9} us/turn: {cells}  growth {growth:5.1f}x  "
                f"hit rate {hits / blocks:.4f}  ({allocator.engine} engine)"
            )
        for way in results:
            if way != "requests":
                ratio = "  ".join(
                    f"{k} {results[way][k] / results['requests'][k]:.2f}" for k in results[way]
                )
                print(f"  {way} / requests: {ratio}")


if __name__ == "__main__":
    main()
