"""The ``prefixcache`` command's arguments: parsed types and every check before any replay.

Every argument is checked before any replay starts: the trace is read and
parsed whole, sizes are checked against this machine's memory, the plot's
folder must exist and be writable. A bad argument raises :class:`BadArgument`,
which the command prints as one line, ``prefixcache: error: argument --NAME:
why``, exiting with status 2.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

from prefixcache import policies
from prefixcache.errors import InvalidArgumentError
from prefixcache.reference.trace import (
    TRACE_BLOCK_SIZE,
    TraceRequest,
    load_mooncake_trace,
    sample_trace_path,
)
from prefixcache.tiers import UNUSABLE_POLICIES
from prefixcache.tools.memory import (
    ByteSize,
    ModelShape,
    format_bytes,
    parse_capacity,
    parse_model_shape,
)

DEFAULT_PLOT = "prefixcache_compare.png"
PLOT_SUFFIXES = (".png", ".pdf", ".svg")
"""Formats ``--plot`` writes; a name without a suffix gets ``.png``."""
BYTES_PER_BLOCK = 512
"""A bound on the host memory one block of capacity costs a replay (the allocator
measures about 185 bytes a cached block; policies, hashes and the trace add to it)."""


class BadArgument(Exception):
    """An argument that parsed but cannot be used; exits with status 2."""

    def __init__(self, argument: str, message: str) -> None:
        super().__init__(message)
        self.argument = argument


def positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {text!r}")
    return value


def non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an int >= 0, got {text!r}")
    return value


def positive_list(text: str) -> tuple[int, ...]:
    return tuple(dict.fromkeys(positive(part) for part in text.split(",")))


def capacity(text: str) -> int:
    """Blocks (``5000``) or bytes (``8GiB``: a :class:`~prefixcache.tools.memory.ByteSize`,
    resolved to blocks with ``--model-shape`` by :func:`check_arguments`)."""
    try:
        return parse_capacity(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def capacity_list(text: str) -> tuple[int, ...]:
    return tuple(capacity(part) for part in text.split(","))


def model_shape(text: str) -> ModelShape:
    try:
        return parse_model_shape(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_trace_arguments(parser: argparse.ArgumentParser) -> None:
    """``--trace``, ``--limit``, ``--no-progress``: how every replaying command reads its trace."""
    parser.add_argument(
        "--trace", type=Path, default=None, help="JSONL trace (default: the shipped sample)"
    )
    parser.add_argument(
        "--limit", type=positive, default=None, help="replay the first N requests (N >= 1)"
    )
    parser.add_argument(
        "--no-progress",
        action="store_true",
        help="hide the progress line (shown only when stderr is a terminal)",
    )


def add_memory_arguments(parser: argparse.ArgumentParser) -> None:
    """``--model-shape`` and ``--block-size``: what turns a capacity in bytes into blocks."""
    parser.add_argument(
        "--model-shape",
        type=model_shape,
        default=None,
        metavar="layers=L,kv_heads=H,head_dim=D,dtype=T",
        help="the model's KV shape, for capacities in bytes (e.g. 8GiB); dtype one of "
        "fp32, fp16, bf16, fp8, int8. Bytes per block = 2 (K, V) x layers x kv_heads x "
        "head_dim x dtype bytes x block size",
    )
    parser.add_argument(
        "--block-size",
        type=positive,
        default=TRACE_BLOCK_SIZE,
        help=f"tokens per trace block, as `prefixcache convert --block-size` wrote them "
        f"(default: {TRACE_BLOCK_SIZE}, Mooncake's)",
    )


def show_progress(args: argparse.Namespace) -> bool:
    """Draw progress only for a person watching: not asked away, and stderr a terminal."""
    return not args.no_progress and sys.stderr.isatty()


def resolve_capacities(args: argparse.Namespace) -> list[str]:
    """Turn capacities given in bytes into blocks, in place; return what to tell the user.

    ``args.capacity`` (replay) or ``args.capacities`` (compare, sweep) may hold
    :class:`~prefixcache.tools.memory.ByteSize` values; they need ``--model-shape``.
    Each becomes ``bytes // bytes per block`` blocks, which must be at least 1.
    Returns one line on the bytes a block takes and one per capacity in bytes.

    Raises:
        BadArgument: bytes without a shape or with ``--workers``, or a size that holds no
            block.
    """
    argument = "--capacity" if hasattr(args, "capacity") else "--capacities"
    given = (args.capacity,) if hasattr(args, "capacity") else tuple(args.capacities or ())
    shape = getattr(args, "model_shape", None)
    in_bytes = any(isinstance(value, ByteSize) for value in given)
    if in_bytes and getattr(args, "workers", None):
        raise BadArgument(argument, "--workers sizes the cluster in blocks, with --total-capacity")
    if shape is None:
        if in_bytes:
            raise BadArgument(
                argument,
                "a capacity in bytes needs --model-shape (e.g. "
                "layers=32,kv_heads=8,head_dim=128,dtype=bf16)",
            )
        return []
    block_bytes = shape.bytes_per_block(args.block_size)
    notes = [f"bytes per block: {shape.describe(args.block_size)}"]
    blocks = []
    for value in given:
        if not isinstance(value, ByteSize):
            blocks.append(value)
            continue
        count = value // block_bytes
        if count < 1:
            raise BadArgument(
                argument, f"{format_bytes(value)} holds no block of {format_bytes(block_bytes)}"
            )
        notes.append(f"capacity {format_bytes(value)} = {count:,} blocks")
        blocks.append(count)
    if hasattr(args, "capacity"):
        args.capacity = blocks[0]
    elif args.capacities is not None:
        args.capacities = tuple(dict.fromkeys(blocks))
    return notes


def check_arguments(args: argparse.Namespace) -> None:
    """Check what argparse cannot, and load the trace, before any replay runs.

    Sets ``args.trace_path``, ``args.requests``, ``args.plot_target`` and
    ``args.notes`` (lines the command prints first: capacities in bytes resolved).

    Raises:
        BadArgument: naming the argument and the reason.
    """
    args.notes = resolve_capacities(args)
    _check_block_size(args)
    if getattr(args, "queue_hints", False) and getattr(args, "concurrency", None) is None:
        raise BadArgument("--queue-hints", "needs --concurrency (hints come from a waiting queue)")
    if getattr(args, "conversation_ends", False):
        for option in ("host_capacity", "workers"):
            if getattr(args, option, None):
                flag = "--" + option.replace("_", "-")
                raise BadArgument("--conversation-ends", f"not with {flag}")
    if hasattr(args, "capacity"):
        _check_memory("--capacity", args.capacity)
        _check_host_tier(args)
    elif args.capacities is not None:  # sweep: None until the trace says (sweep.py)
        _check_memory("--capacities", max(args.capacities))
    total = getattr(args, "total_capacity", None)
    if total is not None:
        if total < 1:
            raise BadArgument("--total-capacity", f"expected an int >= 1, got {total}")
        _check_memory("--total-capacity", total)
        most = max(getattr(args, "workers", None) or [1])
        if total < most:
            raise BadArgument(
                "--total-capacity", f"{total} blocks cannot be split over {most} workers"
            )
    args.plot_target = _plot_target(args)
    args.trace_path, args.requests = _load(args)


def _check_block_size(args: argparse.Namespace) -> None:
    """Only the one-at-a-time replay takes another block size: the concurrent and cluster
    replays size requests in Mooncake's 512-token blocks."""
    if args.block_size == TRACE_BLOCK_SIZE:
        return
    for option in ("concurrency", "workers"):
        if getattr(args, option, None):
            flag = "--" + option.replace("_", "-")
            raise BadArgument(
                "--block-size", f"{flag} replays {TRACE_BLOCK_SIZE}-token blocks only"
            )


