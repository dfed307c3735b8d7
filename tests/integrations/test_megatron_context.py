"""Real megatron-core: two ``DynamicInferenceContext``s, Megatron's allocator and the drop-in.

Skipped when megatron-core is not importable (CI's default environment).
Run it in an environment that has megatron-core 0.19 (see
``tests/integrations/README`` in the report, or ``../shared/bench/README.md``)::

    PYTHONPATH=. $VENV/bin/python -m pytest -q tests/integrations/test_megatron_context.py

Megatron's context insists on CUDA in a few places (``torch.cuda.current_device``
as a device, ``torch.cuda.Event``, pinned host tensors); the CPU shim below
stands in for them. It is part of this test kit, not of the library.

The differential test drives both contexts with the same hypothesis-generated
program (requests added, prefilled, decoded, paused, resumed and finished by
Megatron's own ``add_request`` and ``update_requests``) and compares, after
every step, everything a user of the context can observe, with block IDs
renamed by first appearance (the two allocators hand out different IDs).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings, target
from hypothesis import strategies as st

pytest.importorskip(
    "megatron.core.inference.contexts.dynamic_context", reason="megatron-core is not installed"
)

from megatron.core import parallel_state
from megatron.core.inference.config import (
    InferenceConfig,
    PrefixCachingEvictionPolicy,
)
from megatron.core.inference.contexts.dynamic_context import DynamicInferenceContext
from megatron.core.inference.contexts.kv_block_allocator import KVBlockAllocator
from megatron.core.inference.inference_request import DynamicInferenceRequest
from megatron.core.inference.sampling_params import SamplingParams
from megatron.core.transformer import TransformerConfig

from prefixcache.integrations import megatron

BLOCK_SIZE = 4
_PINNING = ("empty", "zeros", "ones", "full", "arange", "tensor", "empty_like", "zeros_like")


class _NoEvent:
    """``torch.cuda.Event`` on the CPU: everything is already done."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, *args: Any, **kwargs: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait(self, *args: Any, **kwargs: Any) -> None:
        pass

    def query(self) -> bool:
        return True


def _unpinned(make: Any) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        kwargs.pop("pin_memory", None)
        return make(*args, **kwargs)

    return call


@pytest.fixture(scope="module")
def cpu_megatron() -> Iterator[None]:
    """The CPU shim, one process group of one, and Megatron's model-parallel state."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.cuda, "current_device", lambda: "cpu")
        patch.setattr(torch.cuda, "Event", _NoEvent)
        patch.setattr(torch.cuda, "current_stream", lambda *args, **kwargs: _NoEvent())
        patch.setattr(torch.cuda, "synchronize", lambda *args, **kwargs: None)
        for name in _PINNING:
            patch.setattr(torch, name, _unpinned(getattr(torch, name)))
        started = not torch.distributed.is_initialized()
        if started:
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                port = probe.getsockname()[1]
            patch.setitem(os.environ, "MASTER_ADDR", "127.0.0.1")
            patch.setitem(os.environ, "MASTER_PORT", str(port))
            torch.distributed.init_process_group("gloo", rank=0, world_size=1)
            parallel_state.initialize_model_parallel(1, 1)
        try:
            yield
        finally:
            megatron.uninstall()
            if started:
                parallel_state.destroy_model_parallel()
                torch.distributed.destroy_process_group()


def build_context(
    policy: PrefixCachingEvictionPolicy, num_blocks: int, paused_blocks: int = 0
) -> DynamicInferenceContext:
    """A tiny model's context: ``num_blocks`` KV blocks (the dummy included), of which
    ``paused_blocks`` are Megatron's paused buffer (paused requests beyond it are evicted)."""
    model = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, params_dtype=torch.float32
    )
    block_bytes = 4 * 2 * 2 * BLOCK_SIZE * 32  # float32, K and V, layers, tokens, hidden
    config = InferenceConfig(
        block_size_tokens=BLOCK_SIZE,
        buffer_size_gb=num_blocks * block_bytes / 1024**3,
        paused_buffer_size_gb=paused_blocks * block_bytes / 1024**3,
        max_requests=8,
        max_tokens=256,
        max_sequence_length=64,
        enable_prefix_caching=True,
        prefix_caching_eviction_policy=policy,
    )
    return DynamicInferenceContext(model, config)


def request(request_id: int, prompt: list[int], num_generate: int) -> DynamicInferenceRequest:
    return DynamicInferenceRequest(
        request_id=request_id,
        prompt_tokens=torch.tensor(prompt, dtype=torch.int64),
        sampling_params=SamplingParams(num_tokens_to_generate=num_generate, termination_id=-1),
        block_size_tokens=BLOCK_SIZE,
        enable_prefix_caching=True,
    )


