"""Soak: millions of mixed random allocator operations per policy, with invariants checked.

The driver is :mod:`prefixcache.tools.soak` (what it does, what it checks);
this is its command line. Run::

    python benchmarks/soak.py                      # 10^7 operations per policy
    python benchmarks/soak.py --ops 100000 --policies lru ref_zero --seed 3

``tests/properties/test_soak.py`` runs the same driver with 10^5 operations in CI.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script from a checkout
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from prefixcache.tools.soak import main

if __name__ == "__main__":
    sys.exit(main())
