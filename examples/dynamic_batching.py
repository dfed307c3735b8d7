"""A dynamic-batching loop embedding one KVBlockAllocator, on a chat workload that shares prefixes.

Run it from the repository root::

    python examples/dynamic_batching.py

The workload: a few system prompts shared by every conversation, and
multi-turn conversations whose every turn repeats the whole history before
adding a user message. The loop (:mod:`prefixcache.reference.sim`) admits requests with
a longest-prefix match, prefills in chunks, decodes, pauses requests when the
pool runs dry and releases finished ones in a free group. With ``verify`` on,
every prefix hit is checked against recomputed K/V.

The first part steps the loop by hand, as an engine would, and looks inside
(block states, the block table); the second compares eviction policies.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence

from prefixcache import policies
from prefixcache.reference.sim import DynamicBatchingSim, SimConfig, SimRequest, run

BLOCK_SIZE = 16


def chat_workload(num_conversations: int, seed: int = 0) -> list[SimRequest]:
    """Conversations of 1-4 turns; turn ``k`` repeats turns ``0..k-1`` before its message."""
    rng = random.Random(seed)
    system_prompts = [
        [rng.randrange(32_000) for _ in range(rng.randrange(100, 300))] for _ in range(6)
    ]
    requests = []
    for conversation in range(num_conversations):
        history = list(rng.choice(system_prompts))
        arrival = rng.randrange(400)
        for turn in range(rng.randrange(1, 5)):
            history += [rng.randrange(32_000) for _ in range(rng.randrange(10, 60))]  # user
            output_length = rng.randrange(8, 48)
            requests.append(
                SimRequest.from_tokens(
                    f"c{conversation}t{turn}", history, output_length, arrival_step=arrival
                )
            )
            history += [rng.randrange(32_000) for _ in range(output_length)]  # assistant
            arrival += rng.randrange(20, 80)  # the user reads, then types
    return requests


def step_by_hand(requests: list[SimRequest]) -> None:
    """Drive the loop one step at a time and watch the pool."""
    config = SimConfig(
        total_count=300,  # blocks of BLOCK_SIZE tokens; the dummy block included
        paused_count=60,  # blocks paused requests may keep
        block_size=BLOCK_SIZE,
        max_requests=32,  # block-table rows: running + paused requests
        step_token_budget=1024,  # tokens per forward pass: decodes, then prefill chunks
        verify=True,  # write reference K/V, check every prefix hit against it
    )
    sim = DynamicBatchingSim(config)
    for request in requests:
        sim.submit(request)
    print("step  run pause wait | free active paused cached | hit rate  evicted")
    prompt_tokens = saved_tokens = evicted = 0
    while not sim.is_done:
        step = sim.step()
        prompt_tokens += step.prompt_tokens
        saved_tokens += step.prefill_tokens_saved
        evicted += step.num_evicted_blocks
        if sim.num_steps % 100 == 0:
            sim.allocator.check_invariants()  # O(pool): a debugging aid, not for production
            print(
                f"{step.step:4d} {step.num_running:4d} {step.num_paused:5d} {step.num_waiting:4d} |"
                f" {step.num_free_blocks:4d} {step.num_active_blocks:6d}"
                f" {step.num_paused_blocks:6d} {step.num_cached_blocks:6d} |"
                f" {saved_tokens / max(prompt_tokens, 1):8.1%} {evicted:8d}"
            )
            if step.num_running:
                row = sim.block_table.device_table[0, :8].tolist()
                print(f"      block table row 0 (dummy = {sim.allocator.dummy_block_id}): {row}")
    print()
    print(sim.report().summary())
    print(f"allocator at the end: {sim.allocator}")


def compare_policies(requests: list[SimRequest]) -> None:
    """The same workload under each policy and pool size (replay-only policies left out)."""
    names = [name for name in policies.available() if name != "belady"]
    width = max(len("policy"), *map(len, names))  # names run longer than the numbers
    header = ("blocks", "hit rate", "evicted", "pauses", "requeued", "req/s")
    print("\n" + table_row("policy", header, width))
    for total_count in (250, 600, 2000):
        for name in names:
            config = SimConfig(
                total_count=total_count,
                paused_count=total_count // 10,
                block_size=BLOCK_SIZE,
                max_requests=32,
                step_token_budget=1024,
                eviction_policy=name,
            )
            start = time.perf_counter()
            report = run(requests, config)
            rate = len(requests) / (time.perf_counter() - start)
            cells = (
                f"{total_count:,}",
                f"{report.hit_rate:.1%}",
                f"{report.num_evicted_blocks:,}",
                f"{report.num_pauses:,}",
                f"{report.num_preemptions:,}",
                f"{rate:,.0f}",
            )
            print(table_row(name, cells, width))


def table_row(first: str, cells: Sequence[str], width: int) -> str:
    """One line of the policy table: ``first`` left-aligned in ``width``, cells right-aligned."""
    return f"{first:<{width}} " + " ".join(f"{cell:>9}" for cell in cells)


if __name__ == "__main__":
    workload = chat_workload(150)
    print(f"{len(workload)} requests, {sum(r.input_length for r in workload):,} prompt tokens\n")
    step_by_hand(workload)
    compare_policies(workload)
