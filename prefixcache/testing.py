"""Public test kit: what a project building on prefixcache needs to test against it.

Sections:

- **Policy contract** (:class:`PolicyContract`): a pytest mixin that checks
  the laws every eviction policy keeps, for the built-in policies and
  third-party ones alike, as cachetools ships a mixin for its caches.
- **State digest** (:func:`state_digest`, :func:`changed_fields`,
  :func:`pool_digest`): one description of an allocator's whole state, to
  check that a refused or failed call changes nothing (DESIGN.md invariant 6)
  and to compare two allocators, on either engine.
- **Reference model** (:class:`ReferenceModel`): the references a caller
  holds, one entry per reference, and the hashes it saw registered: the much
  simpler model a stateful test checks the allocator against.

Nothing here is imported by the library itself; pytest is imported only
when a law is skipped.
"""

from __future__ import annotations

import copy
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from prefixcache.policies import EvictionPolicy, has_hook, is_transactional

if TYPE_CHECKING:
    from prefixcache.engine.allocator import KVBlockAllocator
    from prefixcache.engine.pool import BlockPool

__all__ = [
    "PolicyContract",
    "ReferenceModel",
    "changed_fields",
    "pool_digest",
    "state_digest",
]


# ====================================================================== policy contract


def _skip(reason: str) -> None:
    import pytest  # only a running test suite skips

    pytest.skip(reason)


def _raises_key_error(method: Any, *args: Any) -> bool:
    """Whether ``method(*args)`` raises KeyError (any other outcome is returned as False)."""
    try:
        method(*args)
    except KeyError:
        return True
    return False


def eviction_order(policy: EvictionPolicy) -> list[int]:
    """Every tracked leaf, next victim first, read from a copy (the policy is unchanged)."""
    return copy.deepcopy(policy).evict(len(policy))


Args = tuple[int, int, int, int]
"""A leaf's insert arguments after its ID: hash, last access, hand-outs, depth."""


@dataclass
class _Cache:
    """The blocks as an engine would see them, to drive a policy with realistic calls.

    A clock ticks on every hand-out and touch; a discarded leaf (a hit) comes
    back later with one more hand-out and a later access; an evicted block's
    hash may be registered again on another block (a returning prefix).
    """

    rng: random.Random
    num_blocks: int
    clock: int = 0
    tracked: dict[int, Args] = field(default_factory=dict)
    out: dict[int, Args] = field(default_factory=dict)  # discarded: may be inserted again
    free: list[int] = field(default_factory=list)
    gone_hashes: list[int] = field(default_factory=list)
    next_hash: int = 1_000

    def __post_init__(self) -> None:
        self.free = list(range(self.num_blocks))

    def new_leaf(self) -> tuple[int, Args] | None:
        """A free block with a new hash or a returning one, and its first arguments."""
        if not self.free:
            return None
        block_id = self.free.pop(self.rng.randrange(len(self.free)))
        if self.gone_hashes and self.rng.random() < 0.4:
            block_hash = self.gone_hashes.pop(self.rng.randrange(len(self.gone_hashes)))
        else:
            self.next_hash += 1
            block_hash = self.next_hash
        self.clock += 1
        args = (block_hash, self.clock, self.rng.choice((1, 1, 1, 2, 3)), self.rng.randint(0, 9))
        return block_id, args

    def returning_leaf(self) -> tuple[int, Args] | None:
        """A discarded block that comes back (released after its hit)."""
        if not self.out:
            return None
        block_id = self.rng.choice(sorted(self.out))
        block_hash, _, num_accesses, depth = self.out.pop(block_id)
        self.clock += 1
        return block_id, (block_hash, self.clock, num_accesses + 1, depth)


def _call_each(policies: list[EvictionPolicy], method: str, *args: Any) -> list[Any]:
    """What ``method(*args)`` returns on each policy, in order."""
    return [getattr(policy, method)(*args) for policy in policies]


