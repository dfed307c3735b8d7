"""The documents-with-hot-prefixes family, the scan-heavy mix: a scan of one-off long
documents mixed with requests on a few hot prefixes.

One family a module, so each generator reads on its own.
"""

from __future__ import annotations

import random
from itertools import count

from prefixcache.engine.validation import require_fraction
from prefixcache.reference.trace import TraceRequest
from prefixcache.tools.workloads._common import (
    _arrivals,
    _blocks,
    _check_document_range,
    _check_positive,
    _request,
)


def documents_with_hot_prefixes(
    num_requests: int,
    *,
    seed: int = 0,
    scan_fraction: float = 0.5,
    min_document_blocks: int = 40,
    max_document_blocks: int = 120,
    num_hot_prefixes: int = 40,
    hot_prefix_blocks: int = 32,
    max_question_blocks: int = 4,
    mean_gap_ms: int = 200,
) -> list[TraceRequest]:
    """A scan of one-off long documents mixed with questions on a few hot prefixes.

    With probability ``scan_fraction`` a request is a long document seen
    once (``min_document_blocks`` to ``max_document_blocks`` fresh blocks);
    otherwise it is one of ``num_hot_prefixes`` shared prefixes (uniform)
    plus a question of its own. LRU lets each scan flush the hot prefixes; a
    scan-resistant policy keeps them.

    Args:
        num_requests: requests to generate (>= 1).
        seed: random seed.
        scan_fraction: share of one-off documents, in ``[0, 1]``.
        min_document_blocks: shortest document (>= 1).
        max_document_blocks: longest document (>= min_document_blocks).
        num_hot_prefixes: shared prefixes (>= 1).
        hot_prefix_blocks: blocks per shared prefix (>= 1).
        max_question_blocks: longest question (>= 1).
        mean_gap_ms: mean time between arrivals (>= 1).

    Returns:
        The trace, in arrival order.

    Raises:
        InvalidArgumentError: an argument is out of range.

    Complexity: O(blocks generated).
    """
    _check_positive(
        num_requests=num_requests,
        min_document_blocks=min_document_blocks,
        max_document_blocks=max_document_blocks,
        num_hot_prefixes=num_hot_prefixes,
        hot_prefix_blocks=hot_prefix_blocks,
        max_question_blocks=max_question_blocks,
        mean_gap_ms=mean_gap_ms,
    )
    require_fraction(scan_fraction, "scan_fraction")
    _check_document_range(min_document_blocks, max_document_blocks)
    rng = random.Random(seed)
    fresh = count()
    hot = [_blocks(fresh, hot_prefix_blocks) for _ in range(num_hot_prefixes)]
    arrivals = _arrivals(rng, mean_gap_ms)
    trace = []
    for _ in range(num_requests):
        if rng.random() < scan_fraction:
            size = rng.randint(min_document_blocks, max_document_blocks)
            hash_ids = _blocks(fresh, size)
        else:
            question = _blocks(fresh, rng.randint(1, max_question_blocks))
            hash_ids = rng.choice(hot) + question
        trace.append(_request(rng, next(arrivals), hash_ids))
    return trace
