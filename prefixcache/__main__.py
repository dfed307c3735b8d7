"""``python -m prefixcache``: the same command line as the ``prefixcache`` script."""

from __future__ import annotations

from prefixcache.tools.cli import main

raise SystemExit(main())
