"""Per-request cached tokens, per-label counters, and preempted requests not counted twice."""

from __future__ import annotations

import pytest

from prefixcache.errors import InvalidArgumentError

BLOCK = 4


def prompt(seed: int, num_blocks: int, extra: int = 0) -> list[int]:
    return [seed * 1000 + i for i in range(num_blocks * BLOCK + extra)]


def test_each_admission_reports_its_cached_tokens_by_tier(make_loop):
    loop = make_loop(9, 16)
    first = loop.requests.admit("a", prompt(1, 3, extra=2))
    assert first is not None and first.num_cached_tokens == 0 and len(first.block_ids) == 4
    loop.requests.finish("a")
    again = loop.requests.admit("b", prompt(1, 2))
    assert again is not None
    assert (again.num_cached_tokens, again.num_device_cached_tokens) == (8, 8)
    assert again.num_host_cached_tokens == 0 and not again.resumed
    loop.requests.finish("b")
    loop.admit("c", prompt(2, 6))  # pushes prompt 1 out of the device, into the host tier
    loop.requests.finish("c")
    back = loop.requests.admit("d", prompt(1, 3))
    assert back is not None and back.num_cached_tokens == 12
    assert back.num_host_cached_tokens > 0
    assert back.num_device_cached_tokens + back.num_host_cached_tokens == 12
    counters = loop.requests.counters()["default"]
    assert counters["num_requests"] == 4
    assert counters["num_queried_tokens"] == 14 + 8 + 24 + 12
    assert counters["num_hit_tokens"] == 8 + 12
    assert counters["num_host_hit_tokens"] == back.num_host_cached_tokens


def test_a_preempted_request_does_not_count_its_own_blocks_as_hits(make_loop):
    loop = make_loop(9, 16)
    loop.requests.admit("a", prompt(1, 3), label="model-x")
    loop.requests.append("a", [9] * BLOCK)
    loop.requests.preempt("a")
    with pytest.raises(InvalidArgumentError):
        loop.requests.append("a", [1])
    before = loop.requests.counters()["model-x"]
    resumed = loop.requests.admit("a", None)  # its tokens so far, its label
    assert resumed is not None and resumed.resumed
    assert resumed.num_cached_tokens == 16  # its own blocks were still cached
    after = loop.requests.counters()["model-x"]
    assert after["num_hit_tokens"] == before["num_hit_tokens"] == 0
    assert after["num_queried_tokens"] == before["num_queried_tokens"] == 12
    assert after["num_resumed_requests"] == 1 and after["num_requests"] == 1
    loop.requests.finish("a")


def test_the_device_pool_counts_a_resume_apart(make_loop):
    """Issue 28, item 8: the pool's vLLM-style counters counted a resumed request's own
    blocks as prefix hits; like vLLM, a resume now counts in the preempted counters."""
    loop = make_loop(9, 16)
    loop.requests.admit("a", prompt(1, 3))
    loop.requests.preempt("a")
    pool = loop.requests.tiered.allocator
    before = pool.stats()
    resumed = loop.requests.admit("a", None)
    assert resumed is not None and resumed.num_cached_tokens == 12
    after = pool.stats()
    assert (after.num_hit_tokens, after.num_queried_tokens) == (
        before.num_hit_tokens,
        before.num_queried_tokens,
    )
    assert after.num_preempted_hit_tokens - before.num_preempted_hit_tokens == 12
    assert after.num_preempted_queried_tokens - before.num_preempted_queried_tokens == 12
    loop.requests.finish("a")


def test_counters_are_kept_per_label(make_loop):
    loop = make_loop(9, 16)
    loop.requests.admit("a", prompt(1, 2), label="tenant-a")
    loop.requests.admit("b", prompt(1, 2), label="tenant-b")
    counters = loop.requests.counters()
    assert list(counters) == ["tenant-a", "tenant-b"]
    assert counters["tenant-a"]["num_hit_tokens"] == 0
    assert counters["tenant-b"]["num_hit_tokens"] == 8


def test_decoded_blocks_are_registered_and_shared(make_loop):
    loop = make_loop(9, 16)
    start = prompt(1, 1, extra=2)  # 6 tokens: 2 blocks, 1 full
    loop.requests.admit("a", start)
    grown = loop.requests.append("a", [5, 6, 7])  # 9 tokens: block 2 fills, block 3 starts
    assert grown is not None and len(grown) == 3
    assert len(loop.requests.hashes_of("a")) == 2
    grown = loop.requests.append("a", [8, 8, 8])  # 12 tokens: 3 full blocks
    assert grown is not None and len(grown) == 3
    assert len(loop.requests.hashes_of("a")) == 3
    other = loop.requests.admit("b", [*start, 5, 6, 7, 8, 8, 8, 1])
    assert other is not None and other.num_cached_tokens == 12
    assert other.block_ids[:3].tolist() == grown.tolist()
    assert loop.requests.append("a", []) is not None


def test_a_full_pool_refuses_growth_without_changing_anything(make_loop):
    loop = make_loop(3, 4)  # 2 usable blocks
    loop.requests.admit("a", prompt(1, 2))
    assert loop.requests.append("a", [1]) is None
    assert len(loop.requests.hashes_of("a")) == 2
    assert loop.tiered.stats().device.num_active == 2


def test_misuse_is_refused(make_loop):
    loop = make_loop(9, 16)
    loop.requests.admit("a", prompt(1, 1))
    with pytest.raises(InvalidArgumentError):
        loop.requests.admit("a", prompt(1, 1))  # running
    with pytest.raises(InvalidArgumentError):
        loop.requests.admit("z", None)  # nothing to resume
    with pytest.raises(InvalidArgumentError):
        loop.requests.admit("y", prompt(1, 1), label="")
    with pytest.raises(InvalidArgumentError):
        loop.requests.finish("nobody")
    with pytest.raises(InvalidArgumentError):
        loop.requests.epoch_of("nobody")
    with pytest.raises(InvalidArgumentError):
        loop.requests.preempt("nobody")
    loop.requests.preempt("a")
    loop.requests.finish("a")  # a preempted request finishes without a release
    assert loop.tiered.stats().device.num_active == 0
