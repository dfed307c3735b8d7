"""The vLLM plugin's metrics and its version checks, on the fake vLLM (``conftest.py``).

Issue 29, item 6: the policy is a label on the plugin's own counters (hits on blocks the
policy kept, blocks it evicted), beside vLLM's ``model_name`` and ``engine`` labels; without
prometheus_client nothing is exported and nothing fails; another vLLM version gets one
``ConfigError`` naming the supported and tested versions. ``test_vllm_integration.py``
checks the same counters through vLLM's own ``/metrics`` registry.
"""

from __future__ import annotations

import importlib
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from prefixcache.engine.native_engine import native_available
from prefixcache.engine.version import installed_version
from prefixcache.errors import ConfigError
from prefixcache.integrations import vllm as plugin
from prefixcache.integrations import vllm_metrics
from prefixcache.testing.vllm_pool import admit, chain, serve

NATIVE = pytest.mark.skipif(not native_available(), reason="the native engine is not built")


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> CollectorRegistry:
    """A fresh registry holding the plugin's families (the global one is left alone)."""
    fresh = CollectorRegistry()
    monkeypatch.setattr(vllm_metrics, "_metrics", vllm_metrics.PluginMetrics(fresh))
    return fresh


def config(model: str = "my-model", index: int = 1) -> SimpleNamespace:
    """What the plugin reads of vLLM's ``VllmConfig``."""
    return SimpleNamespace(
        model_config=SimpleNamespace(served_model_name=model),
        parallel_config=SimpleNamespace(data_parallel_index=index),
    )


def counters(registry: CollectorRegistry, policy: str, model: str, engine: str) -> list[float]:
    labels = {"model_name": model, "engine": engine, "policy": policy}
    return [
        registry.get_sample_value(f"{name}_total", labels) or 0.0
        for name in (vllm_metrics.HITS, vllm_metrics.EVICTIONS)
    ]


# ---------------------------------------------------------------------- the counters


@pytest.mark.parametrize(
    ("policy", "engine", "runs"),
    [
        ("lru", "python", "inline lru queue"),
        ("slru", "python", "Python policy object"),
        pytest.param("lru", "auto", "native queue", marks=NATIVE),
        pytest.param("slru", "auto", "native queue", marks=NATIVE),
    ],
)
def test_hits_on_kept_blocks_and_evictions_are_counted_under_the_policy(
    block_pool: Any,
    registry: CollectorRegistry,
    monkeypatch: pytest.MonkeyPatch,
    policy: str,
    engine: str,
    runs: str,
) -> None:
    """The native queue's counts wait in C (``_native.BlockPoolHook``) and reach the
    counters when the registry is read: the same numbers as the Python queue's."""
    monkeypatch.setenv("PREFIXCACHE_ENGINE", engine)
    plugin.install(policy)
    scheduler = sys.modules["vllm.v1.core.sched.scheduler"].Scheduler(config(), num_blocks=6)
    pool = scheduler.block_pool  # 5 usable blocks: the null block is one
    assert serve(pool, chain(1, 2, 3)) == 0
    assert counters(registry, policy, "my-model", "1") == [0, 0]
    assert serve(pool, chain(1, 2, 3)) == 3  # three free cached blocks the policy kept
    assert counters(registry, policy, "my-model", "1") == [3, 0]
    held, _ = admit(pool, chain(7, 8, 9, 10))  # 2 hash-less blocks, then 2 victims
    assert counters(registry, policy, "my-model", "1") == [3, 2]
    _, hit = admit(pool, chain(7, 8))  # held by the request above: never free, no policy hit
    assert hit == 2 and counters(registry, policy, "my-model", "1") == [3, 2]
    free_cached = next(b for b in pool.blocks if b.ref_cnt == 0 and b.block_hash is not None)
    pool.evict_blocks({free_cached.block_id})  # a connector's eviction, not the policy's
    assert counters(registry, policy, "my-model", "1") == [3, 2]
    pool.free_blocks(reversed(held))
    info = {"model_name": "my-model", "engine": "1", "policy": policy, "runs": runs}
    info["version"] = installed_version()
    assert registry.get_sample_value(vllm_metrics.INFO, info) == 1.0


