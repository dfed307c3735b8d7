"""prefixcache's vLLM plugin against a fake vLLM 0.33 with the real one's interface.

CI's unit stage does not install vLLM: the ``block_pool`` fixture (``conftest.py``) is
:mod:`prefixcache.testing.fake_vllm`'s. ``test_vllm_integration.py`` drives the real
``BlockPool``; ``test_vllm_plugin_metrics.py`` covers the plugin's metrics and versions.
"""

from __future__ import annotations

import importlib
import random
import subprocess
import sys
from typing import Any

import pytest
import xxhash
from hypothesis import settings
from hypothesis.stateful import (
    run_state_machine_as_test,
)

from prefixcache import policies
from prefixcache.engine.native_engine import NATIVE_POLICIES, native_available
from prefixcache.errors import ConfigError, InvariantError
from prefixcache.integrations import vllm as plugin
from prefixcache.integrations import vllm_queue
from prefixcache.integrations.vllm import PolicyFreeBlockQueue, policy_hash
from prefixcache.integrations.vllm_lru import LeafHeap, LruFreeBlockQueue
from prefixcache.integrations.vllm_native_queue import native_queue_class
from prefixcache.testing.vllm_machine import MACHINE_POLICIES, VllmPoolMachine
from prefixcache.testing.vllm_pool import admit, chain, serve
from prefixcache.testing.vllm_queue_driver import Block, queue_run

# ---------------------------------------------------------------------- a serving driver


def ids(blocks: list[Any]) -> list[int]:
    return [block.block_id for block in blocks]


class Spy(policies.LRUPolicy):
    """LRU that records every insert's arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.inserts: list[tuple[int, int, int, int, int]] = []

    def insert(
        self, block_id: int, block_hash: int, last_access: int, num_accesses: int, depth: int
    ) -> None:
        self.inserts.append((block_id, block_hash, last_access, num_accesses, depth))
        super().insert(block_id, block_hash, last_access, num_accesses, depth)


# ---------------------------------------------------------------------- installing


def test_install_puts_a_policy_queue_in_new_pools_and_uninstall_restores_vllm(
    block_pool: Any,
) -> None:
    originals = {name: block_pool.BlockPool.__dict__[name] for name in plugin._WRAPPERS}
    queue_class = block_pool.FreeKVCacheBlockQueue
    before = block_pool.BlockPool(8)
    plugin.install("lfu")
    pool = block_pool.BlockPool(8)
    assert type(pool.free_block_queue) is PolicyFreeBlockQueue
    assert isinstance(pool.free_block_queue.policy, policies.LFUPolicy)
    assert plugin.installed_policy() == "lfu"
    assert serve(before, chain(1, 2)) == 0 and serve(before, chain(1, 2)) == 2  # old pool works
    assert type(before.free_block_queue) is queue_class
    assert plugin.uninstall() is True
    assert block_pool.FreeKVCacheBlockQueue is queue_class
    assert {name: block_pool.BlockPool.__dict__[name] for name in originals} == originals
    assert plugin.installed_policy() is None and plugin.uninstall() is False


def test_install_says_what_runs_in_one_log_line(
    block_pool: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 29, item 6: vLLM's log names the policy and the versions at start-up."""
    with caplog.at_level("INFO", logger="prefixcache.integrations.vllm"):
        plugin.install("s3fifo")
    lines = [r.getMessage() for r in caplog.records if r.name == "prefixcache.integrations.vllm"]
    assert len(lines) == 1, lines
    assert "vLLM 0.33.0" in lines[0] and "'s3fifo'" in lines[0] and "prefixcache " in lines[0]
    assert "(Python policy object)" in lines[0]  # the suite runs PREFIXCACHE_ENGINE=python


