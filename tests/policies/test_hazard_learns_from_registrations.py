"""``hazard`` and the registration hook: evicted prefixes computed again teach their reuse."""

from __future__ import annotations

import copy

from prefixcache.policies import HazardPolicy, has_hook


def _next_victim(returns_registered: bool) -> int:
    """Learn two classes, then evict one of three leaves; return the victim.

    150 depth-0 blocks are evicted after 100 idle ticks; with
    ``returns_registered`` all their hashes are then registered again (as
    the inner blocks of longer requests, which never become leaves here).
    150 depth-8 blocks follow and never come back. Then the oldest leaf is
    at depth 0, a slightly newer one at depth 8, and a fresh one at depth 8.
    """
    policy = HazardPolicy()
    clock = 0
    for depth, first in ((0, 0), (8, 150)):
        for block_id in range(first, first + 150):
            policy.insert(block_id, 10_000 + block_id, clock, 1, depth)
            clock += 1
            if block_id - first >= 100:
                policy.evict(1)
        policy.evict(len(policy))
        if depth == 0 and returns_registered:
            policy.on_register([10_000 + block_id for block_id in range(150)], first_depth=0)
    policy.insert(1000, 1, clock, 1, 0)
    policy.insert(1001, 2, clock + 1, 1, 8)
    policy.insert(1002, 3, clock + 150, 1, 8)
    return policy.evict(1)[0]


def test_hazard_observes_registrations() -> None:
    assert has_hook(HazardPolicy(), "on_register")


def test_returns_seen_at_registration_make_their_class_worth_keeping() -> None:
    assert _next_victim(returns_registered=False) == 1000  # nothing learned: the oldest goes
    assert _next_victim(returns_registered=True) == 1001  # depth 0 is reused, depth 8 is not


def test_registering_hashes_never_evicted_teaches_nothing() -> None:
    policy = HazardPolicy()
    policy.on_register([1, 2, 3], first_depth=0)
    policy.insert(1, 1, 0, 1, 0)
    policy.insert(2, 2, 5, 1, 0)
    assert policy.evict(2) == [1, 2]


def test_a_returned_use_count_survives_a_history_too_short_for_the_wait() -> None:
    # One remembered hash: evicting another would drop it, but its return was recorded first.
    policy = HazardPolicy(history_capacity=1)
    policy.insert(1, 77, 0, 3, 0)
    policy.evict(1)
    policy.on_register([77], first_depth=0)
    policy.insert(2, 88, 1, 1, 0)
    policy.evict(1)  # 88 is now the only remembered hash
    policy.insert(3, 77, 2, 1, 0)
    assert policy._stays[3].num_uses == 4  # the 3 earlier hand-outs plus this one
    policy.clear()
    policy.insert(4, 77, 3, 1, 0)
    assert policy._stays[4].num_uses == 1


def test_what_a_registration_taught_is_taken_back_by_abort() -> None:
    """Inside a transaction the hook is undone too: history, returned counts and statistics."""
    policy = HazardPolicy(history_capacity=1)
    policy.insert(1, 77, 0, 3, 0)
    policy.insert(2, 66, 0, 1, 0)
    policy.evict(2)  # 77 is dropped from a history of one; 66 is remembered
    policy.insert(5, 55, 1, 1, 0)
    policy.evict(1)  # 55 pushes 66 out
    before = copy.deepcopy(policy)
    policy.begin()
    policy.on_register([55, 99], first_depth=0)
    assert len(policy._returned) == 1 and len(policy._history) == 0
    policy.abort()
    assert list(policy._history) == list(before._history) == [55]
    assert len(policy._returned) == 0
    assert policy._reuses == before._reuses and policy._entered == before._entered
