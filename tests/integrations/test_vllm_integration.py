"""prefixcache's vLLM plugin driving vLLM's real ``BlockPool`` (skipped without vLLM 0.33).

Run where vLLM is installed (``../shared/bench/README.md`` builds such a venv), with the
checkout on the path: ``PYTHONPATH=. $PEERS_VENV/bin/python -m pytest -q -p no:cacheprovider
tests/integrations/test_vllm_integration.py``. ``test_vllm_plugin.py`` tests the same
logic on a fake vLLM, in CI.
"""

from __future__ import annotations

import importlib
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from prefixcache.integrations import vllm as plugin
from prefixcache.integrations import vllm_queue
from prefixcache.integrations.vllm_lru import LruFreeBlockQueue
from prefixcache.testing.vllm_machine import VllmPoolMachine, check_pool
from prefixcache.testing.vllm_pool import admit, chain

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (CI); see the module docstring")
if not str(vllm.__version__).startswith(plugin.SUPPORTED_VERSION + "."):
    pytest.skip(
        f"vLLM {vllm.__version__} is not {plugin.SUPPORTED_VERSION}.x", allow_module_level=True
    )

block_pool = importlib.import_module("vllm.v1.core.block_pool")
kv_cache_utils = importlib.import_module("vllm.v1.core.kv_cache_utils")

POLICIES = ["lru", "fifo", "lfu", "slru", "s3fifo", "arc", "protected_lru", "reuse_lru", "hazard"]


@pytest.fixture(autouse=True)
def _uninstalled() -> Iterator[None]:
    plugin.uninstall()
    yield
    plugin.uninstall()


def run_workload(pool: Any, seed: int, steps: int = 400) -> tuple[list[int], list[int]]:
    """Concurrent requests on shared prefixes, freed in reverse as vLLM frees them."""
    rng = random.Random(seed)
    running: list[list[Any]] = []
    hits: list[int] = []
    for _ in range(steps):
        if running and (rng.random() < 0.45 or pool.get_num_free_blocks() < 8):
            pool.free_blocks(reversed(running.pop(rng.randrange(len(running)))))
            continue
        prompt = [rng.randrange(4)] + [rng.randrange(3) for _ in range(rng.randrange(1, 6))]
        blocks, num_hit = admit(pool, chain(*prompt))
        hits.append(num_hit)
        running.append(blocks)
    return hits, [block.block_id for block in pool.free_block_queue.get_all_free_blocks()]


def test_lru_reproduces_vllms_own_order_exactly() -> None:
    for seed in range(5):
        vanilla = run_workload(block_pool.BlockPool(24, True, 16), seed)
        plugin.install("lru")
        pool = block_pool.BlockPool(24, True, 16)
        assert type(pool.free_block_queue) is LruFreeBlockQueue  # lru's fast path
        assert run_workload(pool, seed) == vanilla
        pool.free_block_queue.check_invariants()
        plugin.uninstall()
        assert type(block_pool.BlockPool(4, True, 16).free_block_queue) is (
            kv_cache_utils.FreeKVCacheBlockQueue
        )


def evict_with_events(engine: str, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, ...]:
    """A workload under lru, then ``get_new_blocks`` of every free block with KV events on."""
    monkeypatch.setenv("PREFIXCACHE_ENGINE", engine)
    plugin.install("lru")
    pool = block_pool.BlockPool(24, True, 16)
    hits, _ = run_workload(pool, 3, steps=120)
    queue = pool.free_block_queue
    native = hasattr(queue, "take_evictions")
    if native:
        queue.take_evictions()  # from here on: the evictions of the call below
    pool.enable_kv_cache_events = True  # the requests' own events would need real requests
    taken = pool.get_new_blocks(pool.get_num_free_blocks())
    events = [(type(event).__name__, event.block_hashes) for event in pool.take_events()]
    evictions = queue.take_evictions() if native else None
    plugin.uninstall()
    return hits, [b.block_id for b in taken], [b.ref_cnt for b in taken], events, evictions


def test_get_new_blocks_in_c_makes_vllms_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    """The native queue's pool runs get_new_blocks in C (``vllm_get_new_blocks.cpp``): the
    same blocks, ref counts and BlockRemoved events as vLLM's own over the Python lru queue,
    and one eviction counted per block that lost its hashes."""
    native = evict_with_events("auto", monkeypatch)
    python = evict_with_events("python", monkeypatch)
    assert native[:4] == python[:4]
    assert set(native[2]) == {1} and native[3]  # every block held once; some were evicted
    assert native[4] == len(native[3])  # each victim had one hash: one event, one eviction


