"""Hit rates of a trace replayed through vLLM's real ``KVCacheManager``, per policy, beside
prefixcache's own engine and vLLM's bare ``BlockPool`` on the same trace.

Each request becomes a vLLM ``Request`` whose prompt is one run of ``BLOCK_SIZE`` equal
tokens per trace block (token = the trace's chained block hash, so two prompts share a
vLLM block hash exactly where the trace says they share a block) plus one token more,
so that every full block may hit (vLLM always computes a prompt's last token). Per
request, as vLLM's scheduler does on admission and finish: ``get_computed_blocks``,
``allocate_slots`` for the rest, ``free``. Then the cached free blocks above
``capacity`` are evicted through the pool (taken with ``get_new_blocks`` and freed
hash-less), which is what ``prefixcache.tools.replay.replay`` does with its allocator.

Columns: ``manager`` (this replay, the plugin installed with the policy; ``vLLM`` = no
plugin), ``pool`` (``bench_vllm_plugin.vllm_replay``: the same steps on ``BlockPool``
alone), ``prefixcache`` (``replay``: prefixcache's own engine). Equal semantics give equal
numbers; the note in ``benchmarks/results/vllm_2026-11-25.md`` says where they differ.

``--trace PATH`` replays that Mooncake-format trace (``prefixcache convert`` makes one
from your own requests) instead of the generated family and the shipped sample;
``--requests`` then reads its first N requests.

Run where vLLM 0.33 is installed (``../shared/bench/README.md``), from the checkout:
``PYTHONPATH=. $PEERS_VENV/bin/python benchmarks/bench_vllm_manager.py [--trace PATH]``.
"""

from __future__ import annotations

import argparse
import importlib
import platform
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_vllm_plugin import block_chains, traces, with_policy
from machine import cpu_model

from prefixcache.integrations import vllm as plugin
from prefixcache.reference.trace import TraceRequest, load_mooncake_trace, trace_block_hashes
from prefixcache.tools.replay import replay

BLOCK_SIZE = 16
POLICIES = ("lru", "s3fifo", "arc", "protected_lru", "auto")


def prompts(requests: list[TraceRequest]) -> list[list[int]]:
    """Token IDs: ``BLOCK_SIZE`` copies of each chained block hash, then one more token."""
    out = []
    for request in requests:
        chain = [h & ((1 << 62) - 1) for h in trace_block_hashes(request.hash_ids)]
        out.append([token for h in chain for token in [h] * BLOCK_SIZE] + [0])
    return out


def manager_replay(tokens: list[list[int]], capacity: int) -> tuple[float, float]:
    """Block hit rate and seconds of one replay through a fresh ``KVCacheManager``."""
    torch = importlib.import_module("torch")
    interface = importlib.import_module("vllm.v1.kv_cache_interface")
    manager_module = importlib.import_module("vllm.v1.core.kv_cache_manager")
    kv_cache_utils = importlib.import_module("vllm.v1.core.kv_cache_utils")
    sampling = importlib.import_module("vllm.sampling_params")
    request_module = importlib.import_module("vllm.v1.request")
    hashing = importlib.import_module("vllm.utils.hashing")
    kv_cache_utils.init_none_hash(hashing.sha256)
    longest = max(len(t) for t in tokens) // BLOCK_SIZE + 1
    spec = interface.FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=1, head_size=1, dtype=torch.float32
    )
    config = interface.KVCacheConfig(
        num_blocks=capacity + longest + 1,
        kv_cache_tensors=[],
        kv_cache_groups=[interface.KVCacheGroupSpec(["layer"], spec)],
    )
    manager = manager_module.KVCacheManager(
        config,
        max_model_len=BLOCK_SIZE * (longest + 1),
        scheduler_block_size=BLOCK_SIZE,
        hash_block_size=BLOCK_SIZE,
        enable_caching=True,
    )
    pool, params = manager.block_pool, sampling.SamplingParams(max_tokens=1)
    params.update_from_generation_config({}, eos_token_id=-1)
    hasher = kv_cache_utils.get_request_block_hasher(BLOCK_SIZE, hashing.sha256, 0)
    hit_blocks = total = 0
    start = time.perf_counter()
    for index, prompt in enumerate(tokens):
        request = request_module.Request(
            request_id=str(index),
            prompt_token_ids=prompt,
            sampling_params=params,
            pooling_params=None,
            block_hasher=hasher,
        )
        computed, num_computed, _ = manager.get_computed_blocks(request)
        blocks: Any = manager.allocate_slots(
            request, len(prompt) - num_computed, num_computed, computed
        )
        if blocks is None:
            raise RuntimeError(f"request {index} did not fit in {config.num_blocks} blocks")
        manager.free(request)
        hit_blocks += num_computed // BLOCK_SIZE
        total += len(prompt) // BLOCK_SIZE
        excess = len(pool.cached_block_hash_to_block) - capacity
        if excess > 0:
            num_plain = pool.get_num_free_blocks() - len(pool.cached_block_hash_to_block)
            pool.free_blocks(pool.get_new_blocks(num_plain + excess))
    return hit_blocks / total, time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--capacities", default="100,300,1000")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--trace", type=Path, default=None, help="a Mooncake JSONL trace to replay instead"
    )
    args = parser.parse_args(argv)
    workload = (
        {args.trace.stem: load_mooncake_trace(args.trace, limit=args.requests)}
        if args.trace is not None
        else traces(args.requests, args.seed)
    )
    vllm = importlib.import_module("vllm")
    print(
        f"vLLM {vllm.__version__}, Python {platform.python_version()}, {cpu_model()}; "
        f"{args.requests} requests per trace, seed {args.seed}; block hit rates\n"
    )
    print("| trace | capacity | policy | manager | pool | prefixcache |")
    print("|---|---:|---|---:|---:|---:|")
    for trace_name, requests in workload.items():
        tokens, chains = prompts(requests), block_chains(requests)
        for capacity in (int(c) for c in args.capacities.split(",")):
            for policy in [None, *args.policies.split(",")]:
                plugin.uninstall()
                if policy is not None:
                    plugin.install(policy)
                try:
                    rate, _ = manager_replay(tokens, capacity)
                finally:
                    plugin.uninstall()
                pool_rate, _ = with_policy(policy, chains, capacity)
                own = f"{replay(requests, capacity, policy).hit_rate:.3f}" if policy else ""
                name = policy or "vLLM"
                print(
                    f"| {trace_name} | {capacity} | {name} | {rate:.3f} | {pool_rate:.3f} "
                    f"| {own} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
