"""``python -m prefixcache``: the same command line as the ``prefixcache`` script."""

from __future__ import annotations

from prefixcache.cli import main

raise SystemExit(main())
