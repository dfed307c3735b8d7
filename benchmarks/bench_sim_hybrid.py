"""The hybrid serving loop end to end: what it reuses, and what the exact check costs.

One workload (requests sharing a system prompt, arriving over time, every fourth one
forked into a second sample) served by :func:`prefixcache.reference.sim_hybrid.run_hybrid`
twice in one process, without and with ``verify``, on a toy hybrid model (full,
sliding-window and indexer attention groups, linear-attention layers). Prints what the
run reused (prefix hit rate, states restored from checkpoints, copy-on-write copies) and
tokens per second each way. The toy model computes one token at a time in Python, so
the absolute rate measures the toy, not the cache; the ratio is the cost of checking
every output against an uncached run.

Run: ``python benchmarks/bench_sim_hybrid.py [--requests 24] [--seed 0]``.
"""

from __future__ import annotations

import argparse
import platform
import random
import sys
import time
from pathlib import Path

import torch
from machine import cpu_model  # benchmarks/machine.py, beside this script

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout

from prefixcache.reference.sim_hybrid import HybridSimReport, HybridSimRequest, run_hybrid
from prefixcache.reference.toy_hybrid import ToyHybridModel, build_toy_hybrid

VOCAB = 64


def build_model() -> ToyHybridModel:
    """A fresh memory and model (same weights every time: seed 0)."""
    return build_toy_hybrid(
        num_blocks=256,
        block_size=8,
        window=16,
        max_requests=12,
        num_checkpoints=16,
        vocab_size=VOCAB,
    )


def workload(num_requests: int, seed: int) -> list[HybridSimRequest]:
    """A 40-token system prompt, 1-19 tokens of question, 16 generated; every 4th forked."""
    rng = random.Random(seed)
    system = [rng.randrange(VOCAB) for _ in range(40)]
    return [
        HybridSimRequest(
            i,
            (*system, *(rng.randrange(VOCAB) for _ in range(rng.randrange(1, 20)))),
            16,
            arrival_step=2 * i,
            fork_ranks=(1,) if i % 4 == 0 else (),
        )
        for i in range(num_requests)
    ]


def timed(requests: list[HybridSimRequest], verify: bool) -> tuple[HybridSimReport, float]:
    model = build_model()
    start = time.perf_counter()
    report, _ = run_hybrid(model, requests, step_token_budget=64, verify=verify)
    return report, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    requests = workload(args.requests, args.seed)
    print(f"# {cpu_model()}, Python {platform.python_version()}, torch {torch.__version__}")
    rates = {}
    for verify in (False, True):
        report, seconds = timed(requests, verify)
        tokens = report.prefill_tokens + report.decode_tokens
        rates[verify] = tokens / seconds
        print(
            f"verify={verify!s:5}: {report.num_finished} requests ({report.num_forks} forks, "
            f"{report.num_forks_refused} refused), {tokens} tokens computed in {seconds:.2f} s "
            f"= {rates[verify]:.0f} tokens/s; hit rate {report.hit_rate:.1%}, states restored "
            f"{report.num_restored_states}, checkpoints saved {report.num_checkpoints_saved}, "
            f"copies {report.num_copies}, preemptions {report.num_preemptions}"
        )
    print(f"verify costs {rates[False] / rates[True]:.2f}x the unverified run's time")


if __name__ == "__main__":
    main()
