"""Abort restores a policy's whole state: every field, not only the eviction order.

An engine operation opens a policy transaction (``begin``), makes its calls,
and commits, or aborts when anything failed. A seeded cache model drives each
policy as the engine does (hand-out counts and a clock that ticks on every
allocation, hit and touch) and, at random points, makes an engine-shaped call
inside a transaction and aborts it. The policy's whole state (its fields,
compared recursively; heaps, whose layout depends on lazy deletion, through
the eviction order) must equal a copy taken before, and a twin that never saw
the aborted calls must choose the same victims to the end.

Call shapes are the engine's: an eviction (``evict(1)`` victims interleaved
with inserts of exposed parents or new leaves), a hit (discards), a touch, a
release (inserts), and a mix of them in one transaction (which the inverse
calls of the old protocol could not take back exactly).
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from prefixcache.policies.linked_map import LinkedMap
from sortedcontainers import SortedList

from prefixcache import KVBlockAllocator, policies

pytestmark = pytest.mark.slow  # long programs: the full suite (--full)

NAMES = [
    "lru",
    "fifo",
    "lfu",
    "slru",
    "s3fifo",
    "arc",
    "reuse_lru",
    "hazard",
    "priority",
    "protected_lru",
]
"""Every online built-in policy that tracks leaves."""

STEPS = 300
SMALL = {
    "arc": {"ghost_capacity": 6},
    "s3fifo": {"ghost_capacity": 6},
    "hazard": {"history_capacity": 6, "half_life": 40},
    "reuse_lru": {"history_capacity": 6, "age_smoothing": 0.3},
    "protected_lru": {"history_capacity": 6},
}
"""Small histories and fast learning, so trimming, refreshes and ghost hits happen often."""

# Fields whose layout depends on lazy deletion (their content shows in the eviction order),
# and the transaction's undo log itself (None before begin and after abort).
LAYOUT_ONLY = {"_heap", "_heaps", "_num_keys", "_txn_undo"}


def make(name: str) -> Any:
    policy = policies.get(name, **SMALL.get(name, {}))
    if name == "priority":  # entries above and below the default, expiring during the run
        for block_hash in range(1001, 1200, 2):
            expires_at = None if block_hash % 7 == 0 else block_hash % 300
            policy.set_retention(block_hash, block_hash % 70, expires_at)
    return policy


def state(value: Any) -> Any:
    """A comparable image of ``value``: containers as lists, objects by their fields."""
    if isinstance(value, (SortedList, list, tuple)):
        return [state(item) for item in value]
    if isinstance(value, LinkedMap):
        return [(key, state(value.get(key))) for key in value]
    if isinstance(value, dict):
        items = [(key, state(item)) for key, item in value.items()]
        return items if type(value) is not dict else dict(items)
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    fields = getattr(value, "__dict__", None)
    slots = [name for cls in type(value).__mro__ for name in getattr(cls, "__slots__", ())]
    if fields is None and not slots:
        return value
    names = sorted(set(fields or ()) | set(slots))
    return {
        name: state(getattr(value, name))
        for name in names
        if name not in LAYOUT_ONLY and hasattr(value, name)
    }


def eviction_order(policy: Any) -> list[int]:
    return copy.deepcopy(policy).evict(len(policy))


@dataclass
class Cache:
    """Blocks as the allocator sees them, and the policy it drives.

    ``args`` holds each block's insert arguments (hash, last access,
    hand-outs, depth); ``held`` blocks are registered but out of the policy
    (hit, or inner blocks), ``free`` ones hold nothing.
    """

    policy: Any
    rng: random.Random
    clock: int = 0
    args: dict[int, tuple[int, int, int, int]] = field(default_factory=dict)
    held: set[int] = field(default_factory=set)
    free: list[int] = field(default_factory=lambda: list(range(40)))
    gone_hashes: list[int] = field(default_factory=list)
    next_hash: int = 1000

    def tracked(self) -> list[int]:
        return sorted(b for b in self.args if b in self.policy)

    def new_leaf(self) -> int | None:
        """Register a free block (a returning hash now and then) and return it, held."""
        if not self.free:
            return None
        block_id = self.free.pop(self.rng.randrange(len(self.free)))
        if self.gone_hashes and self.rng.random() < 0.4:
            block_hash = self.gone_hashes.pop(self.rng.randrange(len(self.gone_hashes)))
        else:
            self.next_hash += 1
            block_hash = self.next_hash
        self.clock += 1
        depth = self.rng.randint(0, 9)
        self.args[block_id] = (block_hash, self.clock, self.rng.choice([1, 1, 1, 2, 3]), depth)
        self.held.add(block_id)
        return block_id


@dataclass
class Calls:
    """The policy calls of one engine call, as a replay needs them, and their effect."""

    made: list[tuple[str, tuple[Any, ...], Any]] = field(default_factory=list)
    commits: list[Callable[[], None]] = field(default_factory=list)

    def call(self, policy: Any, method: str, *args: Any) -> Any:
        result = getattr(policy, method)(*args)
        self.made.append((method, args, result))
        return result


def insert_op(cache: Cache, calls: Calls, block_id: int) -> None:
    calls.call(cache.policy, "insert", block_id, *cache.args[block_id])
    calls.commits.append(lambda: cache.held.discard(block_id))


def hit_op(cache: Cache, calls: Calls, block_id: int) -> None:
    calls.call(cache.policy, "discard", block_id)

    def commit() -> None:
        cache.clock += 1
        block_hash, _, num_accesses, depth = cache.args[block_id]
        cache.args[block_id] = (block_hash, cache.clock, num_accesses + 1, depth)
        cache.held.add(block_id)

    calls.commits.append(commit)


def touch_op(cache: Cache, calls: Calls, block_ids: list[int]) -> None:
    now = cache.clock + 1
    for block_id in block_ids:
        calls.call(cache.policy, "touch", block_id, now)

    def commit() -> None:
        cache.clock = now
        for block_id in block_ids:
            block_hash, _, num_accesses, depth = cache.args[block_id]
            cache.args[block_id] = (block_hash, now, num_accesses, depth)

    calls.commits.append(commit)


def evict_op(cache: Cache, calls: Calls) -> None:
    for block_id in calls.call(cache.policy, "evict", 1):

        def commit(block_id: int = block_id) -> None:
            cache.gone_hashes.append(cache.args.pop(block_id)[0])
            cache.free.append(block_id)

        calls.commits.append(commit)


def engine_call(cache: Cache, shape: str) -> Calls:
    """Make one engine-shaped call of ``shape`` (evict, hit, touch, release or mixed)."""
    rng, calls = cache.rng, Calls()
    if shape == "mixed":  # each part sees the model as the parts before it left it
        for part in rng.sample(["evict", "hit", "touch", "release"], rng.randint(2, 4)):
            more = engine_call(cache, part)
            calls.made += more.made
            for commit in more.commits:
                commit()
        return calls
    tracked = cache.tracked()
    inserted: set[int] = set()
    if shape == "evict":
        for _ in range(rng.randint(1, 4)):
            evict_op(cache, calls)
            if rng.random() < 0.6:  # a parent exposed, or a new leaf
                held = sorted(cache.held - inserted)
                block_id = rng.choice(held) if held and rng.random() < 0.7 else cache.new_leaf()
                if block_id is not None:
                    insert_op(cache, calls, block_id)
                    inserted.add(block_id)
    elif shape == "hit":
        for block_id in rng.sample(tracked, min(len(tracked), rng.randint(1, 3))):
            hit_op(cache, calls, block_id)
    elif shape == "touch":
        if tracked:
            touch_op(cache, calls, rng.sample(tracked, min(len(tracked), rng.randint(1, 3))))
    else:
        for _ in range(rng.randint(1, 3)):
            held = sorted(cache.held - inserted)
            block_id = rng.choice(held) if held and rng.random() < 0.6 else cache.new_leaf()
            if block_id is not None:
                insert_op(cache, calls, block_id)
                inserted.add(block_id)
    return calls


def run(name: str, seed: int, aborted_shapes: list[str]) -> int:
    """Drive ``name``, aborting a call of ``aborted_shapes`` now and then.

    A twin policy replays only the committed calls, outside any transaction,
    and must return the same victims; after each abort the policy's state
    must equal a copy taken before the aborted call. Returns how many
    non-empty calls were aborted.
    """
    rng = random.Random(seed)
    cache = Cache(make(name), rng)
    twin = make(name)
    num_checked = 0
    for _ in range(STEPS):
        if rng.random() < 0.4:
            before = copy.deepcopy(cache.policy)
            model = copy.deepcopy([cache.clock, cache.args, cache.held, cache.free])
            model += [list(cache.gone_hashes), cache.next_hash]
            shape = rng.choice(aborted_shapes)
            cache.policy.begin()
            calls = engine_call(cache, shape)
            cache.policy.abort()
            cache.clock, cache.args, cache.held, cache.free, cache.gone_hashes, cache.next_hash = (
                model
            )
            assert state(cache.policy) == state(before), (shape, calls.made)
            assert eviction_order(cache.policy) == eviction_order(before), (shape, calls.made)
            num_checked += bool(calls.made)
        cache.policy.begin()
        calls = engine_call(cache, rng.choice(["evict", "hit", "touch", "release", "release"]))
        cache.policy.commit()
        for method, args, result in calls.made:
            assert getattr(twin, method)(*args) == result, (method, args)
        for commit in calls.commits:
            commit()
    assert state(twin) == state(cache.policy)
    assert eviction_order(twin) == eviction_order(cache.policy)
    return num_checked


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("seed", range(3))
def test_aborting_an_eviction_hit_or_touch_restores_the_whole_state(name: str, seed: int) -> None:
    assert run(name, seed, ["evict", "hit", "touch"]) > 50


@pytest.mark.parametrize("name", NAMES)
def test_aborting_a_release_restores_the_whole_state(name: str) -> None:
    assert run(name, 7, ["release"]) > 50


@pytest.mark.parametrize("name", NAMES)
def test_aborting_a_mix_of_every_shape_restores_the_whole_state(name: str) -> None:
    assert run(name, 11, ["mixed"]) > 50


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("seed", [29, 31])
def test_aborting_calls_of_every_shape_keeps_the_twin_in_step(name: str, seed: int) -> None:
    """Releases mixed with the other shapes: these seeds once made ``hazard`` diverge.

    A release taken back left a heap entry with the same key as its block's
    later one, in another class, which then passed for current.
    """
    assert run(name, seed, ["evict", "hit", "touch", "release"]) > 50


def test_an_insert_then_a_discard_outside_a_transaction_is_a_hit_after_a_release() -> None:
    """The same calls as a release taken back; outside a transaction the ghost hit stays."""
    policy = policies.get("arc")
    policy.insert(1, 10, 1, 1, 0)
    policy.insert(2, 20, 2, 1, 0)
    assert policy.evict(1) == [1]  # hash 10 is now a B1 ghost
    share = policy.recency_share
    policy.insert(3, 10, 3, 1, 0)  # a ghost hit raises p
    policy.discard(3)  # a hit
    assert policy.recency_share > share


def test_a_failed_release_through_the_allocator_gives_back_the_ghost_hit() -> None:
    """The engine aborts the release's transaction: ARC forgets the insert's ghost hit."""
    policy = policies.get("arc")
    allocator = KVBlockAllocator(
        total_count=4, block_size_tokens=2, device="cpu", eviction_policy=policy
    )
    first = allocator.allocate_memory_blocks(1)
    assert first is not None
    allocator.register_kv_block_hashes(first, [10])
    allocator.release_memory_blocks(first)
    assert allocator.evict_cached_blocks(1) == 1  # hash 10 becomes a B1 ghost
    again = allocator.allocate_memory_blocks(1)
    assert again is not None
    allocator.register_kv_block_hashes(again, [10])
    before = copy.deepcopy(policy)

    def broken_release(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("device mirror lost")

    allocator.pool.release = broken_release  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="device mirror lost"):
        allocator.release_memory_blocks(again)
    assert policy.recency_share == before.recency_share
    assert state(policy) == state(before)
    assert not policy.in_transaction
    allocator.check_invariants()


def test_priority_eviction_aborted_gives_back_the_entries_it_expired() -> None:
    """With a clock, ``evict`` expires what came due; the abort puts the entry back."""
    now = [0]
    policy = policies.get("priority", clock=lambda: now[0])
    policy.set_retention(10, priority=90, expires_at=5)
    policy.insert(1, 10, 1, 1, 0)
    policy.insert(2, 20, 2, 1, 0)
    before = copy.deepcopy(policy)
    now[0] = 5
    policy.begin()
    assert policy.evict(1) == [1]  # hash 10 fell back to the default: block 1 is older
    policy.abort()
    assert state(policy) == state(before)
    assert policy.evict(2) == [1, 2]  # the entry, still due, expires again


def test_priority_set_retention_is_final_outside_a_transaction_and_undone_inside() -> None:
    policy = policies.get("priority")
    policy.set_retention(10, priority=90, expires_at=3)
    policy.insert(1, 10, 5, 1, 0)  # the clock seen reaches 5: the entry expires
    policy.set_retention(10, priority=80, expires_at=None)
    policy.discard(1)
    policy.abort()  # no transaction: nothing to take back
    assert policy.priority_of(10) == 80
    policy.insert(1, 10, 6, 1, 0)
    before = copy.deepcopy(policy)
    policy.begin()
    policy.set_retention(10, priority=20, expires_at=7)
    policy.set_retention(30, priority=60, expires_at=None)
    policy.touch(1, 8)  # the clock passes 7: hash 10's new entry expires too
    assert policy.priority_of(10) == 35
    policy.abort()
    assert policy.priority_of(10) == 80 and policy.priority_of(30) == 35
    assert state(policy) == state(before)


def test_protected_lru_registration_hook_is_undone_by_abort() -> None:
    """Outside a transaction the hook's history move is final; inside, abort takes it back."""
    policy = policies.get("protected_lru", history_capacity=2)
    for block_id in (1, 2, 3):
        policy.insert(block_id, block_id * 10, block_id, 1, 0)
    assert policy.evict(3) == [1, 2, 3]  # history 20, 30: hash 10 pushed out
    before = copy.deepcopy(policy)
    policy.begin()
    policy.on_register([20], first_depth=0)  # history 30, 20
    assert list(policy._history) == [30, 20]
    policy.abort()
    assert list(policy._history) == [20, 30] and state(policy) == state(before)
    policy.on_register([20], first_depth=0)  # outside: final
    policy.insert(3, 30, 3, 1, 0)  # hash 30 returns with its use
    assert policy.is_protected(3)
    assert list(policy._history) == [20] and policy.remembered_uses(20) == 1


