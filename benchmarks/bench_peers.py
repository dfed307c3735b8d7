"""prefixcache beside vLLM, Megatron-core and SGLang on W1-W3, reproducible from this repository.

The workloads of ``../shared/bench/WORKLOADS.md`` (W1 allocator churn, W2 prefix
reuse, W3 prefix reuse under eviction pressure) are generated here from the spec
(``peerbench/workloads.py``, checked against its test vectors), not taken from the
shared harness. prefixcache runs through ``peer_adapter.PrefixCacheAdapter``, the
peers through ``peerbench/peers.py``; a library that does not import is reported as
``n/a (not installed)``. The table gives each rate as median [min-max] over the
timed repetitions, the hit rates, and prefixcache's rate divided by each library's,
per interleaved round, with its range; the load average at start says how noisy the
machine was.

The peers are installed in their own virtual environment as ``../shared/bench/README.md``
says (``$PEERS_VENV``; prefixcache need not be installed there: the adapter uses this
checkout, so build the extension first with ``pip install -e .``). From the repository
root::

    PYTHONPATH=. $PEERS_VENV/bin/python benchmarks/bench_peers.py --scale 0.25
    PYTHONPATH=. $PEERS_VENV/bin/python benchmarks/bench_peers.py --peers prefixcache,vllm \
        --workloads W2,W3
    python benchmarks/bench_peers.py --check   # the spec's test vectors; exit 1 on a mismatch
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # peerbench, peer_adapter

from peerbench import peers, report, runner, workloads


def build_workloads(names: list[str], scale: float) -> list[runner.Workload]:
    """The requested workloads' untimed inputs at ``scale``."""
    built = []
    requests: list[list[int]] | None = None
    for name in names:
        if name == "W1":
            codes = runner.churn_codes(workloads.churn_ops(scale))
            built.append(runner.Workload(name, workloads.CHURN_POOL, codes=codes))
            continue
        if requests is None:
            requests, _ = workloads.prefix_requests(scale)
        blocks = len(requests[0]) // workloads.BLOCK_SIZE
        pool = workloads.PREFIX_POOL[name]
        built.append(runner.Workload(name, pool, requests=requests, blocks_per_request=blocks))
    return built


def load_adapters(
    names: list[str], workload_names: list[str]
) -> tuple[dict[str, Any], list[runner.Record]]:
    """The adapters that load, and an ``n/a`` record per workload for those that do not."""
    adapters, missing = {}, []
    for name in names:
        try:
            adapters[name] = peers.load(name)
        except peers.NotInstalled as error:
            print(f"{name}: not installed ({error})", file=sys.stderr)
            missing += [runner.Record(name, "", w, "n/a (not installed)") for w in workload_names]
        except peers.NoMapping as error:
            print(f"{name}: {error}", file=sys.stderr)
            missing += [
                runner.Record(name, "", w, "n/a (installed, not mapped here)")
                for w in workload_names
            ]
    return adapters, missing


def _describe(workload: runner.Workload) -> str:
    if workload.codes is not None:
        return f"{workload.name} {len(workload.codes):,} ops (pool {workload.pool_blocks:,})"
    _, prompt_ids = workloads.prefix_requests(
        len(workload.requests or []) / workloads.PREFIX_REQUESTS
    )
    ideal = workloads.ideal_hit_rate(prompt_ids)
    pool = f"pool {workload.pool_blocks:,}, ideal hit rate {ideal:.4f}"
    return f"{workload.name} {len(prompt_ids):,} requests ({pool})"


def _names(text: str, known: tuple[str, ...]) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in known]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"choose from {', '.join(known)}; got {text!r}")
    return names


def _peer_names(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names or not all(peers.is_known(name) for name in names):
        known = ", ".join((*peers.PEERS, "prefixcache-<policy>"))
        raise argparse.ArgumentTypeError(f"choose from {known}; got {text!r}")
    return names


def main(argv: list[str] | None = None) -> int:
    """Parse the options, check the vectors or run the benchmark; the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--scale",
        type=float,
        default=1.0,
        help="W1 operations and W2/W3 requests x this (pools unchanged)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="timed runs per library and workload (after 1 warm-up)",
    )
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs first")
    parser.add_argument(
        "--workloads", type=lambda t: _names(t, ("W1", "W2", "W3")), default=["W1", "W2", "W3"]
    )
    parser.add_argument(
        "--peers",
        type=_peer_names,
        default=list(peers.PEERS),
        help=f"libraries, comma-separated (default: {','.join(peers.PEERS)}); "
        "prefixcache-<policy> adds prefixcache with that eviction policy (W2/W3)",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="verify the spec's test vectors and exit (1 on a mismatch)",
    )
    args = parser.parse_args(argv)
    if args.scale <= 0 or args.repeats < 1 or args.warmup < 0:
        parser.error("--scale must be > 0, --repeats >= 1, --warmup >= 0")

    failures = workloads.check_vectors()
    for failure in failures:
        print(f"test vector mismatch: {failure}", file=sys.stderr)
    if args.check or failures:
        print("test vectors: " + ("MISMATCH" if failures else "all match"))
        return 1 if failures else 0

    load_at_start = os.getloadavg()
    try:
        import torch

        torch.set_num_threads(1)  # the bookkeeping of Megatron runs on CPU tensors
    except ImportError:
        pass
    adapters, records = load_adapters(args.peers, args.workloads)
    built = build_workloads(args.workloads, args.scale)
    records = runner.measure(adapters, built, args.repeats, args.warmup) + records
    records.sort(key=lambda r: (r.workload, args.peers.index(r.library)))

    command = " ".join(["benchmarks/bench_peers.py", *(sys.argv[1:] if argv is None else argv)])
    print(f"# Peer benchmark: `{command}`\n")
    print("\n".join(report.machine_lines(load_at_start)))
    print(f"- scale {args.scale}: " + ", ".join(_describe(w) for w in built))
    print(
        f"- {args.warmup} untimed warm-up and {args.repeats} timed runs per library and"
        " workload, interleaved; torch 1 thread\n"
    )
    print("\n".join(report.table(records)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
