"""``python -m prefixcache.cluster``: the cluster comparison on its own (see :mod:`.cli`)."""

from prefixcache.cluster.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
