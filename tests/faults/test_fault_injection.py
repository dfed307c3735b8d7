"""Fault injection: every public call either completes or leaves the allocator untouched.

DESIGN.md invariant 6 (the strong exception guarantee) must hold not only for
the errors the allocator raises itself but for any exception raised by what it
stands on: the eviction policy (a third-party object), the block pool and the
hash function. This harness wraps all three so that the Nth call of any of
their methods raises :class:`InjectedFault`:

- the policy: a :class:`FaultyPolicy` proxy around the configured policy,
  passed to the allocator as a policy object through its config;
- the pool: the allocator instance's ``pool`` methods, monkeypatched;
- the hash function: ``prefixcache.engine.hashing.compute_block_hashes``,
  monkeypatched (both :meth:`~KVBlockAllocator.hash_tokens` and
  :meth:`~KVBlockAllocator.fingerprint_tokens` go through it);
- the policy's hooks beyond the core (``on_register`` and ``set_retention``
  where the wrapped policy has them, ``relocate``);
- the facade's collaborators: the KV event log (``record_*``) and the MoE
  routing store (``clear``, ``clear_all``, ``swap_rows``), monkeypatched per
  instance like the pool;
- the KV copy callback of :meth:`~KVBlockAllocator.apply_defragment`.

Beside the engine's own calls, the program runs the composed paths above it:
``admit_request`` / ``release_request`` / ``allocate_block_ids`` (the request
path on the Python engine), ``set_retention_priority`` and defragmentation.

A seeded random program of public calls runs against one allocator. Before
each call, a deep copy runs it with no fault to count the ``k`` wrapped calls
it makes; then, for each ``i`` in ``1..k``, a fresh deep copy runs it with a
fault at wrapped call ``i``, and the full state digest (counters, maps,
free-stack order, policy order, routing, fingerprints, queued events) after
the failed call is compared with the one before. Any difference is a
violation, reported with the public method, the wrapped call that raised and
the digest fields that changed.

The policy's part of the digest is its whole eviction order (a deep copy
evicts everything): every policy, adaptive ones included, must end with the
same order after a failed call (their transactions: ``abort`` restores the
state at ``begin``; DESIGN.md, "The transaction rule").
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from prefixcache.policies import EvictionPolicy, has_hook

from prefixcache import KVBlockAllocator, PrefixCacheError, policies
from prefixcache.engine import hashing
from prefixcache.engine.pool import BlockPool
from prefixcache.testing import ReferenceModel, changed_fields, state_digest

pytestmark = pytest.mark.slow  # long programs: the full suite (--full)

POLICY_NAMES = [name for name in policies.available() if name != "belady"]
TOTAL_COUNT = 12
PAUSED_COUNT = 3
BLOCK_SIZE = 2
SEEDS = range(8)
STEPS = 80
POOL_METHODS = ("acquire", "release", "reset", "free_ids")


class InjectedFault(Exception):
    """The exception a wrapped call raises at the chosen point (not a library error)."""


class FaultPlan:
    """Counts wrapped calls while armed and raises at call number ``fail_at`` (1-based).

    Shared by every copy of an allocator (``deepcopy`` returns the plan
    itself), so one plan drives whichever copy is being exercised.
    """

    def __init__(self) -> None:
        self.armed = False
        self.fail_at = 0  # 0: count only, never raise
        self.calls: list[str] = []

    def __deepcopy__(self, memo: dict[int, Any]) -> FaultPlan:
        return self

    def arm(self, fail_at: int) -> None:
        self.armed, self.fail_at, self.calls = True, fail_at, []

    def disarm(self) -> None:
        self.armed = False

    def tick(self, name: str) -> None:
        """Record a wrapped call; raise if it is the chosen one."""
        if not self.armed:
            return
        self.calls.append(name)
        if len(self.calls) == self.fail_at:
            raise InjectedFault(f"injected at call {self.fail_at}: {name}")


class FaultyPolicy(EvictionPolicy):
    """An eviction policy proxy whose every method first asks the plan whether to fail.

    ``commit`` and ``abort`` never fail (the engine calls them once it can no
    longer undo, and to undo); ``begin`` may.
    """

    def __init__(self, inner: Any, plan: FaultPlan) -> None:
        self.inner = inner
        self.plan = plan
        self.retains_unreferenced = inner.retains_unreferenced

    def insert(
        self, block_id: int, block_hash: int, last_access: int, num_accesses: int, depth: int
    ) -> None:
        self.plan.tick("policy.insert")
        self.inner.insert(block_id, block_hash, last_access, num_accesses, depth)

    def discard(self, block_id: int) -> None:
        self.plan.tick("policy.discard")
        self.inner.discard(block_id)

    def touch(self, block_id: int, now: int) -> None:
        self.plan.tick("policy.touch")
        self.inner.touch(block_id, now)

    def evict(self, num_blocks: int) -> list[int]:
        self.plan.tick("policy.evict")
        return self.inner.evict(num_blocks)

    def begin(self) -> None:
        self.plan.tick("policy.begin")
        self.inner.begin()

    def commit(self) -> None:
        self.inner.commit()

    def abort(self) -> None:
        self.inner.abort()

    def clear(self) -> None:
        self.plan.tick("policy.clear")
        self.inner.clear()

    def __len__(self) -> int:
        self.plan.tick("policy.__len__")
        return len(self.inner)

    def __contains__(self, block_id: object) -> bool:
        self.plan.tick("policy.__contains__")
        return block_id in self.inner

    def evicts_first(
        self, block_id: int, block_hash: int, last_access: int, num_accesses: int, depth: int
    ) -> bool:
        """Forwards when the inner policy predicts its next victim; else never predicts."""
        self.plan.tick("policy.evicts_first")
        if not has_hook(self.inner, "evicts_first"):
            return False
        return self.inner.evicts_first(block_id, block_hash, last_access, num_accesses, depth)


class _HookForwarders:
    """The policy hooks beyond the core, each ticking the plan (see :func:`faulty_policy`)."""

    inner: Any
    plan: FaultPlan

    def on_register(self, block_hashes: list[int], first_depth: int) -> None:
        self.plan.tick("policy.on_register")
        self.inner.on_register(block_hashes, first_depth)

    def set_retention(self, block_hash: int, priority: int, expires_at: int | None) -> None:
        self.plan.tick("policy.set_retention")
        self.inner.set_retention(block_hash, priority, expires_at)

    def relocate(
        self,
        old_id: int,
        new_id: int,
        block_hash: int,
        last_access: int,
        num_accesses: int,
        depth: int,
    ) -> None:
        self.plan.tick("policy.relocate")
        self.inner.relocate(old_id, new_id, block_hash, last_access, num_accesses, depth)


OPTIONAL = ("on_register", "set_retention")


def faulty_policy(inner: Any, plan: FaultPlan) -> FaultyPolicy:
    """A :class:`FaultyPolicy` with the optional hooks ``inner`` has (so ``has_hook`` agrees).

    ``relocate`` is no optional hook (the base class has a default), so it
    always forwards to the inner policy's own.
    """
    hooks = {name: getattr(_HookForwarders, name) for name in OPTIONAL if has_hook(inner, name)}
    hooks["relocate"] = _HookForwarders.relocate
    cls = type(f"Faulty{type(inner).__name__}", (FaultyPolicy,), hooks)
    return cls(inner, plan)


EVENT_METHODS = ("record_stored", "record_removed", "record_cleared")
ROUTING_METHODS = ("clear", "clear_all", "swap_rows")


def instrument_collaborators(allocator: KVBlockAllocator, plan: FaultPlan) -> None:
    """Monkeypatch the event log's and routing store's mutators to tick ``plan`` first."""
    for owner, names in ((allocator.events, EVENT_METHODS), (allocator.routing, ROUTING_METHODS)):
        if owner is None:
            continue
        prefix = "events" if owner is allocator.events else "routing"
        for name in names:
            method = getattr(type(owner), name).__get__(owner)

            def wrapper(*args: Any, _method: Any = method, _name: str = f"{prefix}.{name}") -> Any:
                plan.tick(_name)
                return _method(*args)

            setattr(owner, name, wrapper)


def instrument(allocator: KVBlockAllocator, plan: FaultPlan) -> None:
    """Every wrapped collaborator of ``allocator``: the pool, the event log, the routing store."""
    instrument_pool(allocator, plan)
    instrument_collaborators(allocator, plan)


def instrument_pool(allocator: KVBlockAllocator, plan: FaultPlan) -> None:
    """Monkeypatch the public methods of ``allocator.pool`` to tick ``plan`` first.

    Rebinds from the class each time, so it also replaces the stale wrappers
    a deep copy carries over from the original.
    """
    pool = allocator.pool
    for name in POOL_METHODS:
        method = getattr(BlockPool, name).__get__(pool)

        def wrapper(*args: Any, _method: Any = method, _name: str = name) -> Any:
            plan.tick(f"pool.{_name}")
            return _method(*args)

        setattr(pool, name, wrapper)


def faulty_hash(plan: FaultPlan) -> Callable[..., list[int]]:
    """``compute_block_hashes`` that ticks ``plan`` first."""
    original = hashing.compute_block_hashes

    def compute(*args: Any, **kwargs: Any) -> list[int]:
        plan.tick("hashing.compute_block_hashes")
        return original(*args, **kwargs)

    return compute


def full_digest(allocator: KVBlockAllocator) -> dict[str, Any]:
    """The kit's :func:`~prefixcache.testing.state_digest`, reading the order of the wrapped policy.

    The :class:`FaultyPolicy` proxy must not be driven by the digest (its copy
    would count calls), so the order is read from the policy it wraps.
    """
    policy = allocator.policy
    inner = policy.inner if isinstance(policy, FaultyPolicy) else policy
    return state_digest(allocator, policy=inner)


# ---------------------------------------------------------------------- the program


@dataclass
class Model(ReferenceModel):
    """The kit's reference model (one entry per reference held), plus the prompts served."""

    prompts: list[list[int]] = field(default_factory=list)


