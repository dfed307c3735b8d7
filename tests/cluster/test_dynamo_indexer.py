"""Proof with a real router: NVIDIA Dynamo's standalone KV indexer follows our events.

Three allocators (two LRU, one ref-zero) run random workloads with shared
prefixes, held requests, evictions and resets, and publish their events
through :class:`ZmqEventPublisher`. The indexer (``python -m dynamo.indexer``,
from ``ai-dynamo-runtime``) is started after the workers have already
published, so it must recover the history through the replay socket; one
worker registers only at the end. Then, for many prompts, the overlap the
indexer reports for each worker must equal what that worker's allocator
would serve from cache (``match_prefix`` without acquire).

Skipped unless ``dynamo``, ``zmq`` and ``msgspec`` import. Marked ``dynamo``.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("zmq")
pytest.importorskip("msgspec")
pytest.importorskip("dynamo.indexer")

from prefixcache import KVBlockAllocator
from prefixcache.cluster import (
    DynamoIndexerClient,
    free_tcp_port,
    start_dynamo_indexer,
)
from prefixcache.wire.publisher import ZmqEventPublisher

pytestmark = pytest.mark.dynamo

BLOCK = 4
POLICIES = ("lru", "lru", "ref_zero")
FAMILIES = [[random.Random(f).randrange(1, 30_000) for _ in range(6 * BLOCK)] for f in range(5)]
SETTLE_SECONDS = 15.0


class Worker:
    """An allocator, its publisher and the requests it holds."""

    def __init__(self, worker_id: int, policy: str) -> None:
        self.worker_id = worker_id
        self.allocator = KVBlockAllocator(
            total_count=40,
            block_size_tokens=BLOCK,
            eviction_policy=policy,
            device="cpu",
            kv_events_capacity=10_000,
        )
        self.publisher = ZmqEventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
        self.held: list = []

    def serve(self, prompt: list[int]) -> None:
        """Admit a prompt: hit, allocate the rest, register it, hold it a while."""
        allocator = self.allocator
        hashes = allocator.hash_tokens(prompt)
        hit = allocator.match_prefix(hashes, acquire=True)
        fresh = allocator.allocate_memory_blocks(len(hashes) - len(hit))
        if fresh is None:
            allocator.release_memory_blocks(hit)
        else:
            start = len(hit)
            allocator.register_kv_block_hashes(
                fresh,
                hashes[start:],
                parent_hash=hashes[start - 1] if start else None,
                token_ids=prompt[start * BLOCK : len(hashes) * BLOCK],
            )
            self.held.append(list(hit.tolist()) + list(fresh.tolist()))
        while len(self.held) > 2:
            allocator.release_memory_blocks(self.held.pop(0))
        self.publisher.drain(allocator)

    def reset(self) -> None:
        self.held.clear()
        self.allocator.reset()
        self.publisher.drain(self.allocator)

    def cached_tokens(self, prompt: list[int]) -> int:
        """What this worker would serve from cache: the truth the indexer must match."""
        return len(self.allocator.match_prefix(self.allocator.hash_tokens(prompt))) * BLOCK


def random_prompt(rng: random.Random) -> list[int]:
    family = rng.choice(FAMILIES)
    shared = rng.randrange(0, len(family) + 1)
    tail = [rng.randrange(1, 30_000) for _ in range(rng.randrange(1, 3 * BLOCK))]
    return family[:shared] + tail


def run_workload(workers: list[Worker], rng: random.Random, num_ops: int) -> None:
    for _ in range(num_ops):
        worker = rng.choice(workers)
        if rng.random() < 0.03:
            worker.reset()
        else:
            worker.serve(random_prompt(rng))


@pytest.fixture
def indexer(tmp_path: Path) -> Iterator[tuple[DynamoIndexerClient, Path]]:
    port = free_tcp_port()
    log = tmp_path / "indexer.log"
    process = start_dynamo_indexer(port, log_path=log)
    try:
        yield DynamoIndexerClient(f"http://127.0.0.1:{port}", "m", block_size=BLOCK), log
    finally:
        process.kill()
        process.wait(timeout=10)


def mismatches(client: DynamoIndexerClient, workers: list[Worker], prompts: list) -> list:
    found = []
    for prompt in prompts:
        scores = client.overlap_tokens(prompt)
        for worker in workers:
            truth = worker.cached_tokens(prompt)
            if scores.get(worker.worker_id, 0) != truth:
                found.append((worker.worker_id, truth, scores.get(worker.worker_id, 0)))
    return found


def wait_until_consistent(
    client: DynamoIndexerClient, workers: list[Worker], prompts: list
) -> list:
    deadline = time.monotonic() + SETTLE_SECONDS
    found = mismatches(client, workers, prompts)
    while found and time.monotonic() < deadline:
        time.sleep(0.1)
        found = mismatches(client, workers, prompts)
    return found


def test_indexer_overlap_equals_what_each_allocator_serves(indexer: tuple) -> None:
    client, log = indexer
    rng = random.Random(7)
    workers = [Worker(index + 1, policy) for index, policy in enumerate(POLICIES)]
    try:
        run_workload(workers, rng, 150)  # before any indexer subscribed: replay must recover it
        assert all(w.publisher.next_seq > 0 for w in workers)
        for worker in workers[:2]:
            client.register(
                worker.worker_id, worker.publisher.endpoint, worker.publisher.replay_endpoint
            )
        run_workload(workers[:2], rng, 150)
        late = workers[2]  # the last worker joins the indexer only now
        client.register(late.worker_id, late.publisher.endpoint, late.publisher.replay_endpoint)
        run_workload(workers, rng, 100)
        for worker in workers:  # a batch after registration triggers each gap replay
            worker.serve([40_000 + worker.worker_id] * 2 * BLOCK)
        prompts = [random_prompt(rng) for _ in range(60)] + [f[: 5 * BLOCK] for f in FAMILIES]
        assert sum(w.cached_tokens(p) > 0 for w in workers for p in prompts) > 20  # not vacuous
        assert wait_until_consistent(client, workers, prompts) == []
        stats = [w.allocator.stats() for w in workers]
        assert sum(s.num_evicted_blocks for s in stats) > 0
        assert stats[2].num_dropped_blocks > 0  # ref-zero removals
        assert all(w.publisher.num_replay_requests >= 1 for w in workers)
        assert "Gap detected" in log.read_text(errors="replace")
    finally:
        for worker in workers:
            worker.publisher.close()


def test_the_fast_calls_publish_tokens_a_router_keys_by(indexer: tuple) -> None:
    """Issue 29, item 3: admit_request and a session's turns store their blocks' tokens.

    Before, ``admit_request`` published ``BlockStored`` with empty ``token_ids``: the
    indexer, which keys by the tokens, found nothing for any prompt.
    """
    client, _ = indexer
    allocator = KVBlockAllocator(
        total_count=64, block_size_tokens=BLOCK, device="cpu", kv_events_capacity=1_000
    )
    publisher = ZmqEventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
    try:
        client.register(9, publisher.endpoint, publisher.replay_endpoint)
        prompt = FAMILIES[0][: 3 * BLOCK + 2]
        row = np.zeros(8, dtype=np.int32)
        allocator.admit_request(prompt, row)
        session = allocator.open_session()
        turn = FAMILIES[1][: 2 * BLOCK]
        session.admit(turn)
        session.append(FAMILIES[1][2 * BLOCK : 3 * BLOCK])  # decode fills a third block
        publisher.drain(allocator)
        expected = {
            tuple(prompt): 3 * BLOCK,  # full blocks only
            tuple(FAMILIES[1][: 3 * BLOCK]): 3 * BLOCK,
        }
        deadline = time.monotonic() + SETTLE_SECONDS
        seen: dict[tuple[int, ...], int] = {}
        nudge = 50_000
        while time.monotonic() < deadline:
            seen = {p: client.overlap_tokens(list(p)).get(9, 0) for p in expected}
            if seen == expected:
                break
            # An indexer that subscribed after the first batch sees the gap only when a
            # later batch arrives, then replays it: publish one (a block of its own).
            nudge += 1
            allocator.admit_request([nudge] * BLOCK, row)
            allocator.release_request(row[:1])
            publisher.drain(allocator)
            time.sleep(0.2)
        assert seen == expected
    finally:
        publisher.close()
