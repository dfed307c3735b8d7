"""Writes a generated trace as Mooncake JSONL, so ``prefixcache compare --trace`` can
replay it.

Apart from the generators: writing is the one step that touches files.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from os import PathLike

from prefixcache.reference.trace import ENDS_CONVERSATION, TraceRequest


def write_mooncake_trace(requests: Sequence[TraceRequest], path: str | PathLike[str]) -> None:
    """Write ``requests`` as a Mooncake JSONL trace (readable by ``load_mooncake_trace``).

    A request that ends its conversation gets ``"ends_conversation": true``;
    the others get no such field, so their lines are plain Mooncake lines, as
    before the mark existed.

    Raises:
        OSError: the file cannot be written.

    Complexity: O(size of the trace).
    """
    with open(path, "w", encoding="utf-8") as file:
        for request in requests:
            record = {
                "timestamp": request.timestamp_ms,
                "input_length": request.input_length,
                "output_length": request.output_length,
                "hash_ids": list(request.hash_ids),
            }
            if request.ends_conversation:
                record[ENDS_CONVERSATION] = True
            file.write(json.dumps(record) + "\n")