def step(context: DynamicInferenceContext, arrivals: list[tuple[int, list[int], int]]) -> tuple:
    """Admit what fits (clock ticked per request), then run one update.

    Returns:
        What ``check_availability`` said per arrival, and the request IDs
        the update newly paused and evicted (Megatron's return value).
    """
    admitted = []
    for request_id, prompt, num_generate in arrivals:
        context.prefix_cache_lru_clock += 1  # no two admissions share an LRU timestamp
        candidate = request(request_id, prompt, num_generate)
        fits = context.check_availability(candidate)
        admitted.append(fits)
        if all(fits):
            context.add_request(candidate)
    if context.total_request_count:
        context.initialize_attention_state()
        start, end = context.paused_request_count, context.total_request_count
        done = context.request_kv_length_offsets + context.request_query_lengths
        still_running = (done[start:end] < context.request_output_lengths[start:end]).to(
            torch.uint8
        )
        update = context.update_requests(still_running, torch.ones(end - start, dtype=torch.int64))
        if update is not None:  # None: nothing left running, the context reset itself
            keys = ("newly_paused_request_ids", "evict_request_ids")
            return admitted, ids_of(update[keys[0]]), ids_of(update[keys[1]])
    return admitted, [], []


def ids_of(request_ids: torch.Tensor | None) -> list[int]:
    return [] if request_ids is None else sorted(request_ids.tolist())


def outcome(context: DynamicInferenceContext, arrivals: list) -> tuple[tuple | None, str]:
    """:func:`step`'s result, or the message of the assertion Megatron's context stopped at.

    Megatron asserts when every running request had to pause for a block
    (its engine prevents that by admitting less); the program ends there.
    """
    try:
        return step(context, arrivals), ""
    except AssertionError as exc:
        return None, str(exc)


def renamed(table: torch.Tensor) -> list[list[int]]:
    """Block IDs renamed in order of first appearance (-1 kept), row by row."""
    names: dict[int, int] = {}
    return [
        [names.setdefault(block_id, len(names)) if block_id >= 0 else -1 for block_id in row]
        for row in table.tolist()
    ]


def observe(context: DynamicInferenceContext, exact: bool) -> dict[str, Any]:
    """What a user of the context can see; block IDs renamed unless ``exact`` (compat mode)."""
    allocator = context.kv_block_allocator
    rows = slice(0, context.total_request_count)
    table = context.request_to_kv_block_ids[rows]
    held = table.clamp(min=0).long()
    return {
        "counts": (
            context.total_request_count,
            context.paused_request_count,
            context.active_token_count,
            context.prefix_cache_hits,
            context.prefix_cache_blocks_matched,
        ),
        "requests": context.request_ids[rows].tolist(),
        "block_counts": context.request_kv_block_counts[rows].tolist(),
        "offsets": context.request_kv_length_offsets[rows].tolist(),
        "table": table.tolist() if exact else renamed(table),
        "ref_counts": torch.where(table >= 0, allocator.block_ref_counts[held], -1).tolist(),
        "hashes": torch.where(table >= 0, allocator.block_hashes[held], 0).tolist(),
        "allocator": (
            allocator.total_avail,
            int(allocator.get_evictable_block_count()),
            allocator.get_active_used(),
            allocator.get_paused_used(),
            allocator.get_total_used(),
            str(allocator),
        ),
        "registered": (
            allocator.kv_hash_to_block_id if exact else sorted(allocator.kv_hash_to_block_id)
        ),
        "referenced": int((allocator.block_ref_counts > 0).sum()),
        "free_stack": allocator.block_bag[: allocator.total_avail].tolist() if exact else None,
    }


def run_both(
    policy: PrefixCachingEvictionPolicy,
    program: list,
    num_blocks: int,
    paused_blocks: int = 0,
    strict: bool = True,
) -> dict:
    """Run ``program`` on Megatron's allocator and on the drop-in, comparing every step.

    In compat mode (``strict=False``) the block IDs, the mapping of hashes to
    blocks and the free stack must be Megatron's own; in strict mode block
    IDs are compared renamed by first appearance.

    Returns:
        What the program exercised in Megatron's context: steps with a
        paused request, requests resumed, evicted (past the paused buffer)
        and finished, the most prefix blocks matched, and the drop-in.
    """
    theirs = build_context(policy, num_blocks, paused_blocks)
    ours = build_context(policy, num_blocks, paused_blocks)
    dropin = megatron.attach(ours, strict=strict)
    assert type(theirs.kv_block_allocator) is KVBlockAllocator
    seen = {"paused_steps": 0, "resumed": 0, "evicted": 0, "finished": 0}
    seen |= {"matched": 0, "dropin": dropin}
    paused_before: set[int] = set()
    request_id = admitted = 0
    for arrivals in program:
        numbered = []
        for prompt, num_generate in arrivals:
            numbered.append((request_id, prompt, num_generate))
            request_id += 1
        result = outcome(theirs, numbered)
        assert outcome(ours, numbered) == result
        if result[1]:
            break
        admitted += sum(all(fits) for fits in result[0][0])
        seen["evicted"] += len(result[0][2])
        assert observe(theirs, not strict) == observe(ours, not strict)
        dropin.check_consistency()
        paused = theirs.paused_request_count
        running = set(theirs.request_ids[paused : theirs.total_request_count].tolist())
        seen["paused_steps"] += paused > 0
        seen["matched"] = max(seen["matched"], theirs.prefix_cache_blocks_matched)
        seen["resumed"] += len(paused_before & running)
        paused_before = set(theirs.request_ids[:paused].tolist())
    seen["finished"] = admitted - seen["evicted"] - theirs.total_request_count
    return seen