def test_install_is_idempotent_and_the_last_policy_wins(block_pool: Any) -> None:
    plugin.install("lru")
    plugin.install("slru")
    touch = block_pool.BlockPool.touch
    assert not hasattr(getattr(touch, plugin._MARK), plugin._MARK)  # wrapped once
    assert len(plugin._patches) == 2 + len(plugin._WRAPPERS)  # the queue, Scheduler.__init__
    assert isinstance(block_pool.BlockPool(4).free_block_queue.policy, policies.SLRUPolicy)


def test_install_after_vllm_is_reloaded_leaves_one_plugin(block_pool: Any) -> None:
    plugin.install("lru")
    old_class = block_pool.BlockPool
    reloaded = importlib.reload(block_pool)
    fresh = reloaded.BlockPool.__dict__["touch"]
    assert reloaded.FreeKVCacheBlockQueue is not plugin._FACTORY  # the reload undid it
    plugin.install("fifo")
    assert reloaded.FreeKVCacheBlockQueue is plugin._FACTORY
    assert getattr(reloaded.BlockPool.touch, plugin._MARK) is fresh
    assert isinstance(reloaded.BlockPool(4).free_block_queue.policy, policies.FIFOPolicy)
    plugin.uninstall()
    assert reloaded.BlockPool.__dict__["touch"] is fresh
    assert not hasattr(old_class.__dict__["touch"], plugin._MARK)
    kv_cache_utils = sys.modules["vllm.v1.core.kv_cache_utils"]
    assert reloaded.FreeKVCacheBlockQueue is kv_cache_utils.FreeKVCacheBlockQueue


