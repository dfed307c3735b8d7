"""The document-QA family: questions, and follow-ups, over a few long shared documents
of Zipf popularity.

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
    _check_exponent,
    _check_positive,
    _request,
    _zipf_weights,
)


def document_qa(
    num_requests: int,
    *,
    seed: int = 0,
    num_documents: int = 100,
    min_document_blocks: int = 20,
    max_document_blocks: int = 100,
    zipf_exponent: float = 0.8,
    max_question_blocks: int = 3,
    follow_up_fraction: float = 0.3,
    mean_gap_ms: int = 200,
) -> list[TraceRequest]:
    """Questions, and follow-ups, over a few long shared documents.

    Stands for retrieval over a small corpus (a contract, a code base, a
    manual loaded whole into the prompt): ``num_documents`` documents of
    ``min_document_blocks`` to ``max_document_blocks`` blocks, chosen with
    Zipf popularity, each request the document plus a question of its own.
    With probability ``follow_up_fraction`` a request follows up a recent
    question instead: that question's prompt plus the answer and a new
    question. The documents are long beside the cache, so which ones stay
    cached decides the hit rate.

    Args:
        num_requests: requests to generate (>= 1).
        seed: random seed.
        num_documents: shared documents (>= 1).
        min_document_blocks: shortest document (>= 1).
        max_document_blocks: longest document (>= min_document_blocks).
        zipf_exponent: skew of document popularity (>= 0; 0 is uniform).
        max_question_blocks: longest question or follow-up (>= 1).
        follow_up_fraction: share of follow-ups, in ``[0, 1]``.
        mean_gap_ms: mean time between arrivals (>= 1).

    Returns:
        The trace, in arrival order.

    Raises:
        InvalidArgumentError: an argument is out of range.

    Complexity: O(blocks generated).
    """
    _check_positive(
        num_requests=num_requests,
        num_documents=num_documents,
        min_document_blocks=min_document_blocks,
        max_document_blocks=max_document_blocks,
        max_question_blocks=max_question_blocks,
        mean_gap_ms=mean_gap_ms,
    )
    _check_document_range(min_document_blocks, max_document_blocks)
    _check_exponent(zipf_exponent)
    require_fraction(follow_up_fraction, "follow_up_fraction")
    rng = random.Random(seed)
    fresh = count()
    documents = [
        _blocks(fresh, rng.randint(min_document_blocks, max_document_blocks))
        for _ in range(num_documents)
    ]
    weights = _zipf_weights(num_documents, zipf_exponent)
    recent: list[list[int]] = []  # the last prompts, for follow-ups
    arrivals = _arrivals(rng, mean_gap_ms)
    trace = []
    for _ in range(num_requests):
        question = _blocks(fresh, rng.randint(1, max_question_blocks))
        if recent and rng.random() < follow_up_fraction:
            prompt = recent.pop(rng.randrange(len(recent))) + question
        else:
            prompt = rng.choices(documents, weights)[0] + question
        trace.append(_request(rng, next(arrivals), prompt))
        recent = [*recent[-31:], prompt]
    return trace
