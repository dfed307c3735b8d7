"""vLLM's own v1 KV-cache core tests pass with the plugin installed (skipped without vLLM).

Runs ``vllm_core_suite.py`` (beside this file) in a subprocess once per policy: it
downloads vLLM's sdist from PyPI and checks its SHA-256, or uses the file named by
``PREFIXCACHE_VLLM_SDIST`` (still checked against PyPI's hash unless
``PREFIXCACHE_VLLM_SDIST_SHA256`` gives it). ``lru`` runs every selected test; another
policy deselects the tests that assert vLLM's own LRU order (``ORDER_TESTS`` there).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from prefixcache.engine.native_engine import native_available
from prefixcache.integrations import vllm as plugin

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (CI's unit stage)")
if not str(vllm.__version__).startswith(plugin.SUPPORTED_VERSION + "."):
    pytest.skip(f"vLLM {vllm.__version__} is not 0.33.x", allow_module_level=True)

RUNNER = Path(__file__).with_name("vllm_core_suite.py")


@pytest.mark.parametrize("policy", ["lru", "auto", "s3fifo"])
def test_vllms_core_tests_pass_with_the_plugin(policy: str) -> None:
    """Each policy is a built-in by name and runs in the native queue, as a user gets it
    (the suite's ``PREFIXCACHE_ENGINE=python`` is not passed on)."""
    command = [sys.executable, str(RUNNER), "--policy", policy, "--version", vllm.__version__]
    sdist = os.environ.get("PREFIXCACHE_VLLM_SDIST")
    if sdist:
        command += ["--sdist", sdist]
        if os.environ.get("PREFIXCACHE_VLLM_SDIST_SHA256"):
            command += ["--sha256", os.environ["PREFIXCACHE_VLLM_SDIST_SHA256"]]
    root = Path(__file__).resolve().parents[2]
    env = {
        **{key: value for key, value in os.environ.items() if key != "PREFIXCACHE_ENGINE"},
        "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1200)
    tail = done.stdout[-4000:] + done.stderr[-2000:]
    assert done.returncode == 0, tail
    assert f"prefixcache plugin: policy '{policy}'" in done.stdout, tail
    assert " failed" not in done.stdout.splitlines()[-1], tail
    if native_available():  # a built-in policy by name runs in the native queue
        assert "(NativeFreeBlockQueue)" in done.stdout, tail
