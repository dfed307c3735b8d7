"""``auto``'s safety net: the engine reports hits and ends; the net trips when LRU leads."""

from __future__ import annotations

import copy
from dataclasses import replace

import prefixcache.policies as policies
import pytest
from prefixcache.policies import OPTIONAL_HOOKS, has_hook
from prefixcache.policies.auto import AutoPolicy

from prefixcache.engine.native_engine import native_available
from prefixcache.reference.trace import TraceRequest, trace_block_hashes
from prefixcache.tools.replay import replay
from prefixcache.tools.workloads import split


def _trace(hash_lists: list[list[int]]) -> list[TraceRequest]:
    return [
        TraceRequest(step, 512 * len(hashes), 1, tuple(hashes))
        for step, hashes in enumerate(hash_lists)
    ]


def _lru_beats_frequent() -> list[TraceRequest]:
    """30 blocks used 4 times each and never again, then fresh blocks each reused 10 requests later.

    At 30 cached blocks, ``frequent`` keeps the 30 old blocks and evicts every
    fresh one before its reuse; LRU hits every reuse.
    """
    requests = [[block] for _ in range(4) for block in range(30)]
    for index in range(300):
        requests.append([1000 + index])
        if index >= 10:
            requests.append([1000 + index - 10])
    return _trace(requests)


def _replay_auto(
    monkeypatch: pytest.MonkeyPatch, trace: list[TraceRequest], **options: object
) -> int:
    class Configured(AutoPolicy):
        def __init__(self) -> None:
            # duel_ratio tiny: a duel is dropped at the next one, so duels never see a reuse
            super().__init__(duel_ratio=0.01, **options)  # type: ignore[arg-type]

    monkeypatch.setitem(policies._registry, "auto", Configured)
    return replay(trace, 30, "auto").hit_blocks


def test_on_hit_is_an_optional_hook_that_auto_has() -> None:
    assert "on_hit" in OPTIONAL_HOOKS and has_hook(AutoPolicy(), "on_hit")


def test_the_python_engine_reports_every_matched_block_root_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[list[int]] = []

    class Recording(AutoPolicy):
        def on_hit(self, block_hashes: list[int]) -> None:
            seen.append(list(block_hashes))
            super().on_hit(block_hashes)

    monkeypatch.setitem(policies._registry, "auto", Recording)
    replay(_trace([[1, 2, 3], [1, 2, 3, 4], [1, 2, 9]]), 10, "auto")
    assert [len(hashes) for hashes in seen] == [3, 2]  # inner blocks too: 1, 2 under 3 and 9
    assert seen[1] == seen[0][:2]  # the same hashes, root first


def test_the_net_keeps_auto_at_lru_where_frequency_loses_and_duels_are_blind(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    trace = _lru_beats_frequent()
    lru = replay(trace, 30, "lru").hit_blocks
    without = _replay_auto(monkeypatch, trace, safety_z=None)
    with_net = _replay_auto(monkeypatch, trace)
    assert without < lru - 100  # the failure the net exists for
    assert with_net >= lru - 30  # bounded regret: the test's threshold and one hold's turnover


def test_the_net_does_not_trip_where_frequency_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    # One-off scans between reuses of 20 hot blocks: frequent keeps them, LRU does not.
    requests = []
    for index in range(400):
        requests.append([index % 20])
        requests.append([10_000 + index, 20_000 + index])
    trace = _trace(requests)
    assert _replay_auto(monkeypatch, trace) == _replay_auto(monkeypatch, trace, safety_z=None)
    assert _replay_auto(monkeypatch, trace) > replay(trace, 30, "lru").hit_blocks


def test_the_net_stays_off_until_the_engine_reports_hits() -> None:
    policy = AutoPolicy(safety_z=0)
    for block in range(200):  # misses only: LRU's shadow "leads" on every re-registration
        policy.on_register([block % 50], 0)
        policy.insert(block, block % 50, block, 1, 0)
        if len(policy) > 20:
            policy.evict(1)
    assert not policy.safety_net and policy.metadata()["shadow"] > 0


def test_an_aborted_step_takes_the_net_back_too() -> None:
    policy = AutoPolicy(safety_z=0.5, half_life_ratio=0.5)
    for block in range(40):
        policy.on_register([block], 0)
        policy.insert(block, block, block, 1, 0)
    policy.evict(30)
    twin = copy.deepcopy(policy)
    policy.begin()
    policy.on_hit([5, 6, 39])
    policy.on_register([1, 2, 3, 4], 0)
    for block in range(40, 44):
        policy.insert(block, block - 39, 40, 1, 0)
    policy.evict(5)
    policy.abort()
    assert policy.metadata() == twin.metadata() and policy.safety_net == twin.safety_net
    assert policy._shadow == twin._shadow and policy._net == twin._net
    assert policy.evict(len(policy)) == twin.evict(len(twin))


@pytest.mark.parametrize("value", [-1, "2", True])
def test_safety_z_is_checked(value: object) -> None:
    with pytest.raises(ValueError, match="safety_z"):
        AutoPolicy(safety_z=value)  # type: ignore[arg-type]


def test_on_end_is_an_optional_hook_that_auto_has() -> None:
    assert "on_end" in OPTIONAL_HOOKS and has_hook(AutoPolicy(), "on_end")
    assert not has_hook(policies.get("lru"), "on_end")


def test_an_end_drops_the_freed_hashes_and_their_room_from_the_shadow() -> None:
    policy = AutoPolicy()
    policy.on_register([1, 2, 3, 4, 5, 6], 0)
    policy.on_end([6, 5, 4])  # the engine freed them: LRU, told the same end, frees them too
    assert sorted(policy._shadow) == [1, 2, 3]
    assert policy._shadow_size == 1 + 6 - 3  # its floor of 1, 6 registered, 3 freed
    policy.on_register([4, 5, 6], 0)  # computed again: LRU would have missed them too
    assert policy._net == (0.0, 0.0)


def test_the_python_engine_reports_the_freed_blocks_tail_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[list[int]] = []

    class Recording(AutoPolicy):
        def on_end(self, block_hashes: list[int]) -> None:
            seen.append(list(block_hashes))
            super().on_end(block_hashes)

    monkeypatch.setitem(policies._registry, "auto", Recording)
    trace = _trace([[1, 2, 3], [1, 5, 6]])
    trace[1] = replace(trace[1], ends_conversation=True)
    replay(trace, 10, "auto", conversation_ends=True)
    chain = trace_block_hashes((1, 5, 6))
    assert seen == [[chain[2], chain[1]]]  # 1 still has a child (3): it stays


@pytest.mark.parametrize("engine", ["python", "native"])
def test_ends_do_not_trip_the_net_on_multi_tenant_mix(
    monkeypatch: pytest.MonkeyPatch, engine: str
) -> None:
    """Issue 26: the shadow kept the freed hashes and room, LRU's false lead tripped the net
    (17 trips instead of 1) and the marks cost auto 0.563 -> 0.523; now 0.572."""
    if engine == "native" and not native_available():
        pytest.skip("the native engine is not built")
    monkeypatch.setenv("PREFIXCACHE_ENGINE", engine)
    requests = split.load_trace("multi_tenant_mix", split.TEST_SEED, 1500)
    capacity = 1212  # mid capacity (bench_conversation_end.py)
    off = replay(requests, capacity, "auto").hit_blocks
    ends = replay(requests, capacity, "auto", conversation_ends=True).hit_blocks
    assert ends > off
