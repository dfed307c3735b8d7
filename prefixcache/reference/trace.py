"""Mooncake-format request traces: loading them and hashing their blocks.

A trace is JSON Lines, one request a line, as published with the Mooncake
FAST'25 paper (see ``prefixcache/data/NOTICE``)::

    {"timestamp": 0, "input_length": 40160, "output_length": 6, "hash_ids": [0, 1, 2]}

A line may also say ``"ends_conversation": true``: the request is the last turn
of a conversation its client closed (DESIGN.md, "Scheduler hints": a
conversation's end). The field is optional and False when absent, so traces
written before it existed read as they did.

``hash_ids`` holds one ID per 512-token block of the prompt (the last block
may be partial); two requests share a reusable prefix of ``k`` blocks when
their first ``k`` IDs are equal. :func:`trace_block_hashes` turns those IDs
into the chained hashes the allocator registers, so that equal IDs at equal
positions under an equal prefix map to equal hashes and nothing else does.

>>> requests = load_mooncake_trace(sample_trace_path(), limit=2)
>>> requests[0].hash_ids[:3], requests[0].num_blocks
((0, 1, 2), 79)
>>> first = trace_block_hashes([7, 8, 9])
>>> trace_block_hashes([7, 8]) == first[:2], trace_block_hashes([6, 8])[1] == first[1]
(True, False)
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from os import PathLike
from pathlib import Path
from typing import IO, Any

import xxhash

from prefixcache.engine.validation import is_int, require_flag, require_int
from prefixcache.errors import InvalidArgumentError

__all__ = [
    "ENDS_CONVERSATION",
    "TRACE_BLOCK_SIZE",
    "TraceRequest",
    "load_mooncake_trace",
    "sample_trace_path",
    "trace_block_hashes",
]

TRACE_BLOCK_SIZE = 512
"""Tokens per block in Mooncake traces: one ``hash_ids`` entry covers this many tokens."""

_MASK63 = (1 << 63) - 1
_INT64 = struct.Struct("<q")
# Parent of every chain's first block: derived from a fixed tag of its own, so
# trace chains do not start from any root that prefixcache.engine.hashing derives.
_TRACE_ROOT = xxhash.xxh3_64_intdigest(b"prefixcache.trace.root.v1") & _MASK63 or 1
_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")
ENDS_CONVERSATION = "ends_conversation"
"""The optional field (a JSON bool, False when absent) that marks a conversation's last turn."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace.

    Attributes:
        timestamp_ms: arrival time in milliseconds since the trace's first request.
        input_length: prompt length in tokens.
        output_length: tokens to generate.
        hash_ids: one ID per ``TRACE_BLOCK_SIZE``-token prompt block, in order.
        ends_conversation: the request is the last turn of a conversation its
            client ends explicitly (a replay may then call ``end_conversation``
            once it finishes). An abandoned conversation is not marked: its
            client does not know it is over.
    """

    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]
    ends_conversation: bool = False

    @property
    def num_blocks(self) -> int:
        """Prompt blocks, the partial last one included."""
        return len(self.hash_ids)


def load_mooncake_trace(
    path_or_file: str | PathLike[str] | IO[str], limit: int | None = None
) -> list[TraceRequest]:
    """Read a Mooncake JSONL trace, in file order.

    Blank lines are skipped. Every line is validated: the four fields must be
    present, the lengths non-negative ints, ``hash_ids`` a list of
    non-negative ints below ``2**63``; ``ends_conversation``, when present, a
    JSON bool (absent: False).

    Args:
        path_or_file: a path, or an open text file (read from its position).
        limit: read at most this many requests (None: all).

    Returns:
        The requests as :class:`TraceRequest` objects.

    Raises:
        InvalidArgumentError: a line is not JSON or breaks the format (the
            message names the line number), or ``limit`` is negative.
        OSError: the file cannot be opened.

    Complexity: O(size of the file read).
    """
    if limit is not None:
        limit = require_int(limit, "limit", minimum=0)
    if isinstance(path_or_file, (str, PathLike)):
        with open(path_or_file, encoding="utf-8") as file:
            return _read_requests(file, limit, str(path_or_file))
    return _read_requests(path_or_file, limit, getattr(path_or_file, "name", "<file>"))


def _read_requests(lines: Iterable[str], limit: int | None, source: str) -> list[TraceRequest]:
    requests: list[TraceRequest] = []
    for line_number, line in enumerate(lines, start=1):
        if limit is not None and len(requests) >= limit:
            break
        if line.strip():
            requests.append(_parse_line(line, line_number, source))
    return requests


def _parse_line(line: str, line_number: int, source: str) -> TraceRequest:
    where = f"{source}, line {line_number}"
    try:
        record: Any = json.loads(line)
    except json.JSONDecodeError as exc:
        raise InvalidArgumentError(f"{where}: not valid JSON ({exc.msg})") from exc
    except (ValueError, RecursionError) as exc:  # a 5,000-digit int; nesting past the stack
        raise InvalidArgumentError(f"{where}: not a usable JSON line ({exc})") from exc
    if not isinstance(record, dict):
        raise InvalidArgumentError(f"{where}: expected a JSON object, got {type(record).__name__}")
    missing = [field for field in _FIELDS if field not in record]
    if missing:
        raise InvalidArgumentError(f"{where}: missing field(s) {', '.join(missing)}")
    for field in _FIELDS[:3]:
        if not _is_count(record[field]):
            raise InvalidArgumentError(
                f"{where}: {field} must be an int >= 0, got {record[field]!r}"
            )
    hash_ids = record["hash_ids"]
    if not isinstance(hash_ids, list):
        raise InvalidArgumentError(f"{where}: hash_ids must be a list, got {hash_ids!r}")
    for hash_id in hash_ids:
        if not _is_count(hash_id) or hash_id > _MASK63:
            raise InvalidArgumentError(
                f"{where}: hash_ids must hold ints in [0, 2**63), got {hash_id!r}"
            )
    ends = require_flag(record.get(ENDS_CONVERSATION, False), f"{where}: {ENDS_CONVERSATION}")
    return TraceRequest(
        record["timestamp"], record["input_length"], record["output_length"], tuple(hash_ids), ends
    )


def _is_count(value: object) -> bool:
    return is_int(value) and bool(value >= 0)  # a numpy count compares to a numpy bool


def trace_block_hashes(hash_ids: Iterable[int]) -> list[int]:
    """Chain a request's trace hash IDs into allocator block hashes.

    Hash ``i`` is ``XXH3-64(hash_ids[i] as little-endian int64, seed=hash
    i - 1)`` folded into a positive 63-bit int (0 maps to 1), with a fixed
    root seed before the first block, as :mod:`prefixcache.engine.hashing` chains
    token blocks. So hash ``i`` depends on every ID up to ``i``: equal IDs at
    equal positions under an equal prefix give equal hashes, and an equal ID
    after a different prefix gives a different one (up to 64-bit collisions).
    Every hash is nonzero and fits an int64 (sentinels 0 and -1 stay free).

    Args:
        hash_ids: the request's IDs, ints in ``[-2**63, 2**63)``.

    Returns:
        One hash per ID, in order.

    Raises:
        InvalidArgumentError: an ID is not an int or out of int64 range.

    Complexity: O(len(hash_ids)), one XXH3 call per ID.
    """
    digest, pack = xxhash.xxh3_64_intdigest, _INT64.pack
    hashes: list[int] = []
    parent = _TRACE_ROOT
    for hash_id in hash_ids:
        if type(hash_id) is not int:  # a Python int's range is the pack's to check
            if not is_int(hash_id):
                raise InvalidArgumentError(f"trace hash IDs must be ints, got {hash_id!r}")
            hash_id = int(hash_id)
        try:
            data = pack(hash_id)
        except struct.error as exc:
            raise InvalidArgumentError(f"trace hash ID {hash_id} is outside int64") from exc
        parent = digest(data, seed=parent) & _MASK63 or 1
        hashes.append(parent)
    return hashes


def sample_trace_path() -> Path:
    """Path of the sample trace shipped in the package.

    The first 1,500 requests of the Mooncake synthetic trace; see
    ``prefixcache/data/NOTICE`` for its origin and licence.

    Complexity: O(1).
    """
    return Path(__file__).resolve().parent.parent / "data" / "mooncake_sample.jsonl"
