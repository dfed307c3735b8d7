"""The vLLM plugin's free-block queue: vLLM's ``FreeKVCacheBlockQueue`` interface, cached
blocks ordered by a prefixcache policy.

What maps to what, and why, is in :mod:`prefixcache.integrations.vllm` (which installs
it) and DESIGN.md ("vLLM integration"); :mod:`prefixcache.integrations.vllm_lru` is the
fast path for ``"lru"``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

import xxhash

from prefixcache.errors import InvalidArgumentError, InvariantError
from prefixcache.integrations.vllm_queue_views import (
    _FIRST,
    _HINTED,
    _INNER,
    _LEAF,
    FreeQueueViews,
    _End,
)
from prefixcache.policies import EvictionPolicy, has_hook

__all__ = ["PolicyFreeBlockQueue", "policy_hash"]

_MASK63 = (1 << 63) - 1


def policy_hash(key: object) -> int:
    """The int a policy sees for vLLM's block key (hash bytes + 4-byte group ID). O(len).

    XXH3-64 of the whole key, so every byte and the group count, and equal keys give
    equal ints in every process (a key that is no bytes: Python's ``hash``).

    >>> policy_hash(b"block" + bytes(4)) != policy_hash(b"block" + bytes([0, 0, 0, 1]))
    True
    """
    if isinstance(key, bytes):
        return xxhash.xxh3_64_intdigest(key) & _MASK63
    return hash(key) & _MASK63


class PolicyFreeBlockQueue(FreeQueueViews):
    """vLLM's ``FreeKVCacheBlockQueue`` interface, cached blocks ordered by a policy.

    Queue interface (what ``BlockPool`` calls): ``num_free_blocks``, :meth:`popleft`,
    :meth:`popleft_n`, :meth:`remove`, :meth:`append`, :meth:`append_n`,
    :meth:`prepend_n`, :meth:`get_all_free_blocks`, :meth:`iter_blocks_after`.
    Learning (the wrapped ``BlockPool`` methods call these): :meth:`note_registered`,
    :meth:`note_hits`, :meth:`note_hash_removed`, :meth:`note_moved`,
    :meth:`note_reset`. Scheduler hints: :meth:`set_hinted`, :attr:`num_hinted_blocks`.
    Views (:class:`FreeQueueViews`): ``fake_free_list_head``, :meth:`get_all_free_blocks`,
    :meth:`iter_blocks_after`. Checking: :meth:`check_invariants`.

    Sections of the free blocks, in hand-out order: hash-less blocks; the policy's
    leaves (cached, no cached child); inner blocks (cached, a cached child in use);
    hinted blocks (cached, on a queued request's cached prefix: :meth:`set_hinted`).

    Blocks are vLLM ``KVCacheBlock`` objects (or anything with ``block_id``,
    ``block_hash``, ``is_null`` and the two link fields); state is keyed by
    ``block_id``. Not thread-safe.

    Args:
        blocks: every block of the pool, free, in hand-out order.
        policy: an :class:`EvictionPolicy`, or a native policy
            (``_native.NativePolicy``, the same methods) that answers as one.
        on_register: whether the policy wants ``on_register`` calls; None asks
            :func:`has_hook` (a native policy has every method, so the plugin
            passes what its Python class answers).
    """

    def __init__(
        self, blocks: Iterable[Any], policy: EvictionPolicy, *, on_register: bool | None = None
    ) -> None:
        self.policy = policy
        self.num_free_blocks = 0
        self._first: OrderedDict[int, Any] = OrderedDict()  # hash-less, handed out first
        self._inner: OrderedDict[int, Any] = OrderedDict()  # cached, with a cached child
        self._hinted: OrderedDict[int, Any] = OrderedDict()  # queued prefixes, oldest hint first
        self._head, self._tail = _End(), _End()  # the linked view's ends
        self._where: dict[int, int] = {}  # free block -> section
        self._blocks: dict[int, Any] = {}  # block_id -> block, every block seen
        self._parent: dict[int, int] = {}  # cached child -> its cached parent
        self._children: dict[int, set[int]] = {}  # cached parent -> cached children
        self._depth: dict[int, int] = {}  # position in its block table, from registration
        self._accesses: dict[int, int] = {}  # 1 + prefix hits since it was filled
        self._stamp: dict[int, int] = {}  # clock when last freed
        self._clock = 0
        self._on_register = has_hook(policy, "on_register") if on_register is None else on_register
        self.prepend_n(list(blocks))

    # ------------------------------------------------------------------ queue interface

    def popleft(self) -> Any:
        """Hand out the next block to reuse. Complexity: O(log n).

        Raises:
            ValueError: no block is free (as vLLM's queue).
        """
        if self.num_free_blocks == 0:
            raise ValueError("No free blocks available")
        return self.popleft_n(1)[0]

    def popleft_n(self, n: int) -> list[Any]:
        """Hand out ``n`` blocks: hash-less ones first, then the policy's victims, then
        inner blocks, then hinted ones (the newest hint's deepest block first).

        A victim's parent becomes a leaf at once, so the next victim may be it. The
        victims keep their hashes; ``BlockPool.get_new_blocks`` removes them next.

        Raises:
            ValueError: fewer than ``n`` blocks are free (nothing changes).

        Complexity: O(n log n) with a heap-ordered policy.
        """
        if n > self.num_free_blocks:
            raise ValueError(f"cannot take {n} free blocks: {self.num_free_blocks} are free")
        taken: list[Any] = []
        first, where = self._first, self._where
        while first and len(taken) < n:
            block_id, block = first.popitem(last=False)
            del where[block_id]
            taken.append(block)
        evict, inner, known = self.policy.evict, self._inner, self._blocks
        tables = (self._depth, self._accesses, self._stamp)
        while len(taken) < n:  # one victim at a time: each may expose its parent
            victims = evict(1)
            if victims:
                block_id = victims[0]
                if where.get(block_id) != _LEAF:
                    raise InvariantError(f"the policy evicted {block_id}, which it was not given")
            elif inner:  # no leaf: the oldest freed block whose children are all in use
                block_id = next(iter(inner))
                del inner[block_id]
            elif self._hinted:  # only queued prefixes left: the farthest use first
                block_id = self._hinted.popitem(last=True)[0]
            else:
                raise InvariantError(f"{self.num_free_blocks} blocks counted free, none found")
            del where[block_id]
            self._cut(block_id)
            for table in tables:
                table.pop(block_id, None)
            taken.append(known[block_id])
        self.num_free_blocks -= n
        return taken

    def remove(self, block: Any) -> None:
        """Take ``block`` out of the free blocks (vLLM: a prefix hit on it). O(log n).

        Raises:
            RuntimeError: ``block`` is not free (as vLLM's queue).
        """
        section = self._where.pop(block.block_id, None)
        if section is None:
            raise RuntimeError(f"remove() called on an invalid block: {block}")
        if section == _LEAF:
            self.policy.discard(block.block_id)
        elif section == _INNER:
            del self._inner[block.block_id]
        elif section == _HINTED:
            del self._hinted[block.block_id]
        else:
            del self._first[block.block_id]
        self.num_free_blocks -= 1

    def append(self, block: Any) -> None:
        """Free ``block``: cached ones go to the policy, hash-less ones last. O(log n)."""
        self.append_n((block,))

    def append_n(self, blocks: Sequence[Any]) -> None:
        """:meth:`append` each of ``blocks``, in order (inlined: vLLM frees a whole
        request's blocks here). Complexity: O(k log n)."""
        self._check_not_free(blocks)
        where, children, stamps = self._where, self._children, self._stamp
        inner, known = self._inner, self._blocks
        for block in blocks:
            block_id = block.block_id
            known[block_id] = block
            self._clock += 1
            stamps[block_id] = self._clock
            if block_id in children:
                inner[block_id] = block
                where[block_id] = _INNER
            else:  # a cached leaf, or a hash-less block unpin_blocks appends (read until reused)
                self._insert_leaf(block)
            self.num_free_blocks += 1

    def prepend_n(self, blocks: Sequence[Any]) -> None:
        """Free ``blocks`` to be handed out first, in their order. Complexity: O(k)."""
        self._check_not_free(blocks)
        for block in reversed(blocks):
            self._blocks[block.block_id] = block
            self._first[block.block_id] = block
            self._first.move_to_end(block.block_id, last=False)
            self._where[block.block_id] = _FIRST
        self.num_free_blocks += len(blocks)

    def _check_not_free(self, blocks: Sequence[Any]) -> None:
        """Refuse, before any change, a block already free or listed twice (RuntimeError)."""
        where = self._where
        if len(blocks) == 1:  # append() of one block: the common call
            if blocks[0].block_id in where:
                raise RuntimeError(f"block {blocks[0].block_id} is already free")
            return
        seen: set[int] = set()
        for block in blocks:
            block_id = block.block_id
            if block_id in where or block_id in seen:
                raise RuntimeError(f"block {block_id} is already free")
            seen.add(block_id)

    # ------------------------------------------------------------------ scheduler hints

    @property
    def num_hinted_blocks(self) -> int:
        """Free blocks in the hinted section now. O(1)."""
        return len(self._hinted)

    def set_hinted(self, blocks: Iterable[Any], limit: int) -> int:
        """Replace the hinted section: the free cached blocks among ``blocks``, at most
        ``limit`` of them; return how many.

        ``blocks`` lists the cached prefixes of the queued requests in scheduling order,
        each from its first block (the plugin's scheduler wrapper looks them up once per
        step); a block in use, hash-less or listed before is skipped, so the bound
        keeps the head of the prefix that reaches it. A hinted block leaves the
        policy's leaves (or the inner blocks) and is handed out only when no other free
        block is left, the last listed first: under first-come-first-served admission
        the newest hint is the farthest use. A block no longer hinted goes back where it
        belongs (a leaf to the policy, with its stamp, uses and depth; an inner block to
        the inner blocks' end). Every hinted block stays free: vLLM's counts of free
        blocks and its usage do not change.

        Raises:
            InvalidArgumentError: ``limit`` is negative (nothing changes).

        Complexity: O(len(blocks) + previously hinted), plus the policy's O(log n) per
        block that changes section.
        """
        if limit < 0:
            raise InvalidArgumentError(f"the hint limit must be >= 0, got {limit}")
        where, depth = self._where, self._depth
        picked: OrderedDict[int, Any] = OrderedDict()
        for block in blocks:
            if len(picked) >= limit:
                break
            block_id = block.block_id
            if where.get(block_id, _FIRST) != _FIRST and block_id in depth:
                picked.setdefault(block_id, self._blocks[block_id])
        # Dropped hints go back to their section, deepest first: an inner block's place is
        # by free order, and vLLM frees a request's blocks from its last one.
        for block_id, block in reversed(self._hinted.items()):
            if block_id not in picked:
                if block_id in self._children:
                    self._inner[block_id] = block
                    where[block_id] = _INNER
                else:
                    self._insert_leaf(block)
        for block_id in picked:
            section = where[block_id]
            if section == _LEAF:
                self.policy.discard(block_id)
            elif section == _INNER:
                del self._inner[block_id]
            where[block_id] = _HINTED
        self._hinted = picked
        return len(picked)

    # ------------------------------------------------------------------ learning

    def note_registered(self, blocks: Sequence[Any], start: int, stop: int) -> None:
        """``blocks[start:stop]`` of one block table were just cached: learn their
        depths and parents (``blocks[i - 1]``), and tell a policy with the
        ``on_register`` hook (``auto`` counts uses and settles its duels there) each run
        of consecutive newly cached blocks, as prefixcache's engine does.
        Complexity: O(stop - start)."""
        run: list[int] = []
        depth, accesses, on_register = self._depth, self._accesses, self._on_register
        parents, children = self._parent, self._children
        parent = blocks[start - 1] if start else None
        if parent is not None and (parent.is_null or parent.block_hash is None):
            parent = None
        for index in range(start, stop):
            block = blocks[index]
            block_id = block.block_id
            if block.is_null or block.block_hash is None or block_id in depth:
                self._report(run, index)
                parent = None if block.is_null or block.block_hash is None else block
                continue
            if on_register:
                run.append(policy_hash(block.block_hash))
            depth[block_id] = index
            accesses.setdefault(block_id, 1)
            if parent is not None:  # link to it (the block pool owns both objects)
                parent_id = parent.block_id
                parents[block_id] = parent_id
                siblings = children.get(parent_id)
                if siblings is None:
                    self._first_child(parent, block_id)
                else:
                    siblings.add(block_id)
            parent = block
        self._report(run, stop)

    def _report(self, run: list[int], end: int) -> None:
        """``on_register`` for the run of hashes ending before chain position ``end``."""
        if run:
            self.policy.on_register(run, end - len(run))
            run.clear()

    def note_hits(self, blocks: Iterable[Any]) -> None:
        """``blocks`` were handed to a request as a prefix hit. Complexity: O(k)."""
        accesses = self._accesses
        for block in blocks:
            if not block.is_null:
                accesses[block.block_id] = accesses.get(block.block_id, 1) + 1

    def note_hash_removed(self, block: Any) -> None:
        """``block`` lost its hashes: cut its links; free, it is now hash-less. O(log n)."""
        block_id = block.block_id
        if not self.knows(block_id):
            return  # the common case: a victim popleft_n already cut, or a hash-less block
        self._cut(block_id)
        self._depth.pop(block_id, None)
        self._accesses.pop(block_id, None)
        self._stamp.pop(block_id, None)
        section = self._where.get(block_id)
        if section == _LEAF:
            self.policy.discard(block_id)
        elif section == _INNER:
            del self._inner[block_id]
        elif section == _HINTED:
            del self._hinted[block_id]
        else:
            return
        self._first[block_id] = block
        self._where[block_id] = _FIRST

    def take_evictions(self) -> int:
        """Evictions the queue counted itself since the last call: none here (the plugin's
        hash-removal wrapper counts this queue's); the native queue counts in C. O(1)."""
        return 0

    def knows(self, block_id: int) -> bool:
        """Whether the queue holds any state for ``block_id`` (free, depth or links). O(1)."""
        return (
            block_id in self._depth
            or block_id in self._where
            or block_id in self._parent
            or block_id in self._children
        )

    def note_moved(self, source: Any, target: Any) -> None:
        """``source``'s hashes are about to move to ``target``: so do its links. O(children)."""
        old, new = source.block_id, target.block_id
        self._blocks[new] = target
        parent = self._parent.pop(old, None)
        if parent is not None:
            siblings = self._children[parent]
            siblings.discard(old)
            siblings.add(new)
            self._parent[new] = parent
        children = self._children.pop(old, None)
        if children:
            self._children[new] = children
            for child in children:
                self._parent[child] = new
        for table in (self._depth, self._accesses, self._stamp):
            if old in table:
                table[new] = table.pop(old)

    def note_reset(self) -> None:
        """vLLM dropped every hash (``reset_prefix_cache``): forget all, keep the order. O(n)."""
        order = self._eviction_order()
        self.policy.clear()
        for table in (self._where, self._parent, self._children, self._depth):
            table.clear()
        self._accesses.clear()
        self._stamp.clear()
        self._first, self._inner, self._hinted = OrderedDict(), OrderedDict(), OrderedDict()
        self.num_free_blocks = 0
        self.prepend_n(order)

    def check_invariants(self) -> None:
        """Check every internal invariant (tests call it after each step). O(n).

        Raises:
            InvariantError: naming the first broken invariant.
        """
        sections = {key: 0 for key in (_FIRST, _LEAF, _INNER, _HINTED)}
        for block_id, section in self._where.items():
            sections[section] += 1
            if section == _LEAF and (block_id in self._children or block_id not in self.policy):
                raise InvariantError(f"free leaf {block_id} has children or is not tracked")
            if section == _INNER and block_id not in self._children:
                raise InvariantError(f"free inner block {block_id} has no cached child")
            if section == _HINTED and block_id not in self._depth:
                raise InvariantError(f"hinted block {block_id} is not cached")
        chains = ((_FIRST, self._first), (_INNER, self._inner), (_HINTED, self._hinted))
        for section, chain in chains:
            if [self._where.get(b) for b in chain] != [section] * len(chain):
                raise InvariantError(f"chain {section} disagrees with the section map")
        if sections[_LEAF] != len(self.policy) or sum(sections.values()) != self.num_free_blocks:
            raise InvariantError(f"sections {sections} vs {self.num_free_blocks} free")
        for child, parent in self._parent.items():
            if child not in self._children.get(parent, ()):
                raise InvariantError(f"block {child}'s parent {parent} does not list it")
        if sum(map(len, self._children.values())) != len(self._parent):
            raise InvariantError("a child is listed under a parent it does not name")

    # ------------------------------------------------------------------ internals

    def _insert_leaf(self, block: Any) -> None:
        block_id = block.block_id
        self._where[block_id] = _LEAF
        self.policy.insert(block_id, *self._leaf_args(block_id))

    def _leaf_args(self, block_id: int) -> tuple[int, int, int, int]:
        """The policy's view of a leaf: hash (a hash-less block, which ``unpin_blocks``
        appends, is keyed by its ID), free stamp, use count, depth."""
        key = self._blocks[block_id].block_hash
        return (
            policy_hash(("unpinned", block_id) if key is None else key),
            self._stamp.get(block_id, 0),
            self._accesses.get(block_id, 1),
            self._depth.get(block_id, 0),
        )

    def _first_child(self, parent: Any, child: int) -> None:
        """``parent`` (now linked from ``child``) gains its first cached child; a free
        leaf stops being one."""
        parent_id = parent.block_id
        self._children[parent_id] = {child}
        if self._where.get(parent_id) == _LEAF:
            self.policy.discard(parent_id)
            self._inner[parent_id] = parent
            self._where[parent_id] = _INNER

    def _cut(self, block_id: int) -> None:
        """Forget ``block_id``'s links; a free parent left childless becomes a leaf."""
        parent = self._parent.pop(block_id, None)
        if parent is not None:
            siblings = self._children[parent]
            siblings.discard(block_id)
            if not siblings:
                del self._children[parent]
                if self._where.get(parent) == _INNER:
                    del self._inner[parent]
                    self._insert_leaf(self._blocks[parent])
        for child in self._children.pop(block_id, ()):
            del self._parent[child]
