"""prefixcache's eviction policies inside vLLM 0.33, in two lines.

Run: python examples/vllm_policy.py   (with vLLM 0.33 installed; without it, it says so)

A server needs no code: with prefixcache installed, its vLLM general plugin reads one
environment variable when vLLM starts (``auto`` or any name in
``prefixcache.policies.available()``)::

    PREFIXCACHE_VLLM_POLICY=auto vllm serve MODEL

In your own process, before vLLM builds its engine::

    from prefixcache.integrations import vllm as prefixcache_vllm
from prefixcache.testing.vllm_pool import chain, serve
    prefixcache_vllm.install("protected_lru")

This script drives vLLM's own ``BlockPool`` the way its KV-cache manager does (longest
cached prefix, ``touch``, ``get_new_blocks``, ``cache_full_blocks``, ``free_blocks``) on
a hot shared prefix between scans of one-off prompts, once as vLLM ships and once per
policy, and prints the block hit rates.
"""

from __future__ import annotations

import importlib
from typing import Any

from prefixcache.integrations import vllm as prefixcache_vllm
from prefixcache.testing.vllm_pool import chain, serve


def hit_rate(pool: Any, rounds: int = 30) -> float:
    """A hot 4-block prefix asked twice per round, then four one-off 3-block prompts."""
    hit = total = 0
    for round_index in range(rounds):
        prompts = [chain(0, 1, 2, 3, 7), chain(0, 1, 2, 3, 8)]
        prompts += [chain(1000 + 10 * round_index + k, 1, 2) for k in range(4)]
        for prompt in prompts:  # look up, touch, allocate, cache, free: as vLLM's manager
            hit, total = hit + serve(pool, prompt), total + len(prompt)
    return hit / total


def main() -> None:
    try:
        block_pool = importlib.import_module("vllm.v1.core.block_pool")
    except ImportError:
        print("vLLM is not installed; pip install vllm==0.33.* to run this example")
        return
    print(f"{'vLLM as shipped':>16}: {hit_rate(block_pool.BlockPool(14, True, 16)):.3f}")
    for policy in ("lru", "lfu", "s3fifo", "protected_lru", "auto"):
        prefixcache_vllm.install(policy)  # pools built from now on use it
        rate = hit_rate(block_pool.BlockPool(14, True, 16))
        print(f"{policy:>16}: {rate:.3f}")
    prefixcache_vllm.uninstall()


if __name__ == "__main__":
    main()
