"""A third-party eviction policy: the deepest cached leaf goes first.

Run: python examples/custom_policy.py

Short prefixes shared by many requests (system prompts) sit at small depths;
the tails of finished conversations sit deep. Evicting the deepest leaf first
eats every conversation's tail before any shared prefix, where LRU eats the
oldest conversation whole. The policy subclasses ``EvictionPolicy``: seven
methods, and one ``record_undo`` per change so that a failed engine call can
abort the policy's transaction (DESIGN.md, "The transaction rule").
``tests/policies/test_custom_policy_example.py`` checks it with
``prefixcache.testing.PolicyContract``.
"""

from __future__ import annotations

from prefixcache.policies import EvictionPolicy
from sortedcontainers import SortedList

from prefixcache import KVBlockAllocator, policies

Key = tuple[int, int, int]  # (-depth, last access, block ID): the smallest goes first


@policies.register("deepest_first")
class DeepestFirstPolicy(EvictionPolicy):
    """Evicts the deepest cached leaf, the least recently used among equals."""

    def __init__(self) -> None:
        self._order: SortedList = SortedList()
        self._key_of: dict[int, Key] = {}

    def _add(self, key: Key) -> None:
        self._key_of[key[2]] = key
        self._order.add(key)

    def _remove(self, block_id: int) -> Key:
        key = self._key_of.pop(block_id)  # KeyError for an untracked block
        self._order.remove(key)
        return key

    def insert(
        self, block_id: int, block_hash: int, last_access: int, num_accesses: int, depth: int
    ) -> None:
        self._add((-depth, last_access, block_id))
        self.record_undo(self._remove, block_id)  # what abort() calls to take it back

    def discard(self, block_id: int) -> None:
        self.record_undo(self._add, self._remove(block_id))

    def touch(self, block_id: int, now: int) -> None:
        old = self._remove(block_id)
        self._add((old[0], now, block_id))
        self.record_undo(self._replace, old)

    def _replace(self, old: Key) -> None:
        self._remove(old[2])
        self._add(old)

    def evict(self, num_blocks: int) -> list[int]:
        victims: list[int] = []
        while self._order and len(victims) < num_blocks:
            key = self._order.pop(0)
            del self._key_of[key[2]]
            self.record_undo(self._add, key)
            victims.append(key[2])
        return victims

    def clear(self) -> None:
        self._order.clear()
        self._key_of.clear()

    def __len__(self) -> int:
        return len(self._key_of)

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._key_of


def surviving_conversations(policy: str) -> list[str]:
    """Two conversations share a system prompt and end; a new request needs two blocks."""
    allocator = KVBlockAllocator(
        total_count=9, block_size_tokens=4, device="cpu", eviction_policy=policy
    )
    system_prompt = list(range(100, 108))  # 2 blocks, shared
    hashes = {}
    for name, first_token in (("A", 1), ("B", 50)):
        tokens = [*system_prompt, *range(first_token, first_token + 8)]  # 2 blocks of its own
        hashes[name] = allocator.hash_tokens(tokens)
        hit = allocator.match_prefix(hashes[name], acquire=True)
        fresh = allocator.allocate_memory_blocks(len(hashes[name]) - len(hit))
        assert fresh is not None
        parent = hashes[name][len(hit) - 1] if len(hit) else None
        allocator.register_kv_block_hashes(fresh, hashes[name][len(hit) :], parent_hash=parent)
        allocator.release_memory_blocks([*hit.tolist(), *fresh.tolist()])
    assert allocator.allocate_memory_blocks(4) is not None  # 2 free, 2 evicted
    allocator.check_invariants()
    return [
        f"{name}: {len(allocator.match_prefix(chain))}/{len(chain)} blocks cached"
        for name, chain in hashes.items()
    ]


if __name__ == "__main__":
    for policy in ("lru", "deepest_first"):
        print(f"{policy:>13}:", "; ".join(surviving_conversations(policy)))
