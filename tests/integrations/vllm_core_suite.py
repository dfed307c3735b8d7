"""Run vLLM's own unit tests of its v1 KV-cache core with prefixcache's plugin installed.

No vLLM source is kept in this repository: the runner downloads vLLM's sdist from PyPI
(the simple index's JSON form names the file's URL and SHA-256; the bytes are checked
against it), extracts the chosen test files and the two helper modules they import into
a temporary folder, and runs pytest there in this process, with a pytest plugin that
calls :func:`prefixcache.integrations.vllm.install` before any test module is imported
and, at the end, fails the run if no vLLM block pool was built with the policy's queue
(a green run must have exercised the plugin).

With ``--policy lru`` every selected test must pass: ``lru`` reproduces vLLM's order
exactly. With another policy, the tests that assert vLLM's LRU order itself are
deselected by name (:data:`ORDER_TESTS`, each with its reason); everything else must
pass. Run from the checkout, where vLLM 0.33 is installed::

    python tests/integrations/vllm_core_suite.py --policy lru
    python tests/integrations/vllm_core_suite.py --policy auto

``--sdist FILE`` uses a local copy instead of downloading (its SHA-256 is still checked
against PyPI's unless ``--sha256`` gives the expected one). ``test_vllm_core_suite.py``
runs both policies as a pytest test (skipped without vLLM).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tarfile
import tempfile
import urllib.request
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

INDEX_URL = "https://pypi.org/simple/vllm/"
INDEX_ACCEPT = "application/vnd.pypi.simple.v1+json"
DEFAULT_VERSION = "0.33.0"

TEST_FILES = (
    "tests/v1/core/test_prefix_caching.py",  # KVCacheManager + BlockPool, prefix hits, eviction
    "tests/v1/core/test_kv_cache_utils.py",  # FreeKVCacheBlockQueue, hashing, cache configs
    "tests/v1/core/test_single_type_kv_cache_manager.py",  # full / sliding-window managers
    "tests/v1/core/test_kv_cache_metrics.py",  # block residency metrics
)
"""vLLM's tests of its v1 KV-cache core that run on CPU in about a minute.

The scheduler tests (``test_scheduler.py`` and the files built on it) drive the same
``KVCacheManager`` through a mocked model and take several minutes more; they are left
out to keep the suite inside CI's time."""

HELPERS = (
    "tests/__init__.py",
    "tests/v1/__init__.py",
    "tests/v1/core/__init__.py",
    "tests/v1/core/utils.py",
    "tests/v1/kv_connector/__init__.py",
    "tests/v1/kv_connector/unit/__init__.py",
    "tests/v1/kv_connector/unit/utils.py",
)
"""Modules the selected tests import from vLLM's ``tests`` package."""

_HUB = "builds a ModelConfig, which fetches Qwen/Qwen3-0.6B's config from the Hugging Face hub"
_DEVICE = "builds a scheduler's VllmConfig, which cannot infer a device type on a CPU-only vLLM"
_CACHING = "tests/v1/core/test_prefix_caching.py::"
_UTILS = "tests/v1/core/test_kv_cache_utils.py::"

ENVIRONMENT_TESTS: dict[str, str] = {
    _CACHING + "test_nixl_hisparse_full_block_import_keeps_a_writable_tail": _HUB,
    _CACHING + "test_hisparse_async_admission_requires_full_prompt_host_pages": _DEVICE,
    _CACHING + "test_hisparse_admitted_async_loads_can_finish_with_nothing_running": _DEVICE,
    _UTILS + "test_hisparse_derived_specs_do_not_affect_kv_cache_layout": _HUB,
    _UTILS + "test_dcp_target_allocates_replicated_draft_independently": _HUB,
    _UTILS + "test_dcp_replicated_kpool_tail_keeps_block_interior_layout": _HUB,
    _UTILS + "test_full_attention_merge_preserves_replicated_cache_geometry": _HUB,
    _UTILS + "test_uniform_type_spec_block_table_width_matches_layer_spec": _HUB,
    _UTILS + "test_get_max_concurrency_for_kv_cache_config": _HUB,
    _UTILS + "test_hma_not_disabled_when_kv_events_enabled": _HUB,
}
"""Tests deselected under every policy, with or without the plugin (node IDs; a function's
ID names all its parameters): they fail in vLLM 0.33.0 as shipped on a CPU-only machine
without network (none of them reaches the free queue's order). The run sets
``HF_HUB_OFFLINE=1`` so that nothing waits on the network."""

ORDER_TESTS: dict[str, str] = {
    _CACHING + "test_evict": (
        "asserts the free queue's order after frees ('LRU policy'): least recently freed "
        "first; passes under auto, s3fifo and arc (equal use counts), fails under lfu"
    ),
    _CACHING
    + "test_hisparse_prefix_hit_under_pressure_adopts_surviving_copies[10-adopted_pages1]": (
        "asserts which of a prefix's unpinned device copies survive an allocation: those "
        "vLLM's queue keeps when it evicts them in the reverse of their release order"
    ),
}
"""Node IDs deselected under a policy other than ``lru``, each with why: they assert the
order of vLLM's own free queue (least recently freed first), which another policy
changes on purpose. They all pass under ``lru``."""


class SuiteError(RuntimeError):
    """The sdist could not be found, fetched or verified."""


