"""prefixcache.cluster: routers, the in-process prefix index, the multi-worker replay, the CLI."""

from __future__ import annotations

import argparse

import pytest

from prefixcache.cluster import (
    LeastLoadedRouter,
    PrefixAwareRouter,
    PrefixIndex,
    RoundRobinRouter,
    RouteQuery,
    WorkerLoad,
    add_cluster_arguments,
    cluster_main,
    make_router,
    replay_cluster,
)
from prefixcache.engine.events import AllBlocksCleared, BlockRemoved, BlockStored
from prefixcache.errors import CapacityError, ConfigError, InvalidArgumentError
from prefixcache.reference.trace import TraceRequest, sample_trace_path

IDLE = [WorkerLoad(0, 0)] * 3


def family_trace(num_requests: int, num_families: int = 3) -> list[TraceRequest]:
    """Requests taking prompt families in turn: 8 shared blocks plus one of their own."""
    return [
        TraceRequest(
            i * 100, 9 * 512, 4, (*range(100 * (i % num_families), 100 * (i % num_families) + 8), i)
        )
        for i in range(num_requests)
    ]


def test_prefix_index_follows_stores_removals_and_clears() -> None:
    index = PrefixIndex()
    index.apply(0, [BlockStored((1, 2, 3), None, (), 4)])
    index.apply(1, [BlockStored((1, 2), None, (), 4), BlockStored((9,), 2, (), 4)])
    assert index.overlaps([1, 2, 3], 3) == [3, 2, 0]
    index.apply(0, [BlockRemoved((2,))])
    assert index.overlaps([1, 2, 3], 3) == [1, 2, 0]
    index.apply(1, [AllBlocksCleared()])
    assert index.overlaps([1, 2, 3], 3) == [1, 0, 0]
    assert (index.num_hashes(0), index.num_hashes(1)) == (2, 0)


def test_round_robin_and_least_loaded() -> None:
    query = RouteQuery("r", (), 1)
    router = RoundRobinRouter()
    assert [router.choose(query, IDLE) for _ in range(4)] == [0, 1, 2, 0]
    loads = [WorkerLoad(2, 5), WorkerLoad(1, 9), WorkerLoad(1, 3)]
    assert LeastLoadedRouter().choose(query, loads) == 2


def test_prefix_aware_trades_overlap_against_load() -> None:
    router = PrefixAwareRouter()
    router.observe(1, [BlockStored((1, 2, 3, 4), None, (), 4)])
    query = RouteQuery("r", (1, 2, 3, 4), 6)
    assert router.choose(query, IDLE) == 1
    busy = [WorkerLoad(0, 0), WorkerLoad(3, 5), WorkerLoad(0, 0)]  # 2 + 5 > 6 + 0: the load wins
    assert router.choose(query, busy) == 0
    weighted = PrefixAwareRouter(overlap_weight=3.0)
    weighted.observe(1, [BlockStored((1, 2, 3, 4), None, (), 4)])
    assert weighted.choose(query, busy) == 1  # 3 * 2 + 5 < 3 * 6 + 0
    with pytest.raises(ConfigError):
        PrefixAwareRouter(overlap_weight=-1.0)
    with pytest.raises(ConfigError):
        make_router("random")


def test_prefix_aware_keeps_families_together() -> None:
    trace = family_trace(12)
    blind = replay_cluster(trace, num_workers=2, total_capacity=40, router="round_robin")
    aware = replay_cluster(trace, num_workers=2, total_capacity=40, router="prefix_aware")
    assert aware.hit_rate > 3 * blind.hit_rate
    assert aware.prompt_tokens == blind.prompt_tokens == 12 * 9 * 512
    assert sum(aware.requests_per_worker) == 12
    assert aware.evictions < blind.evictions


def test_one_worker_matches_the_single_engine_replay() -> None:
    from prefixcache.tools.replay import replay_concurrent

    trace = family_trace(9)
    single = replay_concurrent(trace, 30)
    for router in ("round_robin", "prefix_aware"):
        result = replay_cluster(trace, num_workers=1, total_capacity=30, router=router)
        assert (result.tokens_saved, result.prompt_tokens) == (
            single.tokens_saved,
            single.prompt_tokens,
        )


def test_load_spread_and_bad_arguments() -> None:
    result = replay_cluster(family_trace(6), num_workers=3, total_capacity=60, router="round_robin")
    assert result.requests_per_worker == (2, 2, 2)
    assert result.load_spread == pytest.approx(1.0)
    with pytest.raises(InvalidArgumentError):
        replay_cluster(family_trace(2), num_workers=0, total_capacity=60)
    with pytest.raises(CapacityError):  # 5 blocks a worker cannot hold a 10-block request
        replay_cluster(family_trace(2), num_workers=4, total_capacity=20)


def test_cluster_main_prints_the_router_table(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trace", default=None)
    parser.add_argument("--limit", type=int, default=None)
    add_cluster_arguments(parser)
    args = parser.parse_args(["--limit", "120", "--workers", "2", "--total-capacity", "2000"])
    assert cluster_main(args) == 0
    out = capsys.readouterr().out
    assert sample_trace_path().name in out
    rows = [line for line in out.splitlines() if line.startswith("| 2 |")]
    assert [row.split("|")[2].strip() for row in rows] == [
        "round_robin",
        "least_loaded",
        "prefix_aware",
    ]
    with pytest.raises(SystemExit):
        parser.parse_args(["--routers", "random"])
