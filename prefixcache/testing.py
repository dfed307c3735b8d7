"""Public test kit: what a project building on prefixcache needs to test against it.

Sections:

- **Policy contract** (:class:`PolicyContract`): a pytest mixin that checks
  the laws every eviction policy keeps, for the built-in policies and
  third-party ones alike, as cachetools ships a mixin for its caches.

Nothing here is imported by the library itself; pytest is imported only
when a law is skipped.
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass, field
from typing import Any

from prefixcache.policies import EvictionPolicy, has_hook, is_transactional

__all__ = ["PolicyContract"]


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
