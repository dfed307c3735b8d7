"""``benchmarks/vllm_peer_adapters.py``: the shared harness's vLLM peers with the plugin.

Skipped without vLLM 0.33 or without the shared harness (``../shared/bench/run_peers.py``
beside the checkout). Each adapter must run the harness's own W4 loop on a pool whose
queue is the plugin's, with the stock peer's hits where the order is vLLM's (``lru``).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from prefixcache.integrations import vllm as plugin

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (CI); see the module docstring")
if not str(vllm.__version__).startswith(plugin.SUPPORTED_VERSION + "."):
    pytest.skip(
        f"vLLM {vllm.__version__} is not {plugin.SUPPORTED_VERSION}.x", allow_module_level=True
    )
ROOT = Path(__file__).resolve().parents[2]
HARNESS = ROOT.parent / "shared" / "bench" / "run_peers.py"
if not HARNESS.is_file():
    pytest.skip(f"the shared harness is not at {HARNESS}", allow_module_level=True)
pytestmark = pytest.mark.usefixtures("real_vllm_without_plugin")


def load(name: str, path: Path) -> ModuleType:
    """Module ``name`` executed from ``path`` and kept in ``sys.modules``."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def harness() -> ModuleType:
    return load("run_peers", HARNESS)


@pytest.fixture(scope="module")
def adapters(harness: ModuleType) -> ModuleType:
    return load("vllm_peer_adapters", ROOT / "benchmarks" / "vllm_peer_adapters.py")


def run_w4(harness: ModuleType, adapter: Any, pool_blocks: int) -> list[int]:
    """The harness's W4 loop on a small trace (3 sessions to 4,096 tokens): hits per turn."""
    turns = harness.multiturn_trace(3, 4096, 64, 512, 16, 128, 1000, 4)
    workload = dict(harness.WORKLOADS["W4"], pool_blocks=pool_blocks)
    _, hits, _ = harness.run_multiturn(adapter, workload, turns)
    assert len(hits) == len(turns) > 10
    return list(hits)


def test_the_peers_with_the_plugin_hit_as_stock_vllm(
    harness: ModuleType, adapters: ModuleType
) -> None:
    # A new request per turn on 400 blocks evicts other conversations' blocks (fewer hits
    # than with room for all), so the plugin's lru must keep vLLM's own order. Sessions
    # keep their blocks between turns: 800 holds the three.
    for peer, cls, pool_blocks in (
        ("vllm", adapters.VllmWithPlugin, 400),
        ("vllm-session", adapters.VllmSessionWithPlugin, 800),
    ):
        roomy = run_w4(harness, harness.BUILTIN[peer](), 131_072)
        stock = run_w4(harness, harness.BUILTIN[peer](), pool_blocks)
        if peer == "vllm":
            assert sum(stock) < sum(roomy)
        with_plugin = cls()
        assert run_w4(harness, with_plugin, pool_blocks) == stock
        assert type(with_plugin.pool.free_block_queue).__module__.startswith("prefixcache.")
        assert with_plugin.name == f"{peer}+prefixcache-lru"
        assert with_plugin.version().endswith("+ prefixcache lru")


def test_auto_runs_on_the_plugin(harness: ModuleType, adapters: ModuleType) -> None:
    adapter = adapters.VllmSessionWithAuto()
    assert sum(run_w4(harness, adapter, 800)) > 0
    assert plugin.installed_policy() == "auto"
    assert type(adapter.pool.free_block_queue).__module__.startswith("prefixcache.")