class _Driver:
    """Plays one seeded script of calls on any number of policies at once.

    Every policy gets the same calls; :meth:`step` returns what each call
    returned, so twins that must behave alike can be compared call by call.
    The script follows the first policy's victims.
    """

    def __init__(self, seed: int, num_blocks: int, hooks: dict[str, bool]) -> None:
        self.cache = _Cache(random.Random(seed), num_blocks)
        self.hooks = hooks

    def step(self, policies: list[EvictionPolicy]) -> list[Any]:
        """Make one call (an insert, discard, touch, evict, or a hook) on every policy."""
        cache, rng = self.cache, self.cache.rng
        kind = rng.choice(
            ("insert", "insert", "insert", "return", "discard", "touch", "evict", "evict", "hook")
        )
        if kind == "return" and cache.out:
            block_id, args = cache.returning_leaf()  # type: ignore[misc]
            cache.tracked[block_id] = args
            return _call_each(policies, "insert", block_id, *args)
        if kind == "discard" and cache.tracked:
            block_id = rng.choice(sorted(cache.tracked))
            cache.out[block_id] = cache.tracked.pop(block_id)
            return _call_each(policies, "discard", block_id)
        if kind == "touch" and cache.tracked:
            chosen = rng.sample(sorted(cache.tracked), min(len(cache.tracked), 2))
            cache.clock += 1
            for block_id in chosen:
                block_hash, _, num_accesses, depth = cache.tracked[block_id]
                cache.tracked[block_id] = (block_hash, cache.clock, num_accesses, depth)
            return [[p.touch(b, cache.clock) for b in chosen] for p in policies]
        if kind == "evict":
            return self.evict(policies, rng.randint(0, 3))
        if kind == "hook":
            return self._hook(policies)
        leaf = cache.new_leaf()
        if leaf is None:  # no free block: make room
            return self.evict(policies, 1)
        block_id, args = leaf
        cache.tracked[block_id] = args
        return _call_each(policies, "insert", block_id, *args)

    def evict(self, policies: list[EvictionPolicy], num_blocks: int) -> list[Any]:
        """``evict(num_blocks)`` on every policy; the first one's victims become free."""
        results = [p.evict(num_blocks) for p in policies]
        self.evicted(results[0])
        return results

    def evicted(self, victims: list[int]) -> None:
        """The ``victims`` left the cache: their blocks are free, their hashes may return."""
        for block_id in victims:
            args = self.cache.tracked.pop(block_id, None)
            assert args is not None, f"evict returned {block_id}, which is not a tracked leaf"
            self.cache.gone_hashes.append(args[0])
            self.cache.free.append(block_id)

    def _hook(self, policies: list[EvictionPolicy]) -> list[Any]:
        cache, rng = self.cache, self.cache.rng
        if self.hooks["set_retention"] and rng.random() < 0.5:
            block_hash = rng.randint(1_000, cache.next_hash + 3)
            expires_at = rng.choice((None, cache.clock + rng.randint(0, 5)))
            priority = rng.randint(0, 70)
            return _call_each(policies, "set_retention", block_hash, priority, expires_at)
        hashes = sorted(set(rng.sample(cache.gone_hashes, min(2, len(cache.gone_hashes)))))
        first_depth = rng.randint(0, 3)
        return _call_each(policies, "on_register", [*hashes, cache.next_hash + 50], first_depth)


