"""The laws every eviction policy keeps, as a pytest mixin (:class:`PolicyContract`).

For the built-in policies and third-party ones alike, as cachetools ships a
mixin for its caches. Nothing here is imported by the library itself; pytest
is imported only when a law is skipped.
"""

from __future__ import annotations

import copy
from typing import Any

from prefixcache.policies import EvictionPolicy, has_hook, is_transactional
from prefixcache.testing.policy_driver import _Driver, eviction_order

__all__ = ["PolicyContract"]


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
    defaults or keep their promises (``evicts_first`` predicts ``evict(1)`` after an insert
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
                probe = copy.deepcopy(policy)  # the round trip, from the state the call saw
                predicted = policy.evicts_first(candidate, *args)
                assert isinstance(predicted, bool)
                assert eviction_order(policy) == order, f"seed {seed}: evicts_first changed it"
                if not has_hook(policy, "evicts_first"):
                    assert predicted is False
                    continue
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
