"""Megatron-core's dynamic batching on CPU, with prefix caching through prefixcache.

Needs megatron-core 0.19 (``../shared/bench/README.md`` installs it for CPU). Run
``python examples/megatron_dynamic_context.py`` from the repository root.

One ``megatron.install(strict=True)`` makes Megatron's own ``DynamicInferenceContext``
build prefixcache's drop-in allocator in strict mode (its own free order and the native
fast paths; plain ``install()`` is compat mode, with Megatron's block IDs); nothing else
in Megatron changes. The loop is
Megatron's (``add_request`` matches and pins cached prefix blocks, ``update_requests``
runs a decode step, pausing, resuming and finishing requests), run on one workload
with Megatron's allocator, the drop-in with LRU, and the drop-in with s3fifo. Each
run prints the block hit rate and the cost of the allocations that had to evict
(Megatron's allocator scans its pool, the drop-in asks its policy). The ``torch.cuda``
shim lets Megatron's context run on a CPU-only machine (a demo, not prefixcache).
"""

from __future__ import annotations

import importlib
import os
import random
import socket
import time
import warnings
from typing import Any

import torch

from prefixcache.integrations import megatron

warnings.filterwarnings("ignore")  # Megatron's "Transformer Engine is not installed" notices


def megatron_core(name: str) -> Any:
    """A megatron-core module (imported by name: it ships no type information)."""
    return importlib.import_module(f"megatron.core.{name}")


config = megatron_core("inference.config")
contexts = megatron_core("inference.contexts.dynamic_context")
DynamicInferenceRequest = megatron_core("inference.inference_request").DynamicInferenceRequest
SamplingParams = megatron_core("inference.sampling_params").SamplingParams
BLOCK_SIZE, NUM_BLOCKS, MAX_REQUESTS = 16, 1024, 32
MODEL = megatron_core("transformer").TransformerConfig(
    num_layers=2, hidden_size=32, num_attention_heads=4
)


def cpu_only() -> None:
    """Stand-ins for the ``torch.cuda`` calls Megatron's context makes, and one process group."""

    class Event:
        def __init__(self, *args: object, **kwargs: object) -> None: ...
        def record(self, *args: object, **kwargs: object) -> None: ...
        def synchronize(self) -> None: ...
        def wait(self, *args: object, **kwargs: object) -> None: ...

    cuda: Any = torch.cuda
    cuda.current_device = lambda: "cpu"
    cuda.Event = Event
    cuda.current_stream = lambda *args, **kwargs: Event()
    cuda.synchronize = lambda *args, **kwargs: None
    for name in ("empty", "zeros", "ones", "full", "arange", "tensor", "empty_like", "zeros_like"):
        make = getattr(torch, name)
        setattr(torch, name, lambda *a, _make=make, **k: _make(*a, **{**k, "pin_memory": False}))
    with socket.socket() as probe:  # a free port for the process group of one
        probe.bind(("127.0.0.1", 0))
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = (
            "127.0.0.1",
            str(probe.getsockname()[1]),
        )
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    megatron_core("parallel_state").initialize_model_parallel(1, 1)


def workload(num_requests: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """(prompt, tokens to generate): a system prompt (Zipf-popular), then a unique question."""
    rng = random.Random(seed)
    systems = [[rng.randrange(1, 32_000) for _ in range(rng.randrange(64, 600))] for _ in range(32)]
    popularity = [1 / (rank + 1) for rank in range(len(systems))]
    return [
        (rng.choices(systems, popularity)[0]
         + [rng.randrange(1, 32_000) for _ in range(rng.randrange(8, 200))],
         rng.randrange(4, 24))
        for _ in range(num_requests)
    ]  # fmt: skip


def serve(name: str, policy: object, requests: list[tuple[list[int], int]]) -> str:
    """Megatron's dynamic-batching loop over ``requests``: hit rate and eviction cost."""
    block_bytes = 2 * 2 * MODEL.num_layers * BLOCK_SIZE * MODEL.hidden_size  # bf16 K and V
    context = contexts.DynamicInferenceContext(
        MODEL,
        config.InferenceConfig(
            block_size_tokens=BLOCK_SIZE,
            buffer_size_gb=NUM_BLOCKS * block_bytes / 1024**3,
            max_requests=MAX_REQUESTS,
            max_tokens=4096,
            max_sequence_length=1024,
            enable_prefix_caching=True,
            prefix_caching_eviction_policy=policy,
        ),
    )
    allocator, evicting = context.kv_block_allocator, [0.0, 0]
    allocate = allocator.allocate_memory_blocks

    def timed_allocate(num_blocks: int) -> torch.Tensor | None:
        """Megatron's call, timed when the free stack is short (the allocator must evict)."""
        short, start = allocator.total_avail < num_blocks, time.perf_counter()
        block_ids = allocate(num_blocks)
        if short:
            evicting[0] += time.perf_counter() - start
            evicting[1] += 1
        return block_ids

    allocator.allocate_memory_blocks = timed_allocate
    waiting, queried, started = list(enumerate(requests)), 0, time.perf_counter()
    while waiting or context.total_request_count:
        while waiting and context.total_request_count < MAX_REQUESTS // 2:
            request_id, (prompt, num_generate) = waiting[0]
            request = DynamicInferenceRequest(
                request_id=request_id,
                prompt_tokens=torch.tensor(prompt),
                sampling_params=SamplingParams(num_tokens_to_generate=num_generate),
                block_size_tokens=BLOCK_SIZE,
                enable_prefix_caching=True,
            )
            if not all(context.check_availability(request)):
                break
            context.prefix_cache_lru_clock += 1
            context.add_request(request)
            queried += (len(prompt) - 1) // BLOCK_SIZE  # Megatron matches at most this many
            waiting.pop(0)
        context.initialize_attention_state()
        active = slice(context.paused_request_count, context.total_request_count)
        generated = context.request_kv_length_offsets + context.request_query_lengths
        running = (generated[active] < context.request_output_lengths[active]).to(torch.uint8)
        context.update_requests(running, torch.ones(len(running), dtype=torch.int64))
    backing = getattr(allocator, "allocator", None)  # the drop-in's prefixcache allocator
    engine = f", {backing.engine} engine" if backing is not None else ""
    return (
        f"{name} ({getattr(policy, 'spec', 'lru')}{engine}): hit rate "
        f"{context.prefix_cache_blocks_matched / queried:.3f}, {evicting[1]} evicting "
        f"allocations at {1e6 * evicting[0] / max(evicting[1], 1):.0f} us each, "
        f"{time.perf_counter() - started:.1f} s"
    )


def main() -> None:
    cpu_only()
    requests = workload(300)
    print(f"{len(requests)} requests, {NUM_BLOCKS} blocks of {BLOCK_SIZE} tokens")
    print(serve("megatron-core KVBlockAllocator", config.PrefixCachingEvictionPolicy.LRU, requests))
    megatron.install(strict=True)  # from here on, Megatron's context builds the drop-in
    print(serve("prefixcache drop-in", config.PrefixCachingEvictionPolicy.LRU, requests))
    print(serve("prefixcache drop-in", megatron.PrefixCachePolicy("s3fifo"), requests))
    megatron.uninstall()


if __name__ == "__main__":
    main()
