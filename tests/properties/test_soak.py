"""CI version of the soak: 10^5 random operations in all, spread over every online policy.

The driver is :mod:`prefixcache.tools.soak` (``python benchmarks/soak.py`` runs
it for 10^7 operations per policy). Each run checks the invariants and every
reference count against the driver's requests every 1,000 operations, and
ends by releasing everything and checking that the pool is whole again.
"""

from __future__ import annotations

import pytest

from prefixcache.tools import soak
from prefixcache.tools.replay import online_policies

CI_TOTAL_OPS = 100_000
CHECK_EVERY = 1_000


POLICIES = online_policies()


@pytest.mark.parametrize("policy", POLICIES)
def test_soak_keeps_every_invariant_and_leaks_nothing(policy: str) -> None:
    num_ops = CI_TOTAL_OPS // len(POLICIES)
    result = soak.run_soak(policy, num_ops, seed=POLICIES.index(policy), check_every=CHECK_EVERY)
    assert result.num_ops >= num_ops
    assert result.num_checks >= num_ops // CHECK_EVERY
    # The mix really exercised what it claims to: sharing, pressure, every call kind.
    assert result.num_hit_blocks > 0
    assert result.num_refused > 0
    for name in (
        "match_prefix",
        "allocate_memory_blocks",
        "register_kv_block_hashes",
        "release_memory_blocks",
        "free_group",
        "pause",
        "resume",
        "update_timestamps",
        "evict_cached_blocks",
    ):
        assert result.calls[name] > 0, name


def test_soak_detects_a_leaked_reference() -> None:
    """The final drain fails loudly when a reference is still held."""
    driver = soak.SoakDriver("lru", seed=1)
    for _ in range(50):
        driver.serve()
    leaked = driver.active.pop()  # the driver forgets a request it still holds
    assert leaked
    with pytest.raises(AssertionError, match="refs"):
        driver.drain()


def test_soak_command_line_prints_rates_and_totals(capsys: pytest.CaptureFixture[str]) -> None:
    assert soak.main(["--ops", "2000", "--policies", "lru", "ref_zero", "--seed", "5"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and "ops/s" in out
    assert out.count(": OK") == 2
    assert "total: " in out
