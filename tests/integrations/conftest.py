"""Fixtures of the vLLM plugin's unit tests: a fake vLLM 0.33 on ``sys.path``.

``fake_vllm(version, drop=())`` writes :mod:`prefixcache.testing.fake_vllm`'s package
into a temporary folder, puts it first on ``sys.path`` (a real vLLM's modules are set
aside and come back afterwards) and returns its ``vllm.v1.core.block_pool``;
``block_pool`` is that for vLLM 0.33.0. The plugin is uninstalled afterwards.
``real_vllm_without_plugin``: the tests through the real vLLM's scheduler start and end
without the plugin.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from prefixcache.integrations import vllm as plugin
from prefixcache.testing.fake_vllm import write_fake_vllm


def _forget_vllm() -> list[str]:
    return [name for name in sys.modules if name == "vllm" or name.startswith("vllm.")]


@pytest.fixture
def fake_vllm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Any]]:
    """A factory: ``fake_vllm("0.34.1", drop=("touch",))`` -> the fake block_pool module."""
    for name in _forget_vllm():
        monkeypatch.delitem(sys.modules, name)  # a real vLLM comes back afterwards
    made = 0

    def make(version: str = "0.33.0", drop: tuple[str, ...] = ()) -> Any:
        nonlocal made
        for name in _forget_vllm():
            del sys.modules[name]
        made += 1
        root = tmp_path / f"vllm{made}"
        write_fake_vllm(root, version, drop=drop)
        monkeypatch.syspath_prepend(str(root))
        importlib.invalidate_caches()
        return importlib.import_module("vllm.v1.core.block_pool")

    try:
        yield make
    finally:
        plugin.uninstall()
        for name in _forget_vllm():
            del sys.modules[name]


@pytest.fixture
def block_pool(fake_vllm: Callable[..., Any]) -> Any:
    """The fake ``vllm.v1.core.block_pool`` module (vLLM 0.33.0)."""
    return fake_vllm("0.33.0")


@pytest.fixture
def real_vllm_without_plugin(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No plugin before or after; the coordinator builds the ``BlockPool`` the plugin
    wraps (a test that reloads vLLM's block pool leaves it the class from before)."""
    plugin.uninstall()
    coordinator = importlib.import_module("vllm.v1.core.kv_cache_coordinator")
    pool_class = importlib.import_module("vllm.v1.core.block_pool").BlockPool
    monkeypatch.setattr(coordinator, "BlockPool", pool_class)
    yield
    plugin.uninstall()
