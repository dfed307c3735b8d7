"""The liveness oracle of ``benchmarks/bench_oracle_bounds.py``: its order and its registration."""

from __future__ import annotations

import runpy
from pathlib import Path
from typing import Any

import pytest
from prefixcache.policies.belady import BeladyPolicy

from prefixcache import policies
from prefixcache.tools.replay import OPTIMUM_POLICY

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_oracle_bounds.py"


def _bench() -> dict[str, Any]:
    if not BENCH.is_file():
        pytest.skip("benchmarks/ is not beside the tests (installed package)")
    return runpy.run_path(str(BENCH))


def test_dead_blocks_go_first_then_the_least_recent() -> None:
    future = {1: 3, 2: 10, 3: 5, 4: 10}  # 10 = never (the horizon)
    policy = _bench()["LivenessOracle"](future.__getitem__, horizon=10)
    for block_id, stamp in ((1, 1), (2, 5), (3, 2), (4, 4)):
        policy.insert(block_id, block_hash=block_id, last_access=stamp, num_accesses=1, depth=0)
    policy.touch(1, 9)
    assert policy.evict(4) == [4, 2, 3, 1]  # dead: 4 (older) then 2; live: 3, then 1 (touched)


def test_the_oracle_stands_in_for_the_optimum_only_inside_the_block() -> None:
    bench = _bench()
    with pytest.raises(RuntimeError), bench["oracle_as_optimum"](5):
        assert issubclass(policies._registry[OPTIMUM_POLICY], bench["LivenessOracle"])
        raise RuntimeError("the run fails")
    assert policies._registry[OPTIMUM_POLICY] is BeladyPolicy
