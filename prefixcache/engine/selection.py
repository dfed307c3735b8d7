"""Which engine runs an allocator: the native one when it can, else the Python reference."""

from __future__ import annotations

from prefixcache.engine.config import AllocatorConfig
from prefixcache.engine.core import EngineCore
from prefixcache.engine.python_engine import PythonEngine
from prefixcache.policies import EvictionPolicy


def build_engine(
    config: AllocatorConfig, policy: EvictionPolicy, *, track_changes: bool
) -> EngineCore:
    """The engine for ``config`` (:attr:`AllocatorConfig.engine`; DESIGN.md, "The engine seam").

    Args:
        config: the allocator's configuration.
        policy: the policy object built from ``config.eviction_policy``.
        track_changes: the engine records freed blocks and removed hashes
            for the facade's collaborators (events, routing).
    """
    return PythonEngine(
        config.total_count,
        config.paused_count,
        policy,
        config.device,
        track_changes=track_changes,
    )