Operation = Callable[[KVBlockAllocator], Any]
"""A public call with its arguments bound; returns the call's result."""


@dataclass
class Step:
    """One public call of the program, and how it changes the model if it succeeds."""

    method: str
    call: Operation
    commit: Callable[[Any], None]


def _pick(rng: random.Random, pool: list[int], most: int) -> list[int]:
    """Remove and return up to ``most`` random entries of ``pool``."""
    picks = sorted(rng.sample(range(len(pool)), min(most, len(pool))), reverse=True)
    return [pool.pop(i) for i in picks]


def next_step(rng: random.Random, allocator: KVBlockAllocator, model: Model) -> Step:
    """Draw the next public call from the current state (valid calls, mostly)."""
    kind = rng.choice(
        [
            "allocate",
            "allocate",
            "register",
            "register",
            "match",
            "match",
            "release",
            "release",
            "release_paused",
            "free_group",
            "acquire_blocks",
            "pause",
            "resume",
            "evict_cached_blocks",
            "evict_lru_blocks",
            "evict_blocks",
            "update_timestamps",
            "hash_tokens",
            "fingerprint_tokens",
            "reset",
            "admit_request",
            "admit_request",
            "release_request",
            "allocate_block_ids",
            "set_retention_priority",
            "apply_defragment",
        ]
    )
    if kind in ("admit_request", "release_request", "allocate_block_ids"):
        return request_path_step(rng, kind, model)
    if kind in ("set_retention_priority", "apply_defragment"):
        return policy_hook_step(rng, kind, allocator, model)
    if kind == "allocate":
        room = allocator.pool.num_free + allocator.get_evictable_block_count()
        num = rng.choice([rng.randint(0, 3), max(0, room - rng.randint(0, 1))])  # may evict
        return Step(
            "allocate_memory_blocks",
            lambda a: a.allocate_memory_blocks(num),
            lambda ids: model.active.extend([] if ids is None else ids.tolist()),
        )
    if kind == "register":
        # Half the time continue a registered chain, so a cached parent leaf gains a child.
        resident = [h for h, _ in allocator.registry.items()]
        parent = rng.choice(resident) if resident and rng.random() < 0.5 else None
        prompt = [rng.randint(0, 2) for _ in range(rng.randint(1, 3) * BLOCK_SIZE)]
        hashes = hashing.compute_block_hashes(prompt, BLOCK_SIZE, parent=parent)
        fresh = allocator.allocate_memory_blocks(len(hashes))
        if fresh is None:
            return next_step(rng, allocator, model)
        model.active.extend(fresh.tolist())
        if parent is None:
            model.prompts.append(prompt)
        return Step(
            "register_kv_block_hashes",
            lambda a: a.register_kv_block_hashes(fresh, hashes, parent_hash=parent),
            lambda _: None,
        )
    if kind == "match":
        prompt = rng.choice(model.prompts) if model.prompts else [0, 1, 2, 3]
        hashes = hashing.compute_block_hashes(prompt, BLOCK_SIZE)
        return Step(
            "match_prefix",
            lambda a: a.match_prefix(hashes, acquire=True),
            lambda ids: model.active.extend(ids.tolist()),
        )
    if kind in ("release", "free_group"):
        taken = _pick(rng, model.active, 4)
        model.active.extend(taken)  # committed only on success

        def commit(_: Any, taken: list[int] = taken) -> None:
            for block_id in taken:
                model.active.remove(block_id)

        if kind == "release":
            return Step("release_memory_blocks", lambda a: a.release_memory_blocks(taken), commit)
        half = len(taken) // 2

        def grouped(a: KVBlockAllocator) -> None:
            with a.free_group():
                a.release_memory_blocks(taken[:half])
                a.release_memory_blocks(taken[half:])

        return Step("free_group", grouped, commit)
    if kind == "release_paused":
        taken = _pick(rng, model.paused, 3)
        model.paused.extend(taken)

        def commit_paused(_: Any, taken: list[int] = taken) -> None:
            for block_id in taken:
                model.paused.remove(block_id)

        return Step(
            "release_memory_blocks(paused)",
            lambda a: a.release_memory_blocks(taken, paused=True),
            commit_paused,
        )
    if kind in ("pause", "resume"):
        source, target = (
            (model.active, model.paused)
            if kind == "pause"
            else (
                model.paused,
                model.active,
            )
        )
        taken = _pick(rng, source, 2)
        source.extend(taken)

        def commit_move(
            _: Any, taken: list[int] = taken, source: list[int] = source, target: list[int] = target
        ) -> None:
            for block_id in taken:
                source.remove(block_id)
            target.extend(taken)

        return Step(kind, lambda a: getattr(a, kind)(taken), commit_move)
    if kind == "acquire_blocks":
        registered = {b for _, b in allocator.registry.items()}
        cached = registered - set(model.active) - set(model.paused)
        candidates = sorted(cached or registered) or model.active
        chosen = rng.sample(candidates, min(2, len(candidates))) if candidates else []
        return Step(
            "acquire_blocks",
            lambda a: a.acquire_blocks(chosen),
            lambda _: model.active.extend(chosen),
        )
    if kind in ("evict_cached_blocks", "evict_lru_blocks"):
        num = rng.randint(0, 3)
        return Step(kind, lambda a: getattr(a, kind)(num), lambda _: None)
    if kind == "evict_blocks":  # registered blocks parents first: chains eaten tail-first
        registry = allocator.registry
        chosen = sorted((b for _, b in registry.items()), key=lambda b: int(registry.depth_of[b]))
        chosen = chosen[rng.randint(0, len(chosen)) :]
        return Step(kind, lambda a: a.evict_blocks(chosen), lambda _: None)
    if kind == "update_timestamps":
        candidates = sorted({b for _, b in allocator.registry.items()} | set(model.active))
        chosen = rng.sample(candidates, min(3, len(candidates))) if candidates else []
        return Step("update_timestamps", lambda a: a.update_timestamps(chosen), lambda _: None)
    if kind in ("hash_tokens", "fingerprint_tokens"):
        tokens = [rng.randint(0, 9) for _ in range(2 * BLOCK_SIZE)]
        return Step(kind, lambda a: getattr(a, kind)(tokens), lambda _: None)

    def commit_reset(_: Any) -> None:
        model.reset()

    return Step("reset", lambda a: a.reset(), commit_reset)