def hot_prefix_and_scan(pool: Any, rounds: int = 30) -> float:
    """A hot 4-block prefix reused between scans of one-off 3-block prompts."""
    hit = total = 0
    fresh = 1000
    for _ in range(rounds):
        for prompt in ([0, 1, 2, 3, 7], [0, 1, 2, 3, 8]):
            blocks, num_hit = admit(pool, chain(*prompt))
            pool.free_blocks(reversed(blocks))
            hit, total = hit + num_hit, total + len(prompt)
        for _ in range(4):
            fresh += 3
            blocks, num_hit = admit(pool, chain(fresh, fresh + 1, fresh + 2))
            pool.free_blocks(reversed(blocks))
            hit, total = hit + num_hit, total + 3
    return hit / total


def test_hit_rates_differ_from_lru_as_the_policies_say() -> None:
    vanilla = hot_prefix_and_scan(block_pool.BlockPool(14, True, 16))
    rates = {}
    for policy in POLICIES:
        plugin.install(policy)
        rates[policy] = hot_prefix_and_scan(block_pool.BlockPool(14, True, 16))
    # A scan of twelve one-off blocks flushes the hot prefix under LRU. FIFO is LRU here:
    # a hit takes a block out of the free queue and its release inserts it anew.
    assert rates["lru"] == rates["fifo"] == vanilla
    for policy in set(POLICIES) - {"lru", "fifo"}:  # reused blocks outlive one-off ones
        assert rates[policy] > vanilla + 0.1, rates
    # Ghost lists keyed by hash see the hot blocks come back (with every hash equal, as
    # when only vLLM's zero-padded first bytes were read, they fell to about 0.27).
    for policy in ("s3fifo", "arc", "protected_lru"):
        assert rates[policy] > 0.42, rates


def test_a_chain_freed_forward_is_still_eaten_from_its_end() -> None:
    plugin.install("lru")
    pool = block_pool.BlockPool(5, True, 16)
    blocks, _ = admit(pool, chain(1, 2, 3))
    pool.free_blocks(blocks)  # forward: vLLM's queue would drop the root first
    order = [b.block_id for b in pool.get_new_blocks(4)]
    assert order[1:] == [b.block_id for b in reversed(blocks)]


def test_install_after_reloading_vllms_block_pool_leaves_one_plugin() -> None:
    plugin.install("lru")
    reloaded = importlib.reload(block_pool)
    plugin.install("lfu")
    plugin.install("lfu")
    touch = reloaded.BlockPool.touch
    assert not hasattr(getattr(touch, plugin._MARK), plugin._MARK)
    assert reloaded.FreeKVCacheBlockQueue is plugin._FACTORY
    assert plugin.uninstall() is True
    assert reloaded.FreeKVCacheBlockQueue is kv_cache_utils.FreeKVCacheBlockQueue
    assert not hasattr(reloaded.BlockPool.touch, plugin._MARK)


def test_the_general_plugin_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(plugin.POLICY_ENV, "s3fifo")
    plugin.register()
    assert plugin.installed_policy() == "s3fifo"
    assert type(block_pool.BlockPool(4, True, 16).free_block_queue) is plugin.PolicyFreeBlockQueue


class RealPoolMachine(VllmPoolMachine):
    """The shared machine (``prefixcache.testing.vllm_machine``) on vLLM's real ``BlockPool``:
    vLLM's bookkeeping, the queue's invariants and the leaf-only law after every step."""

    def make_pool(self, num_blocks: int) -> Any:
        return block_pool.BlockPool(num_blocks, True, 16)

    def check_host(self) -> None:
        for block in self.pool.blocks:  # every cached block is findable by its hash
            if not block.is_null and block.block_hash is not None:
                assert self.pool.cached_block_hash_to_block.contain(
                    block.block_hash, block.block_id
                )


def test_the_state_machine_on_vllms_block_pool() -> None:
    run_state_machine_as_test(
        RealPoolMachine,
        settings=settings(max_examples=60, stateful_step_count=40, deadline=None),
    )


# ------------------------------------------------- vLLM's KVCacheManager, end to end

BLOCK = 4  # tokens per block: small prompts span several blocks


def make_manager(num_blocks: int) -> Any:
    """vLLM's ``KVCacheManager`` for one full-attention group, caching on (CPU, no tensors)."""
    torch = pytest.importorskip("torch")
    interface = importlib.import_module("vllm.v1.kv_cache_interface")
    manager_module = importlib.import_module("vllm.v1.core.kv_cache_manager")
    hashing = importlib.import_module("vllm.utils.hashing")
    kv_cache_utils.init_none_hash(hashing.sha256)
    spec = interface.FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32
    )
    config = interface.KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[interface.KVCacheGroupSpec(["layer"], spec)],
    )
    return manager_module.KVCacheManager(
        config,
        max_model_len=BLOCK * 16,
        scheduler_block_size=BLOCK,
        hash_block_size=BLOCK,
        enable_caching=True,
    )