def _check_host_tier(args: argparse.Namespace) -> None:
    """``replay``'s host tier options: a usable policy, and a policy only with a tier."""
    if not args.host_capacity:
        if args.host_policy is not None:
            raise BadArgument("--host-policy", "needs --host-capacity >= 1")
        return
    _check_memory("--host-capacity", args.capacity + args.host_capacity)
    if args.host_policy is None:
        args.host_policy = "lru"
    for argument, name in (("--policy", args.policy), ("--host-policy", args.host_policy)):
        if name in UNUSABLE_POLICIES:
            raise BadArgument(argument, f"policy {name!r} cannot run with a host tier")


def _check_memory(argument: str, num_blocks: int) -> None:
    needed = num_blocks * BYTES_PER_BLOCK
    available = _physical_memory()
    if available is not None and needed > available:
        raise BadArgument(
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
    if getattr(args, "command", None) != "compare" or args.no_plot:
        return None
    if args.workers is not None:
        if args.plot is not None:
            raise BadArgument("--plot", "--workers prints the cluster table; it writes no plot")
        return None
    if args.plot is None:
        return Path(DEFAULT_PLOT)
    target: Path = args.plot
    if target.is_dir():
        raise BadArgument("--plot", f"{target} is a folder")
    if not target.suffix:
        target = target.with_suffix(".png")  # what matplotlib would write: say so
    if target.suffix.lower() not in PLOT_SUFFIXES:
        raise BadArgument(
            "--plot", f"{target} has suffix {target.suffix!r}; use one of {PLOT_SUFFIXES}"
        )
    if not target.parent.is_dir():
        raise BadArgument("--plot", f"folder {target.parent} does not exist")
    if target.is_dir():
        raise BadArgument("--plot", f"{target} is a folder")
    _probe_writable(target)
    if not has_matplotlib():
        raise BadArgument(
            "--plot", "writing a plot needs matplotlib: pip install -e '.[plot]' in a clone"
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
        raise BadArgument("--plot", f"cannot write {target}: {exc.strerror or exc}") from exc


def has_matplotlib() -> bool:
    try:
        importlib.import_module("matplotlib.figure")
    except ImportError:
        return False
    return True


def policy_name(text: str) -> str:
    known = policies.available()
    if text not in known:
        raise argparse.ArgumentTypeError(
            f"unknown policy {text!r}; known policies: {', '.join(known)}"
        )
    return text


def policy_list(text: str) -> tuple[str, ...]:
    return tuple(dict.fromkeys(policy_name(part.strip()) for part in text.split(",")))


def _load(args: argparse.Namespace) -> tuple[Path, list[TraceRequest]]:
    path = args.trace if args.trace is not None else sample_trace_path()
    try:
        requests = load_mooncake_trace(path, limit=args.limit)
    except OSError as exc:
        raise BadArgument("--trace", f"cannot read {path}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise BadArgument(
            "--trace",
            f"{path} is not UTF-8 text (byte {exc.object[exc.start]:#04x} "
            f"at offset {exc.start} of a read chunk)",
        ) from exc
    except InvalidArgumentError as exc:
        raise BadArgument("--trace", f"not a Mooncake JSONL trace: {exc}") from exc
    if not requests:
        raise BadArgument("--trace", f"{path} holds no requests")
    return path, requests
