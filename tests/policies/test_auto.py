"""The ``auto`` policy: the contract, determinism, bounded metadata, admission, adaptation."""

from __future__ import annotations

import pytest
from prefixcache.policies import EvictionPolicy, available, get
from prefixcache.policies.auto import EXPERTS, AutoPolicy

from prefixcache.testing import PolicyContract
from prefixcache.tools.replay import replay
from prefixcache.tools.workloads import documents_with_hot_prefixes, multi_turn_chats


class TestAuto(PolicyContract):
    def make_policy(self) -> EvictionPolicy:
        return AutoPolicy(duel_ratio=0.1, sample_ratio=0.5, half_life_ratio=0.05)


class TestAutoLongScripts(PolicyContract):
    """Long scripts: sketch halvings, dropped duels and changes of leader inside them."""

    steps = 700
    seeds = (5, 6)

    def make_policy(self) -> EvictionPolicy:
        return AutoPolicy(
            duel_ratio=0.05, sample_ratio=0.3, half_life_ratio=0.02, switch_margin=0, switch_z=0
        )


def test_auto_is_registered_and_replays_through_the_allocator() -> None:
    assert "auto" in available() and isinstance(get("auto"), AutoPolicy)
    trace = documents_with_hot_prefixes(150, seed=3, num_hot_prefixes=4, hot_prefix_blocks=8)
    result = replay(trace, 60, "auto")
    assert result.hit_blocks > 0 and result.evictions > 0


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("seed", -1),
        ("seed", True),
        ("seed", 1.5),
        ("duel_ratio", 0),
        ("sketch_ratio", -1.0),
        ("sample_ratio", "8"),
        ("half_life_ratio", 0.0),
        ("switch_margin", 1.0),
        ("switch_margin", -0.1),
        ("switch_z", -0.5),
        ("switch_z", None),
    ],
)
def test_bad_arguments_raise_value_error(name: str, value: object) -> None:
    with pytest.raises(ValueError, match=name):
        AutoPolicy(**{name: value})  # type: ignore[arg-type]


def _victims(policy: AutoPolicy, rounds: int = 400) -> list[int]:
    """Drive ``policy`` with a seeded mix of fresh, reused and returning blocks."""
    import random

    rng = random.Random(11)
    victims: list[int] = []
    free = list(range(300))
    hashes: dict[int, int] = {}
    for clock in range(rounds):
        if free:
            block_id = free.pop()
            block_hash = rng.choice((rng.randint(0, 50), 10_000 + clock))
            policy.on_register([block_hash], 0)
            hashes[block_id] = block_hash
            policy.insert(block_id, block_hash, clock, rng.choice((1, 1, 2, 3)), rng.randint(0, 4))
        if len(policy) > 40:
            for victim in policy.evict(rng.randint(1, 3)):
                victims.append(victim)
                free.append(victim)
    return victims


def test_equal_seeds_give_equal_victims() -> None:
    assert _victims(AutoPolicy(seed=4)) == _victims(AutoPolicy(seed=4))
    assert len(_victims(AutoPolicy(seed=5))) == len(_victims(AutoPolicy(seed=4)))


def test_metadata_stays_within_the_stated_fractions_of_the_pool() -> None:
    policy = AutoPolicy(duel_ratio=0.5, sketch_ratio=2.0)
    _victims(policy, rounds=3_000)
    meta = policy.metadata()
    assert meta["pool"] == 300
    assert 0 < meta["duels"] <= 0.5 * meta["pool"]
    assert meta["sketch_counters"] == 4 * 1024  # 4 rows of the power of two >= 2 x 300
    assert meta["stays"] <= meta["pool"]


def test_the_sketch_keeps_its_counts_when_the_pool_grows_and_halves_them_later() -> None:
    policy = AutoPolicy(sample_ratio=100.0)
    for _ in range(5):
        policy.on_register([77], 0)
    assert policy.uses(77) == 5
    policy.insert(5_000, 78, 1, 1, 0)  # a much larger pool: a wider sketch
    assert policy.metadata()["pool"] == 5_001
    assert policy.uses(77) == 5
    small = AutoPolicy(sample_ratio=0.1)  # halves after 6 uses (64-block pool)
    for _ in range(6):
        small.on_register([77], 0)
    assert small.uses(77) == 3


