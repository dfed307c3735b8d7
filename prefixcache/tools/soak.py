"""Soak: millions of mixed random allocator operations per policy, with invariants checked.

Drives one :class:`~prefixcache.KVBlockAllocator` per shipped policy (every
name of ``policies.available()`` except the offline ``belady``) through a
seeded random mix of public calls, the way a scheduler would:

- serve a prompt: ``match_prefix(acquire=True)``, ``allocate_memory_blocks``
  for the rest, ``register_kv_block_hashes`` (prompts share prefixes often);
- grow a running request by fresh blocks (decode);
- release whole requests, several at once so shared prefix blocks appear
  twice in one batch, plainly or in a ``free_group``;
- pause, resume, release paused requests (budget refusals included);
- query without acquiring, touch (``update_timestamps``), evict, and rarely reset.

Every ``check_every`` operations it calls ``check_invariants()`` and compares
every block's reference counts with the references the driver holds. At the
end it releases every reference, evicts every cached block, and checks that
the pool holds exactly its usable blocks. Any failure raises.

The command line is ``python benchmarks/soak.py`` (10^7 operations per
policy; ``--ops``, ``--policies``, ``--seed``, ``--check-every``);
``tests/properties/test_soak.py`` runs :func:`run_soak` with 10^5 operations
in CI.
"""

from __future__ import annotations

import argparse
import platform
import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from prefixcache.engine.allocator import KVBlockAllocator
from prefixcache.engine.hashing import compute_block_hashes
from prefixcache.errors import BudgetExceededError
from prefixcache.tools.replay import online_policies

DEFAULT_OPS = 10_000_000
CHECK_EVERY = 10_000
TOTAL_COUNT = 65
PAUSED_COUNT = 12
BLOCK_SIZE = 4
NUM_PROMPTS = 64
RESET_PROBABILITY = 1e-5

OPERATIONS = (
    ("serve", 26),
    ("grow", 10),
    ("release", 16),
    ("free_group", 6),
    ("pause", 7),
    ("resume", 7),
    ("release_paused", 4),
    ("query", 8),
    ("touch", 8),
    ("evict", 8),
)
"""Operation kinds and their relative weights; ``reset`` comes on top, rarely."""


@dataclass
class SoakResult:
    """What one policy's soak did."""

    policy: str
    num_ops: int
    seconds: float
    num_checks: int
    calls: Counter[str] = field(default_factory=Counter)
    num_hit_blocks: int = 0
    num_refused: int = 0  # allocations that found no room, budget refusals

    @property
    def ops_per_second(self) -> float:
        return self.num_ops / self.seconds if self.seconds else float("inf")


def make_prompts(rng: random.Random, num_prompts: int, block_size: int) -> list[list[int]]:
    """Chained hashes of prompts built from a few shared stems, so prefixes repeat."""
    stems = [[rng.randrange(1000) for _ in range(block_size * 3)] for _ in range(4)]
    prompts = []
    for _ in range(num_prompts):
        tokens = list(rng.choice(stems))[: block_size * rng.randint(0, 3)]
        tokens += [rng.randrange(1000) for _ in range(block_size * rng.randint(1, 5))]
        prompts.append(compute_block_hashes(tokens, block_size))
    return prompts


