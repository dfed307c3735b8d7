"""The native engine against the Python reference, step by step (DESIGN.md, "The native engine").

A hypothesis state machine drives a ``KVBlockAllocator(engine="python")``
and a ``KVBlockAllocator(engine="native")`` with the same operations
(allocate, release with duplicates and paused, free groups, match with and
without acquire, acquire, register with conflicts and partial holders,
pause/resume with budget errors, touch, retention priorities, evict, evict_blocks and
end_conversation, reset, advance_clock, the
request path, defragmentation by plan and by random moves) and compares
every observable after each step: the IDs returned, the exception types,
the free stack in order, reference counts, registry lookups and chains, KV
events and stats. One machine per native policy (every name of
``NATIVE_POLICIES``), with KV events on (the engines' change logs) and off (the fused
request path), each with the stack free list, the lowest-first one
(``free_list="lowest"``) and lowest-first in pages of 3 blocks
(``page_size_blocks=3``): the same hand-out order in both engines.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from prefixcache import KVBlockAllocator, PrefixCacheError
from prefixcache.engine.defragment import DefragmentPlan
from prefixcache.engine.native_engine import NATIVE_POLICIES, native_available
from prefixcache.testing.composed_request import serve_composed

pytestmark = [
    pytest.mark.skipif(
        not native_available(), reason="the native engine (prefixcache.engine._native) is not built"
    ),
    pytest.mark.slow,  # long programs: the full suite (--full)
]

TOTAL_COUNT = 14
PAUSED_COUNT = 3
BLOCK_SIZE = 2
NUM_USABLE = TOTAL_COUNT - 1

# Small hash and token alphabets make conflicts, shared prefixes and partial holders common.
hashes_st = st.lists(st.integers(1, 12), min_size=0, max_size=5)
tokens_st = st.lists(st.integers(0, 1), min_size=0, max_size=9)
ids_st = st.lists(st.integers(0, NUM_USABLE - 1), min_size=0, max_size=6)

settings.register_profile(
    "native-ci",
    max_examples=20,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "native-long",
    max_examples=2000,
    stateful_step_count=80,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "native-sanitize",
    max_examples=8,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
PROFILE = settings.get_profile(os.environ.get("PREFIXCACHE_NATIVE_PROFILE", "native-ci"))


def _outcome(call: Any) -> tuple[str, Any]:
    """What a call did: ("ok", plain result) or ("raised", exception type)."""
    try:
        result = call()
    except PrefixCacheError as error:
        return ("raised", type(error))
    if isinstance(result, torch.Tensor):
        return ("ok", result.tolist())
    if isinstance(result, np.ndarray):
        return ("ok", result.tolist())
    return ("ok", result)


def _as_list(block_ids: Any) -> list[int] | None:
    return None if block_ids is None else list(block_ids.tolist())


class DifferentialMachine(RuleBasedStateMachine):
    """Same operations on both engines; every observable compared after each step."""

    policy = "lru"
    events = True
    free_list = "stack"
    wide = False  # xxh3_128: the native engine behind wide_keys.WideKeyEngine

    def h(self, value: int) -> int:
        """The machine's hash ``value`` as the allocator takes it: under wide hashes a
        128-bit value whose low 63 bits collide for many values (the keys' probing)."""
        return (value << 70) + value % 3 + 1 if self.wide else value

    def hs(self, values: list[int]) -> list[int]:
        return [self.h(value) for value in values]

    @initialize()
    def build(self) -> None:
        config = {
            "total_count": TOTAL_COUNT,
            "paused_count": PAUSED_COUNT,
            "block_size_tokens": BLOCK_SIZE,
            "eviction_policy": self.policy,
            "device": "cpu",
            "kv_events_capacity": 10_000 if self.events else 0,
            "free_list": "stack" if self.free_list == "stack" else "lowest",
            "page_size_blocks": 3 if self.free_list == "paged" else 1,
            "hash_algo": "xxh3_128" if self.wide else "xxh3_64",
        }
        self.python = KVBlockAllocator(engine="python", **config)
        self.native = KVBlockAllocator(engine="native", **config)
        assert self.python.engine == "python" and self.native.engine == "native"
        self.held: list[int] = []  # IDs with an active reference we took (a multiset)
        self.paused: list[int] = []  # IDs with a paused reference we moved
        self.requests: list[list[int]] = []  # the IDs of each admitted or served request

    def both(self, call: Any) -> tuple[str, Any]:
        """Run ``call(allocator)`` on both and require the same outcome."""
        expected = _outcome(lambda: call(self.python))
        actual = _outcome(lambda: call(self.native))
        assert actual == expected, f"python {expected} != native {actual}"
        return expected

    # ------------------------------------------------------------------ allocation

    @rule(count=st.integers(0, TOTAL_COUNT + 1))
    def allocate(self, count: int) -> None:
        kind, ids = self.both(lambda a: a.allocate_memory_blocks(count))
        if kind == "ok" and ids is not None:
            self.held.extend(ids)
            self.requests.append(ids)

    @rule(count=st.integers(0, 4))
    def allocate_block_ids(self, count: int) -> None:
        kind, ids = self.both(lambda a: _as_list(a.allocate_block_ids(count)))
        if kind == "ok" and ids is not None:
            self.held.extend(ids)
            self.requests.append(ids)

    @rule(tokens=tokens_st, keep=st.booleans())
    def serve(self, tokens: list[int], keep: bool) -> None:
        """A request the way an engine composes it: hash, match and pin, allocate, register."""

        def run(allocator: KVBlockAllocator) -> list[int] | None:
            return serve_composed(allocator, tokens, BLOCK_SIZE, keep=keep)

        kind, ids = self.both(run)
        if kind == "ok" and ids is not None and keep:
            self.held.extend(ids)
            self.requests.append(ids)

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def finish_request(self, data: st.DataObject) -> None:
        ids = self.requests.pop(data.draw(st.integers(0, len(self.requests) - 1)))
        kind, _ = self.both(lambda a: a.release_memory_blocks(ids))
        if kind == "ok":
            self._forget(self.held, ids)

    @rule(data=st.data(), extra=ids_st)
    def release(self, data: st.DataObject, extra: list[int]) -> None:
        ids = self._some_held(data) + (extra if data.draw(st.booleans()) else [])
        kind, _ = self.both(lambda a: a.release_memory_blocks(np.array(ids, dtype=np.int64)))
        if kind == "ok":
            self._forget(self.held, ids)

    @rule(data=st.data())
    def release_paused(self, data: st.DataObject) -> None:
        ids = data.draw(st.lists(st.sampled_from(self.paused or [0]), max_size=4))
        kind, _ = self.both(lambda a: a.release_memory_blocks(ids, paused=True))
        if kind == "ok":
            self._forget(self.paused, ids)

    @rule(data=st.data())
    def free_group(self, data: st.DataObject) -> None:
        batches = [self._some_held(data) for _ in range(data.draw(st.integers(1, 3)))]

        def run(allocator: KVBlockAllocator) -> list[tuple[str, Any]]:
            outcomes = []
            with allocator.free_group():
                for batch in batches:
                    outcomes.append(_outcome(lambda b=batch: allocator.release_memory_blocks(b)))
            return outcomes

        _, outcomes = self.both(run)
        for batch, (kind, _) in zip(batches, outcomes, strict=True):
            if kind == "ok":
                self._forget(self.held, batch)

    # ------------------------------------------------------------------ prefix reuse

    @rule(hashes=hashes_st, acquire=st.booleans())
    def match(self, hashes: list[int], acquire: bool) -> None:
        kind, ids = self.both(lambda a: a.match_prefix(self.hs(hashes), acquire=acquire))
        if kind == "ok" and acquire:
            self.held.extend(ids)

    @rule(data=st.data(), extra=ids_st)
    def acquire(self, data: st.DataObject, extra: list[int]) -> None:
        ids = extra[:2] + self._some_held(data)
        kind, _ = self.both(lambda a: a.acquire_blocks(ids))
        if kind == "ok":
            self.held.extend(ids)

    @rule(data=st.data(), hashes=hashes_st, parent=st.one_of(st.none(), st.integers(1, 12)))
    def register(self, data: st.DataObject, hashes: list[int], parent: int | None) -> None:
        pool = sorted(set(self.held + self.paused)) or [0, 1]
        distinct = data.draw(st.booleans()) and len(pool) >= len(hashes)
        ids = data.draw(
            st.lists(
                st.sampled_from(pool), min_size=len(hashes), max_size=len(hashes), unique=distinct
            )
        )
        wide_parent = None if parent is None else self.h(parent)
        self.both(
            lambda a: a.register_kv_block_hashes(ids, self.hs(hashes), parent_hash=wide_parent)
        )

    @rule(tokens=tokens_st)
    def hash_tokens(self, tokens: list[int]) -> None:
        self.both(lambda a: a.hash_tokens(tokens))

    @rule(tokens=tokens_st, as_tensor=st.booleans())
    def admit(self, tokens: list[int], as_tensor: bool) -> None:
        rows = []

        def run(allocator: KVBlockAllocator) -> tuple[int, list[int]]:
            row = np.full(8, -7, dtype=np.int32)
            rows.append(row)
            array = np.array(tokens, dtype=np.int32)
            hit = allocator.admit_request(torch.from_numpy(array) if as_tensor else array, row)
            return hit, row.tolist()

        kind, result = self.both(run)
        if kind == "ok":
            num_blocks = -(-len(tokens) // BLOCK_SIZE)
            self.held.extend(result[1][:num_blocks])
            self.requests.append(result[1][:num_blocks])
        else:  # a refused request leaves the row as it was
            assert all((row == -7).all() for row in rows)

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def release_request(self, data: st.DataObject) -> None:
        ids = self.requests.pop(data.draw(st.integers(0, len(self.requests) - 1)))
        kind, _ = self.both(lambda a: a.release_request(np.array(ids, dtype=np.int32)))
        if kind == "ok":
            self._forget(self.held, ids)

    # ------------------------------------------------------------------ partitions and time

    @rule(data=st.data(), extra=ids_st)
    def pause(self, data: st.DataObject, extra: list[int]) -> None:
        ids = self._some_held(data) + extra[:1]
        kind, _ = self.both(lambda a: a.pause(ids))
        if kind == "ok":
            self._forget(self.held, ids)
            self.paused.extend(ids)

    @rule(data=st.data())
    def resume(self, data: st.DataObject) -> None:
        ids = data.draw(st.lists(st.sampled_from(self.paused or [0]), max_size=4))
        kind, _ = self.both(lambda a: a.resume(ids))
        if kind == "ok":
            self._forget(self.paused, ids)
            self.held.extend(ids)

    @rule(ids=ids_st)
    def touch(self, ids: list[int]) -> None:
        self.both(lambda a: a.update_timestamps(ids))

    @rule(
        hashes=hashes_st,
        priority=st.integers(0, 70),
        duration=st.one_of(st.none(), st.integers(0, 6)),
    )
    def retain(self, hashes: list[int], priority: int, duration: int | None) -> None:
        """Retention priorities (a ConfigError alike where the policy has none)."""
        self.both(lambda a: a.set_retention_priority(self.hs(hashes), priority, duration=duration))

    @rule(count=st.integers(0, TOTAL_COUNT))
    def evict(self, count: int) -> None:
        self.both(lambda a: a.evict_cached_blocks(count))

    @rule(count=st.integers(0, 4))
    def evict_all_or_none(self, count: int) -> None:
        self.both(lambda a: a.evict_lru_blocks(count))

    @rule(ids=st.lists(st.integers(-1, NUM_USABLE), max_size=6))
    def evict_blocks(self, ids: list[int]) -> None:
        """Given blocks freed tail-first where cached leaves (the dummy and -1 refused)."""
        self.both(lambda a: a.evict_blocks(ids))

    @rule(hashes=hashes_st)
    def end_conversation(self, hashes: list[int]) -> None:
        """A looked-up chain, in order: each freed tail exposes the next one."""
        self.both(lambda a: a.end_conversation(self.hs(hashes)))

    @rule(ticks=st.integers(0, 3))
    def advance_clock(self, ticks: int) -> None:
        self.both(lambda a: a.advance_clock(ticks))

    # ------------------------------------------------------------------ layout

    @rule()
    def defragment(self) -> None:
        plan = self.python.plan_defragment()
        assert self.native.plan_defragment().moves == plan.moves
        self.both(lambda a: a.apply_defragment(plan))
        self._rename(plan)

    @rule(sources=ids_st, destinations=ids_st)
    def relocate_any(self, sources: list[int], destinations: list[int]) -> None:
        """Random moves: mostly refused (a free source, a live destination, a repeat)."""
        count = min(len(sources), len(destinations))
        plan = DefragmentPlan(
            np.array(sources[:count], dtype=np.int32),
            np.array(destinations[:count], dtype=np.int32),
        )
        if self.both(lambda a: a.apply_defragment(plan))[0] == "ok":
            self._rename(plan)

    def _rename(self, plan: DefragmentPlan) -> None:
        """Follow the moves in the IDs this machine remembers."""
        rename = dict(plan.moves)
        self.held = [rename.get(b, b) for b in self.held]
        self.paused = [rename.get(b, b) for b in self.paused]
        self.requests = [[rename.get(b, b) for b in row] for row in self.requests]

    @precondition(lambda self: len(self.held) > 6)
    @rule()
    def reset(self) -> None:
        self.both(lambda a: a.reset())
        self.held.clear()
        self.paused.clear()
        self.requests.clear()

    # ------------------------------------------------------------------ observables

    @invariant()
    def same_observables(self) -> None:
        python, native = self.python, self.native
        assert native.stats() == python.stats()
        assert str(native) == str(python)
        assert native.get_paused_avail() == python.get_paused_avail()
        assert native.get_active_avail() == python.get_active_avail()
        assert native._engine.free_ids().tolist() == python.pool.free_ids().tolist()
        everything = np.arange(NUM_USABLE)
        for mine, theirs in zip(
            native.reference_counts(everything), python.reference_counts(everything), strict=True
        ):
            assert mine.tolist() == theirs.tolist()
        for block_id in range(NUM_USABLE):
            assert native._engine.hash_of(block_id) == python._engine.hash_of(block_id)
            assert native._engine.describe_state(block_id) == python._engine.describe_state(
                block_id
            )
        for block_hash in self.hs(list(range(1, 13))):
            assert native.is_hash_registered(block_hash) == python.is_hash_registered(block_hash)
        assert native._engine.registered_chains() == python._engine.registered_chains()
        # Registration generations (what sessions check): 0 exactly where unregistered, the
        # same order of registration (the native counter restarts at reset, Python's not).
        ids = everything.astype(np.int32)
        mine_gen, theirs_gen = native._engine.registrations(ids), python._engine.registrations(ids)
        assert (mine_gen == 0).tolist() == (theirs_gen == 0).tolist()
        registered = np.flatnonzero(theirs_gen)
        assert registered[np.argsort(mine_gen[registered])].tolist() == (
            registered[np.argsort(theirs_gen[registered])].tolist()
        )
        if self.events:
            assert native.take_events() == python.take_events()
        assert native._engine.find_problems() == []
        python.check_invariants()

    # ------------------------------------------------------------------ helpers

    def _some_held(self, data: st.DataObject) -> list[int]:
        """A few held IDs, duplicates allowed (a batch of requests sharing a prefix)."""
        if not self.held:
            return []
        return data.draw(st.lists(st.sampled_from(self.held), max_size=4))

    @staticmethod
    def _forget(pool: list[int], ids: list[int]) -> None:
        for block_id in ids:
            if block_id in pool:
                pool.remove(block_id)


def _machine(
    policy: str, events: bool, free_list: str, wide: bool = False
) -> type[DifferentialMachine]:
    return type(
        f"Differential_{policy}_{'events' if events else 'fused'}_{free_list}"
        + ("_wide" if wide else ""),
        (DifferentialMachine,),
        {"policy": policy, "events": events, "free_list": free_list, "wide": wide},
    )


@pytest.mark.parametrize("free_list", ["stack", "lowest", "paged"])
@pytest.mark.parametrize("events", [True, False], ids=["events", "fused"])
@pytest.mark.parametrize("policy", NATIVE_POLICIES)
def test_native_engine_matches_the_python_engine(policy: str, events: bool, free_list: str) -> None:
    machine = _machine(policy, events, free_list)
    machine.TestCase.settings = PROFILE
    machine.TestCase().runTest()


# auto counts hashes in its sketch: under wide hashes it would count keys, so it stays on the
# Python engine there (selection.native_unsupported_reason).
@pytest.mark.parametrize("events", [True, False], ids=["events", "no-events"])
@pytest.mark.parametrize("policy", [name for name in NATIVE_POLICIES if name != "auto"])
def test_the_native_engine_under_wide_hashes_matches_the_python_engine(
    policy: str, events: bool
) -> None:
    """xxh3_128 hashes whose low 63 bits collide: the wide-key seam (wide_keys.py) keeps
    every observable the Python engine's, events and removals included."""
    machine = _machine(policy, events, "stack", wide=True)
    machine.TestCase.settings = PROFILE
    machine.TestCase().runTest()
