"""Shared fixtures of the unit tests: small allocators and a digest of their whole state.

``state_digest`` (the one copy, in the public test kit
:mod:`prefixcache.testing`) is what "a call that raises changes nothing"
(DESIGN.md invariant 6) is checked against. With ``--import-mode=importlib``
a test module cannot import this file, so the helpers reach tests as
fixtures: ``digest`` returns :func:`state_digest` and ``refuses`` returns
:func:`assert_refused`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch

# Most unit tests look inside the Python engine (its pool, registry, reference table), so
# the suite runs it unless the environment says otherwise. The native engine is tested
# against it step by step (tests/native/), and CI runs the tests of behaviour through the
# public API again with PREFIXCACHE_ENGINE=native (.ci/run).
os.environ.setdefault("PREFIXCACHE_ENGINE", "python")

from prefixcache import KVBlockAllocator, PrefixCacheError
from prefixcache.testing import changed_fields, state_digest

TOTAL_COUNT = 16
PAUSED_COUNT = 4
BLOCK_SIZE = 4
NUM_LAYERS = 2
TOP_K = 2
NUM_EXPERTS = 8

HASHES_A = (101, 102, 103)
"""Hashes of the populated allocator's active chain."""
HASHES_C = (201, 202)
"""Hashes of the populated allocator's released chain (cached under LRU, freed under ref-zero)."""


def assert_refused(
    allocator: KVBlockAllocator,
    error: type[PrefixCacheError],
    call: Callable[..., object],
    *args: Any,
    **kwargs: Any,
) -> PrefixCacheError:
    """Assert that ``call(*args, **kwargs)`` raises ``error`` and leaves ``allocator`` as it was.

    Returns:
        The raised exception, for checks on its message.
    """
    before = state_digest(allocator)
    with pytest.raises(error) as info:
        call(*args, **kwargs)
    assert type(info.value).__module__ == "prefixcache.errors"
    assert isinstance(info.value, PrefixCacheError)
    after = state_digest(allocator)
    assert after == before, changed_fields(before, after)
    allocator.check_invariants()
    return info.value


def make_allocator(policy: str = "lru", **kwargs: Any) -> KVBlockAllocator:
    """A small CPU allocator; ``kwargs`` override the defaults."""
    options: dict[str, Any] = {
        "total_count": TOTAL_COUNT,
        "block_size_tokens": BLOCK_SIZE,
        "eviction_policy": policy,
        "device": "cpu",
    }
    options.update(kwargs)
    return KVBlockAllocator(**options)


def populate(allocator: KVBlockAllocator) -> SimpleNamespace:
    """Put ``allocator`` in a state with blocks in every partition.

    - ``chain_a``: 3 active blocks registered under ``HASHES_A``; the first
      holds two references; with routing configured, all carry routing.
    - ``chain_c``: 2 blocks registered under ``HASHES_C`` and released
      (cached under LRU, free under ref-zero).
    - ``unhashed``: 1 active block without a hash.
    - ``paused``: 1 block held only by a paused request (needs ``paused_count >= 1``).
    - ``free``: an ID on the free stack.
    """
    chain_a = allocator.allocate_memory_blocks(3)
    allocator.register_kv_block_hashes(chain_a, list(HASHES_A))
    if allocator.routing is not None:
        routing = allocator.routing
        for index, block_id in enumerate(chain_a.tolist()):
            values = (index + block_id) % NUM_EXPERTS
            shape = (routing.block_size, routing.num_layers, routing.top_k)
            allocator.store_block_routing(block_id, torch.full(shape, values, dtype=torch.int64))
    chain_c = allocator.allocate_memory_blocks(2)
    allocator.register_kv_block_hashes(chain_c, list(HASHES_C))
    allocator.release_memory_blocks(chain_c)
    unhashed = allocator.allocate_memory_blocks(1)
    paused = allocator.allocate_memory_blocks(1)
    allocator.pause(paused)
    allocator.acquire_blocks(chain_a[:1])
    allocator.advance_clock(3)
    allocator.check_invariants()
    return SimpleNamespace(
        allocator=allocator,
        chain_a=chain_a,
        chain_c=chain_c,
        unhashed=unhashed,
        paused=paused,
        free=int(allocator.pool.free_ids()[0]),
    )


@pytest.fixture
def digest() -> Callable[[KVBlockAllocator], dict[str, Any]]:
    """The :func:`state_digest` function."""
    return state_digest


@pytest.fixture
def refuses() -> Callable[..., PrefixCacheError]:
    """The :func:`assert_refused` function."""
    return assert_refused


@pytest.fixture
def allocator() -> KVBlockAllocator:
    """A fresh LRU allocator: 16 blocks (15 usable), 4 tokens a block, no paused budget."""
    return make_allocator()


@pytest.fixture
def make() -> Callable[..., KVBlockAllocator]:
    """The :func:`make_allocator` factory, for tests that need other settings."""
    return make_allocator


@pytest.fixture(params=["lru", "ref_zero"])
def populated(request: pytest.FixtureRequest) -> SimpleNamespace:
    """An allocator with routing and blocks in every state (see :func:`populate`), per policy."""
    allocator = make_allocator(
        request.param,
        paused_count=PAUSED_COUNT,
        routing_num_layers=NUM_LAYERS,
        routing_top_k=TOP_K,
        routing_num_experts=NUM_EXPERTS,
    )
    scene = populate(allocator)
    scene.policy = request.param
    return scene


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """In the integration stage (``PREFIXCACHE_INTEGRATION=1``) a skipped test is a failure.

    The tests against real Megatron-core, vLLM and Redis skip in the unit suite, where those
    are not installed; the README's integration block installs them and sets this variable,
    so a missing dependency there fails the run instead of passing it silently.
    """
    if os.environ.get("PREFIXCACHE_INTEGRATION") != "1":
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:
        return
    skipped = reporter.stats.get("skipped", [])
    for report in skipped:
        reporter.write_line(f"integration stage: a skip is a failure: {report.nodeid}")
    if skipped:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
