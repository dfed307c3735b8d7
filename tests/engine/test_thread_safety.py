"""ThreadSafeAllocator: eight threads hammer one allocator; invariants hold throughout.

Each worker thread keeps its own requests (the block IDs it holds a
reference to) and runs a seeded random mix of serve (match + allocate +
register under the lock as one sequence), grow, release (also in free
groups), pause, resume, touch and evict, calling ``check_invariants()`` every
few operations. At the end every thread has released everything it held and
the pool is whole again.
"""

from __future__ import annotations

import inspect
import random
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import cast

import pytest
import torch

from prefixcache import (
    BudgetExceededError,
    ConfigError,
    KVBlockAllocator,
    compute_block_hashes,
    policies,
)
from prefixcache.engine import locked
from prefixcache.engine.locked import LIVE_STATE, ThreadSafeAllocator, locked_member_names

NUM_THREADS = 8
OPS_PER_THREAD = 400
CHECK_EVERY = 20
BLOCK_SIZE = 2
PROMPTS = [
    compute_block_hashes([stem] * BLOCK_SIZE + [tail] * (BLOCK_SIZE * length), BLOCK_SIZE)
    for stem in range(3)
    for tail in range(3)
    for length in (1, 2)
]
"""Prompts with a shared first block per stem, so threads hit each other's prefixes."""


def make_shared(policy: str = "lru") -> ThreadSafeAllocator:
    return ThreadSafeAllocator(
        KVBlockAllocator(
            total_count=48,
            paused_count=8,
            block_size_tokens=BLOCK_SIZE,
            eviction_policy=policy,
            device="cpu",
        )
    )


class Worker:
    """One thread's requests and its random program."""

    def __init__(self, shared: ThreadSafeAllocator, seed: int) -> None:
        self.shared = shared
        self.rng = random.Random(seed)
        self.active: list[list[int]] = []
        self.paused: list[list[int]] = []

    def _take(self, requests: list[list[int]]) -> list[int] | None:
        if not requests:
            return None
        return requests.pop(self.rng.randrange(len(requests)))

    def serve(self) -> None:
        hashes = self.rng.choice(PROMPTS)
        with self.shared.lock:  # match, allocate and register as one sequence
            matched = self.shared.match_prefix(hashes, acquire=True).tolist()
            fresh = self.shared.allocate_memory_blocks(len(hashes) - len(matched))
            if fresh is None:
                if matched:
                    self.shared.release_memory_blocks(matched)
                return
            parent = hashes[len(matched) - 1] if matched else None
            self.shared.register_kv_block_hashes(fresh, hashes[len(matched) :], parent_hash=parent)
        self.active.append(matched + fresh.tolist())

    def step(self) -> None:
        kind = self.rng.choice(
            ["serve", "serve", "grow", "release", "group", "pause", "resume", "touch", "evict"]
        )
        if kind == "serve":
            self.serve()
        elif kind == "grow" and self.active:
            fresh = self.shared.allocate_memory_blocks(1)
            if fresh is not None:
                self.rng.choice(self.active).extend(fresh.tolist())
        elif kind == "release" and (request := self._take(self.active)) is not None:
            self.shared.release_memory_blocks(request)
        elif kind == "group" and len(self.active) >= 2:
            first, second = self._take(self.active), self._take(self.active)
            with self.shared.free_group():
                self.shared.release_memory_blocks(first or [])
                self.shared.release_memory_blocks(second or [])
        elif kind in ("pause", "resume"):
            source, target = (
                (self.active, self.paused) if kind == "pause" else (self.paused, self.active)
            )
            request = self._take(source)
            if request is None:
                return
            try:
                getattr(self.shared, kind)(request)
            except BudgetExceededError:
                source.append(request)
            else:
                target.append(request)
        elif kind == "touch" and self.active:
            self.shared.update_timestamps(self.rng.choice(self.active))
        elif kind == "evict":
            self.shared.evict_cached_blocks(1)

    def run(self, errors: list[BaseException]) -> None:
        try:
            for index in range(OPS_PER_THREAD):
                self.step()
                if index % CHECK_EVERY == 0:
                    self.shared.check_invariants()
            for request in self.active:
                self.shared.release_memory_blocks(request)
            for request in self.paused:
                self.shared.release_memory_blocks(request, paused=True)
            self.active.clear()
            self.paused.clear()
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)


