"""Conversation ends through vLLM's real ``Scheduler`` (skipped without vLLM 0.33): a
streaming session's own cached blocks go first once it ends.

Run where vLLM is installed, with the checkout on the path: ``PYTHONPATH=.
$PEERS_VENV/bin/python -m pytest -q -p no:cacheprovider
tests/integrations/test_vllm_scheduler_ends.py``. ``test_vllm_ends.py`` tests the walk on
the plugin's queues alone, in CI.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import pytest

from prefixcache.errors import ConfigError
from prefixcache.integrations import vllm as plugin
from prefixcache.integrations import vllm_ends
from prefixcache.testing.vllm_scheduler import make_request, make_scheduler, run_step

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (CI); see the module docstring")
if not str(vllm.__version__).startswith(plugin.SUPPORTED_VERSION + "."):
    pytest.skip(
        f"vLLM {vllm.__version__} is not {plugin.SUPPORTED_VERSION}.x", allow_module_level=True
    )
pytestmark = pytest.mark.usefixtures("real_vllm_without_plugin")

STATUS = importlib.import_module("vllm.v1.request").RequestStatus
SYSTEM = list(range(100, 132))  # two blocks every conversation starts with


def until_stopped(scheduler: Any, live: dict[str, Any], request: Any) -> None:
    """Steps until ``request``'s turn has stopped (waiting for its next input) or ended."""
    for _ in range(50):
        run_step(scheduler, live)
        if request.status == STATUS.WAITING_FOR_STREAMING_REQ or request.is_finished():
            return
    raise AssertionError("the turn did not stop")


def cached(scheduler: Any, hashes: list[Any]) -> list[bool]:
    pool = scheduler.kv_cache_manager.block_pool
    return [pool.get_cached_block(block_hash, [0]) is not None for block_hash in hashes]


def session_run(tmp_path: Path, policy: str, ends: bool, abort: bool) -> tuple[list[bool], Any]:
    """A plain request caches the system prompt; a streaming session on it runs two
    turns (its own three blocks, then two more) and ends (its client's end marker, or an
    abort). Returns which of the session's block hashes stay cached, and the pool."""
    plugin.install(policy, conversation_ends=ends)
    scheduler = make_scheduler(tmp_path / "model", 24, max_num_seqs=2)
    live: dict[str, Any] = {}
    first = make_request("A", [*SYSTEM, 1])
    live["A"] = first
    scheduler.add_request(first)
    until_stopped(scheduler, live, first)
    session = make_request("S", [*SYSTEM, *range(200, 248), 3], resumable=True)
    live["S"] = session
    scheduler.add_request(session)
    until_stopped(scheduler, live, session)
    scheduler.add_request(make_request("S", list(range(300, 332)), resumable=True))
    until_stopped(scheduler, live, session)
    hashes = list(session.block_hashes)
    assert len(hashes) == 7 and all(cached(scheduler, hashes[:6]))
    if abort:
        scheduler.finish_requests("S", STATUS.FINISHED_ABORTED)
    else:  # the client closes the stream: an update with no input
        scheduler.add_request(make_request("S", [1]))
    assert session.is_finished()
    pool = scheduler.kv_cache_manager.block_pool
    pool.free_block_queue.check_invariants()
    return cached(scheduler, hashes), pool


@pytest.mark.parametrize("policy", ["lru", "s3fifo"])
@pytest.mark.parametrize("abort", [False, True])
def test_a_sessions_end_frees_its_own_blocks_and_keeps_the_shared_prefix(
    tmp_path: Path, policy: str, abort: bool
) -> None:
    kept, pool = session_run(tmp_path, policy, ends=True, abort=abort)
    assert kept[:2] == [True, True]  # the first turn's hits: the system prompt
    assert not any(kept[2:])
    free = pool.free_block_queue.get_all_free_blocks()
    assert all(block.block_hash is None for block in free[:5])  # handed out first
    plugin.uninstall()
    kept, _ = session_run(tmp_path, policy, ends=False, abort=abort)
    assert kept[:6] == [True] * 6  # without ends every full block stays cached


def test_plain_requests_carry_no_end(tmp_path: Path) -> None:
    plugin.install("lru", conversation_ends=True)
    scheduler = make_scheduler(tmp_path / "model", 24)
    request = make_request("P", [*SYSTEM, *range(200, 248), 3])
    live = {"P": request}
    scheduler.add_request(request)
    until_stopped(scheduler, live, request)
    assert request.is_finished() and all(cached(scheduler, list(request.block_hashes)))
    assert not vllm_ends._first_hits


def test_the_environment_turns_ends_on_and_refuses_other_values(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(plugin.POLICY_ENV, "lru")
    monkeypatch.setenv(vllm_ends.ENDS_ENV, "yes")
    with pytest.raises(ConfigError, match="must be 0 or 1"):
        plugin.register()
    assert plugin.installed_policy() is None
    monkeypatch.setenv(vllm_ends.ENDS_ENV, "1")
    monkeypatch.setenv(plugin.OPTIONS_ENV, '{"conversation_ends": true}')
    with pytest.raises(ConfigError, match=vllm_ends.ENDS_ENV):
        plugin.register()
    monkeypatch.delenv(plugin.OPTIONS_ENV)
    plugin.register()
    assert vllm_ends.ends_enabled()
    plugin.uninstall()
    assert not vllm_ends.ends_enabled()
