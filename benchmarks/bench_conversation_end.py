"""A conversation's end (``end_conversation``): each policy's share of the optimum, off and on.

Replays the chat families of the train/test split
(:mod:`prefixcache.tools.workloads.split`) at mid capacity (10% of the trace's
distinct blocks, as ``bench_policy_split.py``), one request at a time
(:func:`prefixcache.tools.replay.replay`), or with ``--in-flight N`` through the
concurrent loop (``replay_concurrent``, as ``prefixcache compare --concurrency N``).
Three columns a policy:

- **off**: no ends;
- **marks**: ``conversation_ends=True`` on the trace as generated: ``end_conversation``
  after each request the family marks ``ends_conversation`` (the last turn of a
  conversation its client closed; abandoned chats and conversations still open at the
  trace's end are not marked). This is the real signal, what a client can say;
- **ended**: the marks replaced by every conversation that really ended: a request whose
  last block's hash no later request of a trace twice as long holds (chained hashes: a
  later turn extends the whole prompt). That adds the abandoned chats, which no client
  signal gives, but not the conversations the trace cuts off (they go on after it);
- **inferred**: the same inference on the trace itself, which adds every conversation
  still open at its end: the upper bound (the optimum knows those never come back too).

The optimum (``belady``, no ends: it knows the future already) is the replay's.

Usage, from the repository root::

    python benchmarks/bench_conversation_end.py  # test side (seed 2), lru and auto
    python benchmarks/bench_conversation_end.py --side train --requests 800
    python benchmarks/bench_conversation_end.py --in-flight 16  # with queue hints off and on
    python benchmarks/bench_conversation_end.py --families multi_tenant_mix,agent_tool_loops
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import replace

from bench_policy_split import capacities

from prefixcache.reference.trace import TraceRequest, trace_block_hashes
from prefixcache.tools.replay import OPTIMUM_POLICY, replay, replay_concurrent
from prefixcache.tools.workloads import split

MODES = ("off", "marks", "ended", "inferred")


def last_turns(requests: Sequence[TraceRequest]) -> list[bool]:
    """Per request: whether no later request's chain holds its last block's hash."""
    chains = [trace_block_hashes(request.hash_ids) for request in requests]
    last_use: dict[int, int] = {}
    for index, chain in enumerate(chains):
        for block_hash in chain:
            last_use[block_hash] = index
    return [bool(chain) and last_use[chain[-1]] == i for i, chain in enumerate(chains)]


def marked(requests: Sequence[TraceRequest], flags: Sequence[bool]) -> list[TraceRequest]:
    """The trace with its marks replaced by ``flags``."""
    return [
        replace(request, ends_conversation=flag)
        for request, flag in zip(requests, flags, strict=True)
    ]


def ended(family: str, seed: int, requests: Sequence[TraceRequest]) -> list[bool] | None:
    """Per request: its conversation ends with it, judged on the trace twice as long.

    The longer trace's first requests must have the same hash IDs (its other fields
    may differ: the log-normal families draw lengths after every turn); None where
    they do not (``multi_tenant_mix`` interleaves its tenants by time: a longer trace
    is another trace), and the column reads n/a.
    """
    longer = split.load_trace(family, seed, 2 * len(requests))
    if [r.hash_ids for r in longer[: len(requests)]] != [r.hash_ids for r in requests]:
        return None
    return last_turns(longer)[: len(requests)]


def rates(
    traces: dict[str, list[TraceRequest] | None],
    capacity: int,
    policy: str,
    in_flight: int,
    hints: bool,
) -> list[float | None]:
    """The hit rate with each of :data:`MODES` (``traces``: the trace each mode replays;
    None for a mode: no rate, None)."""
    out: list[float | None] = []
    for mode in MODES:
        ends = mode != "off"
        trace = traces[mode]
        if trace is None:
            out.append(None)
        elif in_flight:
            result = replay_concurrent(
                trace,
                capacity,
                policy,
                max_requests=in_flight,
                queue_hints=hints,
                conversation_ends=ends,
            )
            out.append(result.hit_rate)
        else:
            out.append(replay(trace, capacity, policy, conversation_ends=ends).hit_rate)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--side", choices=("test", "train"), default="test")
    parser.add_argument("--requests", type=int, default=1500)
    parser.add_argument("--policies", default="lru,auto")
    parser.add_argument(
        "--families",
        default=",".join(split.CHAT_FAMILIES),
        help="comma-separated split families (default: the chat families)",
    )
    parser.add_argument("--in-flight", type=int, default=0, help="N > 0: the concurrent loop")
    args = parser.parse_args(argv)
    seed = split.TEST_SEED if args.side == "test" else split.TRAIN_SEEDS[0]
    names = args.policies.split(",")
    loop = f"at most {args.in_flight} in flight, 50 ms a step" if args.in_flight else "sequential"
    print(f"{args.side} side (seed {seed}), {args.requests} requests, mid capacity, {loop}")
    print("share of the optimum in brackets; marks: the trace's; ended: marks and abandoned")
    print("chats; inferred: those and the conversations the trace cuts off (the upper bound)")
    hint_modes = (False, True) if args.in_flight else (False,)
    header = " | ".join(f"{h}{m}" for h in ("", "hints, ")[: len(hint_modes)] for m in MODES)
    print(f"\n| trace | optimum | marks / ended / inferred | policy | {header} |")
    columns = " | ".join("---:" for _ in hint_modes for _ in MODES)
    print(f"| --- | ---: | ---: | --- | {columns} |")
    for family in args.families.split(","):
        requests = split.load_trace(family, seed, args.requests)
        capacity = capacities(requests)["mid"]
        best = (
            replay_concurrent(requests, capacity, OPTIMUM_POLICY, max_requests=args.in_flight)
            if args.in_flight
            else replay(requests, capacity, OPTIMUM_POLICY)
        )
        last = last_turns(requests)
        long_last = ended(family, seed, requests)
        traces: dict[str, list[TraceRequest] | None] = {
            "off": requests,
            "marks": requests,
            "ended": None if long_last is None else marked(requests, long_last),
            "inferred": marked(requests, last),
        }
        counts = " / ".join(
            "n/a" if trace is None else str(sum(r.ends_conversation for r in trace))
            for trace in (traces[mode] for mode in MODES[1:])
        )
        for name in names:
            start = time.perf_counter()
            cells = [
                "n/a"
                if rate is None
                else f"{rate:.3f} ({rate / best.hit_rate:.2f})"
                if best.hit_rate
                else f"{rate:.3f}"
                for hints in hint_modes
                for rate in rates(traces, capacity, name, args.in_flight, hints)
            ]
            print(
                f"| `{family}` {capacity:,} blocks | {best.hit_rate:.3f} | "
                f"{counts} | {name} | "
                + " | ".join(cells)
                + f" |  <!-- {time.perf_counter() - start:.0f} s -->",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