def request_path_step(rng: random.Random, kind: str, model: Model) -> Step:
    """A call of the request path (composed from the engine's primitives on this engine)."""
    if kind == "admit_request":
        prompt = (
            [*rng.choice(model.prompts), rng.randint(0, 2)]
            if model.prompts and rng.random() < 0.6
            else [rng.randint(0, 2) for _ in range(rng.randint(1, 7))]
        )
        row = np.full(-(-len(prompt) // BLOCK_SIZE), -1, dtype=np.int32)

        def admitted(_: Any) -> None:
            model.active.extend(row.tolist())
            model.prompts.append(prompt[: len(prompt) // BLOCK_SIZE * BLOCK_SIZE] or [0, 0])

        return Step("admit_request", lambda a: a.admit_request(prompt, row), admitted)
    if kind == "allocate_block_ids":
        num = rng.randint(0, 3)
        return Step(
            "allocate_block_ids",
            lambda a: a.allocate_block_ids(num),
            lambda ids: model.active.extend([] if ids is None else list(ids.tolist())),
        )
    taken = _pick(rng, model.active, 4)
    model.active.extend(taken)

    def released(_: Any) -> None:
        for block_id in taken:
            model.active.remove(block_id)

    return Step("release_request", lambda a: a.release_request(taken), released)


def policy_hook_step(
    rng: random.Random, kind: str, allocator: KVBlockAllocator, model: Model
) -> Step:
    """A call that drives the policy's optional hooks: retention or defragmentation."""
    if kind == "set_retention_priority":
        resident = [h for h, _ in allocator.registry.items()]
        hashes = rng.sample(resident, min(3, len(resident)))
        priority, duration = rng.randint(0, 5), rng.choice([None, 3])
        return Step(
            "set_retention_priority",
            lambda a: a.set_retention_priority(hashes, priority, duration=duration),
            lambda _: None,
        )
    plan = allocator.plan_defragment()
    moved = dict(zip(plan.sources, plan.destinations, strict=True))
    faults: FaultPlan = allocator.policy.plan

    def copy_kv(sources: Any, destinations: Any) -> None:
        """The KV storage's copy: a fault here must leave every block where it was."""
        faults.tick("kv.copy")

    def renamed(_: Any) -> None:
        for held in (model.active, model.paused):
            held[:] = [moved.get(block_id, block_id) for block_id in held]

    return Step("apply_defragment", lambda a: a.apply_defragment(plan, copy=copy_kv), renamed)


@dataclass(frozen=True)
class Violation:
    """A failed call that changed state."""

    method: str
    fault_at: int
    wrapped_call: str
    calls: tuple[str, ...]
    changed: tuple[str, ...]

    def __str__(self) -> str:
        return (
            f"{self.method}: fault at wrapped call {self.fault_at}/{len(self.calls)} "
            f"({self.wrapped_call}; sequence {list(self.calls)}) changed " + "; ".join(self.changed)
        )


@dataclass
class Report:
    """What a run of the harness saw, per public method."""

    fault_points: dict[str, int] = field(default_factory=dict)
    violations: list[Violation] = field(default_factory=list)
    known_gaps: dict[str, list[Violation]] = field(default_factory=dict)
    wrapped_calls: set[str] = field(default_factory=set)

    def for_method(self, method: str) -> list[Violation]:
        return [v for v in self.violations if v.method == method]


def inject_everywhere(
    allocator: KVBlockAllocator, plan: FaultPlan, step: Step, report: Report
) -> None:
    """Run ``step`` on copies of ``allocator`` with a fault at each wrapped call in turn."""
    probe = copy.deepcopy(allocator)
    instrument(probe, plan)
    plan.arm(0)
    try:
        step.call(probe)
    except PrefixCacheError:
        pass  # a refused call still gets faults injected at the calls it made
    finally:
        plan.disarm()
    sequence = tuple(plan.calls)
    report.wrapped_calls.update(sequence)
    report.fault_points[step.method] = report.fault_points.get(step.method, 0) + len(sequence)
    for fail_at in range(1, len(sequence) + 1):
        victim = copy.deepcopy(allocator)
        instrument(victim, plan)
        before = full_digest(victim)
        plan.arm(fail_at)
        try:
            step.call(victim)
        except (InjectedFault, PrefixCacheError):
            pass
        finally:
            plan.disarm()
        after = full_digest(victim)
        wrapped = sequence[fail_at - 1]
        problems = tuple(victim._engine.find_problems())
        if problems:  # never tolerated: the engine's own books disagree
            report.violations.append(Violation(step.method, fail_at, wrapped, sequence, problems))
        elif before != after:
            violation = Violation(
                step.method, fail_at, wrapped, sequence, tuple(changed_fields(before, after))
            )
            gap = known_gap(step.method, wrapped, violation.changed)
            if gap is None:
                report.violations.append(violation)
            else:
                report.known_gaps.setdefault(gap, []).append(violation)


AFTER_COMMIT = "a collaborator that runs after the engine committed"
ADMIT_AFTER_HIT = "admit_request after the prefix hit is pinned"
RESET_POOL_FAULT = "reset when the pool fails after the policy was cleared"
KNOWN_GAPS = {
    AFTER_COMMIT: (
        "the KV event log and the routing store are updated after the engine has "
        "committed a call (they hear what it freed or registered); they are the library's "
        "own bookkeeping, with no third-party code or device I/O, so a fault there can only "
        "be a bug or an exhausted interpreter; the engine stays consistent (checked)"
    ),
    ADMIT_AFTER_HIT: (
        "the composed admit_request pins the cached prefix (take_hit), then allocates and "
        "registers; a policy or pool fault in the later steps leaves the hit's references "
        "taken (tests/faults/test_request_path_faults.py pins it as a strict xfail)"
    ),
    RESET_POOL_FAULT: (
        "reset clears the policy (not transactional, by the policy contract) before the "
        "pool; when the pool's device copy fails, the engine inserts the cached leaves "
        "again: every leaf is tracked, but a policy that keeps history (s3fifo's queues) "
        "may order them differently; only the policy's order may differ"
    ),
}
"""Digest changes the harness reports apart, each with why it is not (yet) a violation."""


def known_gap(method: str, wrapped_call: str, changed: tuple[str, ...]) -> str | None:
    """The :data:`KNOWN_GAPS` entry a digest change falls under, or None (a violation)."""
    if wrapped_call.startswith(("events.", "routing.")):
        return AFTER_COMMIT
    if method == "admit_request" and not wrapped_call.startswith("hashing."):
        return ADMIT_AFTER_HIT
    if (method, wrapped_call) == ("reset", "pool.reset") and all(
        line.startswith("policy_order:") for line in changed
    ):
        return RESET_POOL_FAULT
    return None


def run_program(policy_name: str, seed: int, monkeypatch: pytest.MonkeyPatch) -> Report:
    """Drive ``STEPS`` random public calls, injecting faults at every point of each."""
    plan = FaultPlan()
    monkeypatch.setattr(hashing, "compute_block_hashes", faulty_hash(plan))
    allocator = KVBlockAllocator(
        total_count=TOTAL_COUNT,
        paused_count=PAUSED_COUNT,
        block_size_tokens=BLOCK_SIZE,
        eviction_policy=faulty_policy(policies.get(policy_name), plan),
        device="cpu",
        kv_events_capacity=1_000,
        routing_num_layers=1,
        routing_top_k=1,
    )
    rng = random.Random(seed)
    model = Model()
    report = Report()
    for _ in range(STEPS):
        step = next_step(rng, allocator, model)
        inject_everywhere(allocator, plan, step, report)
        try:
            result = step.call(allocator)
        except PrefixCacheError:
            continue
        step.commit(result)
        allocator.check_invariants()
    return report


_REPORTS: dict[str, Report] = {}


def report_for(policy_name: str, monkeypatch: pytest.MonkeyPatch) -> Report:
    """All seeds of one policy merged; computed once per session."""
    if policy_name not in _REPORTS:
        merged = Report()
        for seed in SEEDS:
            report = run_program(policy_name, seed, monkeypatch)
            merged.violations.extend(report.violations)
            merged.wrapped_calls |= report.wrapped_calls
            for gap, seen in report.known_gaps.items():
                merged.known_gaps.setdefault(gap, []).extend(seen)
            for method, count in report.fault_points.items():
                merged.fault_points[method] = merged.fault_points.get(method, 0) + count
        _REPORTS[policy_name] = merged
    return _REPORTS[policy_name]


# ---------------------------------------------------------------------- the tests

METHODS = [
    "allocate_memory_blocks",
    "evict_cached_blocks",
    "evict_lru_blocks",
    "evict_blocks",
    "release_memory_blocks",
    "release_memory_blocks(paused)",
    "free_group",
    "match_prefix",
    "acquire_blocks",
    "register_kv_block_hashes",
    "update_timestamps",
    "reset",
    "pause",
    "resume",
    "hash_tokens",
    "fingerprint_tokens",
    "admit_request",
    "release_request",
    "allocate_block_ids",
    "set_retention_priority",
    "apply_defragment",
]
"""The public methods the program calls (its step names)."""


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("policy_name", POLICY_NAMES)
def test_failed_call_changes_nothing(
    policy_name: str, method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    report = report_for(policy_name, monkeypatch)
    violations = report.for_method(method)
    assert not violations, f"{len(violations)} violation(s), first: {violations[0]}"


@pytest.mark.parametrize("policy_name", POLICY_NAMES)
def test_the_harness_reaches_faults_in_the_committing_methods(
    policy_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Guards against a vacuous pass: the programs do reach pool and policy calls."""
    report = report_for(policy_name, monkeypatch)
    for method in (
        "allocate_memory_blocks",
        "release_memory_blocks",
        "reset",
        "hash_tokens",
        "admit_request",
        "release_request",
        "apply_defragment",
    ):
        assert report.fault_points.get(method, 0) > 0, method
    reached = {"pool.acquire", "kv.copy", "events.record_stored", "routing.clear"}
    if report.known_gaps.get(ADMIT_AFTER_HIT):
        reached.add("hashing.compute_block_hashes")
    assert reached <= report.wrapped_calls, reached - report.wrapped_calls
    if policy_name == "priority":
        assert "policy.set_retention" in report.wrapped_calls
    if policy_name in ("hazard", "protected_lru", "auto"):
        assert "policy.on_register" in report.wrapped_calls


def test_the_known_gaps_are_faults_the_engine_survives(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the harness tolerates is only :data:`KNOWN_GAPS`, and it does meet them.

    A tolerated digest change still had no broken invariant (that would be a
    violation), so these runs show the engine consistent after each.
    """
    report = report_for("lru", monkeypatch)
    assert set(report.known_gaps) <= set(KNOWN_GAPS)
    assert report.known_gaps.get(AFTER_COMMIT), "no post-commit collaborator fault reached"
    assert {v.method for v in report.known_gaps.get(ADMIT_AFTER_HIT, [])} <= {"admit_request"}


def test_the_harness_sees_a_half_applied_call() -> None:
    """A call that changes state and then raises is caught and named."""
    plan = FaultPlan()
    allocator = KVBlockAllocator(total_count=6, device="cpu")
    report = Report()

    def half_applied(a: KVBlockAllocator) -> None:
        a.advance_clock(1)
        a.pool.acquire(0)

    inject_everywhere(allocator, plan, Step("half_applied", half_applied, lambda _: None), report)
    assert [(v.method, v.wrapped_call) for v in report.violations] == [
        ("half_applied", "pool.acquire")
    ]
    assert any(line.startswith("stats:") for line in report.violations[0].changed)


def test_deep_copies_share_the_plan_and_get_their_own_pool_wrappers() -> None:
    plan = FaultPlan()
    allocator = KVBlockAllocator(
        total_count=6, device="cpu", eviction_policy=FaultyPolicy(policies.get("lru"), plan)
    )
    instrument_pool(allocator, plan)
    clone = copy.deepcopy(allocator)
    instrument_pool(clone, plan)
    assert clone.policy.plan is plan
    plan.arm(0)
    clone.allocate_memory_blocks(2)
    plan.disarm()
    assert plan.calls == ["pool.acquire"]
    assert allocator.pool.num_free == 5 and clone.pool.num_free == 3
    assert np.array_equal(allocator.pool.free_ids(), np.arange(4, -1, -1))
