"""Every built-in policy keeps the laws of ``prefixcache.testing.PolicyContract``.

Small ghost lists and histories and fast learning, so that trimming, refreshes
and ghost hits happen within a script. The last tests show the contract can
fail: policies broken on purpose are caught, hidden state included.
"""

from __future__ import annotations

from typing import Any

import pytest
from prefixcache.policies import (
    ARCPolicy,
    BeladyPolicy,
    EvictionPolicy,
    FIFOPolicy,
    HazardPolicy,
    LFUPolicy,
    LRUPolicy,
    PriorityPolicy,
    ProtectedLRUPolicy,
    RefZeroPolicy,
    ReuseLRUPolicy,
    S3FIFOPolicy,
    SLRUPolicy,
)

from prefixcache.testing import PolicyContract


class TestLRU(PolicyContract):
    def make_policy(self) -> EvictionPolicy:
        return LRUPolicy()


class TestFIFO(PolicyContract):
    def make_policy(self) -> EvictionPolicy:
        return FIFOPolicy()


class TestLFU(PolicyContract):
    def make_policy(self) -> EvictionPolicy:
        return LFUPolicy(frequency_weight=0.5)


class TestSLRU(PolicyContract):
    def make_policy(self) -> EvictionPolicy:
        return SLRUPolicy(protected_fraction=0.5)


class TestS3FIFO(PolicyContract):
    def make_policy(self) -> EvictionPolicy:
        return S3FIFOPolicy(small_fraction=0.3, ghost_capacity=6)


class TestARC(PolicyContract):
    def make_policy(self) -> EvictionPolicy:
        return ARCPolicy(ghost_capacity=6)


class TestReuseLRU(PolicyContract):
    def make_policy(self) -> EvictionPolicy:
        return ReuseLRUPolicy(history_capacity=6, age_smoothing=0.3)


class TestProtectedLRU(PolicyContract):
    def make_policy(self) -> EvictionPolicy:
        return ProtectedLRUPolicy(history_capacity=6)


class TestHazard(PolicyContract):
    def make_policy(self) -> EvictionPolicy:
        return HazardPolicy(history_capacity=6, half_life=40)


class TestHazardRefreshing(PolicyContract):
    """Score tables refresh every 256 events: long scripts cross several refreshes."""

    steps = 700
    seeds = (5,)

    def make_policy(self) -> EvictionPolicy:
        return HazardPolicy(history_capacity=6, half_life=40)


class TestPriority(PolicyContract):
    def make_policy(self) -> EvictionPolicy:
        policy = PriorityPolicy(max_retained_fraction=0.4)
        for block_hash in range(1_001, 1_200, 2):  # above and below the default, some expiring
            expires_at = None if block_hash % 7 == 0 else block_hash % 300
            policy.set_retention(block_hash, block_hash % 70, expires_at)
        return policy


class TestBelady(PolicyContract):
    def make_policy(self) -> EvictionPolicy:
        return BeladyPolicy(lambda block_id: (block_id * 7_919) % 101)


class TestRefZero(PolicyContract):
    tracks_leaves = False

    def make_policy(self) -> EvictionPolicy:
        return RefZeroPolicy()


def test_ref_zero_refuses_leaves() -> None:
    with pytest.raises(RuntimeError, match="retains nothing"):
        RefZeroPolicy().insert(1, 10, 1, 1, 0)


# ---------------------------------------------------------------- the contract can fail


class ForgetfulAbortLRU(LRUPolicy):
    """Aborts by committing: the order after an aborted transaction keeps its changes."""

    def abort(self) -> None:
        self.commit()


class UntrackedVictimLRU(LRUPolicy):
    """Hands out a block it does not track when asked for more than one victim."""

    def evict(self, num_blocks: int) -> list[int]:
        victims = super().evict(num_blocks)
        return [*victims, 10_000] if num_blocks > 1 else victims


class GhostLeakingARC(ARCPolicy):
    """Takes an eviction back in the lists but leaves its ghost entry: hidden state."""

    def _unevict(self, key: Any, in_t2: bool, stay: Any, ghosts: Any, remembered: Any) -> None:
        self._stays[key[1]] = stay
        self._put_back(key[1], key, in_t2)


def contract_for(policy: type[EvictionPolicy], **kwargs: Any) -> PolicyContract:
    class Contract(PolicyContract):
        def make_policy(self) -> EvictionPolicy:
            return policy(**kwargs)

    return Contract()


def test_a_policy_whose_abort_keeps_its_changes_fails_the_contract() -> None:
    with pytest.raises(AssertionError):
        contract_for(ForgetfulAbortLRU).test_abort_restores_the_order_and_all_later_behaviour()


def test_a_policy_returning_an_untracked_victim_fails_the_contract() -> None:
    with pytest.raises(AssertionError, match="evict"):
        contract_for(UntrackedVictimLRU).test_evict_returns_at_most_k_distinct_tracked_leaves()


def test_hidden_state_left_by_an_abort_fails_the_contract() -> None:
    """The order right after the abort is right; a later ghost hit gives the leak away."""
    contract = contract_for(GhostLeakingARC, ghost_capacity=6)
    with pytest.raises(AssertionError, match="after the abort"):
        contract.test_abort_restores_the_order_and_all_later_behaviour()
