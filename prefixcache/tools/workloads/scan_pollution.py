"""The scan-pollution family: a steady hot working set, hit by bursts of one-off
long scans.

One family a module, so each generator reads on its own.
"""

from __future__ import annotations

import random
from itertools import count

from prefixcache.engine.validation import require_fraction
from prefixcache.errors import InvalidArgumentError
from prefixcache.reference.trace import TraceRequest
from prefixcache.tools.workloads._common import (
    _arrivals,
    _blocks,
    _check_exponent,
    _check_positive,
    _request,
    _zipf_weights,
)


def scan_pollution(
    num_requests: int,
    *,
    seed: int = 0,
    num_hot_prefixes: int = 128,
    hot_prefix_blocks: int = 16,
    max_question_blocks: int = 2,
    zipf_exponent: float = 0.8,
    burst_probability: float = 0.01,
    max_burst_scans: int = 60,
    min_scan_blocks: int = 32,
    max_scan_blocks: int = 128,
    mean_gap_ms: int = 100,
) -> list[TraceRequest]:
    """A steady hot working set polluted by bursts of one-off long scans.

    Stands for a shared deployment where interactive traffic on a few hot
    prefixes (system prompts, popular documents: ``num_hot_prefixes`` of
    ``hot_prefix_blocks`` blocks, Zipf popularity, each request with a
    question of its own) meets batch jobs now and then: an offline
    evaluation, a crawler or a bulk summarisation that sends one long
    never-repeated prompt after another. After each hot request a burst
    starts with probability ``burst_probability``: 1 to ``max_burst_scans``
    scans in a row, each ``min_scan_blocks`` to ``max_scan_blocks`` fresh
    blocks used once. Unlike
    :func:`~prefixcache.tools.workloads.documents_with_hot_prefixes`
    (scans spread evenly through the trace) the scans come clustered: a
    burst is far larger than the hot set, so LRU loses the whole hot set
    to each one, and a policy must refuse or quickly drop one-hit blocks.
    The defaults make the hot set (2,048 blocks) larger than 2% of a
    1,500-request trace's distinct blocks and smaller than 10%, so the
    small capacity of ``benchmarks/bench_policy_split.py`` cannot hold it
    and the mid one can, if scans do not flush it.

    Args:
        num_requests: requests to generate (>= 1).
        seed: random seed.
        num_hot_prefixes: hot shared prefixes (>= 1).
        hot_prefix_blocks: blocks per hot prefix (>= 1).
        max_question_blocks: longest question after a hot prefix (>= 1).
        zipf_exponent: popularity skew of the hot prefixes (>= 0).
        burst_probability: chance a burst of scans follows a hot request, in ``[0, 1]``.
        max_burst_scans: most scans in one burst (>= 1).
        min_scan_blocks: shortest scan (>= 1).
        max_scan_blocks: longest scan (>= min_scan_blocks).
        mean_gap_ms: mean time between arrivals (>= 1).

    Returns:
        The trace, in arrival order.

    Raises:
        InvalidArgumentError: an argument is out of range.

    Complexity: O(blocks generated).
    """
    _check_positive(
        num_requests=num_requests,
        num_hot_prefixes=num_hot_prefixes,
        hot_prefix_blocks=hot_prefix_blocks,
        max_question_blocks=max_question_blocks,
        max_burst_scans=max_burst_scans,
        min_scan_blocks=min_scan_blocks,
        max_scan_blocks=max_scan_blocks,
        mean_gap_ms=mean_gap_ms,
    )
    _check_exponent(zipf_exponent)
    require_fraction(burst_probability, "burst_probability")
    if max_scan_blocks < min_scan_blocks:
        raise InvalidArgumentError(
            f"max_scan_blocks {max_scan_blocks} < min_scan_blocks {min_scan_blocks}"
        )
    rng = random.Random(seed)
    fresh = count()
    hot = [_blocks(fresh, hot_prefix_blocks) for _ in range(num_hot_prefixes)]
    weights = _zipf_weights(num_hot_prefixes, zipf_exponent)
    arrivals = _arrivals(rng, mean_gap_ms)
    trace = []
    scans_left = 0
    for _ in range(num_requests):
        if scans_left > 0:
            hash_ids = _blocks(fresh, rng.randint(min_scan_blocks, max_scan_blocks))
            scans_left -= 1
        else:
            question = _blocks(fresh, rng.randint(1, max_question_blocks))
            hash_ids = rng.choices(hot, weights)[0] + question
            if rng.random() < burst_probability:
                scans_left = rng.randint(1, max_burst_scans)
        trace.append(_request(rng, next(arrivals), hash_ids))
    return trace