def index_entry(filename: str, *, timeout: float = 60.0) -> dict[str, Any]:
    """PyPI's simple-index record of ``filename`` (``url``, ``hashes``)."""
    request = urllib.request.Request(INDEX_URL, headers={"Accept": INDEX_ACCEPT})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        index = json.load(response)
    for entry in index.get("files", ()):
        if entry.get("filename") == filename:
            return dict(entry)
    raise SuiteError(f"{filename} is not on {INDEX_URL}")


def fetch_sdist(version: str, folder: Path, local: Path | None, sha256: str | None) -> Path:
    """The verified sdist of vLLM ``version``: downloaded into ``folder`` or ``local``."""
    filename = f"vllm-{version}.tar.gz"
    entry = index_entry(filename) if sha256 is None or local is None else {}
    expected = sha256 or entry["hashes"]["sha256"]
    if local is None:
        local = folder / filename
        with urllib.request.urlopen(entry["url"], timeout=600) as response:
            local.write_bytes(response.read())
    digest = hashlib.sha256(local.read_bytes()).hexdigest()
    if digest != expected:
        raise SuiteError(f"{local.name}: SHA-256 {digest}, expected {expected}")
    return local


def extract(sdist: Path, version: str, folder: Path, paths: Iterable[str]) -> None:
    """Write ``paths`` (relative to the sdist's top folder) under ``folder``."""
    top = f"vllm-{version}/"
    wanted = {top + path for path in paths}
    with tarfile.open(sdist) as archive:
        members = [m for m in archive.getmembers() if m.name in wanted and m.isfile()]
        missing = wanted - {m.name for m in members}
        if missing:
            raise SuiteError(f"not in {sdist.name}: {sorted(missing)}")
        for member in members:
            member.name = member.name[len(top) :]
            archive.extract(member, folder, filter="data")
    (folder / "pytest.ini").write_text(
        "[pytest]\nmarkers =\n    cpu_test: vLLM's CPU-only tests\n"
        "    skip_global_cleanup: vLLM's marker\n"
    )


class InstallPlugin:
    """A pytest plugin: installs the policy at start; at the end, checks it was used."""

    def __init__(self, policy: str, deselected: dict[str, str]) -> None:
        self.policy = policy
        self.deselected = deselected
        self.pools = 0
        self.policy_types: set[str] = set()  # the policy objects' classes the queues ran

    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[Any]) -> None:
        """Deselect each named test: a node ID, or a function's ID and all its parameters."""
        keep, drop = [], []
        for item in items:
            function = item.nodeid.split("[", 1)[0]
            named = item.nodeid in self.deselected or function in self.deselected
            (drop if named else keep).append(item)
        if drop:
            config.hook.pytest_deselected(items=drop)
            items[:] = keep

    def pytest_configure(self, config: pytest.Config) -> None:
        from prefixcache.integrations import vllm as plugin

        plugin.install(self.policy)
        queue_init = plugin.PolicyFreeBlockQueue.__init__

        def counting_init(queue: Any, blocks: Any, policy: Any, **options: Any) -> None:
            self.pools += 1
            self.policy_types.add(type(policy).__name__)
            queue_init(queue, blocks, policy, **options)

        plugin.PolicyFreeBlockQueue.__init__ = counting_init  # type: ignore[method-assign]
        native_queue = plugin.native_queue

        def counting_native_queue(*args: Any, **options: Any) -> Any:
            self.pools += 1
            self.policy_types.add("NativeFreeBlockQueue")
            return native_queue(*args, **options)

        plugin.native_queue = counting_native_queue  # type: ignore[assignment]

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        from prefixcache.integrations import vllm as plugin

        terminalreporter.write_line(
            f"prefixcache plugin: policy {plugin.installed_policy()!r}, "
            f"{self.pools} vLLM block pools built with its queue "
            f"({', '.join(sorted(self.policy_types)) or 'the inline lru queue'})"
        )

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if exitstatus == 0 and self.pools == 0:
            session.exitstatus = 1  # the plugin was never exercised: not a pass


def run(policy: str, folder: Path, extra: list[str]) -> int:
    """pytest on the extracted tests in ``folder``; its exit status."""
    args = ["-q", "-p", "no:cacheprovider", "--rootdir", ".", "-c", "pytest.ini", *TEST_FILES]
    deselected = {**ENVIRONMENT_TESTS, **(ORDER_TESTS if policy != "lru" else {})}
    here = Path.cwd()
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.chdir(folder)
    sys.path.insert(0, str(folder))
    try:
        return int(pytest.main(args + extra, plugins=[InstallPlugin(policy, deselected)]))
    finally:
        sys.path.remove(str(folder))
        os.chdir(here)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default="lru", help="prefixcache policy name (lru, auto...)")
    parser.add_argument("--version", default=DEFAULT_VERSION, help="vLLM sdist version")
    parser.add_argument("--sdist", type=Path, help="a local copy of the sdist")
    parser.add_argument("--sha256", help="expected SHA-256 of --sdist (default: PyPI's)")
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="vllm-core-suite-") as name:
        folder = Path(name)
        sdist = fetch_sdist(args.version, folder, args.sdist, args.sha256)
        extract(sdist, args.version, folder / "suite", (*HELPERS, *TEST_FILES))
        return run(args.policy, folder / "suite", args.pytest_args)


if __name__ == "__main__":
    sys.exit(main())
