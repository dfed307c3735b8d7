"""The shared-system-prompts family: many users behind few long system prompts of Zipf
popularity, each request with its own short tail.

One family a module, so each generator reads on its own.
"""

from __future__ import annotations

import random
from itertools import count

from prefixcache.reference.trace import TraceRequest
from prefixcache.tools.workloads._common import (
    _arrivals,
    _blocks,
    _check_exponent,
    _check_positive,
    _request,
    _zipf_weights,
)


def shared_system_prompts(
    num_requests: int,
    *,
    seed: int = 0,
    num_prompts: int = 200,
    prompt_blocks: int = 24,
    max_user_blocks: int = 16,
    zipf_exponent: float = 1.0,
    mean_gap_ms: int = 200,
) -> list[TraceRequest]:
    """Many users sharing few long system prompts.

    Each request is one of ``num_prompts`` system prompts (``prompt_blocks``
    blocks each, picked with Zipf popularity) followed by 1 to
    ``max_user_blocks`` blocks of its own. Hits come from the prompts; the
    user tails are never reused, so a policy must not let them flush the
    prompts.

    Args:
        num_requests: requests to generate (>= 1).
        seed: random seed.
        num_prompts: distinct system prompts (>= 1).
        prompt_blocks: blocks per system prompt (>= 1).
        max_user_blocks: longest user tail in blocks (>= 1).
        zipf_exponent: popularity skew of the prompts (>= 0; 0 is uniform).
        mean_gap_ms: mean time between arrivals (>= 1).

    Returns:
        The trace, in arrival order.

    Raises:
        InvalidArgumentError: an argument is out of range.

    Complexity: O(blocks generated).
    """
    _check_positive(
        num_requests=num_requests,
        num_prompts=num_prompts,
        prompt_blocks=prompt_blocks,
        max_user_blocks=max_user_blocks,
        mean_gap_ms=mean_gap_ms,
    )
    _check_exponent(zipf_exponent)
    rng = random.Random(seed)
    fresh = count()
    prompts = [_blocks(fresh, prompt_blocks) for _ in range(num_prompts)]
    weights = _zipf_weights(num_prompts, zipf_exponent)
    arrivals = _arrivals(rng, mean_gap_ms)
    trace = []
    for _ in range(num_requests):
        prompt = rng.choices(prompts, weights)[0]
        tail = _blocks(fresh, rng.randint(1, max_user_blocks))
        trace.append(_request(rng, next(arrivals), prompt + tail))
    return trace