@pytest.fixture
def frequent_switches() -> Iterator[None]:
    """Switch threads every few microseconds, so unguarded races show up in a short run.

    Without the lock (the wrapper's ``_lock`` swapped for a no-op) this test
    fails on every run at this interval.
    """
    interval = sys.getswitchinterval()
    sys.setswitchinterval(5e-6)
    yield
    sys.setswitchinterval(interval)


@pytest.mark.usefixtures("frequent_switches")
@pytest.mark.parametrize("policy", [name for name in policies.available() if name != "belady"])
def test_eight_threads_keep_the_invariants(policy: str) -> None:
    shared = make_shared(policy)
    errors: list[BaseException] = []
    workers = [Worker(shared, seed) for seed in range(NUM_THREADS)]
    threads = [threading.Thread(target=w.run, args=(errors,), daemon=True) for w in workers]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 60
    for thread in threads:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
    assert not any(thread.is_alive() for thread in threads), "a worker hung"
    assert not errors, repr(errors[0])
    shared.check_invariants()
    stats = shared.stats()
    assert (stats.num_active, stats.num_paused) == (0, 0)
    assert stats.num_allocated_blocks > 0 and stats.num_hit_blocks > 0
    shared.evict_cached_blocks(shared.get_evictable_block_count())
    assert shared.get_total_used() == 0


def _blocked_while_locked(shared: ThreadSafeAllocator, hold: object) -> bool:
    """Whether another thread's ``get_total_used`` waits while ``hold`` is entered here."""
    finished = threading.Event()

    def reader() -> None:
        shared.get_total_used()
        finished.set()

    with hold:  # type: ignore[attr-defined]  # a context manager
        thread = threading.Thread(target=reader, daemon=True)
        thread.start()
        blocked = not finished.wait(0.2)
    thread.join(timeout=5)
    return blocked and finished.is_set()


def test_methods_wait_for_the_lock() -> None:
    shared = make_shared()
    assert _blocked_while_locked(shared, shared.lock)


def test_a_free_group_holds_the_lock_until_its_releases_are_applied() -> None:
    shared = make_shared()
    blocks = shared.allocate_memory_blocks(2)
    group = shared.free_group()
    finished = threading.Event()
    seen: list[int] = []

    def reader() -> None:
        seen.append(shared.get_active_used())
        finished.set()

    with group:
        shared.release_memory_blocks(blocks)
        thread = threading.Thread(target=reader, daemon=True)
        thread.start()
        assert not finished.wait(0.2)  # the other thread waits for the group
    thread.join(timeout=5)
    assert seen == [0]  # and then sees the releases applied, never the queue


def test_the_wrapper_forwards_every_public_method() -> None:
    public = {name for name in dir(KVBlockAllocator) if not name.startswith("_")}
    assert public <= set(dir(ThreadSafeAllocator)), public - set(dir(ThreadSafeAllocator))
    assert set(locked_member_names()) == public


def _held_by_another_thread(lock: threading.RLock) -> bool:
    """Whether a second thread finds ``lock`` taken."""
    taken: list[bool] = []

    def probe() -> None:
        acquired = lock.acquire(blocking=False)
        if acquired:
            lock.release()
        taken.append(not acquired)

    thread = threading.Thread(target=probe)
    thread.start()
    thread.join(timeout=5)
    return taken == [True]


def _is_context_manager(member: object) -> bool:
    return inspect.isgeneratorfunction(inspect.unwrap(member))  # type: ignore[arg-type]


