"""The ``prefixcache`` command: replay a request trace and compare eviction policies.

Commands: ``replay``, ``compare``, ``sweep`` (hit rate against memory, with the
smallest size worth having: :mod:`prefixcache.tools.sweep`) and ``convert``
(a user's own requests as a trace: :mod:`prefixcache.tools.convert_cli`).
Capacities may be given in bytes (``8GiB``) with ``--model-shape``
(:mod:`prefixcache.tools.memory`).

``prefixcache replay`` runs one policy at one capacity; ``prefixcache compare``
runs several policies over several capacities, always with the offline
optimum (``belady``) as the reference, prints a markdown table and, when
matplotlib is installed (the ``plot`` extra), writes a PNG of hit rate
against capacity. Without ``--trace`` both use the sample trace shipped in
the package, so ``prefixcache compare`` alone is a complete demo::

    $ prefixcache compare
    $ prefixcache replay --trace trace.jsonl --policy lru --capacity 5000
    $ prefixcache replay --capacity 1000 --host-capacity 4000   # device + host tier

Both replay the no-concurrency model of :mod:`prefixcache.tools.replay`
(``replay --host-capacity`` puts a host tier behind the device pool, as
:func:`prefixcache.tiers.replay_tiered` does, and reports hit rates per tier);
``compare --concurrency [N]`` replays through the dynamic-batching loop of
``prefixcache.reference.sim`` instead, at most N requests in flight, and
``--queue-hints`` has the loop protect the cached prefixes of waiting requests
(DESIGN.md, "Scheduler hints")::

    $ prefixcache compare --concurrency 32 --queue-hints --policies lru,s3fifo,auto

``--conversation-ends`` (``replay`` and ``compare``, with or without
``--concurrency``) calls ``end_conversation`` after each request the trace
marks ``"ends_conversation": true``, freeing its chain's cached tail.

Every argument is checked before any replay starts
(:mod:`prefixcache.tools.cli_arguments`): the trace is read and parsed whole,
sizes are checked against this machine's memory, the plot's folder must exist.
A bad argument prints one line, ``prefixcache: error: argument --NAME: why``,
and exits with status 2; a failure during a run exits with 1.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from prefixcache import policies
from prefixcache.cluster import add_cluster_arguments, cluster_main
from prefixcache.engine.version import installed_version
from prefixcache.errors import PrefixCacheError
from prefixcache.tiers import TieredReplayResult, replay_tiered
from prefixcache.tools.cli_arguments import (
    DEFAULT_PLOT,
    BadArgument,
    add_memory_arguments,
    add_trace_arguments,
    capacity,
    capacity_list,
    check_arguments,
    non_negative,
    policy_list,
    policy_name,
    positive,
    show_progress,
)
from prefixcache.tools.compare_report import results_table, share_table, write_plot
from prefixcache.tools.convert_cli import add_convert_parser
from prefixcache.tools.replay import (
    OPTIMUM_POLICY,
    replay,
    replay_concurrent,
)
from prefixcache.tools.sweep import add_sweep_parser, replay_grid

__all__ = ["main"]

DEFAULT_CAPACITIES = (1000, 5000, 20000)
DEFAULT_IN_FLIGHT = 256
"""``compare --concurrency`` without N: requests in flight at most (block-table rows)."""
LEFT_OUT_BY_DEFAULT = ("ref_zero", "priority")
"""Policies ``compare`` runs only when named: ref_zero caches nothing (hit rate 0), and
priority without retention hints (a trace has none) evicts exactly as lru."""


def default_policies() -> tuple[str, ...]:
    """The policies ``compare`` runs without ``--policies``."""
    return tuple(name for name in policies.available() if name not in LEFT_OUT_BY_DEFAULT)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``prefixcache`` command line.

    Args:
        argv: arguments without the program name (None: ``sys.argv[1:]``).

    Returns:
        The exit status: 0 on success, 2 on a bad argument (a one-line
        error, before any replay starts; argparse's own errors exit with 2
        too), 1 when a run fails.

    Complexity: that of the replays it runs.
    """
    args = _parser().parse_args(argv)
    try:
        getattr(args, "check", check_arguments)(args)  # convert checks its own arguments
    except BadArgument as exc:
        print(f"prefixcache: error: argument {exc.argument}: {exc}", file=sys.stderr)
        return 2
    for note in getattr(args, "notes", ()):
        print(note)  # capacities given in bytes, as the blocks they resolve to
    try:
        return int(args.handler(args))
    except PrefixCacheError as exc:
        print(f"prefixcache: error: {exc}", file=sys.stderr)
        return 1


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors on one line (no usage block): ``prog: error: why``."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _epilog() -> str:
    """What ``--help`` says of the policies and the trace format."""
    names = ", ".join(name for name in policies.available() if name != OPTIMUM_POLICY)
    return (
        f"policies: {names}; {OPTIMUM_POLICY} is the offline optimum (compare always runs it)."
        "\n\ntrace: Mooncake JSONL, one request a line, e.g. "
        '{"timestamp": 0, "input_length": 1024, "output_length": 64, "hash_ids": [1, 2]}: '
        "hash_ids are the prompt's block IDs in order (blocks of 512 tokens unless "
        "--block-size says otherwise), shared between requests that share a prefix. Without "
        "--trace: the shipped sample. `prefixcache convert` writes one from your own requests."
    )


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="prefixcache",
        description="Replay a Mooncake-format request trace through the prefix cache.",
        epilog=_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"prefixcache {installed_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    one = commands.add_parser(
        "replay",
        help="replay a trace with one policy and capacity",
        epilog=_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_trace_arguments(one)
    one.add_argument("--policy", default="lru", type=policy_name, help="default: lru")
    one.add_argument(
        "--capacity",
        default=5000,
        type=capacity,
        help="cached blocks, or bytes with --model-shape (e.g. 8GiB; default: 5000 blocks)",
    )
    add_memory_arguments(one)
    one.add_argument(
        "--host-capacity",
        default=0,
        type=non_negative,
        help="host tier slots behind the device pool (default: 0, no host tier)",
    )
    _add_conversation_ends(one)
    one.add_argument(
        "--host-policy",
        default=None,
        type=policy_name,
        help="the host tier's eviction policy (default: lru; needs --host-capacity)",
    )
    one.set_defaults(handler=_run_replay)

    many = commands.add_parser(
        "compare",
        help="compare policies over capacities, with the offline optimum",
        epilog=_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_trace_arguments(many)
    many.add_argument(
        "--policies",
        type=policy_list,
        default=None,
        help="comma-separated names (default: every registered policy but ref_zero, which "
        "caches nothing, and priority, which is lru without retention hints)",
    )
    many.add_argument(
        "--capacities",
        type=capacity_list,
        default=DEFAULT_CAPACITIES,
        help="comma-separated capacities, in blocks or bytes with --model-shape "
        "(e.g. 4GiB,8GiB; default: 1000,5000,20000 blocks)",
    )
    add_memory_arguments(many)
    plot = many.add_mutually_exclusive_group()
    plot.add_argument(
        "--plot", type=Path, default=None, help=f"PNG to write (default: {DEFAULT_PLOT})"
    )
    plot.add_argument("--no-plot", action="store_true", help="do not write a plot")
    many.add_argument(
        "--table",
        action="store_true",
        help="also print each policy's share of the optimum per capacity (policy x capacity)",
    )
    many.add_argument(
        "--concurrency",
        nargs="?",
        const=DEFAULT_IN_FLIGHT,
        default=None,
        type=positive,
        metavar="N",
        help="replay through the dynamic-batching loop of prefixcache.reference.sim, at most "
        f"N requests in flight (running or paused; default N: {DEFAULT_IN_FLIGHT})",
    )
    many.add_argument(
        "--queue-hints",
        action="store_true",
        help="with --concurrency: the loop protects the cached prefixes of waiting requests "
        "(KVBlockAllocator.hint_upcoming; never for belady)",
    )
    _add_conversation_ends(many)
    add_cluster_arguments(many)
    many.set_defaults(handler=_run_compare)
    add_sweep_parser(commands, _epilog())
    add_convert_parser(commands)
    return parser


def _add_conversation_ends(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--conversation-ends",
        action="store_true",
        help='after each request the trace marks "ends_conversation": true, free its '
        "chain's cached tail (KVBlockAllocator.end_conversation; never for belady)",
    )


def _run_replay(args: argparse.Namespace) -> int:
    path, requests = args.trace_path, args.requests
    if args.host_capacity:
        return _run_tiered_replay(args)
    result = replay(
        requests,
        args.capacity,
        args.policy,
        progress=show_progress(args),
        block_size=args.block_size,
        conversation_ends=args.conversation_ends,
    )
    ends = ", conversation ends on" if args.conversation_ends else ""
    print(f"trace:         {path} ({result.num_requests} requests)")
    print(f"policy:        {result.policy}, capacity {result.capacity} blocks{ends}")
    print(f"hit rate:      {result.hit_rate:.3f} ({result.hit_blocks}/{result.prompt_blocks})")
    print(f"tokens saved:  {result.tokens_saved} of {result.prompt_tokens} prompt tokens")
    print(f"evictions:     {result.evictions}")
    print(f"speed:         {result.requests_per_second:,.0f} req/s ({result.seconds:.2f} s)")
    return 0


def _run_tiered_replay(args: argparse.Namespace) -> int:
    """``replay --host-capacity``: hit rates per tier and the copy traffic."""
    start = time.perf_counter()
    result: TieredReplayResult = replay_tiered(
        args.requests,
        args.capacity,
        args.host_capacity,
        policy=args.policy,
        host_policy=args.host_policy,
    )
    seconds = time.perf_counter() - start
    blocks = result.prompt_blocks
    print(f"trace:         {args.trace_path} ({result.num_requests} requests)")
    print(f"policy:        {args.policy}, capacity {result.capacity} blocks")
    print(f"host tier:     {args.host_policy}, {result.host_capacity} slots")
    print(f"hit rate:      {result.hit_rate:.3f} (device + host, of {blocks} prompt blocks)")
    print(f"device hits:   {result.device_hit_rate:.3f} ({result.device_hit_blocks}/{blocks})")
    host_rate = result.host_hit_blocks / blocks if blocks else 0.0
    print(f"host hits:     {host_rate:.3f} ({result.host_hit_blocks}/{blocks})")
    print(
        f"copies:        {result.demoted_blocks} demoted, {result.promoted_blocks} promoted "
        f"({result.promoted_per_request:.2f} blocks promoted per request)"
    )
    speed = result.num_requests / seconds if seconds > 0 else 0.0
    print(f"speed:         {speed:,.0f} req/s ({seconds:.2f} s)")
    return 0


def _run_compare(args: argparse.Namespace) -> int:
    if args.workers is not None:
        return cluster_main(args)  # the router table over simulated workers
    names = args.policies if args.policies is not None else default_policies()
    names = (*(name for name in names if name != OPTIMUM_POLICY), OPTIMUM_POLICY)
    if args.concurrency is not None and not _has_sim():
        print(
            "prefixcache: error: concurrency mode needs prefixcache.reference.sim", file=sys.stderr
        )
        return 1
    concurrent = args.concurrency is not None
    run = (
        functools.partial(
            replay_concurrent,
            max_requests=args.concurrency,
            queue_hints=args.queue_hints,
            conversation_ends=args.conversation_ends,
        )
        if concurrent
        else functools.partial(
            replay, block_size=args.block_size, conversation_ends=args.conversation_ends
        )
    )
    path, requests = args.trace_path, args.requests
    results = replay_grid(run, requests, names, args.capacities, progress=show_progress(args))
    mode = _MODES[concurrent]
    if concurrent:
        hints = "queue hints on" if args.queue_hints else "queue hints off"
        mode = f"{mode}; at most {args.concurrency} in flight, {hints}"
    if args.conversation_ends:
        marked = sum(request.ends_conversation for request in requests)
        mode = f"{mode}; conversation ends on ({marked} marked requests)"
    print(f"{path.name}: {len(requests)} requests, {mode}\n")
    print(results_table(results, names, args.capacities))
    if args.table:
        print(f"\n{share_table(results, names, args.capacities)}")
    if args.no_plot:
        return 0
    title = f"{path.name}, {'with' if concurrent else 'no'} concurrency"
    return write_plot(results, names, args.capacities, args.plot_target, title)


_MODES = {
    False: "one request at a time; hit rate = prompt blocks hit / prompt blocks",
    True: (
        "with concurrency (prefixcache.reference.sim); capacity = pool blocks; "
        "hit rate = prompt tokens served from cache / prompt tokens"
    ),
}


def _has_sim() -> bool:
    """Whether the optional dynamic-batching loop ``prefixcache.reference.sim`` can be imported."""
    try:
        importlib.import_module("prefixcache.reference.sim")
    except ImportError:
        return False
    return True