def test_a_pool_built_outside_vllms_scheduler_gets_no_model_and_engine_0(
    block_pool: Any, registry: CollectorRegistry
) -> None:
    plugin.install("fifo")
    pool = block_pool.BlockPool(6)
    serve(pool, chain(4, 5))
    serve(pool, chain(4, 5))
    assert counters(registry, "fifo", "", "0") == [2, 0]


def test_the_scheduler_wrapper_restores_the_labels_and_uninstall_restores_it(
    block_pool: Any, registry: CollectorRegistry
) -> None:
    scheduler_class = importlib.import_module("vllm.v1.core.sched.scheduler").Scheduler
    original = scheduler_class.__dict__["__init__"]
    plugin.install("lru")
    plugin.install("lru")  # wrapped once
    assert getattr(scheduler_class.__init__, plugin._MARK) is original
    scheduler_class(vllm_config=config("other", 0))
    assert vllm_metrics._engine_labels == ("", "0")  # only pools built inside get them
    with pytest.raises(ValueError, match="No free blocks"):
        scheduler_class(config("other", 2), num_blocks=0)  # the pool's constructor raises
    assert vllm_metrics._engine_labels == ("", "0")
    plugin.uninstall()
    assert scheduler_class.__dict__["__init__"] is original


def test_a_vllm_without_the_scheduler_module_gets_unlabelled_pools(
    fake_vllm: Callable[..., Any], registry: CollectorRegistry
) -> None:
    module = fake_vllm("0.33.0")
    (Path(module.__file__).parent / "sched" / "scheduler.py").unlink()
    importlib.invalidate_caches()
    plugin.install("lru")
    assert len(plugin._patches) == 1 + len(plugin._WRAPPERS)  # no scheduler to wrap
    pool = module.BlockPool(6)
    serve(pool, chain(1, 2))
    serve(pool, chain(1, 2))
    assert counters(registry, "lru", "", "0") == [2, 0]


def test_pools_built_before_install_are_not_counted(
    block_pool: Any, registry: CollectorRegistry
) -> None:
    before = block_pool.BlockPool(6)
    plugin.install("lru")
    serve(before, chain(1))
    serve(before, chain(1))
    assert counters(registry, "lru", "", "0") == [0, 0]


