"""The cluster layer: many engine instances behind a router.

Owns the routers (round-robin, least-loaded, prefix-aware), the in-process
prefix index and the client of NVIDIA Dynamo's indexer, and the multi-worker
replay that compares them. It may import serving, wire and engine, never
tools. See DESIGN.md, "Layers".

One file per concern: :mod:`~prefixcache.cluster.routers` (what a router
sees and the three routers), :mod:`~prefixcache.cluster.prefix_index` (where
the prefix-aware router learns what each worker holds),
:mod:`~prefixcache.cluster.dynamo` (NVIDIA Dynamo's indexer),
:mod:`~prefixcache.cluster.replay` (the multi-worker replay) and
:mod:`~prefixcache.cluster.cli` (the ``prefixcache compare --workers``
command, also ``python -m prefixcache.cluster``). Every public name is
importable from here.
"""

from prefixcache.cluster.cli import (
    DEFAULT_TOTAL_CAPACITY,
    DEFAULT_WORKERS,
    add_cluster_arguments,
    cluster_main,
    format_table,
    main,
)
from prefixcache.cluster.dynamo import (
    DynamoIndexerClient,
    DynamoPrefixIndex,
    free_tcp_port,
    start_dynamo_indexer,
    synthetic_block_tokens,
)
from prefixcache.cluster.prefix_index import OverlapIndex, PrefixIndex
from prefixcache.cluster.replay import ClusterResult, replay_cluster
from prefixcache.cluster.routers import (
    ROUTERS,
    LeastLoadedRouter,
    PrefixAwareRouter,
    RoundRobinRouter,
    RouteQuery,
    Router,
    WorkerLoad,
    make_router,
)

__all__ = [
    "DEFAULT_TOTAL_CAPACITY",
    "DEFAULT_WORKERS",
    "ROUTERS",
    "ClusterResult",
    "DynamoIndexerClient",
    "DynamoPrefixIndex",
    "LeastLoadedRouter",
    "OverlapIndex",
    "PrefixAwareRouter",
    "PrefixIndex",
    "RoundRobinRouter",
    "RouteQuery",
    "Router",
    "WorkerLoad",
    "add_cluster_arguments",
    "cluster_main",
    "format_table",
    "free_tcp_port",
    "main",
    "make_router",
    "replay_cluster",
    "start_dynamo_indexer",
    "synthetic_block_tokens",
]
