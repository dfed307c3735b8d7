"""Scheduler queue hints in the vLLM plugin: the queues' hinted section, the per-step
refresh (:mod:`prefixcache.integrations.vllm_hints`) and its configuration, without vLLM.

The Python and native queues are compared on random programs with hint calls in
``test_vllm_native_queue.py``; ``test_vllm_scheduler_hints.py`` runs vLLM's real scheduler.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from prefixcache import policies
from prefixcache.engine.native_engine import native_available
from prefixcache.errors import ConfigError, InvalidArgumentError
from prefixcache.integrations import vllm as plugin
from prefixcache.integrations import vllm_hints
from prefixcache.integrations.vllm_lru import LruFreeBlockQueue
from prefixcache.integrations.vllm_native_queue import native_queue
from prefixcache.integrations.vllm_queue import PolicyFreeBlockQueue
from prefixcache.testing.vllm_queue_driver import Block, ids

QUEUES: dict[str, Callable[[list[Block]], PolicyFreeBlockQueue]] = {
    "policy": lambda blocks: PolicyFreeBlockQueue(blocks, policies.LRUPolicy()),
    "lru": LruFreeBlockQueue,
    "native": lambda blocks: native_queue(blocks, "lru", {}, on_register=False),
}


@pytest.fixture(params=sorted(QUEUES))
def make_queue(request: pytest.FixtureRequest) -> Callable[[list[Block]], PolicyFreeBlockQueue]:
    if request.param == "native" and not native_available():
        pytest.skip("the native engine is not built")
    return QUEUES[request.param]


@pytest.fixture(autouse=True)
def _hints_off() -> Iterator[None]:
    yield
    vllm_hints.set_share(0.0)


def cached_pool(make: Callable[[list[Block]], PolicyFreeBlockQueue]) -> tuple[Any, list[Block]]:
    """Eight free cached blocks: chains 0-1-2-3 and 4-5, lone 6 and 7, freed 7 first
    and 0 last. LRU hands them out 7, 6, 5, 4, 3, 2, 1, 0 (a leaf exposes its parent)."""
    blocks = [Block(i) for i in range(8)]
    queue = make(blocks)
    taken = queue.popleft_n(8)
    for block in taken:
        block.block_hash = bytes([block.block_id + 1]) * 12
    for table in (taken[0:4], taken[4:6], taken[6:7], taken[7:8]):
        queue.note_registered(table, 0, len(table))
    queue.append_n(taken[::-1])
    assert ids(queue.get_all_free_blocks()) == [7, 6, 5, 4, 3, 2, 1, 0]
    return queue, blocks


def test_hinted_blocks_go_last_newest_hint_first_and_stay_free(
    make_queue: Callable[[list[Block]], PolicyFreeBlockQueue],
) -> None:
    queue, b = cached_pool(make_queue)
    # Two queued requests: the older on chain 4-5, the newer on chain 0-3 (4 listed twice).
    assert queue.set_hinted([b[4], b[5], b[0], b[1], b[4], b[2], b[3]], 10) == 6
    queue.check_invariants()
    assert queue.num_free_blocks == 8 and queue.num_hinted_blocks == 6
    assert ids(queue.get_all_free_blocks()) == [7, 6, 3, 2, 1, 0, 5, 4]
    # The bound keeps what is listed first: 6 and 7 (the newer, 7, goes first).
    assert queue.set_hinted([b[6], b[7], b[0], b[1]], 2) == 2
    queue.check_invariants()
    assert ids(queue.get_all_free_blocks()) == [5, 4, 3, 2, 1, 0, 7, 6]
    # No hint: every block back in the policy's order, with its stamp.
    assert queue.set_hinted([], 5) == 0
    queue.check_invariants()
    assert ids(queue.get_all_free_blocks()) == [7, 6, 5, 4, 3, 2, 1, 0]
    assert ids(queue.popleft_n(8)) == [7, 6, 5, 4, 3, 2, 1, 0]


def test_a_hinted_block_taken_by_a_prefix_hit_or_its_hash_lost_leaves_the_section(
    make_queue: Callable[[list[Block]], PolicyFreeBlockQueue],
) -> None:
    queue, b = cached_pool(make_queue)
    queue.set_hinted([b[0], b[1], b[2], b[3], b[6]], 10)
    queue.remove(b[3])  # the queued request is admitted: a prefix hit
    assert queue.num_hinted_blocks == 4 and queue.num_free_blocks == 7
    b[6].block_hash = None
    queue.note_hash_removed(b[6])  # hash-less now: handed out first
    queue.check_invariants()
    assert ids(queue.get_all_free_blocks()) == [6, 7, 5, 4, 2, 1, 0]
    assert queue.set_hinted([b[3], b[6], b[7]], 10) == 1  # in use, hash-less: skipped
    queue.check_invariants()
    assert ids(queue.popleft_n(7)) == [6, 5, 4, 2, 1, 0, 7]
    assert queue.num_hinted_blocks == 0 and queue.num_free_blocks == 0


def test_a_hinted_parent_of_a_block_in_use_and_a_reset(
    make_queue: Callable[[list[Block]], PolicyFreeBlockQueue],
) -> None:
    queue, b = cached_pool(make_queue)
    queue.remove(b[5])  # 4's child in use: 4 is an inner block
    queue.set_hinted([b[4]], 1)
    queue.set_hinted([], 1)  # back to the inner blocks, not the policy
    queue.check_invariants()
    assert ids(queue.get_all_free_blocks()) == [7, 6, 3, 2, 1, 0, 4]
    queue.set_hinted([b[0], b[1]], 2)
    queue.note_reset()  # every hash dropped: hash-less, the hand-out order kept
    queue.check_invariants()
    assert queue.num_hinted_blocks == 0
    assert ids(queue.get_all_free_blocks()) == [7, 6, 3, 2, 4, 1, 0]


def test_a_negative_limit_is_refused_before_any_change(
    make_queue: Callable[[list[Block]], PolicyFreeBlockQueue],
) -> None:
    queue, b = cached_pool(make_queue)
    queue.set_hinted([b[0]], 1)
    with pytest.raises(InvalidArgumentError, match="hint limit"):
        queue.set_hinted([b[1]], -1)
    assert queue.num_hinted_blocks == 1 and ids(queue.get_all_free_blocks())[-1] == 0


# ---------------------------------------------------------------------- the refresh


class Pool:
    """What :func:`vllm_hints.refresh` reads of vLLM's ``BlockPool``."""

    def __init__(self, queue: PolicyFreeBlockQueue, blocks: list[Block]) -> None:
        self.free_block_queue, self.enable_caching = queue, True
        self.num_gpu_blocks, self.hash_block_size = len(blocks), 16
        self.by_hash = {block.block_hash: block for block in blocks}
        self.lookups: list[tuple[bytes, list[int]]] = []

    def get_cached_block(self, block_hash: bytes, group_ids: list[int]) -> list[Block] | None:
        self.lookups.append((block_hash, group_ids))
        block = self.by_hash.get(block_hash)
        return None if block is None else [block]