class PolicyContract:
    """A pytest mixin: the laws of :class:`~prefixcache.policies.EvictionPolicy`.

    Subclass it in a test module with a class whose name starts with
    ``Test`` and define :meth:`make_policy`::

        class TestMyPolicy(PolicyContract):
            def make_policy(self) -> EvictionPolicy:
                return MyPolicy()

    The laws: the policy subclasses ``EvictionPolicy``; ``insert``,
    ``discard`` and ``touch`` track what they say, and ``discard`` and
    ``touch`` of an untracked block raise ``KeyError`` and change nothing;
    ``evict(k)`` returns at most ``k`` distinct tracked leaves, exactly
    ``min(k, len)`` of them, and stops tracking them; ``__len__`` and
    ``__contains__`` agree with the calls; ``clear`` forgets everything;
    ``begin``/``abort`` restores the eviction order exactly, and the whole
    observable behaviour (a twin copied before ``begin`` makes the same
    choices from then on), after any mix of calls, a raising one included;
    ``commit`` keeps the changes (a twin that made the same calls outside a
    transaction behaves the same); the optional hooks either keep their
    defaults or keep their promises (``evicts_first`` predicts ``evict(1)``
    and changes nothing; ``on_register`` and ``set_retention`` change no
    tracked set and are undone by ``abort``).

    The policy must support ``copy.deepcopy`` (the order is read from a
    copy). Scripts are seeded: a failure names its seed and step.

    Attributes:
        tracks_leaves: False for a policy that tracks nothing (the ref-zero
            policy object): only the laws of an empty policy are checked.
        num_blocks: block IDs the scripts use.
        steps: calls per script.
        seeds: the scripts run.
    """

    tracks_leaves = True
    num_blocks = 24
    steps = 200
    seeds: tuple[int, ...] = (0, 1, 2)

    def make_policy(self) -> EvictionPolicy:
        """A fresh policy under test."""
        raise NotImplementedError("subclasses of PolicyContract define make_policy()")

    # ---------------------------------------------------------------- helpers

    def _hooks(self, policy: EvictionPolicy) -> dict[str, bool]:
        return {name: has_hook(policy, name) for name in ("on_register", "set_retention")}

    def _filled(self, seed: int, steps: int | None = None) -> tuple[EvictionPolicy, _Driver]:
        """A policy after ``steps`` scripted calls (default: half of :attr:`steps`)."""
        policy = self.make_policy()
        driver = _Driver(seed, self.num_blocks, self._hooks(policy))
        for _ in range(self.steps // 2 if steps is None else steps):
            driver.step([policy])
        return policy, driver

    def _require_tracking(self) -> None:
        if not self.tracks_leaves:
            _skip("the policy tracks no leaves")

    # ---------------------------------------------------------------- the empty policy

    def test_is_an_eviction_policy_with_transactions(self) -> None:
        policy = self.make_policy()
        assert isinstance(policy, EvictionPolicy)
        assert is_transactional(policy), "subclass prefixcache.policies.EvictionPolicy"
        assert not policy.in_transaction

    def test_a_new_policy_tracks_nothing_and_evicts_nothing(self) -> None:
        policy = self.make_policy()
        assert len(policy) == 0
        assert 0 not in policy and 1 not in policy
        for num_blocks in (0, 1, 5):
            assert policy.evict(num_blocks) == []
        policy.begin()
        assert policy.evict(3) == []
        policy.abort()
        assert len(policy) == 0

    def test_discard_or_touch_of_an_untracked_block_raises_key_error(self) -> None:
        policy = self.make_policy()
        assert _raises_key_error(policy.discard, 7), "discard of an untracked block"
        assert _raises_key_error(policy.touch, 7, 1), "touch of an untracked block"
        assert len(policy) == 0

    # ---------------------------------------------------------------- tracking

    def test_insert_discard_and_touch_track_what_they_say(self) -> None:
        self._require_tracking()
        policy = self.make_policy()
        policy.insert(3, 103, 1, 1, 0)
        policy.insert(5, 105, 2, 1, 1)
        assert len(policy) == 2 and 3 in policy and 5 in policy and 4 not in policy
        policy.touch(3, 3)
        assert len(policy) == 2 and 3 in policy
        policy.discard(3)
        assert len(policy) == 1 and 3 not in policy and 5 in policy
        assert sorted(eviction_order(policy)) == [5]

    def test_a_refused_call_changes_nothing(self) -> None:
        self._require_tracking()
        for seed in self.seeds:
            policy, _ = self._filled(seed)
            untracked = next(b for b in range(self.num_blocks + 1) if b not in policy)
            order = eviction_order(policy)
            assert _raises_key_error(policy.discard, untracked), f"seed {seed}: discard"
            assert _raises_key_error(policy.touch, untracked, 10**6), f"seed {seed}: touch"
            assert eviction_order(policy) == order, f"seed {seed}"

    def test_evict_returns_at_most_k_distinct_tracked_leaves(self) -> None:
        self._require_tracking()
        for seed in self.seeds:
            policy = self.make_policy()
            driver = _Driver(seed, self.num_blocks, self._hooks(policy))
            for step in range(self.steps):
                driver.step([policy])
                tracked = {b for b in range(self.num_blocks) if b in policy}
                assert len(policy) == len(tracked), f"seed {seed} step {step}: __len__"
                if step % 7 == 0:
                    k = driver.cache.rng.randint(0, 4)
                    victims = policy.evict(k)
                    where = f"seed {seed} step {step}: evict({k}) -> {victims}"
                    assert len(victims) == min(k, len(tracked)), where
                    assert len(set(victims)) == len(victims), where
                    assert set(victims) <= tracked, where
                    assert not any(b in policy for b in victims), where
                    assert len(policy) == len(tracked) - len(victims), where
                    driver.evicted(victims)

    def test_evicting_everything_returns_every_tracked_leaf_once(self) -> None:
        self._require_tracking()
        for seed in self.seeds:
            policy, _ = self._filled(seed)
            tracked = sorted(b for b in range(self.num_blocks) if b in policy)
            assert sorted(policy.evict(len(policy) + 3)) == tracked, f"seed {seed}"
            assert len(policy) == 0

    def test_clear_forgets_everything(self) -> None:
        self._require_tracking()
        policy, _ = self._filled(self.seeds[0])
        policy.clear()
        assert len(policy) == 0 and policy.evict(5) == []
        assert not any(b in policy for b in range(self.num_blocks))
        assert not policy.in_transaction
        fresh = self.make_policy()
        for policy_ in (policy, fresh):
            policy_.insert(1, 77, 5, 1, 0)
            policy_.insert(2, 78, 6, 2, 1)
        assert eviction_order(policy) == eviction_order(fresh)

    # ---------------------------------------------------------------- transactions

    def test_abort_restores_the_order_and_all_later_behaviour(self) -> None:
        self._require_tracking()
        for seed in self.seeds:
            policy, driver = self._filled(seed)
            for round_ in range(8):
                twin = copy.deepcopy(policy)
                order = eviction_order(policy)
                saved = copy.deepcopy(driver.cache)
                policy.begin()
                assert policy.in_transaction
                for _ in range(driver.cache.rng.randint(1, 12)):
                    driver.step([policy])
                policy.abort()
                where = f"seed {seed} round {round_}"
                assert not policy.in_transaction, where
                assert eviction_order(policy) == order, where
                assert len(policy) == len(twin), where
                driver.cache = saved
                driver.cache.rng.random()  # a different script from here on
                for step in range(20):
                    results = driver.step([twin, policy])
                    assert results[0] == results[1], f"{where}, step {step} after the abort"

    def test_abort_after_a_refused_call_restores_the_order(self) -> None:
        self._require_tracking()
        for seed in self.seeds:
            policy, driver = self._filled(seed)
            order = eviction_order(policy)
            policy.begin()
            for _ in range(5):
                driver.step([policy])
            untracked = next(b for b in range(self.num_blocks + 1) if b not in policy)
            assert _raises_key_error(policy.touch, untracked, driver.cache.clock + 1)
            policy.abort()
            assert eviction_order(policy) == order, f"seed {seed}"

    def test_commit_keeps_the_changes_like_calls_outside_a_transaction(self) -> None:
        self._require_tracking()
        for seed in self.seeds:
            policy = self.make_policy()
            plain = self.make_policy()
            driver = _Driver(seed, self.num_blocks, self._hooks(policy))
            for step in range(self.steps):
                if step % 5 == 0:
                    policy.begin()
                results = driver.step([policy, plain])
                assert results[0] == results[1], f"seed {seed} step {step}"
                if step % 5 == 4:
                    policy.commit()
            policy.commit()
            assert eviction_order(policy) == eviction_order(plain), f"seed {seed}"

    def test_begin_commits_an_open_transaction(self) -> None:
        self._require_tracking()
        policy, driver = self._filled(self.seeds[0])
        policy.begin()
        for _ in range(4):
            driver.step([policy])
        kept = eviction_order(policy)
        policy.begin()
        for _ in range(4):
            driver.step([policy])
        policy.abort()
        assert eviction_order(policy) == kept

    def test_abort_or_commit_without_a_transaction_changes_nothing(self) -> None:
        self._require_tracking()
        policy, _ = self._filled(self.seeds[0])
        order = eviction_order(policy)
        policy.abort()
        policy.commit()
        assert eviction_order(policy) == order and not policy.in_transaction

    # ---------------------------------------------------------------- optional hooks

    def test_evicts_first_predicts_evict_and_changes_nothing(self) -> None:
        self._require_tracking()
        for seed in self.seeds:
            policy, driver = self._filled(seed)
            rng = driver.cache.rng
            for _ in range(10):
                candidate = next((b for b in driver.cache.free if b not in policy), None)
                if candidate is None:
                    break
                args = (
                    rng.randint(10**6, 2 * 10**6),
                    driver.cache.clock + rng.randint(-5, 5),
                    1,
                    0,
                )
                order = eviction_order(policy)
                predicted = policy.evicts_first(candidate, *args)
                assert isinstance(predicted, bool)
                assert eviction_order(policy) == order, f"seed {seed}: evicts_first changed it"
                if not has_hook(policy, "evicts_first"):
                    assert predicted is False
                    continue
                probe = copy.deepcopy(policy)
                probe.insert(candidate, *args)
                assert predicted == (probe.evict(1) == [candidate]), f"seed {seed} {args}"

    def test_on_register_tracks_nothing_and_is_undone_by_abort(self) -> None:
        self._require_tracking()
        for seed in self.seeds:
            policy, driver = self._filled(seed)
            tracked = sorted(b for b in range(self.num_blocks) if b in policy)
            twin = copy.deepcopy(policy)
            order = eviction_order(policy)
            policy.begin()
            gone = driver.cache.gone_hashes
            policy.on_register([*gone[:3], 10**7], 0)
            assert sorted(b for b in range(self.num_blocks) if b in policy) == tracked
            policy.abort()
            assert eviction_order(policy) == order, f"seed {seed}"
            for step in range(20):
                results = driver.step([twin, policy])
                assert results[0] == results[1], f"seed {seed} step {step} after the abort"

    def test_set_retention_keeps_its_default_or_its_promises(self) -> None:
        self._require_tracking()
        policy, driver = self._filled(self.seeds[0])
        if not has_hook(policy, "set_retention"):
            try:
                policy.set_retention(1_001, 90, None)
            except NotImplementedError:
                return
            raise AssertionError("the default set_retention raises NotImplementedError")
        tracked = sorted(b for b in range(self.num_blocks) if b in policy)
        order = eviction_order(policy)
        twin = copy.deepcopy(policy)
        policy.begin()
        for block_hash in range(1_000, driver.cache.next_hash + 1, 3):
            policy.set_retention(block_hash, 90, driver.cache.clock + 2)
        assert sorted(b for b in range(self.num_blocks) if b in policy) == tracked
        policy.abort()
        assert eviction_order(policy) == order
        for step in range(20):
            results = driver.step([twin, policy])
            assert results[0] == results[1], f"step {step} after the abort"


# ====================================================================== state digest


def _free_ids(engine: Any) -> list[int]:
    """The engine's free stack in order (native: the engine's; Python: its pool's)."""
    free_ids = getattr(engine, "free_ids", None)
    ids = free_ids() if free_ids is not None else engine.pool.free_ids()
    return [int(block_id) for block_id in ids]


def _python_engine_internals(allocator: KVBlockAllocator, policy: Any) -> dict[str, Any]:
    """What only the Python engine can show: access clocks, queued releases, tree shape, order.

    The seam does not expose these (the native engine keeps them in C++, where
    the differential test of ``tests/native/`` compares them); a digest that
    saw only the seam could miss a half-applied call on the reference engine.
    """
    refs = allocator._engine.refs  # type: ignore[attr-defined]
    registry = allocator.registry
    return {
        "last_access": refs.last_access.tolist(),
        "num_accesses": refs.num_accesses.tolist(),
        "pending_releases": refs.pending.tolist(),
        "pending_chunks": [chunk.tolist() for chunk in refs._pending_chunks],
        "group_depth": refs.group_depth,
        "hash_map": sorted(registry.items()),
        "parent_of": registry.parent_of.tolist(),
        "num_children": registry.num_children.tolist(),
        "depth_of": registry.depth_of.tolist(),
        "policy_size": len(policy),
        "policy_tracked": [b for b in range(allocator.total_count) if b in policy],
        "policy_order": _policy_order(policy),
    }


def _policy_order(policy: Any) -> list[int] | None:
    """The policy's own ``eviction_order()``, else a transactional copy's ``evict`` order.

    The policy's own reading comes first: a test policy whose ``evict`` follows a
    script (consumed by a refused call) keeps its true order there. A policy of
    the old protocol without ``eviction_order()`` shows none (its ``evict`` may
    be a script); its tracked set is still compared.
    """
    own = getattr(policy, "eviction_order", None)
    if callable(own):
        return list(own())
    return eviction_order(policy) if is_transactional(policy) else None


def state_digest(allocator: KVBlockAllocator, *, policy: Any = None) -> dict[str, Any]:
    """Everything observable of ``allocator``, by name, for "nothing changed" checks.

    Engine-agnostic part (through the public API and the :class:`EngineCore`
    seam, so it works for ``engine="python"`` and ``engine="native"`` alike):
    ``stats()``, ``str()``, the clock, the engine's counters, the free stack in
    order, every usable block's reference counts and state, the registered
    chains (hash, block, parent hash), the verify-mode fingerprints, the
    routing store's written flags and values, and the queued KV events.
    On the Python engine it adds the internals the seam does not expose (see
    :func:`_python_engine_internals`): per-block access clocks and queued
    releases, the registry's tree, and the policy's tracked set and eviction
    order (its ``eviction_order()``, or read from a copy: the policy is unchanged).

    Args:
        allocator: the allocator to describe.
        policy: the policy whose order to read, when the allocator's own is a
            wrapper that must not be driven (a fault-injecting one); default
            ``allocator.policy``.

    Returns:
        A dict of plain values; equal dicts mean indistinguishable allocators
        (:func:`changed_fields` names the fields that differ).

    Complexity:
        O(total_count + registered + events), plus a copy of the policy on the
        Python engine.
    """
    engine = allocator._engine
    usable = np.arange(allocator.num_usable, dtype=np.int32)
    active, paused = engine.reference_counts(usable)
    routing = allocator.routing
    events = allocator.events
    digest: dict[str, Any] = {
        "engine": allocator.engine,
        "stats": allocator.stats(),
        "str": str(allocator),
        "clock": allocator.clock,
        "counters": engine.counters(),
        "free_stack": _free_ids(engine),
        "active_refs": [int(count) for count in active],
        "paused_refs": [int(count) for count in paused],
        "block_states": [engine.describe_state(b) for b in range(allocator.num_usable)],
        "chains": sorted(
            (block_hash, engine.block_of(block_hash), parent)
            for block_hash, parent in engine.registered_chains()
        ),
        "block_hashes": [engine.hash_of(b) for b in range(allocator.num_usable)],
        "fingerprints": list(allocator._fingerprint_of_block),
        "routing_written": None if routing is None else routing._written.tolist(),
        "routing_data": None if routing is None else routing._data.tobytes(),
        "events": None if events is None else list(events._queue),
    }
    if allocator.engine == "python":
        chosen = allocator.policy if policy is None else policy
        digest.update(_python_engine_internals(allocator, chosen))
    return digest


def changed_fields(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """Names of the digest fields that differ, each with a short ``before -> after``."""
    return [
        f"{name}: {_short(value)} -> {_short(after.get(name))}"
        for name, value in before.items()
        if after.get(name) != value
    ]


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 160 else text[:157] + "..."


def pool_digest(pool: BlockPool) -> tuple[int, list[int]]:
    """A :class:`~prefixcache.engine.pool.BlockPool`'s state: free count and free stack."""
    return pool.num_free, pool.free_ids().tolist()


# ====================================================================== reference model


@dataclass
class ReferenceModel:
    """Who holds which reference, and what was registered: the stateful tests' model.

    Much simpler than the allocator, as hypothesis.stateful recommends: a list
    with one entry per reference held (active or paused) and a hash -> block
    map of what the caller saw registered. The allocator's reference counts,
    used counts and budget checks must agree with it after every step.

    Attributes:
        active: one block ID per active reference held.
        paused: one block ID per paused reference held.
        block_of_hash: hash -> block the caller saw registered and still cached.
    """

    active: list[int] = field(default_factory=list)
    paused: list[int] = field(default_factory=list)
    block_of_hash: dict[int, int] = field(default_factory=dict)

    def held(self) -> set[int]:
        """Every block with at least one reference held."""
        return set(self.active) | set(self.paused)

    def handed_out(self, block_ids: list[int]) -> None:
        """Fresh blocks came back active: their old hashes are gone.

        Raises:
            AssertionError: a block handed out while the model holds it.
        """
        held = self.held()
        for block_id in block_ids:
            assert block_id not in held, f"block {block_id} handed out while held"
            self.forget_block(block_id)
        self.active.extend(block_ids)

    def forget_block(self, block_id: int) -> None:
        """A block came back fresh: whatever hash it carried is gone."""
        self.block_of_hash = {h: b for h, b in self.block_of_hash.items() if b != block_id}

    def take(self, pool: list[int], picks: list[int]) -> list[int]:
        """Remove the references at indexes ``picks`` (distinct) of ``pool`` and return them."""
        taken = [pool[i] for i in picks]
        for i in sorted(picks, reverse=True):
            pool.pop(i)
        return taken

    def reset(self) -> None:
        """The allocator was reset: nothing is held or registered."""
        self.active.clear()
        self.paused.clear()
        self.block_of_hash.clear()

    def pause_exceeds(self, taken: list[int], paused_count: int) -> bool:
        """Whether pausing ``taken`` (already out of :attr:`active`) breaks the paused budget.

        The budget bounds the blocks holding any paused reference: the pause is
        refused when more blocks would take their first paused reference than
        ``paused_count`` minus the blocks already holding one. A pause that
        gives no block its first paused reference always passes.
        """
        holding = set(self.paused)
        return len(set(taken) - holding) > paused_count - len(holding)

    def resume_exceeds(self, taken: list[int], active_count: int) -> bool:
        """Whether resuming ``taken`` (already out of :attr:`paused`) breaks the active budget."""
        newly_active = set(taken) - set(self.active)
        return bool(newly_active) and len(set(self.active) | newly_active) > active_count

    def check(self, allocator: KVBlockAllocator) -> None:
        """Assert the allocator's reference counts and used counts match the model.

        Raises:
            AssertionError: naming the first disagreement.
        """
        ids = list(range(allocator.num_usable))
        active, paused = allocator.reference_counts(ids)
        held_active, held_paused = Counter(self.active), Counter(self.paused)
        assert active.tolist() == [held_active[b] for b in ids], "active reference counts"
        assert paused.tolist() == [held_paused[b] for b in ids], "paused reference counts"
        assert allocator.get_active_used() == len(held_active), "active blocks used"
        assert allocator.get_paused_used() == len(set(held_paused) - set(held_active)), (
            "paused blocks used"
        )
        assert allocator.get_paused_avail() == allocator.paused_count - len(held_paused), (
            "paused budget available"
        )
        assert len(held_paused) <= allocator.paused_count, "paused holders over the budget"
