"""The peer benchmark's workloads are the spec's: its generators match the test vectors.

``benchmarks/peerbench/workloads.py`` generates W1-W3 of ``../shared/bench/WORKLOADS.md``
for ``benchmarks/bench_peers.py``; a wrong draw order would time other operations than the
shared harness, and every ratio in its table would compare different work. The module
imports only the standard library, so it is loaded here by path (benchmarks/ is not a
package of the project).
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "peerbench" / "workloads.py"


@pytest.fixture(scope="module")
def workloads() -> Iterator[ModuleType]:
    spec = importlib.util.spec_from_file_location("peer_workloads", PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


def test_generators_match_every_test_vector_of_the_spec(workloads: ModuleType) -> None:
    assert workloads.check_vectors() == []


def test_scale_shortens_the_stream_and_keeps_its_start(workloads: ModuleType) -> None:
    full = workloads.churn_ops()
    small = workloads.churn_ops(0.01)
    assert len(small.ops) == 2_000
    assert small.ops == full.ops[:2_000]
    requests, prompt_ids = workloads.prefix_requests(0.01)
    assert len(requests) == 20 and prompt_ids[:3] == [10, 13, 0]
    assert all(len(tokens) == 2_304 for tokens in requests)


def test_ideal_hit_rate_counts_each_prompts_first_occurrence_as_a_miss(
    workloads: ModuleType,
) -> None:
    assert workloads.ideal_hit_rate([3, 3, 5, 3]) == pytest.approx(2 * 128 / (4 * 144))
    assert workloads.ideal_hit_rate([1, 2]) == 0.0


def test_a_changed_vector_is_reported(
    workloads: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(workloads, "_W1_DIGEST", "0" * 64)
    failures = workloads.check_vectors()
    assert len(failures) == 1 and failures[0].startswith("W1 SHA-256")