def scheduler(pool: Pool, *queued: list[bytes], block_size: int = 16) -> Any:
    group = SimpleNamespace(kv_cache_spec=SimpleNamespace(block_size=block_size))
    return SimpleNamespace(
        kv_cache_manager=SimpleNamespace(block_pool=pool),
        kv_cache_config=SimpleNamespace(kv_cache_groups=[group]),
        kv_holding_waiting=[SimpleNamespace(block_hashes=queued[0])] if queued else [],
        waiting=[SimpleNamespace(block_hashes=hashes) for hashes in queued[1:]],
    )


def test_the_refresh_hints_each_queued_longest_cached_prefix_in_scheduling_order(
    make_queue: Callable[[list[Block]], PolicyFreeBlockQueue],
) -> None:
    queue, b = cached_pool(make_queue)
    pool = Pool(queue, b)
    h = [block.block_hash for block in b]
    missing = b"\xff" * 12
    sched = scheduler(pool, [h[4], h[5], missing, h[6]], [h[0], h[1], h[2]], [missing, h[7]])
    assert vllm_hints.refresh(sched) is None  # hints off: nothing held, nothing looked up
    vllm_hints.set_share(1.0)
    assert vllm_hints.refresh(sched) == 5  # the walk stops at each prefix's first miss
    assert ids(queue.get_all_free_blocks()) == [7, 6, 3, 2, 1, 0, 5, 4]
    assert pool.lookups[0] == (h[4], [0]) and len(pool.lookups) == 7
    vllm_hints.set_share(0.25)  # two blocks of eight: the oldest request's prefix
    assert vllm_hints.refresh(sched) == 2 and queue.num_hinted_blocks == 2
    assert ids(queue.get_all_free_blocks())[-2:] == [5, 4]
    assert vllm_hints.refresh(scheduler(pool, block_size=32)) is None  # hybrid block sizes
    vllm_hints.set_share(0.0)
    assert vllm_hints.refresh(sched) == 0 and queue.num_hinted_blocks == 0  # turned off
    queue.check_invariants()
    assert vllm_hints.refresh(SimpleNamespace()) is None  # no pool of the plugin's


def test_the_hint_share_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    assert vllm_hints.parse_share("0.5") == 0.5 and vllm_hints.parse_share(0) == 0.0
    for bad in ("half", 1.5, -0.1, None):
        with pytest.raises(ConfigError, match="queue hints"):
            vllm_hints.parse_share(bad)


def test_install_and_the_general_plugin_set_the_hint_share(
    fake_vllm: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_vllm()
    with pytest.raises(ConfigError, match="queue hints"):
        plugin.install("lru", queue_hints=2)
    assert plugin.installed_policy() is None and vllm_hints.hint_share() == 0.0
    plugin.install("lru", queue_hints=0.5)
    assert vllm_hints.hint_share() == 0.5
    plugin.uninstall()
    assert vllm_hints.hint_share() == 0.0
    monkeypatch.setenv(plugin.POLICY_ENV, "s3fifo")
    monkeypatch.setenv(plugin.HINTS_ENV, "0.75")
    plugin.register()
    assert plugin.installed_policy() == "s3fifo" and vllm_hints.hint_share() == 0.75
    monkeypatch.setenv(plugin.OPTIONS_ENV, '{"queue_hints": 1}')
    with pytest.raises(ConfigError, match=plugin.HINTS_ENV):
        plugin.register()