class SoakDriver:
    """One allocator, the requests that hold its blocks, and the operations on them.

    A request is the list of block IDs it holds, one reference each; the
    driver's requests are the model the allocator's counts are checked against.
    """

    def __init__(self, policy: str, seed: int) -> None:
        self.rng = random.Random(seed)
        self.allocator = KVBlockAllocator(
            total_count=TOTAL_COUNT,
            paused_count=PAUSED_COUNT,
            block_size_tokens=BLOCK_SIZE,
            eviction_policy=policy,
            device="cpu",
        )
        self.prompts = make_prompts(self.rng, NUM_PROMPTS, BLOCK_SIZE)
        self.active: list[list[int]] = []
        self.paused: list[list[int]] = []
        self.calls: Counter[str] = Counter()
        self.num_hit_blocks = 0
        self.num_refused = 0

    # ------------------------------------------------------------------ helpers

    def _take(self, requests: list[list[int]], most: int) -> list[list[int]]:
        """Remove and return up to ``most`` random requests (swap-remove, O(1) each)."""
        taken = []
        for _ in range(min(most, len(requests))):
            index = self.rng.randrange(len(requests))
            requests[index], requests[-1] = requests[-1], requests[index]
            taken.append(requests.pop())
        return taken

    def _call(self, name: str) -> None:
        self.calls[name] += 1

    # ------------------------------------------------------------------ operations

    def serve(self) -> None:
        allocator = self.allocator
        hashes = self.rng.choice(self.prompts)
        matched = allocator.match_prefix(hashes, acquire=True).tolist()
        self._call("match_prefix")
        self.num_hit_blocks += len(matched)
        fresh = allocator.allocate_memory_blocks(len(hashes) - len(matched))
        self._call("allocate_memory_blocks")
        if fresh is None:
            self.num_refused += 1
            if matched:
                allocator.release_memory_blocks(matched)
                self._call("release_memory_blocks")
            return
        if len(fresh):
            parent = hashes[len(matched) - 1] if matched else None
            allocator.register_kv_block_hashes(fresh, hashes[len(matched) :], parent_hash=parent)
            self._call("register_kv_block_hashes")
        self.active.append(matched + fresh.tolist())

    def grow(self) -> None:
        if not self.active:
            return
        fresh = self.allocator.allocate_memory_blocks(self.rng.randint(1, 2))
        self._call("allocate_memory_blocks")
        if fresh is None:
            self.num_refused += 1
            return
        self.rng.choice(self.active).extend(fresh.tolist())

    def release(self) -> None:
        requests = self._take(self.active, self.rng.randint(1, 3))
        ids = [block_id for request in requests for block_id in request]
        self.allocator.release_memory_blocks(ids)  # shared prefixes appear more than once
        self._call("release_memory_blocks")

    def free_group(self) -> None:
        requests = self._take(self.active, self.rng.randint(2, 4))
        with self.allocator.free_group():
            for request in requests:
                self.allocator.release_memory_blocks(request)
                self._call("release_memory_blocks")
        self._call("free_group")

    def pause(self) -> None:
        self._move(self.active, self.paused, self.allocator.pause, "pause")

    def resume(self) -> None:
        self._move(self.paused, self.active, self.allocator.resume, "resume")

    def _move(
        self,
        source: list[list[int]],
        target: list[list[int]],
        move: Callable[[list[int]], None],
        name: str,
    ) -> None:
        if not source:
            return
        request = self._take(source, 1)[0]
        try:
            move(request)
        except BudgetExceededError:
            self.num_refused += 1
            source.append(request)  # a refused move changed nothing
        else:
            target.append(request)
        self._call(name)

    def release_paused(self) -> None:
        requests = self._take(self.paused, self.rng.randint(1, 2))
        ids = [block_id for request in requests for block_id in request]
        self.allocator.release_memory_blocks(ids, paused=True)
        self._call("release_memory_blocks")

    def query(self) -> None:
        self.allocator.match_prefix(self.rng.choice(self.prompts))
        self._call("match_prefix")

    def touch(self) -> None:
        if self.active:
            self.allocator.update_timestamps(self.rng.choice(self.active))
            self._call("update_timestamps")

    def evict(self) -> None:
        self.allocator.evict_cached_blocks(self.rng.randint(1, 4))
        self._call("evict_cached_blocks")

    def reset(self) -> None:
        self.allocator.reset()
        self.active.clear()
        self.paused.clear()
        self._call("reset")

    # ------------------------------------------------------------------ checks

    def check(self) -> None:
        """Invariants, and every reference count equal to what the requests hold."""
        allocator = self.allocator
        allocator.check_invariants()
        ids = list(range(allocator.num_usable))
        active, paused = allocator.reference_counts(ids)
        held_active = Counter(b for request in self.active for b in request)
        held_paused = Counter(b for request in self.paused for b in request)
        expected_active = np.array([held_active[b] for b in ids], dtype=np.int32)
        expected_paused = np.array([held_paused[b] for b in ids], dtype=np.int32)
        if not np.array_equal(active.numpy(), expected_active):
            bad = int(np.flatnonzero(active.numpy() != expected_active)[0])
            raise AssertionError(
                f"block {bad}: {int(active[bad])} active refs, held {held_active[bad]}"
            )
        if not np.array_equal(paused.numpy(), expected_paused):
            bad = int(np.flatnonzero(paused.numpy() != expected_paused)[0])
            raise AssertionError(
                f"block {bad}: {int(paused[bad])} paused refs, held {held_paused[bad]}"
            )

    def drain(self) -> None:
        """Release every reference, evict every cached block; the pool must be whole again."""
        allocator = self.allocator
        for request in self.active:
            allocator.release_memory_blocks(request)
        for request in self.paused:
            allocator.release_memory_blocks(request, paused=True)
        self.active.clear()
        self.paused.clear()
        allocator.evict_cached_blocks(allocator.get_evictable_block_count())
        self.check()
        stats = allocator.stats()
        if (stats.num_active, stats.num_paused, stats.num_cached) != (0, 0, 0):
            raise AssertionError(f"blocks still held after draining: {stats}")
        # The pool is whole: every usable ID can be handed out again, each once.
        # Through the public API, so the check holds for every engine.
        every = allocator.allocate_memory_blocks(allocator.num_usable)
        if every is None or sorted(every.tolist()) != list(range(allocator.num_usable)):
            held = None if every is None else len(every)
            raise AssertionError(f"pool hands out {held} blocks, not the {allocator.num_usable}")
        allocator.release_memory_blocks(every)