def test_an_evicted_leaf_inserted_again_after_an_empty_evict_and_a_discard_is_new() -> None:
    """A leaf discarded when it gained a child, re-inserted after the child's subtree went."""
    policy = policies.get("lfu")
    policy.insert(1, 10, 1, 1, 0)
    policy.insert(2, 20, 2, 1, 0)
    assert policy.evict(1) == [1]  # the age rises to 1
    policy.discard(2)  # a child registered below block 2; its key scored at age 0
    assert policy.evict(1) == []  # nothing tracked: the planner drops a pinned subtree
    policy.insert(2, 20, 2, 1, 0)  # same arguments, a new call: scored at the current age
    policy.insert(3, 30, 0, 1, 0)
    assert policy.evict(2) == [3, 2]  # (2, 0, 3) < (2, 2, 2); the old key (1, 2, 2) would lead


def test_linked_map_puts_removed_entries_back_in_place() -> None:
    ghosts: LinkedMap[int] = LinkedMap()
    for key in (1, 2, 3, 4):
        ghosts.put(key, key * 10)
    middle = ghosts.unlink(2)
    oldest = ghosts.unlink_oldest()
    ghosts.put(5, 50)
    assert list(ghosts) == [3, 4, 5]
    assert ghosts.unlink(5) is not None  # later changes undone first
    ghosts.relink(*oldest)
    assert middle is not None
    ghosts.relink(2, middle)
    assert list(ghosts) == [1, 2, 3, 4] and ghosts.get(2) == 20
    ghosts.put(1, 11)  # an existing key keeps its place
    assert list(ghosts) == [1, 2, 3, 4] and ghosts.get(1) == 11 and len(ghosts) == 4


@pytest.mark.parametrize("name", NAMES)
def test_nothing_is_recorded_outside_a_transaction_and_commit_drops_the_log(name: str) -> None:
    policy = make(name)
    for step in range(500):  # releases and evictions, no transaction
        policy.insert(step % 10, step, step, 1, 0)
        policy.evict(1)
    assert policy._txn_undo is None
    policy.begin()
    policy.insert(1, 10_000, 600, 1, 0)
    assert policy._txn_undo  # something to undo
    policy.commit()
    assert policy._txn_undo is None and 1 in policy
