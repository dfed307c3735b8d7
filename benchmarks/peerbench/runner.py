"""Timing W1-W3 on an adapter, by the spec's rules.

Only the operation loop is timed: the trace, the prompts and their conversion to
the library's input are made before it, the pool is built before it and torn down
after it. Each run gets a fresh pool, and ``gc.collect(); gc.freeze()`` comes just
before the loop (vLLM's engine freezes the heap after start-up too).
:func:`measure` runs one untimed warm-up per library and workload, then the timed
repetitions **interleaved** (round ``r`` runs every library once), so that repetition
``r`` of prefixcache and of a peer share the machine's state of that moment: their
ratio per round is the spread that the table reports.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from typing import Any

from peerbench.peers import NoMapping
from peerbench.workloads import BLOCK_SIZE, ChurnTrace


class ConservationError(RuntimeError):
    """After a W1 run and its teardown, the pool does not report ``C`` free blocks."""


@dataclass
class Record:
    """One library on one workload: a rate per timed repetition, and what it served.

    Attributes:
        library, version, workload: what ran.
        status: ``ok``, or why there is no number (``n/a (not installed)``, ...).
        rates: operations (W1) or requests (W2/W3) per second, one per repetition.
        hit_rate, request_hit_rate: W2/W3 block hit rate and share of requests with
            a hit (the same in every repetition: the runs are deterministic).
        hash_shares: per repetition, the share of the loop spent hashing, where the
            adapter times it apart.
    """

    library: str
    version: str
    workload: str
    status: str = "ok"
    rates: list[float] = field(default_factory=list)
    hit_rate: float | None = None
    request_hit_rate: float | None = None
    hash_shares: list[float] = field(default_factory=list)


def churn_codes(trace: ChurnTrace) -> list[int]:
    """W1's ops as ints for a lean loop: ``k > 0`` allocates k, ``-1 - i`` releases live[i]."""
    return [value if kind == "A" else -1 - value for kind, value in trace.ops]


def run_churn(adapter: Any, codes: list[int], pool_blocks: int) -> float:
    """One W1 run on a fresh pool: the loop's seconds; checks conservation after teardown."""
    adapter.churn_init(pool_blocks, BLOCK_SIZE)
    allocate, free = adapter.churn_alloc, adapter.churn_free
    live: list[Any] = []
    gc.collect()
    gc.freeze()
    start = time.perf_counter()
    for code in codes:
        if code > 0:
            live.append(allocate(code))
        else:
            index = -1 - code
            free(live[index])
            last = live.pop()
            if index < len(live):
                live[index] = last
    elapsed = time.perf_counter() - start
    gc.unfreeze()
    for handle in live:
        free(handle)
    if adapter.churn_num_free() != pool_blocks - 1:
        raise ConservationError(
            f"{adapter.name}: {adapter.churn_num_free()} free blocks after teardown, "
            f"expected {pool_blocks - 1}"
        )
    return elapsed


def run_prefix(adapter: Any, prepared: list[Any], pool_blocks: int) -> tuple[float, list[int]]:
    """One W2/W3 run on a fresh pool: the loop's seconds and each request's hit blocks."""
    adapter.prefix_init(pool_blocks, BLOCK_SIZE)
    serve = adapter.serve
    gc.collect()
    gc.freeze()
    start = time.perf_counter()
    hits = [serve(request) for request in prepared]
    elapsed = time.perf_counter() - start
    gc.unfreeze()
    return elapsed, hits


@dataclass
class Workload:
    """One workload, ready to run: its kind, pool and the untimed inputs."""

    name: str
    pool_blocks: int
    codes: list[int] | None = None  # W1
    requests: list[list[int]] | None = None  # W2/W3
    blocks_per_request: int = 0


def _run_once(adapter: Any, workload: Workload, prepared: Any, record: Record) -> None:
    if workload.codes is not None:
        elapsed = run_churn(adapter, workload.codes, workload.pool_blocks)
        record.rates.append(len(workload.codes) / elapsed)
        return
    elapsed, hits = run_prefix(adapter, prepared, workload.pool_blocks)
    record.rates.append(len(hits) / elapsed)
    record.hit_rate = sum(hits) / (len(hits) * workload.blocks_per_request)
    record.request_hit_rate = sum(hit > 0 for hit in hits) / len(hits)
    if getattr(adapter, "hash_s", 0.0) > 0:
        record.hash_shares.append(adapter.hash_s / elapsed)


def measure(
    adapters: dict[str, Any], workloads: list[Workload], repeats: int, warmup: int = 1
) -> list[Record]:
    """Every adapter on every workload: ``warmup`` untimed runs, then interleaved repeats.

    A library whose run raises gets the error as its status for that workload.
    """
    records = []
    for workload in workloads:
        runs = {}
        for name, adapter in adapters.items():
            record = Record(name, adapter.version(), workload.name)
            prepared = None
            if workload.requests is not None:
                prepared = [adapter.prepare(tokens) for tokens in workload.requests]
            runs[name] = (adapter, prepared, record)
            records.append(record)
        for round_index in range(warmup + repeats):
            for adapter, prepared, record in runs.values():
                if record.status != "ok":
                    continue
                try:
                    _run_once(adapter, workload, prepared, record)
                except NoMapping as error:  # the library has no API for this workload
                    record.status = f"n/a ({error})"
                    record.rates.clear()
                    continue
                except Exception as error:  # reported in the table, not hidden
                    record.status = f"error: {type(error).__name__}: {error}"
                    record.rates.clear()
                    continue
                if round_index < warmup:  # the warm-up's numbers are dropped
                    record.rates.clear()
                    record.hash_shares.clear()
    return records
