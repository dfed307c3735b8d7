"""HashRegistry: which block holds which chained hash, and the tree they form."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from prefixcache.engine.types import NO_HASH
from prefixcache.errors import InvariantError

ROOT = -1
"""Parent value of a block whose hash starts a chain."""

NONE = -1
"""Link value meaning "no such block" in the child lists."""

_DEREGISTER_ONE_BY_ONE_UP_TO = 8
"""Plans this small skip the vectorised path of ``deregister_leaves``: its numpy calls
cost more than a few scalar updates (benchmarks/bench_core.py, eviction of one block)."""


def _read_only(array: np.ndarray) -> np.ndarray:
    """A view of ``array`` that raises on writes: only the registry changes its arrays."""
    view: np.ndarray = array.view()
    view.flags.writeable = False
    return view


class HashRegistry:
    """Hash <-> block maps with parent/child links between registered blocks.

    A block's hash covers its whole prefix, so the registered blocks form a
    forest: a block's parent is the block holding the previous hash of its
    chain. The registry keeps that forest ancestor-closed (a block is
    registered only under a registered parent) and answers longest-prefix
    queries by walking a query's hashes through one dict. It knows nothing of
    reference counts: the allocator decides when a block may be registered or
    dropped.

    Fields (all indexed by block ID, owned and changed only by this class; the
    public arrays are read-only views of private ones, so no other module can
    write them):

    - ``is_registered``: numpy bool, for vectorised checks by the allocator.
    - ``num_children``: numpy int32, number of registered children.
    - ``_first_child`` / ``_next_sibling`` / ``_prev_sibling``: numpy int32
      links (``NONE`` where absent) of an intrusive doubly linked list of each
      block's children: O(1) insert and unlink without a Python object per
      block (a ``set`` per parent cost about 250 bytes a block,
      ``benchmarks/bench_core.py --memory``).
    - ``parent_of`` / ``depth_of``: numpy int32, parent block (``ROOT`` for a
      chain's first block) and 0-based position in the chain.
    - ``_registered_at``: numpy int64, the registration generation of each
      registered block (a counter bumped at every registration, never reset):
      what a session compares to trust its remembered chain (:meth:`registrations`).

    Methods: :meth:`match`, :meth:`block_of`, :meth:`holds_none`, :meth:`hash_of`,
    :meth:`register`, :meth:`deregister_leaf`, :meth:`deregister_leaves`,
    :meth:`children_of`, :meth:`relocate`, :meth:`clear`. Not thread-safe.
    """

    def __init__(self, num_blocks: int) -> None:
        self._block_of_hash: dict[int, int] = {}
        self._hash_of_block: list[int] = [NO_HASH] * num_blocks
        self._first_child = np.full(num_blocks, NONE, dtype=np.int32)
        self._next_sibling = np.full(num_blocks, NONE, dtype=np.int32)
        self._prev_sibling = np.full(num_blocks, NONE, dtype=np.int32)
        self._is_registered = np.zeros(num_blocks, dtype=bool)
        self._num_children = np.zeros(num_blocks, dtype=np.int32)
        self._parent_of = np.full(num_blocks, ROOT, dtype=np.int32)
        self._depth_of = np.zeros(num_blocks, dtype=np.int32)
        self._registered_at = np.zeros(num_blocks, dtype=np.int64)
        self._num_registrations = 0
        self._make_views()

    def _make_views(self) -> None:
        """Read-only views for everyone else (the engine, the planner, the checker)."""
        self.is_registered = _read_only(self._is_registered)
        self.num_children = _read_only(self._num_children)
        self.parent_of = _read_only(self._parent_of)
        self.depth_of = _read_only(self._depth_of)

    def __getstate__(self) -> dict[str, object]:
        """Pickle and copy the private arrays only; views are rebuilt over the copies."""
        views = ("is_registered", "num_children", "parent_of", "depth_of")
        return {key: value for key, value in self.__dict__.items() if key not in views}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        self._make_views()

    def __len__(self) -> int:
        return len(self._block_of_hash)

    def block_of(self, block_hash: int) -> int | None:
        """The block holding ``block_hash``, or None. Complexity: O(1)."""
        return self._block_of_hash.get(block_hash)

    def holds_none(self, block_hashes: Sequence[int]) -> bool:
        """Whether no block holds any of ``block_hashes``. Complexity: O(k), at C speed."""
        return self._block_of_hash.keys().isdisjoint(block_hashes)

    def hash_of(self, block_id: int) -> int:
        """The hash ``block_id`` carries, or ``NO_HASH``. Complexity: O(1)."""
        return self._hash_of_block[block_id]

    def registrations(self, block_ids: np.ndarray) -> np.ndarray:
        """Each block's registration generation (int64), 0 where it is unregistered.

        A generation is given once (the counter only grows, across :meth:`clear`
        too), so an unchanged nonzero value means the block has carried the same
        hash under the same parent since it was read. Complexity: O(k), vectorised.
        """
        ids = np.asarray(block_ids, dtype=np.intp)
        return np.where(self._is_registered[ids], self._registered_at[ids], 0)

    def match(self, block_hashes: Sequence[int]) -> list[int]:
        """Blocks holding the longest registered prefix of ``block_hashes``.

        The registered hashes of one chain are prefix-closed (a hash is
        registered only under its parent), so a binary search finds where the
        match ends; the matched blocks are then looked up in one C-level
        ``map``. A collision could break prefix-closure, so the result is
        still cut at the first hash with no block (found by a second pass,
        only in that case).

        Complexity: O(log n) probes plus O(matched) lookups.
        """
        lookup = self._block_of_hash.get
        low, high = 0, len(block_hashes)
        if high and lookup(block_hashes[high - 1]) is not None:
            low = high
        while low < high:
            middle = (low + high) // 2
            if lookup(block_hashes[middle]) is None:
                high = middle
            else:
                low = middle + 1
        try:
            # __getitem__ raises on a gap, which spares scanning the result for None.
            return list(map(self._block_of_hash.__getitem__, block_hashes[:low]))
        except KeyError:
            matched = list(map(lookup, block_hashes[:low]))
            del matched[matched.index(None) :]
            return matched  # type: ignore[return-value]

    def children_of(self, block_id: int) -> Sequence[int]:
        """Registered children of ``block_id`` (a copy). Complexity: O(children)."""
        children: list[int] = []
        child = int(self._first_child[block_id])
        while child != NONE:
            children.append(child)
            child = int(self._next_sibling[child])
        return tuple(children)

    def _link_child(self, parent_id: int, child_id: int) -> None:
        """Put ``child_id`` at the head of ``parent_id``'s child list. O(1)."""
        head = int(self._first_child[parent_id])
        self._next_sibling[child_id] = head
        self._prev_sibling[child_id] = NONE
        if head != NONE:
            self._prev_sibling[head] = child_id
        self._first_child[parent_id] = child_id

    def _unlink_child(self, parent_id: int, child_id: int) -> None:
        """Remove ``child_id`` from ``parent_id``'s child list. O(1)."""
        before: int = self._prev_sibling.item(child_id)
        after: int = self._next_sibling.item(child_id)
        if before == NONE:
            self._first_child[parent_id] = after
        else:
            self._next_sibling[before] = after
        if after != NONE:
            self._prev_sibling[after] = before
        self._next_sibling[child_id] = self._prev_sibling[child_id] = NONE

    def register(self, block_id: int, block_hash: int, parent_id: int) -> None:
        """Record that ``block_id`` holds ``block_hash`` under ``parent_id``.

        Preconditions (checked by the allocator): the block is unregistered,
        the hash is free, and the parent is registered or ``ROOT``.

        Complexity: O(1).
        """
        self._block_of_hash[block_hash] = block_id
        self._hash_of_block[block_id] = block_hash
        self._is_registered[block_id] = True
        self._parent_of[block_id] = parent_id
        self._num_registrations += 1
        self._registered_at[block_id] = self._num_registrations
        if parent_id == ROOT:
            self._depth_of[block_id] = 0
        else:
            self._depth_of[block_id] = self._depth_of[parent_id] + 1
            self._num_children[parent_id] += 1
            self._link_child(parent_id, block_id)

    def register_chain(
        self, block_ids: np.ndarray, id_list: list[int], block_hashes: list[int], parent_id: int
    ) -> None:
        """Register a fresh chain at once: ``block_ids[i]`` under ``block_hashes[i]``.

        Each block is the parent of the next; the first hangs under
        ``parent_id``. Preconditions (checked by the allocator): the blocks
        are distinct and unregistered, the hashes free, the parent registered
        or ``ROOT``. Equivalent to calling :meth:`register` in order.

        Complexity: O(k), per-block numpy writes vectorised.
        """
        count = len(id_list)
        self._block_of_hash.update(zip(block_hashes, id_list, strict=True))
        hash_of_block = self._hash_of_block
        for block_id, block_hash in zip(id_list, block_hashes, strict=True):
            hash_of_block[block_id] = block_hash
        parents = [parent_id, *id_list[:-1]]
        self._is_registered[block_ids] = True
        self._parent_of[block_ids] = parents
        first_depth = 0 if parent_id == ROOT else int(self._depth_of[parent_id]) + 1
        self._depth_of[block_ids] = np.arange(first_depth, first_depth + count)
        first = self._num_registrations + 1
        self._registered_at[block_ids] = np.arange(first, first + count)
        self._num_registrations += count
        # Inside the chain each block is its parent's only child.
        self._num_children[block_ids[:-1]] += 1
        self._first_child[block_ids[:-1]] = block_ids[1:]
        self._next_sibling[block_ids[1:]] = NONE
        self._prev_sibling[block_ids[1:]] = NONE
        if parent_id != ROOT:
            self._num_children[parent_id] += 1
            self._link_child(parent_id, id_list[0])

    def deregister_leaf(self, block_id: int) -> int:
        """Forget the hash of ``block_id``, which must have no registered child.

        Returns:
            The former parent (``ROOT`` for a chain's first block).

        Complexity: O(1).
        """
        del self._block_of_hash[self._hash_of_block[block_id]]
        self._hash_of_block[block_id] = NO_HASH
        self._is_registered[block_id] = False
        parent_id: int = self._parent_of.item(block_id)
        self._parent_of[block_id] = ROOT
        if parent_id != ROOT:
            self._num_children[parent_id] -= 1
            self._unlink_child(parent_id, block_id)
        return parent_id

    def deregister_leaves(self, block_ids: Sequence[int]) -> list[int]:
        """Forget the hashes of ``block_ids``, as :meth:`deregister_leaf` on each in order.

        Meant for committing an eviction plan, which removes whole tails of
        chains: a block may be the parent of blocks listed before it. Child
        lists are unlinked only where the parent stays registered; a parent
        removed in the same call loses all its children (the precondition),
        so its list is simply emptied. Per-block numpy writes are vectorised.

        Preconditions: the blocks are distinct and registered (checked here,
        before any change), and each has no registered child once the blocks
        before it are gone (checked by the allocator's plan).

        Args:
            block_ids: the blocks, each childless at its turn.

        Returns:
            The hashes the blocks carried, in the order of ``block_ids`` (for
            KV cache events).

        Raises:
            InvariantError: a block is listed twice or is not registered;
                nothing changes.

        Complexity: O(k) dict deletions plus vectorised writes, plus O(1)
        list surgery per block whose parent stays registered.
        """
        if not block_ids:
            return []
        hash_of_block = self._hash_of_block
        hashes = [hash_of_block[block_id] for block_id in block_ids]
        if NO_HASH in hashes or len(set(block_ids)) != len(block_ids):
            raise InvariantError(
                f"deregister_leaves: {list(block_ids)} holds an unregistered block or a block twice"
            )
        if len(block_ids) <= _DEREGISTER_ONE_BY_ONE_UP_TO:
            for block_id in block_ids:
                self.deregister_leaf(block_id)
            return hashes
        block_of_hash = self._block_of_hash
        for block_hash in hashes:
            del block_of_hash[block_hash]
        for block_id in block_ids:
            hash_of_block[block_id] = NO_HASH
        ids = np.array(block_ids, dtype=np.intp)
        parents = self._parent_of[ids]
        self._is_registered[ids] = False
        # A parent still registered now is outside the batch: unlink from its list
        # before the links of the removed blocks are reset below. (ROOT indexes the
        # last entry; the comparison with ROOT masks it out.)
        kept = (parents != ROOT) & self._is_registered[parents]
        if np.count_nonzero(kept):
            for parent_id, child_id in zip(parents[kept].tolist(), ids[kept].tolist(), strict=True):
                self._num_children[parent_id] -= 1
                self._unlink_child(parent_id, child_id)
        self._parent_of[ids] = ROOT
        self._num_children[ids] = 0
        self._first_child[ids] = NONE
        self._next_sibling[ids] = NONE
        self._prev_sibling[ids] = NONE
        return hashes

    def relocate(self, sources: np.ndarray, destinations: np.ndarray) -> None:
        """Move each source's hash, links and depth to its destination, which holds none.

        For defragmentation. The moves are disjoint swaps of a block and an
        unregistered one, so every per-block array is permuted and every link
        renamed through the same permutation; each hash keeps its place in
        the registration order (the dict is updated in place).
        Preconditions (checked by the engine): the IDs are distinct and every
        destination is unregistered.

        Complexity: O(num_blocks) vectorised, plus O(k) for the hashes.
        """
        if not len(sources):
            return
        src = np.asarray(sources, dtype=np.intp)
        dst = np.asarray(destinations, dtype=np.intp)
        perm = np.arange(len(self._is_registered), dtype=np.intp)
        perm[src], perm[dst] = dst, src
        both, swapped = np.concatenate((src, dst)), np.concatenate((dst, src))
        for array in (self._is_registered, self._num_children, self._depth_of, self._registered_at):
            array[both] = array[swapped]
        for links in (self._first_child, self._next_sibling, self._prev_sibling, self._parent_of):
            links[both] = links[swapped]
            linked = links >= 0
            links[linked] = perm[links[linked]]
        hash_of_block, block_of_hash = self._hash_of_block, self._block_of_hash
        for source, destination in zip(src.tolist(), dst.tolist(), strict=True):
            block_hash = hash_of_block[source]
            hash_of_block[source], hash_of_block[destination] = NO_HASH, block_hash
            if block_hash != NO_HASH:
                block_of_hash[block_hash] = destination

    def clear(self) -> None:
        """Forget everything. Complexity: O(num_blocks)."""
        self._block_of_hash.clear()
        self._hash_of_block[:] = [NO_HASH] * len(self._hash_of_block)
        self._first_child[:] = NONE
        self._next_sibling[:] = NONE
        self._prev_sibling[:] = NONE
        self._is_registered[:] = False
        self._num_children[:] = 0
        self._parent_of[:] = ROOT
        self._depth_of[:] = 0

    def items(self) -> list[tuple[int, int]]:
        """Every ``(hash, block)`` pair (for checks and snapshots). Complexity: O(n)."""
        return list(self._block_of_hash.items())

    def check(self) -> list[str]:
        """Describe every broken internal invariant (empty when consistent). O(num_blocks)."""
        problems: list[str] = []
        for block_hash, block_id in self._block_of_hash.items():
            if self._hash_of_block[block_id] != block_hash:
                problems.append(
                    f"hash {block_hash} maps to block {block_id}, which carries another"
                )
        registered = np.flatnonzero(self._is_registered)
        if len(registered) != len(self._block_of_hash):
            problems.append(
                f"{len(registered)} blocks flagged registered, {len(self._block_of_hash)} hashes"
            )
        counted = np.zeros_like(self._num_children)
        for block_id in registered.tolist():
            if self._hash_of_block[block_id] == NO_HASH:
                problems.append(f"block {block_id} flagged registered without a hash")
            parent_id = int(self._parent_of[block_id])
            if parent_id == ROOT:
                continue
            if not self._is_registered[parent_id]:
                problems.append(
                    f"block {block_id} is registered under unregistered parent {parent_id}"
                )
            counted[parent_id] += 1
        if not np.array_equal(counted, self._num_children):
            bad = int(np.flatnonzero(counted != self._num_children)[0])
            problems.append(
                f"block {bad} counts {self._num_children[bad]} children, {counted[bad]} registered"
            )
        problems.extend(self._check_child_lists(counted))
        return problems

    def _check_child_lists(self, expected: np.ndarray) -> list[str]:
        """Each child list holds exactly the registered children, with consistent links."""
        problems: list[str] = []
        for parent_id in np.flatnonzero((self._first_child != NONE) | (expected > 0)).tolist():
            seen, previous = 0, NONE
            child = int(self._first_child[parent_id])
            while child != NONE and seen <= expected[parent_id]:
                if int(self._parent_of[child]) != parent_id or not self._is_registered[child]:
                    problems.append(f"block {child} is listed as a child of {parent_id}")
                if int(self._prev_sibling[child]) != previous:
                    problems.append(f"block {child} has a broken back link")
                seen, previous = seen + 1, child
                child = int(self._next_sibling[child])
            if seen != expected[parent_id]:
                problems.append(
                    f"block {parent_id} lists {seen} children, {expected[parent_id]} registered"
                )
        return problems
