"""Rollback of policy calls: the journal's inverse calls restore a policy exactly.

``prefixcache.engine.journal.PolicyJournal`` takes back a failed allocator call's
policy calls, newest first: an inserted leaf is discarded, a discarded or
evicted leaf inserted again with the arguments it had, a touched leaf
discarded and inserted with its old arguments. A seeded cache model drives
each policy as the allocator does (hand-out counts and a clock that ticks on
every allocation, hit and touch) and, at random points, makes an
allocator-shaped call and takes it back that way. The policy's whole state
(its fields, compared recursively; heaps, whose layout depends on lazy
deletion, through the eviction order) must equal a copy taken before, and a
twin that never saw the aborted calls must choose the same victims to the
end.

Call shapes are the allocator's: an eviction (``evict(1)`` victims
interleaved with inserts of exposed parents or new leaves), a hit (discards),
a touch, a release (inserts). A release taken back (its inserts discarded)
is the same call sequence as a hit right after a release; the journal's
closing ``on_rollback`` signal (``policies.ObservesRollbacks``) tells the
policies with an undo log to undo those inserts too.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from prefixcache.policies import ObservesRollbacks
from prefixcache.policies.undo import LinkedMap, UndoLog
from sortedcontainers import SortedList

from prefixcache import KVBlockAllocator, policies

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
"""LRU needs no undo log: its order is a function of the insert arguments; the rest have one."""

STEPS = 300
SMALL = {
    "arc": {"ghost_capacity": 6},
    "s3fifo": {"ghost_capacity": 6},
    "hazard": {"history_capacity": 6, "half_life": 40},
    "reuse_lru": {"history_capacity": 6, "age_smoothing": 0.3},
    "protected_lru": {"history_capacity": 6},
}
"""Small histories and fast learning, so trimming, refreshes and ghost hits happen often."""

# Fields whose layout depends on lazy deletion; their content shows in the eviction order.
LAYOUT_ONLY = {"_heap", "_heaps", "_num_keys", "_records", "_num_paired", "_limit", "_trim_at"}


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


Journal = list[tuple[str, int]]
"""What the journal records of a call: ("inserted" | "removed" | "touched", block ID)."""


@dataclass
class Calls:
    """The policy calls of one allocator call, as the journal and a replay need them."""

    journal: Journal = field(default_factory=list)
    made: list[tuple[str, tuple[Any, ...], Any]] = field(default_factory=list)
    commits: list[Callable[[], None]] = field(default_factory=list)

    def call(self, policy: Any, method: str, *args: Any) -> Any:
        result = getattr(policy, method)(*args)
        self.made.append((method, args, result))
        return result


def insert_op(cache: Cache, calls: Calls, block_id: int) -> None:
    calls.call(cache.policy, "insert", block_id, *cache.args[block_id])
    calls.journal.append(("inserted", block_id))
    calls.commits.append(lambda: cache.held.discard(block_id))


def hit_op(cache: Cache, calls: Calls, block_id: int) -> None:
    calls.call(cache.policy, "discard", block_id)
    calls.journal.append(("removed", block_id))

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
        calls.journal.append(("touched", block_id))

    def commit() -> None:
        cache.clock = now
        for block_id in block_ids:
            block_hash, _, num_accesses, depth = cache.args[block_id]
            cache.args[block_id] = (block_hash, now, num_accesses, depth)

    calls.commits.append(commit)


def evict_op(cache: Cache, calls: Calls) -> None:
    for block_id in calls.call(cache.policy, "evict", 1):
        calls.journal.append(("removed", block_id))

        def commit(block_id: int = block_id) -> None:
            cache.gone_hashes.append(cache.args.pop(block_id)[0])
            cache.free.append(block_id)

        calls.commits.append(commit)


def allocator_call(cache: Cache, shape: str) -> Calls:
    """Make one allocator-shaped call of ``shape`` (evict, hit, touch or release)."""
    rng, calls = cache.rng, Calls()
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


def roll_back(cache: Cache, journal: Journal) -> None:
    """The journal's inverse calls, newest first, with the unchanged block arguments.

    Then, as the allocator's journal does after replaying at least one, the
    ``on_rollback`` signal to a policy that observes rollbacks.
    """
    for what, block_id in reversed(journal):
        if what != "removed":
            cache.policy.discard(block_id)
        if what != "inserted":
            cache.policy.insert(block_id, *cache.args[block_id])
    if journal and isinstance(cache.policy, ObservesRollbacks):
        cache.policy.on_rollback()


def run(name: str, seed: int, aborted_shapes: list[str]) -> int:
    """Drive ``name``, taking back a call of ``aborted_shapes`` now and then.

    A twin policy replays only the committed calls and must return the same
    victims; after each rollback the policy's state must equal a copy taken
    before the aborted call. Returns how many non-empty calls were taken back.
    """
    rng = random.Random(seed)
    cache = Cache(make(name), rng)
    twin = make(name)
    num_checked = 0
    for _ in range(STEPS):
        if rng.random() < 0.4:
            before = copy.deepcopy(cache.policy)
            shape = rng.choice(aborted_shapes)
            calls = allocator_call(cache, shape)
            roll_back(cache, calls.journal)
            assert state(cache.policy) == state(before), (shape, calls.made)
            assert eviction_order(cache.policy) == eviction_order(before), (shape, calls.made)
            num_checked += bool(calls.journal)
        calls = allocator_call(cache, rng.choice(["evict", "hit", "touch", "release", "release"]))
        for method, args, result in calls.made:
            assert getattr(twin, method)(*args) == result, (method, args)
        for commit in calls.commits:
            commit()
    assert state(twin) == state(cache.policy)
    assert eviction_order(twin) == eviction_order(cache.policy)
    return num_checked


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("seed", range(3))
def test_taking_back_an_eviction_hit_or_touch_restores_the_whole_state(
    name: str, seed: int
) -> None:
    assert run(name, seed, ["evict", "hit", "touch"]) > 50


@pytest.mark.parametrize("name", NAMES)
def test_taking_back_a_release_restores_the_whole_state(name: str) -> None:
    assert run(name, 7, ["release"]) > 50


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("seed", [29, 31])
def test_taking_back_calls_of_every_shape_keeps_the_twin_in_step(name: str, seed: int) -> None:
    """Releases mixed with the other shapes: these seeds once made ``hazard`` diverge.

    A release taken back left a heap entry with the same key as its block's
    later one, in another class, which then passed for current.
    """
    assert run(name, seed, ["evict", "hit", "touch", "release"]) > 50


def test_without_the_rollback_signal_a_release_taken_back_is_a_hit_after_a_release() -> None:
    """The same calls, insert then discard: without ``on_rollback`` the ghost hit stays."""
    policy = policies.get("arc")
    policy.insert(1, 10, 1, 1, 0)
    policy.insert(2, 20, 2, 1, 0)
    assert policy.evict(1) == [1]  # hash 10 is now a B1 ghost
    share = policy.recency_share
    policy.insert(3, 10, 3, 1, 0)  # a ghost hit raises p
    policy.discard(3)  # a hit, as far as the policy can tell
    assert policy.recency_share > share


def test_a_failed_release_through_the_allocator_gives_back_the_ghost_hit() -> None:
    """The journal's ``on_rollback`` makes ARC forget the aborted insert's ghost hit."""
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
    allocator.check_invariants()


def test_priority_eviction_taken_back_gives_back_the_entries_it_expired() -> None:
    """With a clock, ``evict`` expires what came due; the put-back of its victim restores it."""
    now = [0]
    policy = policies.get("priority", clock=lambda: now[0])
    policy.set_retention(10, priority=90, expires_at=5)
    policy.insert(1, 10, 1, 1, 0)
    policy.insert(2, 20, 2, 1, 0)
    before = copy.deepcopy(policy)
    now[0] = 5
    assert policy.evict(1) == [1]  # hash 10 fell back to the default: block 1 is older
    policy.insert(1, 10, 1, 1, 0)  # the journal puts the victim back
    policy.on_rollback()
    assert state(policy) == state(before)
    assert policy.evict(2) == [1, 2]  # the entry, still due, expires again


def test_priority_set_retention_drops_the_undo_records() -> None:
    """A retention change cannot be taken back, nor can the calls before it."""
    policy = policies.get("priority")
    policy.set_retention(10, priority=90, expires_at=3)
    policy.insert(1, 10, 5, 1, 0)  # the clock seen reaches 5: the entry expires
    policy.set_retention(10, priority=80, expires_at=None)
    policy.discard(1)
    policy.on_rollback()  # would otherwise take the insert back, expiry and all
    assert policy.priority_of(10) == 80


def test_protected_lru_registration_hook_drops_the_undo_records() -> None:
    """A history entry the hook moves would break the links a record keeps: no undo past it."""
    policy = policies.get("protected_lru", history_capacity=2)
    for block_id in (1, 2, 3):
        policy.insert(block_id, block_id * 10, block_id, 1, 0)
    assert policy.evict(3) == [1, 2, 3]  # history 20, 30: hash 10 pushed out
    policy.on_register([20], first_depth=0)  # history 30, 20
    policy.insert(3, 30, 3, 1, 0)  # not a put-back now: hash 30 returns with its use
    assert policy.is_protected(3)
    assert list(policy._history) == [20] and policy.remembered_uses(20) == 1


def test_an_evicted_leaf_put_back_after_an_empty_evict_and_a_discard_is_not_an_undo() -> None:
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


def test_undo_log_memory_is_bounded_by_the_largest_block_id() -> None:
    policy = policies.get("lfu")
    for step in range(5_000):  # releases and evictions only: no boundary drops records
        policy.insert(step % 10, step, step, 1, 0)
        policy.evict(1)
    log: UndoLog = policy._undo
    assert len(log._records) <= 1.5 * 64