def test_every_public_member_of_the_allocator_runs_under_the_lock() -> None:
    """A recording allocator notes, inside each of its public members, whether the lock is held.

    Generated from the class as it stands, so a method the facade gains
    later is checked without an edit here.
    """
    held: dict[str, bool] = {}
    shared: list[ThreadSafeAllocator] = []

    def note(name: str) -> None:
        held[name] = _held_by_another_thread(shared[0].lock)

    def fake(name: str, member: object) -> object:
        if isinstance(member, property):
            return property(lambda self: note(name))
        if _is_context_manager(member):

            @contextmanager
            def block(self: object, *args: object, **kwargs: object) -> Iterator[None]:
                note(f"{name}: enter")
                yield
                note(f"{name}: exit")

            return block
        return lambda self, *args, **kwargs: note(name)

    members = {
        name: inspect.getattr_static(KVBlockAllocator, name)
        for name in locked_member_names()
        if name not in LIVE_STATE
    }
    recording = type(
        "RecordingAllocator",
        (KVBlockAllocator,),
        {name: fake(name, member) for name, member in members.items()},
    )
    blank = cast(KVBlockAllocator, object.__new__(recording))  # no state: nothing runs
    shared.append(ThreadSafeAllocator(blank))
    for name, member in members.items():
        value = getattr(shared[0], name)
        if isinstance(member, property):
            continue  # reading it was the call
        if _is_context_manager(member):
            with value():
                note(f"{name}: body")
        else:
            value()
    assert not _held_by_another_thread(shared[0].lock)  # every call let go of it
    unlocked = sorted(name for name, was_held in held.items() if not was_held)
    assert not unlocked, f"ran without the lock: {unlocked}"
    called = {name.split(":")[0] for name in held}
    assert called == set(members), set(members) ^ called
    assert {"free_group: enter", "free_group: body", "free_group: exit"} <= set(held)


VALUE_RESULTS = {
    "None",
    "bool",
    "int",
    "str",
    "list[int]",
    "torch.Tensor",
    "torch.Tensor | None",
    "tuple[torch.Tensor, torch.Tensor]",
    "AllocatorStats",
    "DefragmentPlan",
    "list[BlockStored]",
    "list[KVCacheEvent]",
    "Iterator[None]",
}
"""Result annotations that are values (fresh objects or immutable), safe to use unlocked."""

VALUE_MEMBERS = {
    "allocate_block_ids": "a fresh int32 buffer (a numpy array, or the native BlockIds)",
}
"""Members typed loosely (``Any``) whose result is nonetheless a fresh value."""


def test_every_forwarded_member_returns_a_value_not_live_state() -> None:
    """A member that returns something else must be classified: a value here, or LIVE_STATE."""
    unknown = {}
    for name in locked_member_names():
        member = inspect.getattr_static(KVBlockAllocator, name)
        function = member.fget if isinstance(member, property) else member
        result = str(function.__annotations__.get("return"))
        if name not in LIVE_STATE | VALUE_MEMBERS.keys() and result not in VALUE_RESULTS:
            unknown[name] = result
    assert not unknown, (
        f"add to LIVE_STATE (prefixcache/engine/locked.py) or VALUE_RESULTS: {unknown}"
    )


@pytest.mark.parametrize("name", sorted(LIVE_STATE & set(locked_member_names())))
def test_live_state_is_refused_with_the_way_to_reach_it(name: str) -> None:
    shared = make_shared()
    with pytest.raises(AttributeError, match=rf"with shared.lock: shared.allocator.{name}"):
        getattr(shared, name)


def test_a_member_the_wrapper_cannot_lock_stops_the_import() -> None:
    def steps(self: object) -> Iterator[int]:
        yield 1

    async def later(self: object) -> None:
        return None

    for member in (steps, later, staticmethod(len), 3):
        with pytest.raises(TypeError, match="hand-written"):
            locked._locked_member("new_member", member)


