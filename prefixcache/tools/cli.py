"""The ``prefixcache`` command: replay a request trace and compare eviction policies.

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
``compare --concurrency`` replays through the dynamic-batching loop of
``prefixcache.reference.sim`` instead.

Every argument is checked before any replay starts: the trace is read and
parsed whole, sizes are checked against this machine's memory, the plot's
folder must exist. A bad argument prints one line, ``prefixcache: error:
argument --NAME: why``, and exits with status 2; a failure during a run exits
with 1.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from prefixcache import __version__, policies
from prefixcache.cluster import add_cluster_arguments, cluster_main
from prefixcache.errors import InvalidArgumentError, PrefixCacheError
from prefixcache.reference.trace import TraceRequest, load_mooncake_trace, sample_trace_path
from prefixcache.tiers import UNUSABLE_POLICIES, TieredReplayResult, replay_tiered
from prefixcache.tools.compare_report import results_table, share_table, write_plot
from prefixcache.tools.replay import (
    OPTIMUM_POLICY,
    replay,
    replay_concurrent,
)

__all__ = ["main"]

DEFAULT_CAPACITIES = (1000, 5000, 20000)
DEFAULT_PLOT = "prefixcache_compare.png"
LEFT_OUT_BY_DEFAULT = ("ref_zero", "priority")
"""Policies ``compare`` runs only when named: ref_zero caches nothing (hit rate 0), and
priority without retention hints (a trace has none) evicts exactly as lru."""


def default_policies() -> tuple[str, ...]:
    """The policies ``compare`` runs without ``--policies``."""
    return tuple(name for name in policies.available() if name not in LEFT_OUT_BY_DEFAULT)


PLOT_SUFFIXES = (".png", ".pdf", ".svg")
"""Formats ``--plot`` writes; a name without a suffix gets ``.png``."""
BYTES_PER_BLOCK = 512
"""A bound on the host memory one block of capacity costs a replay (the allocator
measures about 185 bytes a cached block; policies, hashes and the trace add to it)."""


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
        _check_arguments(args)
    except _BadArgument as exc:
        print(f"prefixcache: error: argument {exc.argument}: {exc}", file=sys.stderr)
        return 2
    try:
        return int(args.handler(args))
    except PrefixCacheError as exc:
        print(f"prefixcache: error: {exc}", file=sys.stderr)
        return 1


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors on one line (no usage block): ``prog: error: why``."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


class _BadArgument(Exception):
    """An argument that parsed but cannot be used; exits with status 2."""

    def __init__(self, argument: str, message: str) -> None:
        super().__init__(message)
        self.argument = argument


def _epilog() -> str:
    """What ``--help`` says of the policies and the trace format."""
    names = ", ".join(name for name in policies.available() if name != OPTIMUM_POLICY)
    return (
        f"policies: {names}; {OPTIMUM_POLICY} is the offline optimum (compare always runs it)."
        "\n\ntrace: Mooncake JSONL, one request a line, e.g. "
        '{"timestamp": 0, "input_length": 1024, "output_length": 64, "hash_ids": [1, 2]}: '
        "hash_ids are the prompt's block IDs in order (blocks of 512 tokens), shared "
        "between requests that share a prefix. Without --trace: the shipped sample."
    )


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="prefixcache",
        description="Replay a Mooncake-format request trace through the prefix cache.",
        epilog=_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"prefixcache {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    one = commands.add_parser(
        "replay",
        help="replay a trace with one policy and capacity",
        epilog=_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_trace_arguments(one)
    one.add_argument("--policy", default="lru", type=_policy_name, help="default: lru")
    one.add_argument(
        "--capacity", default=5000, type=_positive, help="cached blocks (default: 5000)"
    )
    one.add_argument(
        "--host-capacity",
        default=0,
        type=_non_negative,
        help="host tier slots behind the device pool (default: 0, no host tier)",
    )
    one.add_argument(
        "--host-policy",
        default=None,
        type=_policy_name,
        help="the host tier's eviction policy (default: lru; needs --host-capacity)",
    )
    one.set_defaults(handler=_run_replay)

    many = commands.add_parser(
        "compare",
        help="compare policies over capacities, with the offline optimum",
        epilog=_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_trace_arguments(many)
    many.add_argument(
        "--policies",
        type=_policy_list,
        default=None,
        help="comma-separated names (default: every registered policy but ref_zero, which "
        "caches nothing, and priority, which is lru without retention hints)",
    )
    many.add_argument(
        "--capacities",
        type=_positive_list,
        default=DEFAULT_CAPACITIES,
        help="comma-separated capacities in blocks (default: 1000,5000,20000)",
    )
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
        action="store_true",
        help="replay through the dynamic-batching loop of prefixcache.reference.sim",
    )
    add_cluster_arguments(many)
    many.set_defaults(handler=_run_compare)
    return parser


def _add_trace_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--trace", type=Path, default=None, help="JSONL trace (default: the shipped sample)"
    )
    parser.add_argument(
        "--limit", type=_positive, default=None, help="replay the first N requests (N >= 1)"
    )
    parser.add_argument(
        "--no-progress",
        action="store_true",
        help="hide the progress line (shown only when stderr is a terminal)",
    )


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {text!r}")
    return value


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an int >= 0, got {text!r}")
    return value


def _positive_list(text: str) -> tuple[int, ...]:
    return tuple(dict.fromkeys(_positive(part) for part in text.split(",")))


def _check_arguments(args: argparse.Namespace) -> None:
    """Check what argparse cannot, and load the trace, before any replay runs.

    Sets ``args.trace_path``, ``args.requests`` and ``args.plot_target``.

    Raises:
        _BadArgument: naming the argument and the reason.
    """
    if hasattr(args, "capacity"):
        _check_memory("--capacity", args.capacity)
        _check_host_tier(args)
    else:
        _check_memory("--capacities", max(args.capacities))
    total = getattr(args, "total_capacity", None)
    if total is not None:
        if total < 1:
            raise _BadArgument("--total-capacity", f"expected an int >= 1, got {total}")
        _check_memory("--total-capacity", total)
        most = max(getattr(args, "workers", None) or [1])
        if total < most:
            raise _BadArgument(
                "--total-capacity", f"{total} blocks cannot be split over {most} workers"
            )
    args.plot_target = _plot_target(args)
    args.trace_path, args.requests = _load(args)


def _check_host_tier(args: argparse.Namespace) -> None:
    """``replay``'s host tier options: a usable policy, and a policy only with a tier."""
    if not args.host_capacity:
        if args.host_policy is not None:
            raise _BadArgument("--host-policy", "needs --host-capacity >= 1")
        return
    _check_memory("--host-capacity", args.capacity + args.host_capacity)
    if args.host_policy is None:
        args.host_policy = "lru"
    for argument, name in (("--policy", args.policy), ("--host-policy", args.host_policy)):
        if name in UNUSABLE_POLICIES:
            raise _BadArgument(argument, f"policy {name!r} cannot run with a host tier")