def test_a_scan_of_one_hit_blocks_does_not_push_out_reused_blocks() -> None:
    policy = AutoPolicy()
    for block_id in range(5):  # reused prefixes, the oldest leaves
        policy.on_register([block_id], 0)
        policy.insert(block_id, block_id, block_id, 3, 0)
    for step in range(200):  # a scan: each block used once, the cache trimmed to 10 leaves
        block_id = 100 + step
        policy.on_register([block_id], 0)
        policy.insert(block_id, block_id, 10 + step, 1, 0)
        if len(policy) > 10:
            assert policy.evict(1)[0] >= 100
    assert all(block_id in policy for block_id in range(5))
    assert policy.leader == "frequent"


def _phase(policy: AutoPolicy, first_id: int, rounds: int, *, fresh_return: bool) -> None:
    """Each round an old reused leaf and a fresh one-use leaf arrive; one eviction each.

    ``lru`` evicts the old reused leaves, ``frequent`` the one-use ones. With
    ``fresh_return`` a one-use victim's prefix is computed again at once
    (chat-like: a first use predicts the next); otherwise a reused victim's
    is (a scan beside hot prefixes).
    """
    for step in range(rounds):
        old, fresh = first_id + 2 * step, first_id + 2 * step + 1
        policy.on_register([old, old], 0)
        policy.insert(old, old, step, 3, 0)  # reused, last used long ago
        policy.on_register([fresh], 0)
        policy.insert(fresh, fresh, 10**6 + first_id + step, 1, 0)
        for victim in policy.evict(2):
            if (victim % 2 == 1) == fresh_return:
                policy.on_register([victim], 0)


def test_the_lead_moves_to_the_expert_that_loses_fewer_hits_when_traffic_changes() -> None:
    policy = AutoPolicy(half_life_ratio=0.01)  # a pool of ~20,000: charges halve each 200
    assert policy.leader == "frequent"
    _phase(policy, 10_000, 300, fresh_return=True)
    assert policy.leader == "lru"
    charges = policy.charges()
    assert charges["frequent"] > charges["lru"]
    _phase(policy, 20_000, 300, fresh_return=False)
    assert policy.leader == "frequent"
    assert set(policy.charges()) == set(EXPERTS)


def test_the_lead_moves_only_once_the_evidence_passes_the_sequential_test() -> None:
    """A few misses move the lead without the test; with it, only a larger difference does."""
    hasty, patient = AutoPolicy(switch_z=0), AutoPolicy(switch_z=6)
    for policy in (hasty, patient):
        _phase(policy, 10_000, 4, fresh_return=True)
    assert hasty.leader == "lru"
    assert patient.leader == "frequent"
    charges = patient.charges()
    lead, challenger = charges["frequent"], charges["lru"]
    assert lead - challenger <= 6 * (lead + challenger) ** 0.5  # the rule held it back
    _phase(patient, 20_000, 100, fresh_return=True)
    assert patient.leader == "lru"


def test_auto_beats_lru_where_frequency_pays_and_matches_it_on_chat() -> None:
    """Small replays: documents + hot prefixes (frequency pays), chats (recency pays)."""
    docs = documents_with_hot_prefixes(600, seed=1, num_hot_prefixes=10, hot_prefix_blocks=16)
    assert replay(docs, 150, "auto").hit_rate > replay(docs, 150, "lru").hit_rate + 0.05
    chats = multi_turn_chats(800, seed=1, num_conversations=60)
    assert replay(chats, 400, "auto").hit_rate >= replay(chats, 400, "lru").hit_rate - 0.01


def test_abort_takes_back_a_larger_pool_and_its_wider_sketch() -> None:
    policy = AutoPolicy()
    for _ in range(4):
        policy.on_register([77], 0)
    before = policy.metadata()
    policy.begin()
    policy.insert(10_000, 78, 1, 2, 0)
    assert policy.metadata()["pool"] == 10_001
    policy.abort()
    assert policy.metadata() == before and policy.uses(77) == 4 and len(policy) == 0