@pytest.mark.parametrize(
    ("policy", "options", "message"),
    [
        ("no_such_policy", {}, "unknown eviction policy"),
        ("belady", {}, "offline optimum"),
        ("ref_zero", {}, "no-enable-prefix-caching"),
        ("lru", {"colour": 1}, r"refused options \['colour'\]"),
        (42, {}, "must be a name or a policy class"),
        (lambda: object(), {}, "no EvictionPolicy"),
    ],
)
def test_a_bad_policy_is_refused_before_anything_changes(
    block_pool: Any, policy: Any, options: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        plugin.install(policy, **options)
    assert plugin.installed_policy() is None
    assert not hasattr(block_pool.BlockPool.touch, plugin._MARK)


def test_a_policy_class_with_options(block_pool: Any) -> None:
    plugin.install(policies.SLRUPolicy, protected_fraction=0.5)
    assert plugin.installed_policy() == "SLRUPolicy"
    assert isinstance(block_pool.BlockPool(4).free_block_queue.policy, policies.SLRUPolicy)


def test_auto_is_the_registered_auto_policy_or_the_documented_default(
    block_pool: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    plugin.install("auto")
    expected = "auto" if "auto" in policies.available() else plugin.AUTO_POLICY
    assert plugin.installed_policy() == expected
    monkeypatch.setattr(policies, "is_registered", lambda name: name == "lru")
    plugin.install(" AUTO ")
    assert plugin.installed_policy() == plugin.AUTO_POLICY


def test_the_general_plugin_installs_only_when_asked(
    block_pool: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(plugin.POLICY_ENV, raising=False)
    plugin.register()
    assert plugin.installed_policy() is None
    monkeypatch.setenv(plugin.POLICY_ENV, "  ")
    plugin.register()
    assert plugin.installed_policy() is None
    monkeypatch.setenv(plugin.POLICY_ENV, "slru")
    monkeypatch.setenv(plugin.OPTIONS_ENV, '{"protected_fraction": 0.25}')
    plugin.register()
    plugin.register()  # vLLM may load plugins more than once
    assert plugin.installed_policy() == "slru"
    assert len(plugin._patches) == 2 + len(plugin._WRAPPERS)  # the queue, Scheduler.__init__


@pytest.mark.parametrize(("raw", "message"), [("{nope", "is not JSON"), ("[1]", "JSON object")])
def test_the_plugin_refuses_bad_options(
    block_pool: Any, monkeypatch: pytest.MonkeyPatch, raw: str, message: str
) -> None:
    monkeypatch.setenv(plugin.POLICY_ENV, "lru")
    monkeypatch.setenv(plugin.OPTIONS_ENV, raw)
    with pytest.raises(ConfigError, match=message):
        plugin.register()
    assert plugin.installed_policy() is None


# ---------------------------------------------------------------------- the order


def test_lru_reproduces_vllms_own_order_on_a_workload(block_pool: Any) -> None:
    prompts = [chain(p % 5, *range(p % 3 + 1)) for p in range(12)] + [chain(9, 9, 9, 9)] * 3
    runs = []
    for install in (False, True):
        if install:
            plugin.install("lru")
        pool = block_pool.BlockPool(10)
        hits = [serve(pool, prompt) for prompt in prompts]
        runs.append((hits, ids(pool.free_block_queue.get_all_free_blocks())))
    assert runs[0] == runs[1]
    assert sum(runs[0][0]) > 0


class PlainLru(policies.LRUPolicy):
    """LRU exactly, but not ``LRUPolicy`` itself: the queue's generic path drives it."""


def random_run(pool: Any, seed: int, steps: int = 80) -> list[Any]:
    """Admit, free (either order), evict by ID, move hashes; record what vLLM sees."""
    rng = random.Random(seed)
    running: list[list[Any]] = []
    seen: list[Any] = []
    for _ in range(steps):
        roll = rng.random()
        if running and (roll < 0.4 or pool.get_num_free_blocks() < 5):
            blocks = running.pop(rng.randrange(len(running)))
            pool.free_blocks(reversed(blocks) if rng.random() < 0.7 else blocks)
        elif roll < 0.47:
            pool.evict_blocks({rng.randrange(1, len(pool.blocks))})
        elif roll < 0.5 and running:
            source = rng.choice(rng.choice(running))
            target = pool.get_new_blocks(1)[0]
            if source.block_hash is not None:
                pool.move_block_hashes(source, target)
            running.append([target])
        else:
            prompt = [rng.randrange(3)] + [rng.randrange(3) for _ in range(rng.randrange(4))]
            blocks, num_hit = admit(pool, chain(*prompt))
            running.append(blocks)
            seen.append((num_hit, ids(blocks)))
        pool.free_block_queue.check_invariants()
        seen.append(ids(pool.free_block_queue.get_all_free_blocks()))
    for blocks in running:
        pool.free_blocks(blocks)
    queue = pool.free_block_queue
    seen.append(ids(queue.popleft_n(queue.num_free_blocks)))
    return seen


def test_the_lru_fast_path_hands_out_what_the_lru_policy_does(
    block_pool: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PREFIXCACHE_ENGINE", "python")  # else "lru" runs the native queue
    for seed in range(25):
        runs = []
        for policy in ("lru", PlainLru):
            plugin.install(policy)
            pool = block_pool.BlockPool(14)
            fast = policy == "lru"
            assert (type(pool.free_block_queue) is LruFreeBlockQueue) is fast
            runs.append(random_run(pool, seed))
        assert runs[0] == runs[1], seed


@pytest.mark.skipif(not native_available(), reason="the native engine is not built")
@pytest.mark.parametrize(
    ("name", "options"),
    [(name, {}) for name in sorted(set(NATIVE_POLICIES) - {"ref_zero"})]
    + [("s3fifo", {"ghost_capacity": 3, "small_fraction": 0.3})],
)
def test_a_built_in_policy_runs_natively_and_hands_out_what_its_class_does(
    block_pool: Any, monkeypatch: pytest.MonkeyPatch, name: str, options: dict[str, float]
) -> None:
    """Issue 25, item 5: a policy named by name runs in the native queue (bookkeeping and
    policy compiled), and vLLM sees the same blocks, hits and free order as with the
    Python queue and class (lru: the inline lru queue)."""
    for seed in range(8):
        runs = []
        for engine in ("python", "auto"):
            monkeypatch.setenv("PREFIXCACHE_ENGINE", engine)
            plugin.install(name, **options)
            pool = block_pool.BlockPool(14)
            native = type(pool.free_block_queue) is native_queue_class()
            assert native is (engine == "auto"), engine
            runs.append(random_run(pool, seed))
        assert runs[0] == runs[1], (name, seed)


def test_a_policy_class_keeps_its_python_object(
    block_pool: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PREFIXCACHE_ENGINE", raising=False)
    plugin.install(policies.S3FIFOPolicy)
    assert type(block_pool.BlockPool(8).free_block_queue.policy) is policies.S3FIFOPolicy


def test_a_chain_is_eaten_from_its_end_whatever_order_it_is_freed_in(block_pool: Any) -> None:
    plugin.install("lru")
    pool = block_pool.BlockPool(5)
    blocks, _ = admit(pool, chain(1, 2, 3))
    pool.free_blocks(blocks)  # forward: vLLM's own queue would evict the root first
    assert ids(pool.get_new_blocks(1)) == [4]  # the one hash-less block goes first
    assert ids(pool.free_block_queue.get_all_free_blocks()) == ids(blocks[::-1])
    assert ids(pool.get_new_blocks(3)) == ids(blocks[::-1])


def test_hash_less_blocks_go_first_newest_prepended_first(block_pool: Any) -> None:
    plugin.install("lru")
    pool = block_pool.BlockPool(6)
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [1, 2, 3, 4, 5]
    cached, _ = admit(pool, chain(7))
    plain = pool.get_new_blocks(2)
    pool.free_blocks(cached)
    pool.free_blocks(plain)
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [*ids(plain), 4, 5, *ids(cached)]


def test_the_policy_learns_depth_hits_and_free_order(block_pool: Any) -> None:
    plugin.install(Spy)
    pool = block_pool.BlockPool(8)
    spy = pool.free_block_queue.policy
    serve(pool, chain(1, 2))  # blocks 1, 2; freed 2 (clock 1), then 1 (clock 2, inner)
    serve(pool, chain(1, 2, 3))  # hits 1, 2; block 3 under 2; freed 3, 2, 1 (clocks 3-5)
    pool.get_new_blocks(5)  # four hash-less blocks, then leaf 3, which exposes 2
    key = [hash_ + bytes(4) for hash_ in chain(1, 2, 3)]  # vLLM's key: hash + group 0
    assert spy.inserts == [
        (2, policy_hash(key[1]), 1, 1, 1),
        (3, policy_hash(key[2]), 3, 1, 2),
        (2, policy_hash(key[1]), 4, 2, 1),  # one prefix hit since it was filled
    ]


class RegisterSpy(policies.LRUPolicy):
    """LRU with the ``on_register`` hook, recording each call."""

    def __init__(self) -> None:
        super().__init__()
        self.registered: list[tuple[list[int], int]] = []

    def on_register(self, block_hashes: list[int], first_depth: int) -> None:
        self.registered.append((list(block_hashes), first_depth))


def test_a_policy_with_on_register_sees_each_newly_cached_run(block_pool: Any) -> None:
    plugin.install(RegisterSpy)
    pool = block_pool.BlockPool(8)
    spy = pool.free_block_queue.policy
    serve(pool, chain(1, 2))
    serve(pool, chain(1, 2, 3, 4))  # hits 1, 2: only 3 and 4 are new, from depth 2
    serve(pool, chain(1, 2))  # all hit: nothing registered
    key = [hash_ + bytes(4) for hash_ in chain(1, 2, 3, 4)]
    assert spy.registered == [
        ([policy_hash(key[0]), policy_hash(key[1])], 0),
        ([policy_hash(key[2]), policy_hash(key[3])], 2),
    ]
    plugin.install(Spy)  # no hook: never called (the base default is skipped)
    assert not plugin.PolicyFreeBlockQueue([], Spy())._on_register


def test_a_prefix_hit_takes_the_block_out_of_the_policy(block_pool: Any) -> None:
    plugin.install("lru")
    pool = block_pool.BlockPool(6)
    serve(pool, chain(1, 2))
    blocks, num_hit = admit(pool, chain(1, 2, 3))
    queue = pool.free_block_queue
    assert num_hit == 2 and len(queue.policy) == 0
    assert queue._accesses[blocks[0].block_id] == 2
    queue.check_invariants()


def test_a_parent_whose_child_is_in_use_goes_only_when_no_leaf_is_left(block_pool: Any) -> None:
    plugin.install("lru")
    pool = block_pool.BlockPool(7)
    running, _ = admit(pool, chain(1, 2))
    pool.free_blocks([running[0]])  # a sliding window frees the root while the child runs
    other, _ = admit(pool, chain(5))
    pool.free_blocks(other)
    queue = pool.free_block_queue
    assert queue._where[running[0].block_id] == vllm_queue._INNER
    predicted = ids(queue.get_all_free_blocks())
    assert predicted[-2:] == [other[0].block_id, running[0].block_id]
    assert ids(pool.get_new_blocks(4))[-1] == other[0].block_id  # three hash-less, the leaf
    assert ids(pool.get_new_blocks(1)) == [running[0].block_id]  # no leaf left: the inner one
    assert running[1].block_id not in queue._parent  # the child is a root now
    pool.free_blocks(running[1:])
    queue.check_invariants()
    assert len(queue.policy) == 1


def test_unpinned_hash_less_blocks_keep_vllms_place_among_cached_ones(block_pool: Any) -> None:
    plugin.install("lru")
    pool = block_pool.BlockPool(4)
    plain = pool.get_new_blocks(1)
    pool.unpin_blocks(plain, lambda block: None)
    cached, _ = admit(pool, chain(3))
    pool.free_blocks(cached)
    assert (ids(plain), ids(cached)) == ([1], [2])
    queue = pool.free_block_queue
    assert queue._where[1] == vllm_queue._LEAF and 1 in queue.policy
    assert ids(queue.get_all_free_blocks()) == [3, 1, 2]  # vLLM's: appended before 2
    assert ids(pool.get_new_blocks(3)) == [3, 1, 2]


def test_the_fake_head_links_every_free_block_in_hand_out_order(block_pool: Any) -> None:
    plugin.install("lru")
    pool = block_pool.BlockPool(6)
    blocks, _ = admit(pool, chain(1, 2))
    pool.free_blocks(reversed(blocks))
    queue = pool.free_block_queue
    walked, block = [], queue.fake_free_list_head.next_free_block
    while block is not queue.fake_free_list_tail:
        assert block.next_free_block.prev_free_block is block
        walked.append(block)
        block = block.next_free_block
    assert walked == queue.get_all_free_blocks() and ids(walked)[-2:] == ids(blocks)[::-1]
    pool.get_new_blocks(5)
    assert queue.fake_free_list_head.next_free_block is queue.fake_free_list_tail
    assert queue.fake_free_list_tail.prev_free_block is queue.fake_free_list_head


def test_a_free_block_that_loses_its_hash_becomes_hash_less(block_pool: Any) -> None:
    plugin.install("lru")
    pool = block_pool.BlockPool(5)
    blocks, _ = admit(pool, chain(1, 2))
    pool.free_blocks(reversed(blocks))
    pool.evict_blocks({blocks[0].block_id})  # a KV connector drops the root's hash
    queue = pool.free_block_queue
    assert queue._where[blocks[0].block_id] == vllm_queue._FIRST
    assert ids(queue.get_all_free_blocks()) == [3, 4, blocks[0].block_id, blocks[1].block_id]
    pool.evict_blocks({blocks[1].block_id})
    assert len(queue.policy) == 0 and queue.num_free_blocks == 4
    queue.check_invariants()


def test_moving_hashes_moves_the_links(block_pool: Any) -> None:
    plugin.install("lru")
    pool = block_pool.BlockPool(6)
    blocks, _ = admit(pool, chain(1, 2, 3))
    copy = pool.get_new_blocks(1)[0]
    pool.move_block_hashes(blocks[1], copy)
    queue = pool.free_block_queue
    assert queue._parent[blocks[2].block_id] == copy.block_id
    assert queue._parent[copy.block_id] == blocks[0].block_id
    assert blocks[1].block_id not in queue._parent and blocks[1].block_id not in queue._depth
    pool.free_blocks([copy, blocks[2], blocks[1], blocks[0]])
    queue.check_invariants()
    assert ids(blocks) == [1, 2, 3] and copy.block_id == 4
    assert ids(queue.get_all_free_blocks()) == [2, 5, 3, 4, 1]  # 2 lost its hash: first


def test_moving_a_lone_block_and_touching_the_null_block(block_pool: Any) -> None:
    before = block_pool.BlockPool(4)  # built before install: the wrappers leave it alone
    plugin.install("lru")
    pool = block_pool.BlockPool(4)
    for target in (before, pool):
        blocks, _ = admit(target, chain(1))
        copy = target.get_new_blocks(1)[0]
        target.move_block_hashes(blocks[0], copy)
        target.touch([target.null_block, copy])
        assert target.get_cached_block(chain(1)[0], [0]) == [copy]
    queue = pool.free_block_queue
    assert queue._depth == {copy.block_id: 0} and queue._accesses == {copy.block_id: 2}
    assert not queue._parent and not queue._children


def test_resetting_the_prefix_cache_forgets_everything_and_keeps_the_order(
    block_pool: Any,
) -> None:
    plugin.install("lru")
    pool = block_pool.BlockPool(6)
    serve(pool, chain(1, 2))
    running, _ = admit(pool, chain(4))
    assert pool.reset_prefix_cache() is False  # a block is in use: vLLM refuses
    pool.free_blocks(running)
    order = ids(pool.free_block_queue.get_all_free_blocks())
    assert pool.reset_prefix_cache() is True
    queue = pool.free_block_queue
    assert ids(queue.get_all_free_blocks()) == order
    assert len(queue.policy) == 0 and not queue._parent and not queue._depth
    queue.check_invariants()


def test_touch_takes_any_iterable(block_pool: Any) -> None:
    plugin.install("lru")
    pool = block_pool.BlockPool(4)
    serve(pool, chain(1))
    found = pool.get_cached_block(chain(1)[0], [0])
    pool.touch(iter(found))
    assert pool.free_block_queue._accesses[found[0].block_id] == 2


# ---------------------------------------------------------------------- the queue alone


def test_the_queue_refuses_what_vllms_refuses() -> None:
    blocks = [Block(i) for i in range(3)]
    queue = PolicyFreeBlockQueue(blocks, policies.LRUPolicy())
    with pytest.raises(ValueError, match="cannot take 4 free blocks: 3 are free"):
        queue.popleft_n(4)
    assert queue.num_free_blocks == 3 and queue.popleft_n(0) == []
    with pytest.raises(RuntimeError, match="already free"):
        queue.append(blocks[0])
    with pytest.raises(RuntimeError, match="already free"):
        queue.prepend_n([blocks[1]])
    assert ids(queue.popleft_n(3)) == [0, 1, 2]
    with pytest.raises(ValueError, match="No free blocks available"):
        queue.popleft()
    with pytest.raises(RuntimeError, match="invalid block"):
        queue.remove(blocks[0])
    queue.append(blocks[2])
    assert queue.popleft() is blocks[2]
    queue.prepend_n(blocks[:2])
    queue.remove(blocks[1])  # a hash-less free block, taken from the middle
    assert queue.get_all_free_blocks() == [blocks[0]] and queue.num_free_blocks == 1


@pytest.mark.parametrize("fast", [False, True], ids=["policy", "lru"])
def test_a_refused_free_changes_nothing(fast: bool) -> None:
    """Issue 28, item 5: a block listed twice used to be half-freed before the refusal."""
    blocks = [Block(i, bytes([i]) * 12) for i in range(4)]
    queue = (
        LruFreeBlockQueue(blocks[:1])
        if fast
        else PolicyFreeBlockQueue(blocks[:1], policies.LRUPolicy())
    )
    before = (queue.num_free_blocks, ids(queue.get_all_free_blocks()))
    for free in (queue.prepend_n, queue.append_n):
        with pytest.raises(RuntimeError, match="already free"):
            free([blocks[1], blocks[2], blocks[1]])
        with pytest.raises(RuntimeError, match="already free"):
            free([blocks[2], blocks[0]])
        assert (queue.num_free_blocks, ids(queue.get_all_free_blocks())) == before
    queue.append_n(blocks[1:])  # the same blocks, once each, are accepted
    assert queue.num_free_blocks == 4


def test_iter_blocks_after_walks_from_a_cursor() -> None:
    blocks = [Block(i, bytes([i]) * 12) for i in range(4)]
    queue = PolicyFreeBlockQueue([], policies.LRUPolicy())
    queue.append_n(blocks)
    assert list(queue.iter_blocks_after(None)) == blocks
    assert list(queue.iter_blocks_after(blocks[1])) == blocks[2:]
    queue.remove(blocks[1])
    assert list(queue.iter_blocks_after(blocks[1])) == []  # not free: vLLM yields nothing
    assert list(queue.iter_blocks_after(blocks[3])) == []


def test_policy_hash_reads_every_byte_and_takes_anything() -> None:
    key = bytes(31) + b"\x01" + bytes(4)  # a 64-bit hash padded big-endian: zeros first
    assert policy_hash(key) != policy_hash(bytes(36)) != policy_hash(bytes(32) + b"\0\0\0\1")
    assert policy_hash(key) == xxhash.xxh3_64_intdigest(key) & ((1 << 63) - 1)
    assert 0 <= policy_hash(-5) < 1 << 63 and policy_hash(7) == 7


def test_a_policy_that_breaks_its_contract_is_caught() -> None:
    class Liar(policies.LRUPolicy):
        def evict(self, num_blocks: int) -> list[int]:
            return [99]

    queue = PolicyFreeBlockQueue([], Liar())
    queue.append(Block(1, b"x" * 12))
    with pytest.raises(InvariantError, match="evicted 99"):
        queue.popleft()

    class Mute(policies.LRUPolicy):
        def evict(self, num_blocks: int) -> list[int]:
            return []

    queue = PolicyFreeBlockQueue([], Mute())
    queue.append(Block(1, b"x" * 12))
    with pytest.raises(InvariantError, match="1 blocks counted free, none found"):
        queue.popleft()


def _linked_queue() -> tuple[PolicyFreeBlockQueue, list[Block]]:
    blocks = [Block(i, bytes([i + 1]) * 12) for i in range(3)]
    queue = PolicyFreeBlockQueue([], policies.LRUPolicy())
    queue.note_registered(blocks, 0, 3)
    queue.append_n(blocks[::-1])
    queue.check_invariants()
    return queue, blocks


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (lambda q: q.policy.discard(2), "not tracked"),
        (lambda q: q._children.pop(1), "no cached child"),
        (lambda q: q._where.__setitem__(0, vllm_queue._FIRST), "chain"),
        (lambda q: setattr(q, "num_free_blocks", 7), "free"),
        (lambda q: q._children[1].clear(), "does not list it"),
        (lambda q: q._children[0].add(5), "a child is listed"),
        (lambda q: q._children.__setitem__(2, {9}), "has children"),
    ],
)
def test_check_invariants_catches_corruption(corrupt: Any, message: str) -> None:
    queue, _ = _linked_queue()
    corrupt(queue)
    with pytest.raises(InvariantError, match=message):
        queue.check_invariants()


def test_a_free_leaf_that_gains_a_child_stops_being_a_leaf() -> None:
    queue, blocks = _linked_queue()
    extra = Block(5, b"e" * 12)
    queue.note_registered([blocks[2], extra], 1, 2)
    assert queue._where[2] == vllm_queue._INNER and 2 not in queue.policy
    queue.note_registered([blocks[2], extra], 1, 2)  # a second time changes nothing
    queue.check_invariants()
    # No leaf: the oldest inner block (1) goes, which makes 0 a leaf; then 2 (inner last).
    assert ids(queue.popleft_n(3)) == [1, 0, 2]


def test_the_lru_fast_queue_matches_the_lru_policy_call_by_call() -> None:
    for seed in range(40):
        runs = []
        for fast in (True, False):
            blocks = [Block(i) for i in range(12)]
            queue = LruFreeBlockQueue(blocks) if fast else PolicyFreeBlockQueue(blocks, PlainLru())
            runs.append(queue_run(queue, blocks, seed))
        assert runs[0] == runs[1], seed


def test_the_leaf_heap_is_an_lru_policy() -> None:
    heap = LeafHeap()
    for block_id, last_access in ((1, 5), (2, 3), (3, 9), (4, 3)):
        heap.insert(block_id, 0, last_access, 1, 0)
    heap.touch(2, 10)
    heap.discard(3)
    with pytest.raises(KeyError):
        heap.touch(3, 11)
    assert len(heap) == 3 and 3 not in heap and 4 in heap
    assert heap.evict(2) == [4, 1] and heap.evict(5) == [2] and heap.evict(1) == []
    for block_id in range(200):  # stale entries pile up, then the heap is rebuilt
        heap.insert(block_id, 0, block_id, 1, 0)
        heap.discard(block_id)
    assert len(heap.heap) <= 64 and len(heap) == 0
    heap.insert(7, 0, 1, 1, 0)
    heap.clear()
    assert heap.evict(1) == [] and not heap.heap


# ---------------------------------------------------------------------- a state machine


POLICIES = MACHINE_POLICIES


class PoolMachine(VllmPoolMachine):
    """The shared machine (``prefixcache.testing.vllm_machine``) on the fake vLLM pool."""

    block_pool: Any

    def make_pool(self, num_blocks: int) -> Any:
        return self.block_pool.BlockPool(num_blocks)

    def check_host(self) -> None:
        pool = self.pool
        for key, blocks in pool.cached.items():
            assert all(block.block_hash == key for block in blocks.values())
        for block in pool.blocks:  # every cached block is findable by its hash
            assert block.block_hash is None or block.block_id in pool.cached[block.block_hash]


def test_the_state_machine(block_pool: Any) -> None:
    machine = type("Machine", (PoolMachine,), {"block_pool": block_pool})
    run_state_machine_as_test(
        machine, settings=settings(max_examples=40, stateful_step_count=30, deadline=None)
    )


def test_get_all_free_blocks_is_the_hand_out_order(block_pool: Any) -> None:
    for policy in POLICIES:
        plugin.install(policy)
        pool = block_pool.BlockPool(9)
        for prompt in ([1, 2, 3], [1, 2, 4], [5], [1, 2, 3], [6, 7], [5, 8]):
            serve(pool, chain(*prompt))
        queue = pool.free_block_queue
        predicted = ids(queue.get_all_free_blocks())
        assert ids(queue.popleft_n(queue.num_free_blocks)) == predicted, policy


def test_the_module_imports_without_vllm() -> None:
    code = "import sys, prefixcache.integrations.vllm; print('vllm' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.strip() == "False", result.stderr