def _check_memory(argument: str, num_blocks: int) -> None:
    needed = num_blocks * BYTES_PER_BLOCK
    available = _physical_memory()
    if available is not None and needed > available:
        raise _BadArgument(
            argument,
            f"{num_blocks:,} blocks need about {needed / 2**30:,.1f} GiB of host memory; "
            f"this machine has {available / 2**30:,.1f} GiB",
        )


def _physical_memory() -> int | None:
    """Bytes of physical memory, or None where the platform does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def _plot_target(args: argparse.Namespace) -> Path | None:
    """Where ``compare`` writes its plot (None: no plot), checked before the replays."""
    if getattr(args, "handler", None) is not _run_compare or args.no_plot:
        return None
    if args.workers is not None:
        if args.plot is not None:
            raise _BadArgument("--plot", "--workers prints the cluster table; it writes no plot")
        return None
    if args.plot is None:
        return Path(DEFAULT_PLOT)
    target: Path = args.plot
    if target.is_dir():
        raise _BadArgument("--plot", f"{target} is a folder")
    if not target.suffix:
        target = target.with_suffix(".png")  # what matplotlib would write: say so
    if target.suffix.lower() not in PLOT_SUFFIXES:
        raise _BadArgument(
            "--plot", f"{target} has suffix {target.suffix!r}; use one of {PLOT_SUFFIXES}"
        )
    if not target.parent.is_dir():
        raise _BadArgument("--plot", f"folder {target.parent} does not exist")
    if target.is_dir():
        raise _BadArgument("--plot", f"{target} is a folder")
    _probe_writable(target)
    if not _has_matplotlib():
        raise _BadArgument(
            "--plot", "writing a plot needs matplotlib: pip install 'prefixcache[plot]'"
        )
    return target


def _probe_writable(target: Path) -> None:
    """Open ``target`` for appending (removing it again if it is new), so a plot that could
    not be written fails now, not after the replays."""
    existed = target.exists()
    try:
        with target.open("ab"):
            pass
        if not existed:
            target.unlink()
    except OSError as exc:
        raise _BadArgument("--plot", f"cannot write {target}: {exc.strerror or exc}") from exc


def _has_matplotlib() -> bool:
    try:
        importlib.import_module("matplotlib.figure")
    except ImportError:
        return False
    return True


def _policy_name(text: str) -> str:
    known = policies.available()
    if text not in known:
        raise argparse.ArgumentTypeError(
            f"unknown policy {text!r}; known policies: {', '.join(known)}"
        )
    return text


def _policy_list(text: str) -> tuple[str, ...]:
    return tuple(dict.fromkeys(_policy_name(part.strip()) for part in text.split(",")))


def _load(args: argparse.Namespace) -> tuple[Path, list[TraceRequest]]:
    path = args.trace if args.trace is not None else sample_trace_path()
    try:
        requests = load_mooncake_trace(path, limit=args.limit)
    except OSError as exc:
        raise _BadArgument("--trace", f"cannot read {path}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise _BadArgument(
            "--trace",
            f"{path} is not UTF-8 text (byte {exc.object[exc.start]:#04x} "
            f"at offset {exc.start} of a read chunk)",
        ) from exc
    except InvalidArgumentError as exc:
        raise _BadArgument("--trace", f"not a Mooncake JSONL trace: {exc}") from exc
    if not requests:
        raise _BadArgument("--trace", f"{path} holds no requests")
    return path, requests


def _run_replay(args: argparse.Namespace) -> int:
    path, requests = args.trace_path, args.requests
    if args.host_capacity:
        return _run_tiered_replay(args)
    result = replay(requests, args.capacity, args.policy, progress=_progress(args))
    print(f"trace:         {path} ({result.num_requests} requests)")
    print(f"policy:        {result.policy}, capacity {result.capacity} blocks")
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
    if args.concurrency and not _has_sim():
        print(
            "prefixcache: error: concurrency mode needs prefixcache.reference.sim", file=sys.stderr
        )
        return 1
    run = replay_concurrent if args.concurrency else replay
    path, requests = args.trace_path, args.requests
    results = {
        (name, capacity): run(requests, capacity, name, progress=_progress(args))
        for capacity in args.capacities
        for name in names
    }
    print(f"{path.name}: {len(requests)} requests, {_MODES[args.concurrency]}\n")
    print(results_table(results, names, args.capacities))
    if args.table:
        print(f"\n{share_table(results, names, args.capacities)}")
    if args.no_plot:
        return 0
    title = f"{path.name}, {'with' if args.concurrency else 'no'} concurrency"
    return write_plot(results, names, args.capacities, args.plot_target, title)


_MODES = {
    False: "one request at a time; hit rate = prompt blocks hit / prompt blocks",
    True: (
        "with concurrency (prefixcache.reference.sim); capacity = pool blocks; "
        "hit rate = prompt tokens served from cache / prompt tokens"
    ),
}


def _progress(args: argparse.Namespace) -> bool:
    """Draw progress only for a person watching: not asked away, and stderr a terminal."""
    return not args.no_progress and sys.stderr.isatty()


def _has_sim() -> bool:
    """Whether the optional dynamic-batching loop ``prefixcache.reference.sim`` can be imported."""
    try:
        importlib.import_module("prefixcache.reference.sim")
    except ImportError:
        return False
    return True