def make_request(request_id: str, tokens: list[int]) -> Any:
    """A vLLM ``Request`` whose block hashes vLLM's own hasher computes."""
    sampling = importlib.import_module("vllm.sampling_params")
    request_module = importlib.import_module("vllm.v1.request")
    hashing = importlib.import_module("vllm.utils.hashing")
    params = sampling.SamplingParams(max_tokens=4)
    params.update_from_generation_config({}, eos_token_id=100)
    return request_module.Request(
        request_id=request_id,
        prompt_token_ids=tokens,
        sampling_params=params,
        pooling_params=None,
        block_hasher=kv_cache_utils.get_request_block_hasher(BLOCK, hashing.sha256, 0),
    )


class ManagerMachine(RuleBasedStateMachine):
    """Requests through vLLM's real ``KVCacheManager`` (``get_computed_blocks``,
    ``allocate_slots``, ``free``, ``reset_prefix_cache``) with the plugin under each
    policy. After every step: the queue's invariants and the policy contract (the
    policy holds exactly the free cached leaves), vLLM's free count, every block's
    reference count against the running requests' block tables, every cached block
    findable by its hash, and the prefix hit as long as the longest cached prefix."""

    @initialize(policy=st.sampled_from([*POLICIES, "auto"]), num_blocks=st.integers(6, 24))
    def start(self, policy: str, num_blocks: int) -> None:
        plugin.install(policy)
        self.manager = make_manager(num_blocks)
        self.pool = self.manager.block_pool
        assert isinstance(self.pool.free_block_queue, plugin.PolicyFreeBlockQueue)
        self.running: dict[str, Any] = {}
        self.next_id = 0

    @rule(
        blocks=st.lists(st.integers(0, 2), min_size=1, max_size=5),
        tail=st.integers(1, BLOCK),
    )
    def admit(self, blocks: list[int], tail: int) -> None:
        tokens = [t for value in blocks for t in [value] * BLOCK] + [7] * tail
        request = make_request(str(self.next_id), tokens)
        self.next_id += 1
        expected = 0  # the longest prefix of full blocks vLLM has cached
        for block_hash in request.block_hashes:
            if not self.pool.get_cached_block(block_hash, [0]):
                break
            expected += 1
        computed, num_computed, _ = self.manager.get_computed_blocks(request)
        assert num_computed == BLOCK * min(expected, (len(tokens) - 1) // BLOCK)
        new = self.manager.allocate_slots(
            request, len(tokens) - num_computed, num_computed, computed
        )
        if new is not None:
            self.running[request.request_id] = request

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.running)))
        self.manager.free(self.running.pop(request_id))

    @precondition(lambda self: not self.running)
    @rule()
    def reset_prefix_cache(self) -> None:
        assert self.manager.reset_prefix_cache()

    @invariant()
    def bookkeeping_holds(self) -> None:
        pool = getattr(self, "pool", None)
        if pool is None:
            return
        queue = pool.free_block_queue
        leaves = {b for b, where in queue._where.items() if where == vllm_queue._LEAF}
        assert all(block_id in queue.policy for block_id in leaves)
        assert len(queue.policy) == len(leaves)
        held = [
            block
            for request_id in self.running
            for block in self.manager.get_blocks(request_id).blocks[0]
        ]
        check_pool(pool, held)
        for block in pool.blocks:
            if not block.is_null and block.block_hash is not None:
                assert pool.cached_block_hash_to_block.contain(block.block_hash, block.block_id)

    def teardown(self) -> None:
        plugin.uninstall()


def test_the_state_machine_on_vllms_kv_cache_manager() -> None:
    run_state_machine_as_test(
        ManagerMachine,
        settings=settings(max_examples=60, stateful_step_count=30, deadline=None),
    )


def test_the_example_prints_lru_equal_to_vllm_and_better_policies_above() -> None:
    example = Path(__file__).resolve().parents[2] / "examples" / "vllm_policy.py"
    done = subprocess.run(
        [sys.executable, str(example)], capture_output=True, text=True, timeout=600, check=True
    )
    rates = dict(line.rsplit(":", 1) for line in done.stdout.splitlines() if ":" in line)
    rates = {name.strip(): float(rate) for name, rate in rates.items()}
    assert rates["lru"] == rates["vLLM as shipped"]
    assert rates["auto"] > rates["lru"] + 0.1 and rates["s3fifo"] > rates["lru"] + 0.1