def test_a_property_with_a_setter_sets_under_the_lock() -> None:
    calls: list[tuple[str, bool]] = []
    shared: list[ThreadSafeAllocator] = []

    def note(kind: str) -> None:
        calls.append((kind, _held_by_another_thread(shared[0].lock)))

    def get(self: object) -> int:
        note("get")
        return 7

    def put(self: object, value: int) -> None:
        note("set")

    member = property(get, put)
    wrapped = locked._locked_property("window", member)
    target = type("Target", (KVBlockAllocator,), {"window": member})
    shared.append(ThreadSafeAllocator(cast(KVBlockAllocator, object.__new__(target))))
    assert wrapped.__get__(shared[0]) == 7
    wrapped.__set__(shared[0], 3)
    assert calls == [("get", True), ("set", True)]


def test_the_wrapper_returns_what_the_allocator_returns() -> None:
    shared = make_shared()
    blocks = shared.allocate_memory_blocks(2)
    hashes = shared.hash_tokens([1, 2, 3, 4])
    assert shared.register_kv_block_hashes(blocks, hashes).tolist() == [True, True]
    assert shared.is_hash_registered(hashes[1])
    assert shared.match_prefix(hashes).tolist() == blocks.tolist()
    active, paused = shared.reference_counts(blocks)
    assert active.tolist() == [1, 1] and paused.tolist() == [0, 0]
    assert shared.advance_clock(2) == shared.clock
    assert "active 2/" in str(shared) and "ThreadSafeAllocator(" in repr(shared)
    assert shared.allocator.get_active_used() == 2


def test_only_an_allocator_can_be_wrapped() -> None:
    with pytest.raises(ConfigError, match="KVBlockAllocator"):
        ThreadSafeAllocator(object())  # type: ignore[arg-type]


def _program(target: KVBlockAllocator | ThreadSafeAllocator) -> list[object]:
    """Every public method once, returning what each call gave (tensors as lists)."""
    results: list[object] = []

    def keep(value: object) -> None:
        results.append(value.tolist() if hasattr(value, "tolist") else value)

    tokens = list(range(8))
    hashes = target.hash_tokens(tokens)
    blocks = target.allocate_memory_blocks(len(hashes))
    keep(target.register_kv_block_hashes(blocks, hashes, token_ids=tokens))
    keep(target.fingerprint_tokens(tokens))
    keep(target.is_memory_available(3))
    target.acquire_blocks(blocks[:1])
    target.pause(blocks[:1])
    keep((target.get_active_used(), target.get_paused_used(), target.get_total_used()))
    keep((target.get_active_avail(), target.get_paused_avail()))
    target.resume(blocks[:1])
    target.update_timestamps(blocks)
    routing = torch.zeros(BLOCK_SIZE, 1, 1, dtype=torch.int16)
    target.store_block_routing(int(blocks[0]), routing)
    target.store_routing_per_block(routing, [int(blocks[1])] * BLOCK_SIZE, [0, 1])
    keep(target.get_block_routing(int(blocks[0])))
    keep(target.reconstruct_routing_from_blocks(blocks, 2 * BLOCK_SIZE))
    target.release_memory_blocks([*blocks.tolist(), int(blocks[0])])
    keep(target.get_evictable_block_count())
    keep(target.snapshot())
    keep(target.evict_lru_blocks(1))
    keep(target.evict_cached_blocks(5))
    keep(target.take_events())
    target.reset()
    keep(target.stats())
    target.check_invariants()
    return results


def test_the_wrapper_behaves_exactly_like_the_allocator() -> None:
    def build() -> KVBlockAllocator:
        return KVBlockAllocator(
            total_count=16,
            block_size_tokens=BLOCK_SIZE,
            paused_count=2,
            device="cpu",
            routing_num_layers=1,
            routing_top_k=1,
            kv_events_capacity=32,
        )

    assert _program(ThreadSafeAllocator(build())) == _program(build())


def test_retention_priorities_pass_through() -> None:
    shared = make_shared()
    with pytest.raises(ConfigError, match="retention"):
        shared.set_retention_priority([7], 1)
