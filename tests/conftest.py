"""Shared fixtures of the unit tests: small allocators and a digest of their whole state.

``state_digest`` (the one copy, in the public test kit
:mod:`prefixcache.testing`) is what "a call that raises changes nothing"
(DESIGN.md invariant 6) is checked against. With ``--import-mode=importlib``
a test module cannot import this file, so the helpers reach tests as
fixtures: ``digest`` returns :func:`state_digest` and ``refuses`` returns
:func:`assert_refused`. Likewise ``make_small``, ``chain``, ``flaky`` and
``injected_fault`` hand the engine and fault tests one copy of their small
allocator, chain registration and failing-on-cue LRU; ``vllm_events`` the
wire tests' re-declaration of vLLM's event structs.
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
# against it step by step (tests/native/), and tests that build an allocator with
# engine="native" run it whatever the environment says.
os.environ.setdefault("PREFIXCACHE_ENGINE", "python")

from prefixcache.policies import LRUPolicy

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


def small_allocator(policy: Any = "lru", total_count: int = 10, **kwargs: Any) -> KVBlockAllocator:
    """A CPU allocator of 2-token blocks, ``total_count`` of them (one reserved).

    ``policy`` is a policy name or instance (LRU, the allocator's default, unless
    given); ``kwargs`` (``paused_count=3``, ``hash_salt=...``) go to the constructor.
    """
    return KVBlockAllocator(
        total_count=total_count,
        block_size_tokens=2,
        device="cpu",
        eviction_policy=policy,
        **kwargs,
    )


def allocate_chain(allocator: KVBlockAllocator, hashes: list[int], **kwargs: Any) -> list[int]:
    """Allocate one block per hash and register them as one chain; return the block IDs.

    ``kwargs`` (``parent_hash=...``, ``lora_name=...``) go to ``register_kv_block_hashes``.
    """
    ids = allocator.allocate_memory_blocks(len(hashes))
    assert ids is not None
    allocator.register_kv_block_hashes(ids, hashes, **kwargs)
    return ids.tolist()


class InjectedFault(RuntimeError):
    """What a :class:`FlakyLRU` or a patched pool raises (not a library error)."""


class FlakyLRU(LRUPolicy):
    """LRU whose ``fail_at[method]``-th call of ``method`` (1-based) raises, once armed.

    It raises before changing anything, as the journal requires of a policy.
    It also records its inserts, to show which leaves went through the policy
    and with which arguments.
    """

    def __init__(self) -> None:
        super().__init__()
        self.fail_at: dict[str, int] = {}
        self.calls: dict[str, int] = {}
        self.inserted: list[int] = []
        self.insert_args: list[tuple[int, int, int, int, int]] = []

    def _tick(self, method: str) -> None:
        if method in self.fail_at:
            self.calls[method] = self.calls.get(method, 0) + 1
            if self.calls[method] == self.fail_at[method]:
                raise InjectedFault(f"{method} call {self.calls[method]}")

    def insert(
        self, block_id: int, block_hash: int, last_access: int, num_accesses: int, depth: int
    ) -> None:
        self._tick("insert")
        self.inserted.append(block_id)
        self.insert_args.append((block_id, block_hash, last_access, num_accesses, depth))
        super().insert(block_id, block_hash, last_access, num_accesses, depth)

    def discard(self, block_id: int) -> None:
        self._tick("discard")
        super().discard(block_id)

    def touch(self, block_id: int, now: int) -> None:
        self._tick("touch")
        super().touch(block_id, now)


@pytest.fixture(scope="session")
def make_small() -> Callable[..., KVBlockAllocator]:
    """The :func:`small_allocator` factory: 2-token blocks, 10 of them unless told."""
    return small_allocator


@pytest.fixture(scope="session")
def chain() -> Callable[..., list[int]]:
    """The :func:`allocate_chain` function: allocate and register a chain of hashes."""
    return allocate_chain


def flaky_allocator(**kwargs: Any) -> tuple[FlakyLRU, KVBlockAllocator]:
    """A fresh :class:`FlakyLRU` (not armed) and a :func:`small_allocator` over it.

    ``kwargs`` (``total_count=5``, ...) go to :func:`small_allocator`.
    """
    policy = FlakyLRU()
    return policy, small_allocator(policy, **kwargs)


@pytest.fixture(scope="session")
def flaky() -> Callable[..., tuple[FlakyLRU, KVBlockAllocator]]:
    """The :func:`flaky_allocator` factory: an LRU that fails on cue, and an allocator over it."""
    return flaky_allocator


@pytest.fixture(scope="session")
def injected_fault() -> type[InjectedFault]:
    """The :class:`InjectedFault` class, for ``pytest.raises`` and patched collaborators."""
    return InjectedFault


@pytest.fixture(scope="session")
def vllm_events() -> SimpleNamespace:
    """vLLM 0.33's KV event structs, re-declared: decode a published batch as vLLM would.

    ``Batch`` (``ts``, ``events``, ``data_parallel_rank``) and the event types
    ``BlockStoredV``, ``BlockRemovedV`` and ``ClearedV``, tagged by vLLM's names.
    Built with ``msgspec.defstruct`` so that no annotation has to be resolved
    in this module; skips where msgspec (the events extra) is not installed.
    """
    msgspec = pytest.importorskip("msgspec", reason="the events extra (msgspec) is not installed")
    event = msgspec.defstruct("_Event", [], tag=True, omit_defaults=True)
    stored = msgspec.defstruct(
        "BlockStoredV",
        [
            ("block_hashes", list[int]),
            ("parent_block_hash", int | None),
            ("token_ids", list[int]),
            ("block_size", int),
            ("lora_id", int | None),
            ("medium", str | None),
            ("lora_name", str | None),
            ("extra_keys", list | None, None),
        ],
        bases=(event,),
        tag="BlockStored",
    )
    removed = msgspec.defstruct(
        "BlockRemovedV",
        [("block_hashes", list[int]), ("medium", str | None)],
        bases=(event,),
        tag="BlockRemoved",
    )
    cleared = msgspec.defstruct("ClearedV", [], bases=(event,), tag="AllBlocksCleared")
    batch = msgspec.defstruct(
        "Batch",
        [
            ("ts", float),
            ("events", list[stored | removed | cleared]),
            ("data_parallel_rank", int | None, None),
        ],
        array_like=True,
    )
    return SimpleNamespace(
        Batch=batch, BlockStoredV=stored, BlockRemovedV=removed, ClearedV=cleared
    )


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
