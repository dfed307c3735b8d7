"""Requests from a vLLM server's log: the prompt token IDs ``--enable-log-requests`` writes.

vLLM's OpenAI server started with ``--enable-log-requests --log-level DEBUG``
logs each request's prompt as token IDs (``vllm/entrypoints/serve/utils/
request_logger.py``, ``RequestLogger.log_inputs``, vLLM 0.33)::

    (APIServer pid=7) DEBUG 11-29 03:22:53 [request_logger.py:56] Request cmpl-1 details:
    prompt: 'Hi', prompt_token_ids: [9906, 0], prompt_embeds shape: None.

(one line). Older releases (vLLM 0.6 to 0.10, ``vllm/entrypoints/logger.py``)
log the IDs at INFO: ``INFO 11-29 03:22:53 logger.py:39] Received request
cmpl-1: prompt: 'Hi', params: SamplingParams(...), prompt_token_ids: [9906, 0],
lora_request: None ...``. Both are read. With ``--enable-log-outputs`` as well,
``Generated response cmpl-1 details: output_token_ids: [...]`` (DEBUG) gives a
request's output length; without it the output length is 0.

The timestamp is the line's ``MM-DD HH:MM:SS`` (vLLM's log format: no year,
whole seconds), so arrival times are exact to a second. Every other line of the
log is skipped. ``--max-log-len N`` makes vLLM cut each prompt to ``N`` tokens:
run the server without it, or the trace holds the cut prompts.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from datetime import datetime

from prefixcache.errors import InvalidArgumentError
from prefixcache.tools.convert import TokenRequest

__all__ = ["read_vllm_log"]

_REQUEST = re.compile(r"(?:\] Request (\S+) details|Received request (\S+?)):")
_OUTPUT = re.compile(r"Generated response (\S+?)(?: \(streaming complete\))? details: ")
_TIME = re.compile(r"(?:DEBUG|INFO|WARNING) (\d\d-\d\d \d\d:\d\d:\d\d)")


def read_vllm_log(lines: Iterable[str]) -> Iterator[TokenRequest]:
    """The requests a vLLM log holds, in the order they were logged.

    Raises:
        InvalidArgumentError: naming a request line whose token IDs cannot be read,
            or the log when it holds no request with token IDs at all (the message
            says which vLLM flags write them).

    Complexity: O(size of the log).
    """
    requests: list[tuple[str, TokenRequest]] = []  # (vLLM's request ID, the request)
    outputs: dict[str, int] = {}
    for number, line in enumerate(lines, start=1):
        match = _REQUEST.search(line)
        if match and "prompt_token_ids: [" in line:
            token_ids = _token_ids(line, "prompt_token_ids: [", number)
            request_id = match.group(1) or match.group(2)
            requests.append((request_id, TokenRequest(number, token_ids, _timestamp(line))))
            continue
        output = _OUTPUT.search(line)
        if output and "output_token_ids: [" in line:
            outputs[output.group(1)] = len(_token_ids(line, "output_token_ids: [", number))
    if not requests:
        raise InvalidArgumentError(
            "no request with prompt_token_ids in the log: start vLLM with "
            "--enable-log-requests --log-level DEBUG (vLLM >= 0.11; INFO before)"
        )
    for request_id, request in requests:
        yield TokenRequest(
            request.line, request.token_ids, request.timestamp_ms, outputs.get(request_id, 0)
        )


def _token_ids(line: str, marker: str, number: int) -> list[int]:
    start = line.rfind(marker) + len(marker)  # the last: a prompt's text may hold the marker
    end = line.find("]", start)
    body = line[start:end].strip() if end >= 0 else None
    try:
        if body is None:
            raise ValueError("no closing ]")
        return [int(part) for part in body.split(",")] if body else []
    except ValueError as exc:
        raise InvalidArgumentError(f"line {number}: unreadable {marker[:-3]} ({exc})") from None


def _timestamp(line: str) -> float | None:
    """Milliseconds since 1 January of a leap year (vLLM logs no year), or None."""
    match = _TIME.search(line)
    if match is None:
        return None
    try:
        when = datetime.strptime(f"2000-{match.group(1)}", "%Y-%m-%d %H:%M:%S")
    except ValueError:
        return None
    return (when - datetime(2000, 1, 1)).total_seconds() * 1000.0
