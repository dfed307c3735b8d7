"""Queue hints through vLLM's real ``Scheduler`` (skipped without vLLM 0.33).

Run where vLLM is installed, with the checkout on the path: ``PYTHONPATH=.
$PEERS_VENV/bin/python -m pytest -q -p no:cacheprovider
tests/integrations/test_vllm_scheduler_hints.py``. ``test_vllm_queue_hints.py`` tests the
queues and the refresh alone, in CI.
"""

from __future__ import annotations

import importlib
import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from prefixcache.integrations import vllm as plugin
from prefixcache.integrations import vllm_hint_walk
from prefixcache.testing.vllm_scheduler import make_request, make_scheduler, run_step

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (CI); see the module docstring")
if not str(vllm.__version__).startswith(plugin.SUPPORTED_VERSION + "."):
    pytest.skip(
        f"vLLM {vllm.__version__} is not {plugin.SUPPORTED_VERSION}.x", allow_module_level=True
    )
pytestmark = pytest.mark.usefixtures("real_vllm_without_plugin")

FINISHED = importlib.import_module("vllm.v1.request").RequestStatus.FINISHED_STOPPED


def serve(scheduler: Any, request: Any) -> None:
    """Prefill ``request`` alone, chunk by chunk, and finish it: its full blocks cached."""
    scheduler.add_request(request)
    while request.num_computed_tokens < request.num_prompt_tokens:
        scheduler.schedule()
    scheduler.finish_requests(request.request_id, FINISHED)


def queued_prefix_run(
    tmp_path: Path, hints: float, policy: str = "lru"
) -> tuple[int, list[Any], str]:
    """A 4-block prefix P cached, then a 4-block prefix Q cached after it; then a long
    request B runs (one sequence at a time) while C, on P, waits: B's prefill needs
    three of the eight cached blocks. Returns the tokens C hits on admission, per step
    vLLM's free blocks, usage and the hinted blocks, and the queue's class name."""
    plugin.install(policy, queue_hints=hints)
    scheduler = make_scheduler(tmp_path / "model", 16, max_num_seqs=1, max_num_batched_tokens=32)
    pool = scheduler.kv_cache_manager.block_pool
    prefix = list(range(100, 164))
    serve(scheduler, make_request("A", [*prefix, 1]))
    serve(scheduler, make_request("E", [*range(300, 364), 1]))
    long, queued = make_request("B", list(range(500, 645))), make_request("C", [*prefix, 7, 8])
    scheduler.add_request(long)
    scheduler.add_request(queued)
    steps: list[Any] = []
    while True:
        output = scheduler.schedule()
        pool.free_block_queue.check_invariants()
        if "C" in output.num_scheduled_tokens:
            hit = queued.num_computed_tokens - output.num_scheduled_tokens["C"]
            return hit, steps, type(pool.free_block_queue).__name__
        steps.append(
            (pool.get_num_free_blocks(), pool.get_usage(), pool.free_block_queue.num_hinted_blocks)
        )
        if long.num_computed_tokens == long.num_prompt_tokens:
            scheduler.finish_requests("B", FINISHED)


@pytest.mark.parametrize("engine", ["python", "auto"])
def test_a_queued_prefix_survives_the_step_before_its_admission(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, engine: str
) -> None:
    monkeypatch.setenv("PREFIXCACHE_ENGINE", engine)
    hit_off, steps_off, _ = queued_prefix_run(tmp_path, 0.0)
    hit_on, steps_on, queue = queued_prefix_run(tmp_path, 1.0)
    assert queue == {"python": "LruFreeBlockQueue", "auto": "NativeFreeBlockQueue"}[engine]
    assert (hit_off, hit_on) == (16, 64)  # LRU ate P's tail; the hint kept all of P
    assert [step[:2] for step in steps_on] == [step[:2] for step in steps_off]  # accounting
    assert {step[2] for step in steps_on} == {4} and {step[2] for step in steps_off} == {0}
    _, bounded, _ = queued_prefix_run(tmp_path, 2 / 16)  # a bound of two blocks: P's head
    assert {step[2] for step in bounded} == {2}


def test_another_policy_keeps_the_prefix_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PREFIXCACHE_ENGINE", "auto")
    assert queued_prefix_run(tmp_path, 1.0, "s3fifo")[0] == 64


@pytest.mark.parametrize("engine", ["python", "auto"])
def test_the_incremental_walk_lists_what_the_full_walk_lists_in_vllm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, engine: str
) -> None:
    """Random multi-turn traffic through vLLM's scheduler (conversations that grow, a
    pool small enough that prefixes are evicted, preemptions): at every step the
    incremental walk lists the full walk's blocks, in order."""
    monkeypatch.setenv("PREFIXCACHE_ENGINE", engine)
    listings: list[int] = []
    original = vllm_hint_walk.PrefixWalk.blocks

    def checked(walk: Any, requests: Any, max_blocks: int) -> list[Any]:
        queued = list(requests)
        listed = original(walk, iter(queued), max_blocks)
        pool = SimpleNamespace(get_cached_block=walk._lookup)
        expected = vllm_hint_walk.full_walk(pool, queued, walk.group_ids, max_blocks)
        assert [b.block_id for b in listed] == [b.block_id for b in expected]
        listings.append(len(listed))
        return listed

    monkeypatch.setattr(vllm_hint_walk.PrefixWalk, "blocks", checked)
    plugin.install("lru", queue_hints=1.0)
    scheduler = make_scheduler(tmp_path / "model", 40, max_num_seqs=3, max_num_batched_tokens=64)
    rng = random.Random(7)
    history = {c: list(range(1000 * c, 1000 * c + 16 * rng.randint(1, 4))) for c in range(6)}
    live: dict[str, Any] = {}
    steps = preempted = 0
    while steps < 300 or live:
        steps += 1
        if steps < 300 and rng.random() < 0.3:
            conversation = rng.randrange(6)
            history[conversation] += [rng.randrange(5, 900) for _ in range(rng.randint(4, 40))]
            request = make_request(f"{steps}", history[conversation][-300:], 16, rng.randint(1, 20))
            live[request.request_id] = request
            scheduler.add_request(request)
        output = run_step(scheduler, live)
        preempted += len(output.preempted_req_ids or ())
    assert len(listings) == steps and max(listings) > 8 and preempted > 0
