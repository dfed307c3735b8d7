"""The vLLM plugin's metrics on vLLM 0.33's real ``BlockPool`` and ``/metrics`` registry.

Skipped without vLLM 0.33 (CI's integration stage installs it; README, "Integration
tests"). The counters are checked against what vLLM itself did: the blocks its
``get_new_blocks`` evicted and the free blocks its ``touch`` took back. The multiprocess
test runs a pool in another process, as vLLM's engine core is, and reads the samples
through vLLM's own ``get_prometheus_registry``, which its API server serves at ``/metrics``.
"""

from __future__ import annotations

import importlib
import inspect
import os
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from prefixcache.integrations import vllm as plugin
from prefixcache.integrations import vllm_metrics
from prefixcache.testing.vllm_pool import admit, chain

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (CI's unit stage)")
if not str(vllm.__version__).startswith(plugin.SUPPORTED_VERSION + "."):
    pytest.skip(f"vLLM {vllm.__version__} is not 0.33.x", allow_module_level=True)

block_pool = importlib.import_module("vllm.v1.core.block_pool")
ROOT = Path(__file__).resolve().parents[2]

WORKLOAD = """
import random, sys
from types import SimpleNamespace
from prefixcache.integrations import vllm as plugin, vllm_metrics
from prefixcache.testing.vllm_pool import admit, chain
from vllm.v1.core.block_pool import BlockPool

plugin.install(sys.argv[1])
config = SimpleNamespace(
    model_config=SimpleNamespace(served_model_name="tiny"),
    parallel_config=SimpleNamespace(data_parallel_index=0),
)
with vllm_metrics.labelled(config):  # as vLLM's Scheduler builds its pool
    pool = BlockPool(12, True, 16)
rng = random.Random(7)
for _ in range(200):
    blocks, _ = admit(pool, chain(rng.randrange(3), *(rng.randrange(4) for _ in range(3))))
    pool.free_blocks(reversed(blocks))
print("done")
"""


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[CollectorRegistry]:
    fresh = CollectorRegistry()
    monkeypatch.setattr(vllm_metrics, "_metrics", vllm_metrics.PluginMetrics(fresh))
    yield fresh
    plugin.uninstall()


@pytest.mark.parametrize("engine", ["python", "auto"])
@pytest.mark.parametrize("policy", ["lru", "s3fifo", "auto"])
def test_the_counters_are_what_vllms_pool_did(
    registry: CollectorRegistry, monkeypatch: pytest.MonkeyPatch, policy: str, engine: str
) -> None:
    """Both queues; the native one's counts wait in C until the registry is read."""
    monkeypatch.setenv("PREFIXCACHE_ENGINE", engine)
    plugin.install(policy)
    pool = block_pool.BlockPool(16, True, 16)
    seen = {"evicted": 0, "kept": 0}
    evict = pool._maybe_evict_cached_block  # vLLM's, called per block get_new_blocks hands out
    touch = pool.touch  # the plugin's wrapper of vLLM's

    def counting_evict(block: Any) -> bool:
        evicted = bool(evict(block))
        seen["evicted"] += evicted
        return evicted

    def counting_touch(blocks: list[Any]) -> None:
        seen["kept"] += sum(1 for b in blocks if b.ref_cnt == 0 and not b.is_null)
        touch(blocks)

    pool._maybe_evict_cached_block = counting_evict
    pool.touch = counting_touch
    rng, running = random.Random(3), []
    for _ in range(400):
        if running and (rng.random() < 0.45 or pool.get_num_free_blocks() < 6):
            pool.free_blocks(reversed(running.pop(rng.randrange(len(running)))))
            continue
        blocks, _ = admit(pool, chain(rng.randrange(4), *(rng.randrange(3) for _ in range(3))))
        running.append(blocks)
    labels = {"model_name": "", "engine": "0", "policy": plugin.installed_policy() or ""}
    hits = registry.get_sample_value("prefixcache_vllm_hit_blocks_total", labels)
    evictions = registry.get_sample_value("prefixcache_vllm_evicted_blocks_total", labels)
    assert seen["kept"] > 0 and seen["evicted"] > 0, seen
    assert (hits, evictions) == (seen["kept"], seen["evicted"])


def test_the_scheduler_wrapper_fits_vllms_scheduler() -> None:
    scheduler = importlib.import_module("vllm.v1.core.sched.scheduler").Scheduler
    original = scheduler.__dict__["__init__"]
    assert list(inspect.signature(original).parameters)[1] == "vllm_config"
    plugin.install("lru")
    try:
        assert getattr(scheduler.__init__, plugin._MARK) is original
    finally:
        plugin.uninstall()
    assert scheduler.__dict__["__init__"] is original


@pytest.mark.parametrize("engine", ["python", "auto"])
def test_an_engine_process_shows_its_counters_on_vllms_metrics_registry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, engine: str
) -> None:
    """vLLM's engine core is a process of its own: with PROMETHEUS_MULTIPROC_DIR set, what
    the plugin counts there is on the API server's ``/metrics`` (the native queue's counts
    flushed at the latest when the process exits: this one runs no scheduler)."""
    env = {
        **os.environ,
        "PREFIXCACHE_ENGINE": engine,
        "PROMETHEUS_MULTIPROC_DIR": str(tmp_path),
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, "-c", WORKLOAD, "s3fifo"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0 and "done" in done.stdout, done.stderr[-3000:]
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    prometheus = importlib.import_module("vllm.v1.metrics.prometheus")
    text = generate_latest(prometheus.get_prometheus_registry()).decode()
    labels = 'engine="0",model_name="tiny",policy="s3fifo"'
    values = {}
    for line in text.splitlines():
        for name in ("hit_blocks_total", "evicted_blocks_total"):
            if line.startswith(f"prefixcache_vllm_{name}{{") and labels in line:
                values[name] = float(line.rsplit(" ", 1)[1])
    assert values.get("hit_blocks_total", 0) > 0 and values.get("evicted_blocks_total", 0) > 0
    info = [line for line in text.splitlines() if line.startswith("prefixcache_vllm_policy_info{")]
    assert len(info) == 1 and labels in info[0] and info[0].endswith(" 1.0"), info