DOCUMENTS = [[(7 * d + 3 * i) % 11 + 1 for i in range(20)] for d in range(4)]
"""Prompts are prefixes of these, so requests share chains and hits refresh old ones."""

prompts = st.builds(
    lambda document, length, tail: DOCUMENTS[document][:length] + tail,
    st.integers(0, 3),
    st.integers(1, 20),
    st.lists(st.integers(20, 22), max_size=3),
)
programs = st.lists(
    st.lists(st.tuples(prompts, st.integers(1, 10)), max_size=3), min_size=1, max_size=20
)


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "compat"])
@pytest.mark.parametrize("policy", list(PrefixCachingEvictionPolicy))
@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(program=programs, num_blocks=st.integers(8, 20), paused_blocks=st.integers(0, 4))
def test_the_drop_in_behaves_as_megatrons_allocator(
    cpu_megatron: None,
    policy: PrefixCachingEvictionPolicy,
    program: list,
    num_blocks: int,
    paused_blocks: int,
    strict: bool,
) -> None:
    seen = run_both(policy, program, num_blocks, paused_blocks, strict)
    for name in ("paused_steps", "resumed", "evicted", "finished"):
        if seen[name]:
            event(name)
    target(seen["dropin"].stats().num_evicted_blocks, label="evicted blocks")
    target(seen["resumed"], label="resumed requests")  # steer towards pause and resume


PAUSING = [
    [(DOCUMENTS[0][:8], 10), ([*DOCUMENTS[0][:8], 20], 10), (DOCUMENTS[1][:8], 10)],
    [],
    [(DOCUMENTS[0][:12], 3)],
    *[[] for _ in range(12)],
    [(DOCUMENTS[0][:8], 2)],
]
"""Requests that outgrow a small pool: some pause, resume, are evicted past the paused
buffer or finish, and later ones hit the cache."""


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "compat"])
@pytest.mark.parametrize("policy", list(PrefixCachingEvictionPolicy))
def test_requests_pause_resume_are_evicted_and_finish_alike(
    cpu_megatron: None, policy: PrefixCachingEvictionPolicy, strict: bool
) -> None:
    seen = run_both(policy, PAUSING, num_blocks=14, paused_blocks=4, strict=strict)
    assert seen["paused_steps"] > 0
    assert seen["resumed"] > 0
    assert seen["evicted"] > 0
    assert seen["finished"] > 0
    assert seen["matched"] > 0


def test_install_makes_new_contexts_build_the_drop_in(cpu_megatron: None) -> None:
    with megatron.installed(cached_policy="s3fifo"):
        context = build_context(PrefixCachingEvictionPolicy.LRU, 16)
        allocator = context.kv_block_allocator
        assert isinstance(allocator, megatron.MegatronKVBlockAllocator)
        assert type(allocator.allocator.policy).__name__ == "S3FIFOPolicy"
        step(context, [(0, [1, 2, 3, 1, 2, 3, 1, 2, 3], 2), (1, [1, 2, 3, 1, 2], 1)])
        assert context.prefix_cache_hits == 1
        allocator.check_consistency()
    assert type(build_context(PrefixCachingEvictionPolicy.LRU, 16).kv_block_allocator) is (
        KVBlockAllocator
    )


def test_a_prefixcache_policy_value_passes_megatrons_config(cpu_megatron: None) -> None:
    with megatron.installed():
        context = build_context(megatron.PrefixCachePolicy("slru"), 16)  # type: ignore[arg-type]
        assert type(context.kv_block_allocator.allocator.policy).__name__ == "SLRUPolicy"
        step(context, [(0, [2] * 9, 1), (1, [2] * 9, 1)])
        assert context.prefix_cache_hits == 1


def test_the_installed_version_is_supported() -> None:
    assert megatron.check_version().startswith(megatron.SUPPORTED_VERSIONS)