def test_without_prometheus_client_the_plugin_runs_and_exports_nothing(
    block_pool: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # import raises ImportError
    monkeypatch.setattr(vllm_metrics, "_metrics", None)
    monkeypatch.setattr(vllm_metrics, "_failed", False)
    plugin.install("slru")
    pool = block_pool.BlockPool(4)
    assert serve(pool, chain(1, 2)) == 0 and serve(pool, chain(1, 2)) == 2
    assert serve(pool, chain(3, 4, 5)) == 0  # evicts: nothing to count it in
    assert not hasattr(pool.free_block_queue, vllm_metrics.COUNTS)
    assert vllm_metrics.metrics() is None
    with pytest.raises(ImportError):
        vllm_metrics.PluginMetrics()


def test_names_taken_in_the_registry_give_a_warning_and_no_metrics(
    block_pool: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    taken, real = CollectorRegistry(), vllm_metrics.PluginMetrics
    real(taken)
    monkeypatch.setattr(vllm_metrics, "_metrics", None)
    monkeypatch.setattr(vllm_metrics, "_failed", False)
    monkeypatch.setattr(vllm_metrics, "PluginMetrics", lambda: real(taken))
    with caplog.at_level(logging.WARNING, logger="prefixcache.integrations.vllm_metrics"):
        plugin.install("lru")
    assert vllm_metrics.metrics() is None
    assert "exports no metrics" in caplog.text
    assert serve(block_pool.BlockPool(4), chain(3)) == 0


# ---------------------------------------------------------------------- versions


def test_another_vllm_version_gets_one_error_naming_the_supported_ones(
    fake_vllm: Callable[..., Any],
) -> None:
    module = fake_vllm("0.34.1")
    message = (
        r"vLLM plugin supports vLLM 0\.33\.x \(tested: 0\.33\.0\) only; this is vLLM 0\.34\.1, "
        r"whose block pool may differ: install vllm==0\.33\.\*, or unset PREFIXCACHE_VLLM_POLICY"
    )
    with pytest.raises(ConfigError, match=message):
        plugin.install("lru")
    assert not hasattr(module.BlockPool.touch, plugin._MARK)
    assert plugin.installed_policy() is None and not plugin._patches


def test_the_general_plugin_stays_dormant_in_another_version_until_asked(
    fake_vllm: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM calls every general plugin at start-up and lets an exception stop it: the
    plugin raises only when the user asked for a policy."""
    fake_vllm("0.32.2")
    monkeypatch.delenv(plugin.POLICY_ENV, raising=False)
    plugin.register()
    assert plugin.installed_policy() is None
    monkeypatch.setenv(plugin.POLICY_ENV, "auto")
    with pytest.raises(ConfigError, match=r"supports vLLM 0\.33\.x .* this is vLLM 0\.32\.2"):
        plugin.register()


def test_a_patch_release_or_dev_build_of_0_33_is_supported(
    fake_vllm: Callable[..., Any],
) -> None:
    module = fake_vllm("0.33.7.dev12+g0123abc")
    plugin.install("lru")
    assert plugin.installed_policy() == "lru"
    assert hasattr(module.BlockPool.touch, plugin._MARK)


def test_a_0_33_whose_block_pool_differs_is_refused_before_anything_changes(
    fake_vllm: Callable[..., Any],
) -> None:
    module = fake_vllm("0.33.0", drop=("touch", "move_block_hashes"))
    message = r"has no BlockPool\.touch, BlockPool\.move_block_hashes, which"
    with pytest.raises(ConfigError, match=message):
        plugin.install("lru")
    assert not plugin._patches
    assert (
        module.FreeKVCacheBlockQueue
        is importlib.import_module("vllm.v1.core.kv_cache_utils").FreeKVCacheBlockQueue
    )


def test_a_0_33_without_the_queue_name_is_refused(
    fake_vllm: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delattr(fake_vllm("0.33.0"), "FreeKVCacheBlockQueue")
    with pytest.raises(ConfigError, match=r"has no FreeKVCacheBlockQueue, which"):
        plugin.install("lru")
    assert not plugin._patches


def test_without_vllm_the_error_names_the_versions(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm raises ImportError
    with pytest.raises(ConfigError, match=r"needs vLLM 0\.33\.x \(tested: 0\.33\.0\)"):
        plugin.install("lru")
    assert plugin.TESTED_VERSIONS[0].startswith(plugin.SUPPORTED_VERSION + ".")


def test_the_readme_matrix_and_ci_pin_the_versions_the_code_names() -> None:
    """The README's version matrix and its integration block (what CI installs) agree with
    ``SUPPORTED_VERSION`` / ``TESTED_VERSIONS`` and Megatron's ``SUPPORTED_VERSIONS``."""
    from prefixcache.integrations.megatron import SUPPORTED_VERSIONS

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    tested = ", ".join(plugin.TESTED_VERSIONS)
    row = f"| vLLM plugin | vLLM {tested} (`TESTED_VERSIONS`) | vLLM {plugin.SUPPORTED_VERSION}.x"
    assert row in readme
    integration = readme[readme.index("## Integration tests") :]
    for version in plugin.TESTED_VERSIONS:
        assert f"vllm=={version}" in integration
    (megatron,) = SUPPORTED_VERSIONS
    pinned = integration.split("megatron-core==", 1)[1].split()[0]
    assert pinned.startswith(megatron)
    assert f"| megatron-core {pinned} | megatron-core {megatron}x (`SUPPORTED_VERSIONS`)" in readme
