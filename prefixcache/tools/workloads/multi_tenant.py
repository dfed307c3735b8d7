"""The multi-tenant family: several tenants, each with its own traffic shape, rate and
system prompt, interleaved on one cache.

One family a module, so each generator reads on its own.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable
from dataclasses import replace
from itertools import islice

from prefixcache.reference.trace import TRACE_BLOCK_SIZE, TraceRequest
from prefixcache.tools.workloads._common import _check_positive
from prefixcache.tools.workloads.agent_loops import agent_tool_loops
from prefixcache.tools.workloads.chats import multi_turn_chats
from prefixcache.tools.workloads.document_qa import document_qa
from prefixcache.tools.workloads.system_prompts import shared_system_prompts

TENANT_FAMILIES: tuple[Callable[..., list[TraceRequest]], ...] = (
    multi_turn_chats,
    agent_tool_loops,
    document_qa,
    shared_system_prompts,
)
"""Tenant ``i`` sends the traffic of ``TENANT_FAMILIES[i % 4]``."""


def multi_tenant_mix(
    num_requests: int,
    *,
    seed: int = 0,
    num_tenants: int = 4,
    tenant_prompt_blocks: int = 8,
    mean_gap_ms: int = 100,
) -> list[TraceRequest]:
    """Tenants of different shapes and rates sharing one cache.

    Stands for a shared inference endpoint: a chat product, a coding agent,
    a document-QA service and an API of system-prompted calls behind one
    pool of KV blocks. Tenant ``i`` sends the traffic of
    ``TENANT_FAMILIES[i % 4]`` (its own seed, drawn from ``seed``) behind a
    system prompt of its own (``tenant_prompt_blocks`` blocks, shared by all
    its requests and by no other tenant's), at a rate proportional to
    ``1 / (i + 1)``: the first tenant is the busiest, the rest a long tail.
    The streams are merged by arrival time (``mean_gap_ms`` apart overall).
    Tenants share no block, so each request's reuse comes from its own
    tenant only, and a policy tuned to one shape must not starve the others.

    Args:
        num_requests: requests to generate (>= 1).
        seed: random seed.
        num_tenants: tenants (>= 1).
        tenant_prompt_blocks: blocks of each tenant's system prompt (>= 1).
        mean_gap_ms: mean time between arrivals, all tenants together (>= 1).

    Returns:
        The trace, in arrival order.

    Raises:
        InvalidArgumentError: an argument is out of range.

    Complexity: O(num_tenants * blocks of ``num_requests`` requests of a family).
    """
    _check_positive(
        num_requests=num_requests,
        num_tenants=num_tenants,
        tenant_prompt_blocks=tenant_prompt_blocks,
        mean_gap_ms=mean_gap_ms,
    )
    rng = random.Random(seed)
    harmonic = sum(1.0 / (tenant + 1) for tenant in range(num_tenants))
    streams = []
    next_id = 0
    for tenant in range(num_tenants):
        generate = TENANT_FAMILIES[tenant % len(TENANT_FAMILIES)]
        # Tenant i's gap: mean_gap_ms / (its share of the traffic), never below
        # mean_gap_ms, so num_requests of its own outlast the merged trace.
        gap = max(1, round(mean_gap_ms * harmonic * (tenant + 1)))
        requests = generate(num_requests, seed=rng.randrange(2**32), mean_gap_ms=gap)
        prompt = tuple(range(next_id, next_id + tenant_prompt_blocks))
        offset = next_id + tenant_prompt_blocks
        next_id = offset + 1 + max(h for request in requests for h in request.hash_ids)
        extra_tokens = tenant_prompt_blocks * TRACE_BLOCK_SIZE
        streams.append(
            [
                replace(
                    request,
                    input_length=request.input_length + extra_tokens,
                    hash_ids=prompt + tuple(h + offset for h in request.hash_ids),
                )
                for request in requests
            ]
        )
    merged = heapq.merge(*streams, key=lambda request: request.timestamp_ms)
    return list(islice(merged, num_requests))
