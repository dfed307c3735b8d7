"""Turning a user's own requests into a Mooncake-format trace: token IDs -> chained block IDs.

Mooncake's trace (``prefixcache/data/NOTICE``) gives each request's prompt as
``hash_ids``, one ID per block of tokens, "remapped" to small ints: two
prompts share a reusable prefix of ``k`` blocks exactly when their first ``k``
IDs are equal. :class:`TraceBuilder` makes such IDs from token IDs:

- a block's ID is a function of its parent block's ID and its own tokens, so
  equal prefixes give equal IDs and an equal block after a different prefix
  does not (the chaining of vLLM's and SGLang's block hashes);
- IDs are numbered 0, 1, 2, ... in order of first appearance, as Mooncake's are;
- the partial last block gets an ID of its own (keyed by its shorter run of
  tokens), as Mooncake's does: its sample's first request has 40,160 tokens
  and 79 IDs, ``ceil(40160 / 512)``. A replay counts it as a block; it matches
  only a request with the same partial tail.

A block is keyed by its parent's ID and a 128-bit XXH3 of its tokens, so the
builder's memory grows with distinct blocks, not with tokens.

The readers (:func:`read_token_requests`, :func:`read_chat_requests`, and
:func:`prefixcache.tools.vllm_log.read_vllm_log`) turn each input line into a
:class:`TokenRequest`; :func:`convert` chains them and writes the trace. A bad
line raises :class:`~prefixcache.errors.InvalidArgumentError` naming its number.

>>> builder = TraceBuilder(block_size=2)
>>> builder.hash_ids([5, 6, 7, 8, 9]), builder.hash_ids([5, 6, 7, 8, 1, 2])
([0, 1, 2], [0, 1, 3])
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import IO, Any

import xxhash

from prefixcache.engine.validation import is_int, is_number, require_flag
from prefixcache.errors import InvalidArgumentError
from prefixcache.reference.trace import ENDS_CONVERSATION, TRACE_BLOCK_SIZE

__all__ = [
    "ChatTokenizer",
    "TokenRequest",
    "TraceBuilder",
    "convert",
    "read_chat_requests",
    "read_token_requests",
]

ChatTokenizer = Callable[[list[dict[str, Any]]], Sequence[int]]
"""Chat messages (OpenAI's ``[{"role": ..., "content": ...}]``) -> the prompt's token IDs."""

TOKEN_FIELDS = ("token_ids", "prompt_token_ids", "input_ids")
"""Where a token-ID line may hold its prompt (the first present is used)."""
SESSION_FIELDS = ("session_id", "conversation_id")


@dataclass(frozen=True, slots=True)
class TokenRequest:
    """One request as token IDs, before its blocks are chained.

    Attributes:
        line: the input line it came from (1-based), for error messages.
        token_ids: the prompt's tokens.
        timestamp_ms: arrival time in milliseconds (None: not given).
        output_length: tokens generated (0 when the input does not say).
        session_id: the conversation it belongs to, if the input names one.
        ends_conversation: the input marks it its conversation's last turn
            (``"ends_conversation": true``: the client closed the chat).
    """

    line: int
    token_ids: Sequence[int]
    timestamp_ms: float | None = None
    output_length: int = 0
    session_id: str | int | None = None
    ends_conversation: bool = False


class TraceBuilder:
    """Chained, remapped block IDs for token sequences (see the module docstring).

    Complexity: O(tokens) per request; memory O(distinct blocks).
    """

    def __init__(self, block_size: int = TRACE_BLOCK_SIZE) -> None:
        if not is_int(block_size) or block_size < 1:
            raise InvalidArgumentError(f"block_size must be an int >= 1, got {block_size!r}")
        self.block_size = int(block_size)
        self._ids: dict[tuple[int, int], int] = {}

    @property
    def num_blocks(self) -> int:
        """Distinct blocks seen so far (the next ID)."""
        return len(self._ids)

    def hash_ids(self, token_ids: Sequence[int]) -> list[int]:
        """The chained ID of each block of ``token_ids``, the partial last one included.

        Raises:
            InvalidArgumentError: a token is not an int in ``[0, 2**63)``.
        """
        try:
            data = array("q", token_ids)
        except (TypeError, OverflowError) as exc:
            raise InvalidArgumentError(f"token IDs must be ints in [0, 2**63): {exc}") from exc
        if data and min(data) < 0:
            raise InvalidArgumentError(f"token IDs must be >= 0, got {min(data)}")
        ids: list[int] = []
        parent = -1
        step = self.block_size
        for start in range(0, len(data), step):
            key = (parent, xxhash.xxh3_128_intdigest(data[start : start + step].tobytes()))
            parent = self._ids.setdefault(key, len(self._ids))
            ids.append(parent)
        return ids


def convert(requests: Iterable[TokenRequest], out: IO[str], block_size: int) -> int:
    """Write ``requests`` to ``out`` as Mooncake JSONL; return how many were written.

    Timestamps become milliseconds since the first request's (a request
    without one takes the previous request's; all missing: 0). They must not
    go backwards: a trace is in arrival order. A request's ``session_id``, if
    any, is kept as an extra field (the loader ignores it); ``ends_conversation``
    is written as ``true`` on the requests that carry it (the loader reads it).

    Raises:
        InvalidArgumentError: naming the line of a request that goes back in
            time or has an empty prompt, or a bad token; or no requests at all.

    Complexity: O(tokens).
    """
    builder = TraceBuilder(block_size)
    first: float | None = None
    last = 0
    count = 0
    for request in requests:
        where = f"line {request.line}"
        if not request.token_ids:
            raise InvalidArgumentError(f"{where}: the prompt has no tokens")
        try:
            hash_ids = builder.hash_ids(request.token_ids)
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(f"{where}: {exc}") from None
        timestamp = last
        if request.timestamp_ms is not None:
            first = request.timestamp_ms if first is None else first
            timestamp = round(request.timestamp_ms - first)
            if timestamp < last:
                raise InvalidArgumentError(
                    f"{where}: timestamp {request.timestamp_ms} is earlier than the line "
                    "before it; sort the requests by arrival first"
                )
        last = timestamp
        record: dict[str, Any] = {
            "timestamp": timestamp,
            "input_length": len(request.token_ids),
            "output_length": request.output_length,
            "hash_ids": hash_ids,
        }
        if request.session_id is not None:
            record["session_id"] = request.session_id
        if request.ends_conversation:
            record[ENDS_CONVERSATION] = True
        out.write(json.dumps(record) + "\n")
        count += 1
    if count == 0:
        raise InvalidArgumentError("no requests in the input")
    return count


def json_lines(lines: Iterable[str]) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line number, object)`` for each non-blank line, refusing what is not a JSON object."""
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (ValueError, RecursionError) as exc:
            raise InvalidArgumentError(f"line {number}: not valid JSON ({exc})") from None
        if not isinstance(record, dict):
            raise InvalidArgumentError(
                f"line {number}: expected a JSON object, got {type(record).__name__}"
            )
        yield number, record


def read_token_requests(lines: Iterable[str]) -> Iterator[TokenRequest]:
    """Requests from token-ID JSONL: ``{"token_ids": [...], "session_id": ..., "timestamp":
    ms, "output_length": n, "ends_conversation": true}`` a line; only the tokens are
    required (also read from ``prompt_token_ids`` or ``input_ids``; ``conversation_id``
    for the session).

    Raises:
        InvalidArgumentError: naming the line that breaks the format.
    """
    for number, record in json_lines(lines):
        field = next((name for name in TOKEN_FIELDS if name in record), None)
        if field is None:
            raise InvalidArgumentError(
                f"line {number}: no token IDs (expected a field {' or '.join(TOKEN_FIELDS)})"
            )
        tokens = record[field]
        if not isinstance(tokens, list) or not all(_is_token(t) for t in tokens):
            raise InvalidArgumentError(
                f"line {number}: {field} must be a list of ints in [0, 2**63)"
            )
        yield _request(number, tokens, record)


def read_chat_requests(lines: Iterable[str], tokenizer: ChatTokenizer) -> Iterator[TokenRequest]:
    """Requests from OpenAI-style chat JSONL, ``{"messages": [{"role", "content"}, ...]}`` a
    line (``timestamp``, ``output_length``, ``session_id`` optional, as for token IDs),
    each prompt tokenized by ``tokenizer`` (:func:`prefixcache.tools.tokenizer.load_tokenizer`).

    Raises:
        InvalidArgumentError: naming the line whose messages are missing or malformed,
            or that the tokenizer refused.
    """
    for number, record in json_lines(lines):
        messages = record.get("messages")
        if not isinstance(messages, list) or not messages:
            raise InvalidArgumentError(f"line {number}: expected a non-empty list 'messages'")
        for message in messages:
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise InvalidArgumentError(
                    f"line {number}: each message must be an object with a string 'role'"
                )
            if not isinstance(message.get("content"), (str, list, type(None))):
                raise InvalidArgumentError(
                    f"line {number}: a message's 'content' must be a string or a list of parts"
                )
        try:
            tokens = list(tokenizer(messages))
        except Exception as exc:  # the user's tokenizer: any failure is this line's
            raise InvalidArgumentError(f"line {number}: the tokenizer failed: {exc}") from exc
        if not all(_is_token(t) for t in tokens):
            raise InvalidArgumentError(
                f"line {number}: the tokenizer returned something other than token IDs"
            )
        yield _request(number, tokens, record)


def _request(number: int, tokens: Sequence[int], record: dict[str, Any]) -> TokenRequest:
    """The optional fields of a line, checked."""
    timestamp = record.get("timestamp")
    if timestamp is not None and (not is_number(timestamp) or timestamp < 0):
        raise InvalidArgumentError(
            f"line {number}: timestamp must be a number of milliseconds >= 0, got {timestamp!r}"
        )
    output_length = record.get("output_length", 0)
    if not is_int(output_length) or output_length < 0:
        raise InvalidArgumentError(
            f"line {number}: output_length must be an int >= 0, got {output_length!r}"
        )
    ends = require_flag(record.get(ENDS_CONVERSATION, False), f"line {number}: {ENDS_CONVERSATION}")
    session = next((record[name] for name in SESSION_FIELDS if name in record), None)
    if session is not None and not (isinstance(session, str) or is_int(session)):
        raise InvalidArgumentError(
            f"line {number}: a session id must be a string or an int, got {session!r}"
        )
    return TokenRequest(
        number,
        tokens,
        None if timestamp is None else float(timestamp),
        int(output_length),
        session if session is None or isinstance(session, str) else int(session),
        ends,
    )


def _is_token(value: object) -> bool:
    return is_int(value) and bool(value >= 0)  # is_int bounds it below 2**63
