"""``prefixcache convert``: a user's own requests as a Mooncake trace for ``replay``, ``compare``
and ``sweep``.

Three inputs (``--from``), each JSON Lines or a log, one request a line:

- ``tokens``: ``{"token_ids": [...]}`` with optional ``session_id``, ``timestamp`` (ms),
  ``output_length`` and ``ends_conversation`` (true on the last turn of a conversation
  the client closed; kept in the trace) (:func:`prefixcache.tools.convert.read_token_requests`);
- ``chat``: OpenAI-style ``{"messages": [{"role", "content"}, ...]}``, tokenized by
  ``--tokenizer`` (:mod:`prefixcache.tools.tokenizer`);
- ``vllm``: a vLLM server log written with ``--enable-log-requests --log-level DEBUG``
  (:mod:`prefixcache.tools.vllm_log`).

::

    $ prefixcache convert requests.jsonl -o trace.jsonl
    $ prefixcache convert chats.jsonl --from chat --tokenizer meta-llama/Llama-3.1-8B -o trace.jsonl

The trace is written to a temporary file beside ``--output`` and renamed when
every line converted, so a bad line (the error names it) leaves no half trace.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from prefixcache.errors import InvalidArgumentError
from prefixcache.reference.trace import TRACE_BLOCK_SIZE
from prefixcache.tools.cli_arguments import BadArgument, positive
from prefixcache.tools.convert import convert, read_chat_requests, read_token_requests
from prefixcache.tools.tokenizer import load_tokenizer
from prefixcache.tools.vllm_log import read_vllm_log

__all__ = ["add_convert_parser"]

SOURCES = ("tokens", "chat", "vllm")


def add_convert_parser(commands: Any) -> None:
    """The ``convert`` command's arguments, on the ``prefixcache`` command's subparsers."""
    parser = commands.add_parser(
        "convert",
        help="turn token-ID JSONL, chat logs or vLLM request logs into a Mooncake trace",
        description="Write a Mooncake-format trace (JSONL) from your own requests. Block IDs "
        "are chained as Mooncake's are: requests that share a prefix share their leading IDs; "
        "a partial last block gets an ID of its own. A bad line stops it, naming the line.",
    )
    parser.add_argument("input", type=Path, help="the file to convert")
    parser.add_argument(
        "--from",
        dest="source",
        choices=SOURCES,
        default="tokens",
        help='tokens: {"token_ids": [...]} a line (default); chat: {"messages": [...]} a '
        "line, needs --tokenizer; vllm: a vLLM log with --enable-log-requests",
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="for --from chat: a Hugging Face model name or folder (needs transformers), or "
        "module:function, a callable from messages to token IDs",
    )
    parser.add_argument(
        "--block-size",
        type=positive,
        default=TRACE_BLOCK_SIZE,
        help=f"tokens per block (default: {TRACE_BLOCK_SIZE}, Mooncake's); give the same "
        "--block-size to replay, compare and sweep",
    )
    parser.add_argument(
        "-o", "--output", type=Path, default=None, help="the trace to write (default: stdout)"
    )
    parser.set_defaults(handler=_run_convert, check=_check_convert)


def _check_convert(args: argparse.Namespace) -> None:
    """Everything but the lines themselves, before anything is read or written."""
    if not args.input.is_file():
        raise BadArgument("input", f"{args.input} is not a file")
    if not os.access(args.input, os.R_OK):
        raise BadArgument("input", f"cannot read {args.input}")
    if args.source == "chat" and args.tokenizer is None:
        raise BadArgument("--tokenizer", "--from chat needs a tokenizer (a model name)")
    if args.source != "chat" and args.tokenizer is not None:
        raise BadArgument("--tokenizer", f"--from {args.source} holds token IDs already")
    if args.output is not None:
        if args.output.is_dir():
            raise BadArgument("--output", f"{args.output} is a folder")
        if not args.output.parent.is_dir():
            raise BadArgument("--output", f"folder {args.output.parent} does not exist")
        if args.output.resolve() == args.input.resolve():
            raise BadArgument("--output", "would overwrite the input")
    args.chat_tokenizer = None
    if args.tokenizer is not None:
        try:
            args.chat_tokenizer = load_tokenizer(args.tokenizer)
        except InvalidArgumentError as exc:
            raise BadArgument("--tokenizer", str(exc)) from None


def _run_convert(args: argparse.Namespace) -> int:
    with open(args.input, encoding="utf-8") as lines:
        if args.source == "chat":
            requests = read_chat_requests(lines, args.chat_tokenizer)
        elif args.source == "vllm":
            requests = read_vllm_log(lines)
        else:
            requests = read_token_requests(lines)
        try:
            count = _write(requests, args.output, args.block_size)
        except UnicodeDecodeError as exc:
            raise InvalidArgumentError(f"{args.input} is not UTF-8 text ({exc.reason})") from None
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(f"{args.input}, {exc}") from None
    where = args.output if args.output is not None else "stdout"
    report = sys.stderr if args.output is None else sys.stdout
    print(
        f"wrote {count} requests in {args.block_size}-token blocks to {where}",
        file=report,
    )
    return 0


def _write(requests: Any, output: Path | None, block_size: int) -> int:
    """Convert into ``output`` through a temporary file (or to stdout when None)."""
    if output is None:
        return convert(requests, sys.stdout, block_size)
    handle, temporary = tempfile.mkstemp(dir=output.parent, prefix=f".{output.name}.")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            count = convert(requests, out, block_size)
        os.replace(temporary, output)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
    return count
