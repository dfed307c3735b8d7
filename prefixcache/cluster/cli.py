"""The ``prefixcache compare --workers`` command: the cluster comparison as a table.

:func:`add_cluster_arguments` and :func:`cluster_main` plug it into the
``prefixcache`` command line (:mod:`prefixcache.tools.cli`); :func:`main`
runs it on its own as ``python -m prefixcache.cluster``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from prefixcache.cluster.dynamo import (
    DynamoIndexerClient,
    DynamoPrefixIndex,
    free_tcp_port,
    start_dynamo_indexer,
)
from prefixcache.cluster.replay import ClusterResult, replay_cluster
from prefixcache.cluster.routers import ROUTERS, PrefixAwareRouter
from prefixcache.errors import InvalidArgumentError, PrefixCacheError
from prefixcache.reference.trace import (
    TRACE_BLOCK_SIZE,
    TraceRequest,
    load_mooncake_trace,
    sample_trace_path,
)

__all__ = [
    "DEFAULT_TOTAL_CAPACITY",
    "DEFAULT_WORKERS",
    "add_cluster_arguments",
    "cluster_main",
    "format_table",
    "main",
]

DEFAULT_WORKERS = (2, 4, 8)
DEFAULT_TOTAL_CAPACITY = 8000
"""Blocks across all workers (512-token blocks: about 4M tokens of KV)."""


def _count_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(dict.fromkeys(int(part) for part in text.split(",")))
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints >= 1, got {text!r}")
    return values


def _router_list(text: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(part.strip() for part in text.split(",")))
    unknown = [name for name in names if name not in ROUTERS]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown router(s) {unknown}; valid: {', '.join(ROUTERS)}"
        )
    return names


def add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--workers``, ``--routers``, ``--total-capacity`` and ``--dynamo`` to ``parser``.

    ``--workers`` defaults to None, so a command can tell whether cluster mode was asked.
    """
    parser.add_argument(
        "--workers",
        type=_count_list,
        default=None,
        help="replay over N workers behind each router, e.g. 4 or 2,4,8 (cluster mode)",
    )
    parser.add_argument(
        "--routers",
        type=_router_list,
        default=ROUTERS,
        help=f"comma-separated routers (default: {','.join(ROUTERS)})",
    )
    parser.add_argument(
        "--total-capacity",
        type=int,
        default=DEFAULT_TOTAL_CAPACITY,
        help=f"blocks across all workers (default: {DEFAULT_TOTAL_CAPACITY})",
    )
    parser.add_argument(
        "--dynamo",
        action="store_true",
        help="prefix_aware asks NVIDIA Dynamo's standalone indexer (started on 127.0.0.1)",
    )


def cluster_main(args: argparse.Namespace) -> int:
    """Run the cluster comparison and print a markdown table; return the exit status.

    Reads ``args.trace``, ``args.limit``, ``args.workers``, ``args.routers``,
    ``args.total_capacity``, ``args.dynamo`` and, if present, the first of
    ``args.policies`` (default LRU).

    Complexity: one :func:`replay_cluster` per router and worker count.
    """
    path = args.trace if args.trace is not None else sample_trace_path()
    try:
        requests = load_mooncake_trace(path, limit=args.limit)
    except OSError as exc:
        raise InvalidArgumentError(f"cannot read trace {path}: {exc.strerror or exc}") from exc
    policy = args.policies[0] if getattr(args, "policies", None) else "lru"
    counts = args.workers or DEFAULT_WORKERS
    rows = [
        _run_one(requests, n, args.total_capacity, name, policy, args.dynamo)
        for n in counts
        for name in args.routers
    ]
    print(
        f"{Path(path).name}: {len(requests)} requests; {args.total_capacity:,} blocks in total "
        f"split evenly; policy {policy}; hit rate = prompt tokens served from cache / prompt "
        "tokens; spread = busiest worker's computed tokens / mean\n"
    )
    print(format_table(rows))
    return 0


def _run_one(
    requests: Sequence[TraceRequest], n: int, total: int, name: str, policy: str, dynamo: bool
) -> ClusterResult:
    if not (dynamo and name == "prefix_aware"):
        return replay_cluster(requests, n, total, name, policy=policy)
    port = free_tcp_port()
    process = start_dynamo_indexer(port)
    index = None
    try:
        client = DynamoIndexerClient(f"http://127.0.0.1:{port}", block_size=TRACE_BLOCK_SIZE)
        index = DynamoPrefixIndex(client, n)
        router = PrefixAwareRouter(index)
        result = replay_cluster(requests, n, total, router, policy=policy)
        return ClusterResult(**{**result.__dict__, "router": "prefix_aware (dynamo)"})
    finally:
        if index is not None:
            index.close()
        process.kill()
        process.wait()


def format_table(results: Sequence[ClusterResult]) -> str:
    """A markdown table, one row per result."""
    lines = [
        "| workers | router | hit rate | tokens saved | spread | requests/worker (min-max) "
        "| steps | evictions | preempted |",
        "| ---: | --- | ---: | ---: | ---: | --- | ---: | ---: | ---: |",
    ]
    for r in results:
        lines.append(
            f"| {r.num_workers} | {r.router} | {r.hit_rate:.3f} | {r.tokens_saved:,} "
            f"| {r.load_spread:.2f} | {min(r.requests_per_worker)}-{max(r.requests_per_worker)} "
            f"| {r.num_steps:,} | {r.evictions:,} | {r.preemptions} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m prefixcache.cluster``: the cluster comparison on its own."""
    parser = argparse.ArgumentParser(
        prog="python -m prefixcache.cluster",
        description="Replay a trace over N workers behind several routers.",
    )
    parser.add_argument("--trace", type=Path, default=None, help="default: the shipped sample")
    parser.add_argument("--limit", type=int, default=None, help="replay the first N requests")
    parser.add_argument("--policy", default="lru", help="eviction policy (default: lru)")
    add_cluster_arguments(parser)
    args = parser.parse_args(argv)
    args.policies = (args.policy,)
    try:
        return cluster_main(args)
    except PrefixCacheError as exc:
        print(f"prefixcache: error: {exc}", file=sys.stderr)
        return 1
