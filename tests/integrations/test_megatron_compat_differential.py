"""Compat mode against Megatron-core 0.19.2's own ``KVBlockAllocator``, step by step.

The same random programs drive Megatron's class and
:class:`~prefixcache.integrations.megatron.MegatronCompatAllocator`:
allocate, release (shared blocks released together), register (on held
blocks and, in LRU mode, on free ones), update_timestamps with the clock
moving, evict, reset, the pin writes ``block_ref_counts[ids] += 1`` / ``-= 1``
that the context makes, and writes to ``total_avail``. After every step the
return values, the block IDs themselves (no renaming), the whole free stack,
``total_avail``, every mirror tensor, ``kv_hash_to_block_id`` and the
``on_blocks_deregistered`` calls must be equal. The programs stay within what
compat mode reproduces (DESIGN.md, "Megatron-core drop-in": no misuse that
corrupts Megatron's stack, no eviction while a block registered on the free
stack is still there, no hash registered twice).
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

pytest.importorskip(
    "megatron.core.inference.contexts.kv_block_allocator", reason="megatron-core is not installed"
)

from megatron.core.inference.config import PrefixCachingEvictionPolicy
from megatron.core.inference.contexts.kv_block_allocator import KVBlockAllocator

from prefixcache.integrations.megatron import MegatronCompatAllocator

MIRRORS = (
    "block_bag",
    "block_ref_counts",
    "block_hashes",
    "block_timestamps",
    "block_parent_id",
    "block_child_count",
)
MODES = [
    (False, PrefixCachingEvictionPolicy.REF_ZERO),
    (True, PrefixCachingEvictionPolicy.REF_ZERO),
    (True, PrefixCachingEvictionPolicy.LRU),
]


class Context:
    """What the allocator reads from its context in these programs."""

    def __init__(self) -> None:
        self.prefix_cache_lru_clock = 0
        self.block_size_tokens = 4


class Twin:
    """Megatron's allocator and the drop-in, called alike and compared after every call."""

    def __init__(self, total: int, caching: bool, policy: Any) -> None:
        self.ref_context, self.our_context = Context(), Context()
        self.ref = KVBlockAllocator(self.ref_context, total, 2, caching, policy)
        self.ours = MegatronCompatAllocator(self.our_context, total, 2, caching, policy)
        self.ref_calls: list[Any] = []
        self.our_calls: list[Any] = []
        self.ref.on_blocks_deregistered = lambda ids, keys: self.ref_calls.append((ids, keys))
        self.ours.on_blocks_deregistered = lambda ids, keys: self.our_calls.append((ids, keys))
        self.caching, self.lru = caching, policy == PrefixCachingEvictionPolicy.LRU

    def call(self, name: str, *args: Any) -> Any:
        expected = getattr(self.ref, name)(*args)
        got = getattr(self.ours, name)(*args)
        if isinstance(expected, torch.Tensor):
            assert isinstance(got, torch.Tensor) and got.dtype == expected.dtype, name
            assert got.tolist() == expected.tolist(), (name, args)
            return expected.clone()
        assert got == expected, (name, args, got, expected)
        return expected

    def write_refs(self, ids: torch.Tensor, delta: int) -> None:
        self.ref.block_ref_counts[ids] += delta
        self.ours.block_ref_counts[ids] += delta

    def set_total_avail(self, value: int) -> None:
        self.ref.total_avail = value
        self.ours.total_avail = value

    def tick(self) -> None:
        self.ref_context.prefix_cache_lru_clock += 1
        self.our_context.prefix_cache_lru_clock += 1

    def compare(self) -> None:
        ref, ours = self.ref, self.ours
        assert ours.total_avail == ref.total_avail
        assert ours.get_total_used() == ref.get_total_used()
        for name in MIRRORS:
            assert hasattr(ours, name) == hasattr(ref, name), name
            if hasattr(ref, name):
                assert getattr(ours, name).tolist() == getattr(ref, name).tolist(), name
        if self.caching:
            assert ours.kv_hash_to_block_id == ref.kv_hash_to_block_id
            assert int(ours.get_evictable_block_count()) == int(ref.get_evictable_block_count())
        assert self.our_calls == self.ref_calls
        ours.check_consistency()


def _free_registered_on_stack(ref: KVBlockAllocator) -> bool:
    """Whether a block registered while free is still on Megatron's stack."""
    if not ref.enable_prefix_caching:
        return False
    on_stack = ref.block_bag[: ref.total_avail].long()
    return bool((ref.block_hashes[on_stack] != -1).any())


