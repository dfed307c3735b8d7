"""The peer benchmark's markdown: the machine, then one row per library and workload.

Each rate is the median over the timed repetitions with [min-max]. The ratio column
is prefixcache's rate divided by the library's, per round (round ``r`` of both ran
back to back), shown as the median with [min-max] over the rounds: a ratio whose
range is wide, or that crosses 1, is not resolved by this run.
"""

from __future__ import annotations

import os
import platform
import statistics
import subprocess
from pathlib import Path

from peerbench.runner import Record

REFERENCE = "prefixcache"


def _spread(values: list[float], fmt: str) -> str:
    low, mid, high = min(values), statistics.median(values), max(values)
    return f"{format(mid, fmt)} [{format(low, fmt)}-{format(high, fmt)}]"


def machine_lines(load_at_start: tuple[float, float, float]) -> list[str]:
    """The machine, versions, commit and the load average at start (the noise caveat)."""
    cpu = "?"
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            cpu = next(
                (
                    line.split(":", 1)[1].strip()
                    for line in cpuinfo
                    if line.startswith("model name")
                ),
                "?",
            )
    except OSError:
        pass
    repo = Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(repo), "status", "--porcelain"], capture_output=True, text=True
        ).stdout
        commit += " (uncommitted changes)" if dirty.strip() else ""
    except (OSError, subprocess.CalledProcessError):
        commit = "?"
    load = ", ".join(f"{value:.2f}" for value in load_at_start)
    return [
        f"- machine: {cpu}, {os.cpu_count()} CPUs, {platform.platform()}",
        f"- Python {platform.python_version()}; prefixcache commit {commit}",
        f"- load average at start (1, 5, 15 min): {load}. With a load near or above the"
        " number of CPUs other processes share them: absolute rates vary by tens of percent"
        " between runs, so compare libraries within one run and read the ratio's range.",
    ]


def table(records: list[Record]) -> list[str]:
    """One markdown row per library and workload, with the ratio against prefixcache."""
    reference = {r.workload: r for r in records if r.library == REFERENCE and r.status == "ok"}
    lines = [
        "| library | version | workload | ops/s or req/s, median [min-max] | hit rate | "
        "request hit rate | hash share | prefixcache ÷ library, median [min-max] |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for record in records:
        if record.status != "ok":
            cells = [record.library, record.version, record.workload, record.status, "", "", "", ""]
            lines.append("| " + " | ".join(cells) + " |")
            continue
        unit = "ops/s" if record.workload == "W1" else "req/s"
        rate = f"{_spread(record.rates, ',.0f')} {unit}"
        hit = "" if record.hit_rate is None else f"{record.hit_rate:.4f}"
        request_hit = "" if record.request_hit_rate is None else f"{record.request_hit_rate:.4f}"
        share = f"{statistics.median(record.hash_shares):.0%}" if record.hash_shares else ""
        ratio = ""
        base = reference.get(record.workload)
        if base is not None and record.library != REFERENCE:
            ratios = [mine / theirs for mine, theirs in zip(base.rates, record.rates, strict=False)]
            ratio = f"{_spread(ratios, '.2f')}x" if ratios else ""
        cells = [
            record.library,
            record.version,
            record.workload,
            rate,
            hit,
            request_hit,
            share,
            ratio,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines
