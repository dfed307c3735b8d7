"""Drives eviction policies with seeded, realistic scripts of calls (the contract's engine).

:class:`_Driver` plays one script on any number of policies at once, as an
engine would call them (inserts of new and returning leaves, hits, touches,
evictions, registrations, retention), so :class:`~prefixcache.testing.PolicyContract`
can compare policies and check a policy against a copy of itself.
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass, field
from typing import Any

from prefixcache.policies import EvictionPolicy


def eviction_order(policy: EvictionPolicy) -> list[int]:
    """Every tracked leaf, next victim first, read from a copy (the policy is unchanged)."""
    return copy.deepcopy(policy).evict(len(policy))


Args = tuple[int, int, int, int]
"""A leaf's insert arguments after its ID: hash, last access, hand-outs, depth."""


@dataclass
class _Cache:
    """The blocks as an engine would see them, to drive a policy with realistic calls.

    A clock ticks on every hand-out and touch; a discarded leaf (a hit) comes
    back later with one more hand-out and a later access; an evicted block's
    hash may be registered again on another block (a returning prefix).
    """

    rng: random.Random
    num_blocks: int
    clock: int = 0
    tracked: dict[int, Args] = field(default_factory=dict)
    out: dict[int, Args] = field(default_factory=dict)  # discarded: may be inserted again
    free: list[int] = field(default_factory=list)
    gone_hashes: list[int] = field(default_factory=list)
    next_hash: int = 1_000

    def __post_init__(self) -> None:
        self.free = list(range(self.num_blocks))

    def new_leaf(self) -> tuple[int, Args] | None:
        """A free block with a new hash or a returning one, and its first arguments."""
        if not self.free:
            return None
        block_id = self.free.pop(self.rng.randrange(len(self.free)))
        if self.gone_hashes and self.rng.random() < 0.4:
            block_hash = self.gone_hashes.pop(self.rng.randrange(len(self.gone_hashes)))
        else:
            self.next_hash += 1
            block_hash = self.next_hash
        self.clock += 1
        args = (block_hash, self.clock, self.rng.choice((1, 1, 1, 2, 3)), self.rng.randint(0, 9))
        return block_id, args

    def returning_leaf(self) -> tuple[int, Args] | None:
        """A discarded block that comes back (released after its hit)."""
        if not self.out:
            return None
        block_id = self.rng.choice(sorted(self.out))
        block_hash, _, num_accesses, depth = self.out.pop(block_id)
        self.clock += 1
        return block_id, (block_hash, self.clock, num_accesses + 1, depth)


def _call_each(policies: list[EvictionPolicy], method: str, *args: Any) -> list[Any]:
    """What ``method(*args)`` returns on each policy, in order."""
    return [getattr(policy, method)(*args) for policy in policies]


class _Driver:
    """Plays one seeded script of calls on any number of policies at once.

    Every policy gets the same calls; :meth:`step` returns what each call
    returned, so twins that must behave alike can be compared call by call.
    The script follows the first policy's victims.
    """

    def __init__(self, seed: int, num_blocks: int, hooks: dict[str, bool]) -> None:
        self.cache = _Cache(random.Random(seed), num_blocks)
        self.hooks = hooks

    def step(self, policies: list[EvictionPolicy]) -> list[Any]:
        """Make one call (an insert, discard, touch, evict, or a hook) on every policy."""
        cache, rng = self.cache, self.cache.rng
        kind = rng.choice(
            ("insert", "insert", "insert", "return", "discard", "touch", "evict", "evict", "hook")
        )
        if kind == "return" and cache.out:
            block_id, args = cache.returning_leaf()  # type: ignore[misc]
            cache.tracked[block_id] = args
            return _call_each(policies, "insert", block_id, *args)
        if kind == "discard" and cache.tracked:
            block_id = rng.choice(sorted(cache.tracked))
            cache.out[block_id] = cache.tracked.pop(block_id)
            return _call_each(policies, "discard", block_id)
        if kind == "touch" and cache.tracked:
            chosen = rng.sample(sorted(cache.tracked), min(len(cache.tracked), 2))
            cache.clock += 1
            for block_id in chosen:
                block_hash, _, num_accesses, depth = cache.tracked[block_id]
                cache.tracked[block_id] = (block_hash, cache.clock, num_accesses, depth)
            return [[p.touch(b, cache.clock) for b in chosen] for p in policies]
        if kind == "evict":
            return self.evict(policies, rng.randint(0, 3))
        if kind == "hook":
            return self._hook(policies)
        leaf = cache.new_leaf()
        if leaf is None:  # no free block: make room
            return self.evict(policies, 1)
        block_id, args = leaf
        cache.tracked[block_id] = args
        return _call_each(policies, "insert", block_id, *args)

    def evict(self, policies: list[EvictionPolicy], num_blocks: int) -> list[Any]:
        """``evict(num_blocks)`` on every policy; the first one's victims become free."""
        results = [p.evict(num_blocks) for p in policies]
        self.evicted(results[0])
        return results

    def evicted(self, victims: list[int]) -> None:
        """The ``victims`` left the cache: their blocks are free, their hashes may return."""
        for block_id in victims:
            args = self.cache.tracked.pop(block_id, None)
            assert args is not None, f"evict returned {block_id}, which is not a tracked leaf"
            self.cache.gone_hashes.append(args[0])
            self.cache.free.append(block_id)

    def _hook(self, policies: list[EvictionPolicy]) -> list[Any]:
        cache, rng = self.cache, self.cache.rng
        if self.hooks["set_retention"] and rng.random() < 0.5:
            block_hash = rng.randint(1_000, cache.next_hash + 3)
            expires_at = rng.choice((None, cache.clock + rng.randint(0, 5)))
            priority = rng.randint(0, 70)
            return _call_each(policies, "set_retention", block_hash, priority, expires_at)
        hashes = sorted(set(rng.sample(cache.gone_hashes, min(2, len(cache.gone_hashes)))))
        first_depth = rng.randint(0, 3)
        return _call_each(policies, "on_register", [*hashes, cache.next_hash + 50], first_depth)