def register(twin: Twin, rng: random.Random, requests: list[list[int]], next_hash: int) -> int:
    """Register fresh hashes on a request's unregistered blocks, chained as the context does.

    The first block's parent is 0 or a registered block of the same request
    (a request holds its whole prefix). In LRU mode, sometimes free blocks
    instead, one at a time, as a root. Returns the next unused hash.
    """
    ref = twin.ref
    if twin.lru and rng.random() < 0.1:  # one root: a chain could be split by a pop
        free = [int(b) for b in ref.block_bag[: ref.total_avail] if ref.block_hashes[b] == -1]
        pool = free[-1:] if rng.random() < 0.5 else free[:1]
        parents = [0]
    elif requests:
        request = rng.choice(requests)
        pool = [b for b in request if ref.block_hashes[b] == -1]
        parents = [0] + [int(ref.block_hashes[b]) for b in request if ref.block_hashes[b] != -1]
    else:
        return next_hash
    if not pool:
        return next_hash
    ids = rng.sample(sorted(set(pool)), rng.randint(1, min(3, len(set(pool)))))
    hashes = list(range(next_hash, next_hash + len(ids)))
    twin.call("register_kv_block_hashes", ids, hashes, [rng.choice(parents), *hashes[:-1]])
    return next_hash + len(ids)


def matched_chain(twin: Twin, rng: random.Random) -> torch.Tensor | None:
    """A registered block and its registered ancestors, as ``add_request`` pins a match.

    Not a block still on the free stack (registered while free: Megatron
    would hand it out with two references). In ref-zero mode only held
    blocks are registered, and any of them is a match.
    """
    ref = twin.ref
    on_stack = set(ref.block_bag[: ref.total_avail].tolist())
    ready = [b for b in ref.kv_hash_to_block_id.values() if b not in on_stack]
    if not twin.lru:
        ready = [b for b in ready if ref.block_ref_counts[b] > 0]
    if not ready:
        return None
    chain = [rng.choice(ready)]
    while twin.lru and int(ref.block_parent_id[chain[-1]]) >= 0:
        chain.append(int(ref.block_parent_id[chain[-1]]))
    if any(b in on_stack for b in chain):
        return None
    return torch.tensor(chain[::-1], dtype=torch.int64)


def run_program(seed: int, caching: bool, policy: Any, steps: int = 120) -> None:
    """One random program; every decision is taken from Megatron's state."""
    rng = random.Random(seed)
    twin = Twin(rng.choice([6, 9, 14]), caching, policy)
    ref = twin.ref
    requests: list[list[int]] = []  # each request's references, in order
    pins: list[torch.Tensor] = []  # pins that may still be rolled back
    next_hash = 1000
    for _ in range(steps):
        op = rng.choice(
            ["alloc", "alloc", "release", "release", "register", "register", "touch", "evict"]
            + ["pin", "unpin", "avail", "check"]
            + (["reset"] if rng.random() < 0.1 else [])
        )
        risky = _free_registered_on_stack(ref)  # an eviction would push it twice
        if op == "alloc":
            limit = ref.total_avail if risky else ref.total_avail + 3
            ids = twin.call("allocate_memory_blocks", rng.randint(0, max(0, min(limit, 4))))
            if ids is not None:
                requests.append(ids.tolist())
        elif op == "release" and requests:
            chosen = rng.sample(range(len(requests)), min(len(requests), rng.randint(1, 2)))
            blocks = [b for i in chosen for b in requests[i]]
            requests = [r for i, r in enumerate(requests) if i not in chosen]
            pins = []  # a rollback after the release would be misuse
            twin.call("release_memory_blocks", torch.tensor(blocks, dtype=torch.int32))
        elif op == "register" and caching:
            next_hash = register(twin, rng, requests, next_hash)
        elif op == "touch" and twin.lru:
            twin.tick()
            ids = rng.sample(range(ref.total_count), rng.randint(1, 3))
            twin.call("update_timestamps", torch.tensor(ids, dtype=torch.int64))
        elif op == "evict" and caching and not risky:
            twin.call("evict_lru_blocks", rng.randint(0, 3))
        elif op == "pin" and caching:
            ids = matched_chain(twin, rng)
            if ids is not None:
                twin.write_refs(ids, 1)
                requests.append(ids.tolist())
                pins.append(ids)
        elif op == "unpin" and pins:
            ids = pins.pop()
            requests.remove(ids.tolist())
            twin.write_refs(ids, -1)
        elif op == "avail" and ref.total_avail:
            lowered = rng.randint(0, ref.total_avail)
            old = ref.total_avail
            twin.set_total_avail(lowered)
            twin.compare()
            twin.call("allocate_memory_blocks", 0)
            twin.set_total_avail(old)  # nothing pushed since: the same IDs come back
        elif op == "reset":
            twin.call("reset")
            requests, pins = [], []
        elif op == "check":
            twin.call("is_memory_available", rng.randint(0, 12), rng.randint(0, 2))
        twin.compare()


@pytest.mark.parametrize(("caching", "policy"), MODES, ids=["plain", "ref_zero", "lru"])
@pytest.mark.parametrize("seed", range(25))
def test_compat_mode_matches_megatrons_allocator(seed: int, caching: bool, policy: Any) -> None:
    run_program(seed, caching, policy)
