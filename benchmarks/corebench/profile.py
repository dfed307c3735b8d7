"""``--profile``: cProfile of the shared harness's workloads through the peer adapter."""

from __future__ import annotations

import argparse
import cProfile
import functools
import gc
import importlib.util
import pstats
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from corebench.common import BENCH_CORE, fmt3, time_each

# --------------------------------------------------------------------------
# --profile: cProfile of the harness workloads through the adapter
# --------------------------------------------------------------------------


def load_module(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def run_churn(adapter: Any, pool_blocks: int, trace: list[int]) -> None:
    """W1's operation loop (WORKLOADS.md) on a fresh pool: allocate k > 0, or
    release and swap-remove ``live[~op]``."""
    adapter.churn_init(pool_blocks, 16)
    allocate, release = adapter.churn_alloc, adapter.churn_free
    live: list[Any] = []
    for op in trace:
        if op > 0:
            live.append(allocate(op))
        else:
            index = ~op
            handle = live[index]
            last = live.pop()
            if index < len(live):
                live[index] = last
            release(handle)


def run_prefix(adapter: Any, pool_blocks: int, prepared: list[Any]) -> None:
    """W2/W3's request loop on a fresh pool: serve each prepared prompt in turn."""
    adapter.prefix_init(pool_blocks, 16)
    serve = adapter.serve
    for tokens in prepared:
        serve(tokens)


def workload_runner(harness: ModuleType, adapter: Any, workload: str) -> Callable[[], None]:
    """One untimed-setup, timed-loop run of ``workload`` built from the harness's generators."""
    spec = harness.WORKLOADS[workload]
    if spec["kind"] == "churn":
        trace, _ = harness.churn_trace(
            spec["ops"], spec["pool_blocks"], spec["k_max"], spec["seed"]
        )
        return functools.partial(run_churn, adapter, spec["pool_blocks"], trace)
    requests = harness.prefix_requests(
        spec["requests"],
        spec["prompts"],
        spec["prompt_tokens"],
        spec["unique_tokens"],
        spec["seed"],
    )
    prepared = [adapter.prepare(tokens) for _, tokens in requests]
    return functools.partial(run_prefix, adapter, spec["pool_blocks"], prepared)


def bench_profile(args: argparse.Namespace) -> None:
    """cProfile the adapter on the harness's own W1/W2/W3 operations.

    The traces come from ``run_peers.py`` (imported, not copied). The profile
    covers the operation loop plus building the fresh allocator (a few ms),
    after one warm-up run.
    """
    harness = load_module(Path(args.harness), "run_peers")
    adapter_module = load_module(BENCH_CORE.with_name("peer_adapter.py"), "peer_adapter")
    for workload in args.profile.split(","):
        run = workload_runner(harness, adapter_module.PrefixCacheAdapter(), workload)
        run()  # warm-up
        gc.collect()
        if args.profiler == "none":  # for an outside sampler: py-spy record -- python ...
            samples = time_each(run, 0, args.profile_runs)
            print(f"## {workload}: {fmt3(samples, 1.0, 3)} s per run (min / median / max)\n")
            continue
        profiler = cProfile.Profile()
        start = time.perf_counter()
        with profiler:
            run()
        seconds = time.perf_counter() - start
        print(f"## cProfile of {workload} ({seconds:.3f} s under the profiler)\n")
        pstats.Stats(profiler).sort_stats("tottime").print_stats(args.profile_top)
