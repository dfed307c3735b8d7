"""Tier numbers of issue 18: host tier hit rates, the remote tier on a real Redis, epoch switches.

Three parts, each a markdown table on stdout:

1. **Host tier.** The Mooncake trace and the multi-turn chat family replayed
   (``prefixcache.tiers.replay_tiered``, the no-concurrency model) through
   ``C`` device blocks alone and with a host tier of ``4 C`` slots: hit rate
   per tier and the copy traffic (blocks promoted per request).
2. **Remote tier.** The Mooncake trace dealt round-robin to two workers, each
   with ``C`` device blocks and a host tier, behind a ``redis-server`` this
   script starts on a free loopback port (``--redis-server``) or one at
   ``--redis-url``: hit rate of two workers sharing the remote tier beside two
   with a namespace each and two with no remote tier, and the time of every
   remote lookup that matched (one pipelined ``MGET``; p50/p99). K/V is real
   bytes of a small layout (``--kv-heads`` x ``--kv-head-dim`` per token, one
   layer, float16: 2 KiB a 512-token block at the defaults), written through
   ``KVTransfer``; each worker's write queue is flushed after each request so
   the run is repeatable.
3. **Epoch switch.** ``TieredCache.begin_weight_epoch`` with 10^3, 10^4 and 10^5
   blocks cached on the device and as many in the host tier, and the mean
   time of the allocations after it, which drop the retired entries a few
   at a time.

Usage, from the repository root::

    python benchmarks/bench_tiers.py \\
        --trace ../shared/traces/mooncake_synthetic_trace.jsonl > tiers.md

Times depend on the machine (printed first); compare numbers of one run.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from machine import cpu_model

from prefixcache import KVBlockAllocator
from prefixcache.reference.trace import (
    TRACE_BLOCK_SIZE,
    TraceRequest,
    load_mooncake_trace,
    trace_block_hashes,
)
from prefixcache.serving.kv_cache import KVCache
from prefixcache.tiers import HostKVStore, HostTier, KVTransfer, TieredCache, replay_tiered
from prefixcache.tiers.remote import RemoteTier, connect
from prefixcache.tools import workloads


def main(argv: Sequence[str] | None = None) -> int:
    """Run the three parts and print their tables."""
    args = _parser().parse_args(argv)
    engine = os.environ.get("PREFIXCACHE_ENGINE", "auto")
    print(
        f"# Tier benchmarks\n\nMachine: {cpu_model()}, Python {platform.python_version()}, ", end=""
    )
    print(f"torch {torch.__version__}, engine {engine}.\n")
    print(f"Load average before the run: {' '.join(f'{x:.1f}' for x in os.getloadavg())}.\n")
    traces = _traces(args)
    if "host" in args.parts:
        _host_tier(traces, args.capacities)
    if "remote" in args.parts:
        if args.mooncake is not None:
            with _redis(args) as url:
                _remote_tier(args.mooncake, url, args)
        else:
            print("(remote tier skipped: no Mooncake trace)\n")
    if "epoch" in args.parts:
        _epoch_switch(args.epoch_sizes)
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--trace", type=Path, default=Path("../shared/traces/mooncake_synthetic_trace.jsonl")
    )
    parser.add_argument(
        "--parts", default="host,remote,epoch", help="comma-separated subset of the three"
    )
    parser.add_argument("--chat-requests", type=int, default=4000)
    parser.add_argument("--capacities", type=_ints, default=(1000, 5000))
    parser.add_argument("--remote-capacity", type=int, default=1000)
    parser.add_argument("--remote-host-capacity", type=int, default=1000)
    parser.add_argument("--kv-heads", type=int, default=1)
    parser.add_argument("--kv-head-dim", type=int, default=1)
    parser.add_argument("--redis-server", default="redis-server", help="binary to start")
    parser.add_argument("--redis-url", default=None, help="use this server instead")
    parser.add_argument(
        "--remote-timeout", type=float, default=1.0, help="client socket timeout, seconds"
    )
    parser.add_argument("--epoch-sizes", type=_ints, default=(10**3, 10**4, 10**5))
    return parser


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(","))


def _traces(args: argparse.Namespace) -> dict[str, list[TraceRequest]]:
    traces: dict[str, list[TraceRequest]] = {}
    args.mooncake = None
    if args.trace.is_file():
        args.mooncake = traces["mooncake"] = load_mooncake_trace(args.trace)
    else:
        print(f"({args.trace} not found: Mooncake rows skipped)\n")
    traces["multi_turn_chats"] = workloads.multi_turn_chats(args.chat_requests, seed=0)
    return traces


# ---------------------------------------------------------------------- 1. host tier


def _host_tier(traces: dict[str, list[TraceRequest]], capacities: Sequence[int]) -> None:
    print("## Host tier of 4x the device capacity\n")
    print(
        "| trace | device blocks | host slots | hit rate | device | host "
        "| promoted / request | demoted / request | replay s |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, requests in traces.items():
        for capacity in capacities:
            for host in (0, 4 * capacity):
                start = time.perf_counter()
                result = replay_tiered(requests, capacity, host)
                seconds = time.perf_counter() - start
                host_rate = result.hit_rate - result.device_hit_rate
                demoted = result.demoted_blocks / max(result.num_requests, 1)
                print(
                    f"| {name} | {capacity} | {host} | {result.hit_rate:.3f} "
                    f"| {result.device_hit_rate:.3f} | {host_rate:.3f} "
                    f"| {result.promoted_per_request:.2f} | {demoted:.2f} | {seconds:.2f} |"
                )
    print()


# ---------------------------------------------------------------------- 2. remote tier


class _Worker:
    """One engine instance of the replay: device pool, host tier, K/V bytes, maybe a remote."""

    def __init__(
        self,
        capacity: int,
        host_capacity: int,
        longest: int,
        remote: RemoteTier | None,
        layout: tuple[int, int],
    ) -> None:
        total = capacity + longest + 2
        self.capacity = capacity
        self.allocator = KVBlockAllocator(
            total_count=total, block_size_tokens=TRACE_BLOCK_SIZE, device="cpu"
        )
        self.kv = KVCache(1, total, TRACE_BLOCK_SIZE, *layout, device="cpu")
        self.store = HostKVStore(self.kv, host_capacity)
        self.host = HostTier(host_capacity, block_size=TRACE_BLOCK_SIZE)
        self.tiered = TieredCache(self.allocator, self.host, remote=remote, store=self.store)
        self.transfer = KVTransfer(self.kv, self.store, remote=remote)
        self.remote = remote
        self.prompt_blocks = self.device_hits = self.host_hits = self.remote_hits = 0

    def serve(self, hashes: list[int]) -> None:
        """Match, compute the misses (their K/V is left as is), release, trim to capacity."""
        tiered = self.tiered
        match = tiered.match(hashes)
        self.prompt_blocks += len(hashes)
        self.device_hits += match.num_device_blocks
        self.host_hits += match.num_host_blocks
        self.remote_hits += match.num_remote_blocks
        num_hit = len(match.block_ids)
        fresh = tiered.allocate(len(hashes) - num_hit)
        assert fresh is not None  # the pool holds the cache plus the longest request
        if len(fresh):
            parent = hashes[num_hit - 1] if num_hit else None
            tiered.register(fresh, hashes[num_hit:], parent_hash=parent)
        tiered.release(fresh)
        tiered.release(match.block_ids)
        excess = self.allocator.get_evictable_block_count() - self.capacity
        if excess > 0:
            tiered.evict(excess)
        self.transfer.run(tiered.take_transfer())
        self.transfer.wait()
        if self.remote is not None:
            self.remote.flush()


def _remote_tier(requests: list[TraceRequest], url: str, args: argparse.Namespace) -> None:
    capacity, host = args.remote_capacity, args.remote_host_capacity
    chains = [trace_block_hashes(request.hash_ids) for request in requests]
    longest = max(len(chain) for chain in chains)
    layout = (args.kv_heads, args.kv_head_dim)
    block_bytes = 2 * TRACE_BLOCK_SIZE * args.kv_heads * args.kv_head_dim * 2
    print(
        f"## Remote tier: two workers on one redis-server (loopback)\n\nMooncake trace dealt "
        f"round-robin to 2 workers; each {capacity} device blocks + {host} host slots; "
        f"{block_bytes} bytes of K/V per block.\n"
    )
    print(
        "| setup | hit rate | device | host | remote | remote lookups | matched "
        "| matched p50 ms | matched p99 ms | all p50 ms | blocks / matched lookup "
        "| errors | s |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    run_id = f"bench-{os.getpid()}-{time.time_ns()}"
    setups: dict[str, Callable[[int], RemoteTier | None]] = {
        "no remote tier": lambda worker: None,
        "a namespace each": lambda worker: connect(
            url, namespace=f"{run_id}-own{worker}", timeout_s=args.remote_timeout
        ),
        "one shared namespace": lambda worker: connect(
            url, namespace=f"{run_id}-shared", timeout_s=args.remote_timeout
        ),
    }
    for setup, make_remote in setups.items():
        remotes = [make_remote(worker) for worker in range(2)]
        timings: list[tuple[float, int]] = []
        for remote in remotes:
            if remote is not None:
                _time_lookups(remote, timings)
        workers = [_Worker(capacity, host, longest, remote, layout) for remote in remotes]
        start = time.perf_counter()
        for index, chain in enumerate(chains):
            workers[index % 2].serve(chain)
        seconds = time.perf_counter() - start
        errors = 0
        for remote in remotes:
            if remote is not None:
                stats = remote.stats()
                errors += stats.num_lookup_errors + stats.num_write_errors
                remote.close()
        _remote_row(setup, workers, timings, seconds, errors)
    print()


def _time_lookups(remote: RemoteTier, timings: list[tuple[float, int]]) -> None:
    """Record (seconds, blocks found) of every lookup ``remote`` makes."""
    lookup = remote.lookup

    def timed(block_hashes: Sequence[int]) -> list[bytes]:
        start = time.perf_counter()
        found = lookup(block_hashes)
        timings.append((time.perf_counter() - start, len(found)))
        return found

    remote.lookup = timed  # type: ignore[method-assign]


def _remote_row(
    setup: str,
    workers: list[_Worker],
    timings: list[tuple[float, int]],
    seconds: float,
    errors: int,
) -> None:
    blocks = sum(w.prompt_blocks for w in workers)
    device, host, remote = (
        sum(getattr(w, name) for w in workers) / blocks
        for name in ("device_hits", "host_hits", "remote_hits")
    )
    matched = [(t, n) for t, n in timings if n]
    cells = ["-"] * 4
    if matched:
        times = np.array([t for t, _ in matched]) * 1e3
        every = np.array([t for t, _ in timings]) * 1e3
        cells = [
            f"{np.percentile(times, 50):.3f}",
            f"{np.percentile(times, 99):.3f}",
            f"{np.percentile(every, 50):.3f}",
            f"{statistics.fmean(n for _, n in matched):.1f}",
        ]
    print(
        f"| {setup} | {device + host + remote:.3f} | {device:.3f} | {host:.3f} | {remote:.3f} "
        f"| {len(timings)} | {len(matched)} | {' | '.join(cells)} | {errors} | {seconds:.1f} |"
    )


@contextmanager
def _redis(args: argparse.Namespace) -> Iterator[str]:
    """The URL of ``--redis-url``, or of a redis-server started on a free loopback port."""
    if args.redis_url is not None:
        yield args.redis_url
        return
    binary = shutil.which(args.redis_server)
    if binary is None:
        sys.exit(f"bench_tiers: {args.redis_server} not found (or pass --redis-url)")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with tempfile.TemporaryDirectory() as folder:
        command = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
        command += ["--appendonly", "no", "--dir", folder]
        server = subprocess.Popen(command, stdout=subprocess.DEVNULL, cwd=folder)
        try:
            import redis

            client = redis.Redis(host="127.0.0.1", port=port)
            for _ in range(500):
                try:
                    client.ping()
                    break
                except redis.ConnectionError:
                    time.sleep(0.01)
            client.close()
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            server.kill()
            server.wait()


# ---------------------------------------------------------------------- 3. epoch switch


def _epoch_switch(sizes: Sequence[int], repeats: int = 5, allocations: int = 200) -> None:
    print("## Weight epoch switch\n")
    print(
        "| cached blocks (device + host) | switch µs (median of 5) "
        "| allocate(1) µs before | allocate(1) µs after |"
    )
    print("|---:|---:|---:|---:|")
    for size in sizes:
        switches, before, after = [], [], []
        for _ in range(repeats):
            tiered = _full_cache(size)
            before.append(_allocation_time(tiered, allocations))
            start = time.perf_counter()
            tiered.begin_weight_epoch("new weights")
            switches.append(time.perf_counter() - start)
            after.append(_allocation_time(tiered, allocations))
            assert tiered.stats().host.num_retired == min(size, 8 * allocations)
        print(
            f"| {size:,} + {size:,} | {statistics.median(switches) * 1e6:.1f} "
            f"| {statistics.median(before) * 1e6:.1f} | {statistics.median(after) * 1e6:.1f} |"
        )
    print()


def _full_cache(size: int) -> TieredCache:
    """``size`` cached device blocks and ``size`` host entries, all of the current epoch."""
    allocator = KVBlockAllocator(total_count=size + 64, block_size_tokens=16, device="cpu")
    host = HostTier(size, block_size=16)
    tiered = TieredCache(allocator, host)
    ids = tiered.allocate(size)
    assert ids is not None
    hashes = list(range(1, size + 1))
    tiered.register(ids, hashes)
    tiered.release(ids)
    for index in range(size):
        host.put(size + 1 + index, None, depth=0)
    return tiered


def _allocation_time(tiered: TieredCache, count: int) -> float:
    """Mean seconds of ``allocate(1)`` + release, ``count`` times."""
    start = time.perf_counter()
    for _ in range(count):
        ids = tiered.allocate(1)
        assert ids is not None
        tiered.release(ids)
    tiered.take_transfer()
    return (time.perf_counter() - start) / count


if __name__ == "__main__":
    sys.exit(main())
