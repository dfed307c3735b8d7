"""A progress bar for long replays: tqdm when installed, else a counter on stderr.

Apart from the replays (:mod:`prefixcache.tools.replay`) so they read as replays.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["progress_bar"]

# Show a progress bar for runs with at least this many requests.
_PROGRESS_MIN_REQUESTS = 500


@contextmanager
def progress_bar(total: int, *, enabled: bool, label: str = "") -> Iterator[Callable[[int], None]]:
    """Yield an ``advance(n)`` callable; draw progress when enabled and the run is long.

    Uses tqdm when it is installed (an optional dependency), else rewrites a
    counter on stderr every 1% of the run; both name the run (``label``: the
    policy and the capacity).
    """
    if not enabled or total < _PROGRESS_MIN_REQUESTS:
        yield lambda n: None
        return
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    if tqdm is not None:
        with tqdm(total=total, unit="req", leave=False, desc=label or None) as bar:
            yield bar.update
        return
    step = max(1, total // 100)
    done = 0
    prefix = f"{label}: " if label else ""

    def advance(n: int) -> None:
        nonlocal done
        before, done = done, done + n
        if done // step > before // step or (n and done == total):
            print(f"\r{prefix}{done}/{total} requests", end="", file=sys.stderr, flush=True)

    yield advance
    print(file=sys.stderr)
