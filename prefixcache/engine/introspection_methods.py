"""What :class:`~prefixcache.KVBlockAllocator` says about itself: engine, stats, invariants.

Read-only calls for operators, tests and debugging: which engine runs and why,
a statistics snapshot, the invariant check, and the Python engine's own parts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from prefixcache.engine.core import EngineCore
from prefixcache.engine.events import KVEventLog
from prefixcache.engine.pool import BlockPool
from prefixcache.engine.registry import HashRegistry
from prefixcache.engine.stats import AllocatorStats
from prefixcache.errors import EngineMismatchError, InvariantError

__all__ = ["IntrospectionMethods"]


class IntrospectionMethods:
    """The engine's name and reason, ``stats``, ``check_invariants``, ``pool``, ``registry``."""

    _engine: EngineCore
    _engine_reason: str
    total_count: int
    num_usable: int
    events: KVEventLog | None
    _num_rejected: int
    _num_queried_tokens: int
    _num_hit_tokens: int
    _num_preempted_queried_tokens: int
    _num_preempted_hit_tokens: int

    if TYPE_CHECKING:

        def largest_free_run(self) -> int: ...  # DefragmentMethods'

    @property
    def engine(self) -> str:
        """Which engine runs this allocator, ``"python"`` or ``"native"`` (why: engine_reason)."""
        return self._engine.name

    @property
    def engine_reason(self) -> str:
        """Why :attr:`engine` runs this allocator, in one sentence.

        When ``engine="auto"`` had to run the Python engine, this says what the
        native one lacks for this configuration (also logged once per reason).
        """
        return self._engine_reason

    @property
    def pool(self) -> BlockPool:
        """The Python engine's free-stack pool, a host structure (tests and debugging).

        Raises:
            EngineMismatchError: the allocator runs the native engine, which has no
                Python pool (``engine="python"`` gives one).
        """
        pool: BlockPool = self._python_engine_part("pool")
        return pool

    @property
    def registry(self) -> HashRegistry:
        """The Python engine's hash registry (read-only use: tests and debugging).

        Raises:
            EngineMismatchError: the allocator runs the native engine, which has no
                Python registry (``engine="python"`` gives one).
        """
        registry: HashRegistry = self._python_engine_part("registry")
        return registry

    def _python_engine_part(self, name: str) -> Any:
        part = getattr(self._engine, name, None)
        if part is None:
            raise EngineMismatchError(
                f"allocator.{name} is the Python engine's; this allocator runs the "
                f"{self._engine.name} engine (KVBlockAllocator(engine='python') has one)"
            )
        return part

    def stats(self) -> AllocatorStats:
        """A snapshot of counts per state and cumulative events, all plain ints.

        O(1), but for ``largest_free_run`` (the fragmentation figure): O(num_usable).

        Whatever integer type an engine keeps, the snapshot holds Python
        ``int``s, so ``json.dumps(stats.as_dict())`` always works.
        """
        engine = self._engine
        counters = engine.counters()
        return AllocatorStats(
            total_count=self.total_count,
            num_usable=self.num_usable,
            num_free=int(engine.num_free),
            num_active=int(engine.num_active),
            num_paused=int(engine.num_paused),
            num_cached=int(engine.num_cached),
            num_registered=int(engine.num_registered),
            num_allocated_blocks=int(counters.num_allocated_blocks),
            num_released_references=int(counters.num_released_references),
            num_queried_blocks=int(counters.num_queried_blocks),
            num_hit_blocks=int(counters.num_hit_blocks),
            num_evicted_blocks=int(counters.num_evicted_blocks),
            num_dropped_blocks=int(counters.num_dropped_blocks),
            num_rejected_hits=self._num_rejected,
            num_dropped_events=0 if self.events is None else self.events.num_dropped,
            clock=int(counters.clock),
            num_queried_tokens=self._num_queried_tokens,
            num_hit_tokens=self._num_hit_tokens,
            largest_free_run=self.largest_free_run(),
            num_preempted_queried_tokens=self._num_preempted_queried_tokens,
            num_preempted_hit_tokens=self._num_preempted_hit_tokens,
        )

    def check_invariants(self) -> None:
        """Check every invariant of DESIGN.md; raise InvariantError naming the first broken one.

        Meant for tests and debugging. Complexity: O(total_count).
        """
        problems = self._engine.find_problems()
        if problems:
            raise InvariantError("; ".join(problems[:5]))
