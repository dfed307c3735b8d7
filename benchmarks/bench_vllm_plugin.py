"""Hit rate of LRU vs prefixcache's policies inside vLLM's own block pool, on a trace family.

Each trace is replayed one request at a time through vLLM 0.33's real ``BlockPool``:
longest cached prefix (``get_cached_block``), ``touch`` on the hit, ``get_new_blocks`` for
the rest, ``cache_full_blocks``, ``free_blocks`` in reverse (as vLLM's manager does). The
pool has ``capacity + longest request + 1`` blocks, and after each request the cached free
blocks above ``capacity`` are evicted (taken with ``get_new_blocks`` and freed again,
hash-less), which is what ``prefixcache.tools.replay.replay`` does with its allocator: so
the ``prefixcache`` column (prefixcache's own engine, same trace, same capacity) is the
same experiment outside vLLM. Columns: ``vLLM`` (no plugin), then each policy installed
with :func:`prefixcache.integrations.vllm.install`; each cell is the block hit rate, and
the last column the plugin's hit rate minus prefixcache's own for that policy.

Traces: three of the five seeded families of :mod:`prefixcache.tools.workloads` and the shipped
Mooncake sample. Times: microseconds per request (min/median/max over ``--repeats``, the
first a warm-up) for vLLM without the plugin and with each of ``--time-policies`` (default
``lru``, ``auto``, ``s3fifo``); a policy with a native unit is timed twice, as the plugin
runs it (``native``: the native queue, ``integrations/vllm_native_queue.py``) and with
``PREFIXCACHE_ENGINE=python`` (``python``: the Python queue with the policy's Python class;
``lru``: the inline lru queue, ``integrations/vllm_lru.py``).

Run where vLLM 0.33 is installed (``../shared/bench/README.md``), from the checkout:
``PYTHONPATH=. $PEERS_VENV/bin/python benchmarks/bench_vllm_plugin.py``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import cpu_model

from prefixcache.engine.native_engine import NATIVE_POLICIES
from prefixcache.integrations import vllm as plugin
from prefixcache.reference.trace import (
    TraceRequest,
    load_mooncake_trace,
    sample_trace_path,
    trace_block_hashes,
)
from prefixcache.testing.vllm_pool import admit
from prefixcache.tools import workloads
from prefixcache.tools.replay import replay

POLICIES = ("lru", "fifo", "lfu", "slru", "s3fifo", "arc", "hazard", "reuse_lru", "protected_lru")


def block_chains(requests: list[TraceRequest]) -> list[list[bytes]]:
    """Each request's chained trace hashes as vLLM's 32-byte ``BlockHash`` values."""
    return [[h.to_bytes(32, "big") for h in trace_block_hashes(r.hash_ids)] for r in requests]


def traces(num_requests: int, seed: int) -> dict[str, list[TraceRequest]]:
    """The trace family: three generated shapes and the shipped sample."""
    return {
        "shared_system_prompts": workloads.shared_system_prompts(num_requests, seed=seed),
        "multi_turn_chats": workloads.multi_turn_chats(num_requests, seed=seed),
        "documents_with_hot_prefixes": workloads.documents_with_hot_prefixes(
            num_requests, seed=seed
        ),
        "mooncake_sample": load_mooncake_trace(sample_trace_path(), limit=num_requests),
    }


def vllm_replay(
    chains: list[list[bytes]], capacity: int, *, trim: bool = True
) -> tuple[float, float]:
    """Block hit rate and seconds of one replay through a fresh ``BlockPool``.

    ``trim``: evict down to ``capacity`` cached blocks after each request (the hit
    table); without it vLLM evicts only when it allocates, as when serving (the times).
    """
    block_pool = importlib.import_module("vllm.v1.core.block_pool")  # vLLM: no type stubs
    pool = block_pool.BlockPool(capacity + max(map(len, chains)) + 1, True, 16)
    index = pool.cached_block_hash_to_block
    hit_blocks = total = 0
    start = time.perf_counter()
    for hashes in chains:
        blocks, num_hit = admit(pool, hashes)
        pool.free_blocks(reversed(blocks))
        excess = len(index) - capacity if trim else 0
        if excess > 0:  # evict down to capacity, as prefixcache's replay does: the free
            # hash-less blocks come first, then `excess` victims; all return hash-less
            num_plain = pool.get_num_free_blocks() - len(index)
            pool.free_blocks(pool.get_new_blocks(num_plain + excess))
        hit_blocks, total = hit_blocks + num_hit, total + len(hashes)
    return hit_blocks / total, time.perf_counter() - start


def with_policy(
    policy: str | None, chains: list[list[bytes]], capacity: int, *, trim: bool = True
) -> tuple[float, float]:
    """:func:`vllm_replay` with the plugin installed for ``policy`` (None: vLLM as shipped)."""
    plugin.uninstall()
    if policy is not None:
        plugin.install(policy)
    try:
        return vllm_replay(chains, capacity, trim=trim)
    finally:
        plugin.uninstall()


def hit_table(
    family: dict[str, list[TraceRequest]], capacities: list[int], names: list[str]
) -> None:
    """Print one row per trace and capacity: vLLM, each policy, and plugin - prefixcache."""
    print(f"| trace | capacity | vLLM | {' | '.join(names)} | max abs(plugin - prefixcache) |")
    print("|---|---:|---:|" + "---:|" * len(names) + "---|")
    for trace_name, requests in family.items():
        chains = [[h.to_bytes(32, "big") for h in trace_block_hashes(r.hash_ids)] for r in requests]
        for capacity in capacities:
            vanilla, _ = with_policy(None, chains, capacity)
            cells, gaps = [], []
            for name in names:
                rate, _ = with_policy(name, chains, capacity)
                own = replay(requests, capacity, name).hit_rate
                cells.append(f"{rate:.3f}")
                gaps.append((abs(rate - own), name, own))
            worst = max(gaps)
            note = f"{worst[0]:.3f} ({worst[1]}: prefixcache {worst[2]:.3f})" if worst[0] else "0"
            print(f"| {trace_name} | {capacity} | {vanilla:.3f} | {' | '.join(cells)} | {note} |")


def time_settings(names: list[str]) -> list[tuple[str | None, str]]:
    """vLLM as shipped, then each policy; one with a native unit (the native queue runs
    it unless ``PREFIXCACHE_ENGINE=python``) twice: native and the Python queue."""
    settings: list[tuple[str | None, str]] = [(None, "auto")]
    for name in names:
        if name in NATIVE_POLICIES:
            settings += [(name, "auto"), (name, "python")]
        else:
            settings.append((name, "auto"))
    return settings


def time_table(
    family: dict[str, list[TraceRequest]], capacity: int, repeats: int, names: list[str]
) -> None:
    """Microseconds per request without the plugin and with each policy of ``names``."""
    print(f"\n| trace (capacity {capacity}) | setting | us/request min | median | max |")
    print("|---|---|---:|---:|---:|")
    for trace_name, requests in family.items():
        chains = [[h.to_bytes(32, "big") for h in trace_block_hashes(r.hash_ids)] for r in requests]
        for setting, engine in time_settings(names):
            os.environ["PREFIXCACHE_ENGINE"] = engine
            samples = [
                with_policy(setting, chains, capacity, trim=False)[1] for _ in range(repeats + 1)
            ][1:]
            us = sorted(s / len(chains) * 1e6 for s in samples)
            label = "vLLM" if setting is None else f"plugin {setting}"
            if setting in NATIVE_POLICIES:
                label += " (python)" if engine == "python" else " (native)"
            print(
                f"| {trace_name} | {label} | {us[0]:.1f} | {statistics.median(us):.1f} "
                f"| {us[-1]:.1f} |"
            )
    os.environ.pop("PREFIXCACHE_ENGINE", None)


def __getattr__(name: str) -> Any:
    """``VllmPluginLru`` / ``VllmPluginAuto``: the shared harness's vLLM adapter with the plugin.

    For the overhead rows (W2/W3 with and without the plugin, same run), from the checkout::

        PYTHONPATH=. $PEERS_VENV/bin/python ../shared/bench/run_peers.py --peers vllm \\
            --adapter benchmarks/bench_vllm_plugin.py:VllmPluginLru \\
            --adapter benchmarks/bench_vllm_plugin.py:VllmPluginAuto --workloads W2,W3

    The harness runs itself as ``__main__`` in each peer's process; its ``VllmAdapter``
    is subclassed there, so this module needs no import of the harness.
    """
    policies = {"VllmPluginLru": "lru", "VllmPluginAuto": "auto"}
    if name not in policies:
        raise AttributeError(name)
    base = sys.modules["__main__"].VllmAdapter
    policy = policies[name]

    def prefix_init(self: Any, pool_blocks: int, block_size: int) -> None:
        plugin.install(policy)
        base.prefix_init(self, pool_blocks, block_size)

    return type(name, (base,), {"name": f"vllm+prefixcache {policy}", "prefix_init": prefix_init})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1500)
    parser.add_argument("--capacities", default="100,300,1000")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--time-capacity", type=int, default=300)
    parser.add_argument(
        "--time-policies",
        default="lru,auto,s3fifo",
        help="policies timed beside vLLM (a natively run one also with its Python class)",
    )
    args = parser.parse_args(argv)
    vllm = importlib.import_module("vllm")
    auto = "auto" if "auto" in plugin.policies.available() else plugin.AUTO_POLICY
    print(
        f"vLLM {vllm.__version__}, Python {platform.python_version()}, {cpu_model()}; "
        f"{args.requests} requests per trace, seed {args.seed}; auto = {auto}\n"
    )
    family = traces(args.requests, args.seed)
    capacities = [int(c) for c in args.capacities.split(",")]
    hit_table(family, capacities, args.policies.split(","))
    time_table(family, args.time_capacity, args.repeats, args.time_policies.split(","))


if __name__ == "__main__":
    main()