def run_soak(
    policy: str, num_ops: int, seed: int = 0, *, check_every: int = CHECK_EVERY
) -> SoakResult:
    """Run ``num_ops`` random operations (public calls) on a fresh allocator with ``policy``.

    Raises:
        AssertionError, prefixcache.InvariantError: the allocator went wrong.
    """
    driver = SoakDriver(policy, seed)
    names = [name for name, _ in OPERATIONS]
    weights = [weight for _, weight in OPERATIONS]
    operations = {name: getattr(driver, name) for name in names}
    rng = driver.rng
    num_checks = 0
    next_check = check_every
    start = time.perf_counter()
    while True:
        done = sum(driver.calls.values())
        if done >= num_ops:
            break
        for name in rng.choices(names, weights, k=256):
            operations[name]()
        if rng.random() < RESET_PROBABILITY * 256:
            driver.reset()
        if sum(driver.calls.values()) >= next_check:
            driver.check()
            num_checks += 1
            next_check += check_every
    driver.drain()
    num_checks += 1
    seconds = time.perf_counter() - start
    return SoakResult(
        policy=policy,
        num_ops=sum(driver.calls.values()),
        seconds=seconds,
        num_checks=num_checks,
        calls=driver.calls,
        num_hit_blocks=driver.num_hit_blocks,
        num_refused=driver.num_refused,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry point; prints one line per policy and the totals."""
    parser = argparse.ArgumentParser(
        prog="python benchmarks/soak.py",
        description=(__doc__ or "").split("\n")[0],
    )
    parser.add_argument("--ops", type=int, default=DEFAULT_OPS, help="operations per policy")
    parser.add_argument("--policies", nargs="+", default=None, help="default: all online ones")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check-every", type=int, default=CHECK_EVERY)
    args = parser.parse_args(argv)
    names = args.policies or online_policies()
    print(
        f"machine: {platform.machine()} {platform.processor() or ''}; "
        f"Python {platform.python_version()}; torch {torch.__version__}; numpy {np.__version__}"
    )
    print(f"soak: {args.ops:,} ops per policy, seed {args.seed}, check every {args.check_every:,}")
    total_ops, total_seconds = 0, 0.0
    for name in names:
        result = run_soak(name, args.ops, args.seed, check_every=args.check_every)
        total_ops += result.num_ops
        total_seconds += result.seconds
        print(
            f"{name:>10}: {result.num_ops:,} ops in {result.seconds:.1f} s "
            f"({result.ops_per_second:,.0f} ops/s), {result.num_checks:,} checks, "
            f"{result.num_hit_blocks:,} hit blocks, {result.num_refused:,} refusals, "
            f"{result.calls['reset']} resets: OK"
        )
    rate = total_ops / total_seconds
    print(f"total: {total_ops:,} ops in {total_seconds:.1f} s ({rate:,.0f} ops/s)")
    return 0
