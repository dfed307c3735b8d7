"""A hypothesis state machine of random requests on a vLLM ``BlockPool`` with the plugin.

One machine for both of the plugin's test files: ``tests/integrations/test_vllm_plugin.py``
runs it on a fake vLLM module (the unit stage, no vLLM installed) and
``test_vllm_integration.py`` on vLLM's real ``BlockPool``. A subclass says how to build
the pool (:meth:`VllmPoolMachine.make_pool`) and what of the host's own index to check
(:meth:`VllmPoolMachine.check_host`); the rules (admit, release in either order, a
connector evicting a block by ID, vLLM's prefix-cache reset) and the checks every pool
shares (the queue's invariants, vLLM's free count and free set, reference counts, the
leaf-only law) are here. Needs ``hypothesis`` (the ``test`` extra).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from prefixcache.integrations import vllm as plugin
from prefixcache.testing.vllm_pool import admit, chain

__all__ = ["MACHINE_POLICIES", "VllmPoolMachine", "check_pool"]

MACHINE_POLICIES = [
    "lru",
    "fifo",
    "lfu",
    "slru",
    "s3fifo",
    "arc",
    "protected_lru",
    "reuse_lru",
    "hazard",
]
"""The policies the machine installs (``auto`` learns too slowly to matter in 40 steps;
``priority`` without retention hints orders as ``lru``)."""


def check_pool(pool: Any, held: Iterable[Any]) -> None:
    """What every pool with the plugin keeps: the queue's invariants, vLLM's free count and
    free set the queue's, and each block's ``ref_cnt`` the number of times ``held`` (the
    running requests' blocks) names it. Raises AssertionError or InvariantError."""
    queue = pool.free_block_queue
    queue.check_invariants()
    free = [b for b in pool.blocks if b.ref_cnt == 0 and not b.is_null]
    assert queue.num_free_blocks == len(free) == pool.get_num_free_blocks()
    assert {id(b) for b in queue.get_all_free_blocks()} == {id(b) for b in free}
    holds = Counter(id(block) for block in held if not block.is_null)
    for block in pool.blocks:
        if not block.is_null:
            assert block.ref_cnt == holds[id(block)], block


class VllmPoolMachine(RuleBasedStateMachine):
    """Random requests on a vLLM pool with the plugin; bookkeeping checked after each step."""

    pool: Any
    running: list[list[Any]]

    def make_pool(self, num_blocks: int) -> Any:
        """A fresh ``BlockPool`` of ``num_blocks`` blocks, prefix caching on."""
        raise NotImplementedError

    def check_host(self) -> None:
        """The host pool's own index: every cached block findable by its hash."""
        raise NotImplementedError

    @initialize(policy=st.sampled_from(MACHINE_POLICIES), num_blocks=st.integers(4, 13))
    def start(self, policy: str, num_blocks: int) -> None:
        plugin.install(policy)
        self.pool = self.make_pool(num_blocks)
        self.running = []

    @rule(prompt=st.lists(st.integers(0, 3), min_size=1, max_size=5))
    def admit(self, prompt: list[int]) -> None:
        hashes = chain(*prompt)
        if len(hashes) > self.pool.get_num_free_blocks():
            return
        queue = self.pool.free_block_queue
        children = {parent: set(kids) for parent, kids in queue._children.items()}
        blocks, num_hit = admit(self.pool, hashes)
        taken: set[int] = set()
        for block in blocks[num_hit:]:  # leaf-only: a block goes after its cached children
            assert children.get(block.block_id, set()) <= taken, (block, children)
            taken.add(block.block_id)
        self.running.append(blocks)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), reverse=st.booleans())
    def release(self, data: st.DataObject, reverse: bool) -> None:
        blocks = self.running.pop(data.draw(st.integers(0, len(self.running) - 1)))
        self.pool.free_blocks(reversed(blocks) if reverse else blocks)

    @rule(block_id=st.integers(1, 13))
    def connector_evicts(self, block_id: int) -> None:
        if block_id < len(self.pool.blocks):
            self.pool.evict_blocks({block_id})

    @precondition(lambda self: not self.running)
    @rule()
    def reset_prefix_cache(self) -> None:
        assert self.pool.reset_prefix_cache()

    @invariant()
    def bookkeeping_holds(self) -> None:
        pool = getattr(self, "pool", None)
        if pool is None:
            return
        check_pool(pool, [block for blocks in self.running for block in blocks])
        self.check_host()

    def teardown(self) -> None:
        plugin.uninstall()
