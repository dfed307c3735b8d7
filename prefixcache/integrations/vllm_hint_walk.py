"""The queue hints' per-step walk, incremental: each queued request's cached prefix kept from
the last step and looked up again only from where the pool's cache may have changed.

:func:`prefixcache.integrations.vllm_hints.refresh` needs, once per scheduler step, the
blocks of every queued request's longest cached prefix, request by request in scheduling
order (:func:`full_walk`, the reference). Looking each hash up again every step costs
O(queue + prefixes) Python calls of vLLM's ``get_cached_block`` a step, which slowed the
scheduler loop by half. What ``get_cached_block(hash, groups)`` answers can change only
where vLLM's hash map (``BlockPool.cached_block_hash_to_block``) inserts or pops one of the
hash's keys (``hash + group ID``, ``make_block_hash_with_group_id``); a
:class:`PrefixWalk` records those keys (its own ``insert`` and ``pop`` on the map instance,
calling vLLM's), and per request keeps how many leading hashes were found, their blocks,
and an index from each hash it looked up to (request, position). At the next step the
recorded keys mark, through the index, the first position of each request whose lookup may
differ; only from there is it looked up again (and from its end when a request with every
hash cached got more hashes, after a preemption). A request seen for the first time, or
not reached at the last step (the listing stops at the pool's size), is walked whole.
Recording is conservative (every insert and pop, whatever it changed), so the blocks
listed equal :func:`full_walk`'s at every step
(``tests/integrations/test_vllm_hint_walk.py`` runs both over random programs).

The queue's unchanged run (the last step's requests from the new head on, in the same
order, compared by identity in C) keeps its prefixes and has their block lists
concatenated in C; the requests after it are handled one by one. Cost per step: O(keys
inserted or popped since the last step + positions looked up again + requests after the
run) Python work, plus O(run + listed blocks) in C; the index is rebuilt when stale
entries outnumber live ones (amortised O(1) an entry). A pool whose map has no
``insert``/``pop`` (a stand-in) gets :func:`full_walk` each step.
"""

from __future__ import annotations

import weakref
from bisect import bisect_left
from collections.abc import Iterable, Sequence
from itertools import accumulate, chain
from operator import attrgetter, is_
from typing import Any

__all__ = ["PrefixWalk", "close_all", "full_walk", "prefix_walk"]

_ATTR = "_prefixcache_prefix_walk"  # on a BlockPool: its PrefixWalk
_GROUP_ID_BYTES = 4  # vLLM 0.33's key: the hash, then the group ID in 4 bytes
_WALKS: weakref.WeakSet[PrefixWalk] = weakref.WeakSet()  # the walks recording now


def full_walk(
    pool: Any, requests: Iterable[Any], group_ids: Sequence[int], max_blocks: int
) -> list[Any]:
    """The blocks of each request's longest cached prefix, request by request, each
    from its first block (all groups' blocks of a hash together); at most about
    ``max_blocks`` (the walk stops after the first request that reaches it).
    Complexity: O(the blocks listed + the requests walked) lookups."""
    blocks: list[Any] = []
    groups = list(group_ids)
    lookup = pool.get_cached_block
    for request in requests:
        for block_hash in request.block_hashes:
            cached = lookup(block_hash, groups)
            if cached is None:
                break
            blocks.extend(cached)
        if len(blocks) >= max_blocks:
            break
    return blocks


class _Prefix:
    """One queued request's cached prefix as of the last step it was walked."""

    __slots__ = ("blocks", "found", "hashes", "redo", "request", "size", "slot")

    def __init__(self, request: Any) -> None:
        self.request = request  # held, so its id() names it while this lives
        self.hashes: list[Any] = request.block_hashes
        self.size = 0  # len(hashes) when walked
        self.found = 0  # leading hashes found cached
        self.blocks: list[Any] = []  # their blocks, all groups' of a hash together
        self.redo: int | None = 0  # the first position to look up again; None: none
        self.slot = -1  # its index in the walk's last queue, plus the walk's base

    def looked_up(self) -> int:
        """Positions the last walk looked up: the cached ones and the miss, if any."""
        return self.found + (self.found < self.size)


_BLOCKS = attrgetter("blocks")


class PrefixWalk:
    """The cached prefixes of a pool's queued requests, kept step to step (module doc).

    Args:
        pool: vLLM's ``BlockPool`` (``get_cached_block``, ``cached_block_hash_to_block``).
        group_ids: the KV-cache groups whose blocks a prefix holds.
    """

    def __init__(self, pool: Any, group_ids: Sequence[int]) -> None:
        self.cache_map: Any = pool.cached_block_hash_to_block
        self.group_ids = list(group_ids)
        self._lookup = pool.get_cached_block
        self._dirty: set[bytes] = set()  # keys inserted or popped since the last step
        self._by_request: dict[int, _Prefix] = {}  # id(request) -> prefix, stale ones too
        self._queue: list[Any] = []  # the requests listed at the last step, in order
        self._prefixes: list[_Prefix] = []  # their prefixes
        self._complete: list[_Prefix] = []  # those with every hash cached (the rest may grow)
        self._base = 0  # a listed prefix's index in _queue: its slot - _base
        self._index: dict[Any, list[tuple[_Prefix, int]]] = {}  # hash -> where looked up
        self._entries = 0  # index entries, stale ones too
        self._check_at = 1024  # entries at which to count the live ones again
        self.recording = True
        self._record()
        _WALKS.add(self)

    def _record(self) -> None:
        """Put the recording ``insert`` and ``pop`` on the map instance (vLLM's inside)."""
        cache_map, note = self.cache_map, self._dirty.add
        insert, pop = cache_map.insert, cache_map.pop

        def recorded_insert(key: Any, block: Any) -> None:
            note(key)
            insert(key, block)

        def recorded_pop(key: Any, block_id: int) -> Any:
            note(key)
            return pop(key, block_id)

        cache_map.insert, cache_map.pop = recorded_insert, recorded_pop

    def close(self) -> None:
        """Stop recording: the map's own ``insert`` and ``pop`` again. O(1)."""
        for name in ("insert", "pop"):
            self.cache_map.__dict__.pop(name, None)
        self._by_request, self._index, self._entries = {}, {}, 0
        self._queue, self._prefixes, self._complete = [], [], []
        self._dirty.clear()
        self.recording = False
        _WALKS.discard(self)

    def _listed(self, prefix: _Prefix) -> bool:
        """Whether ``prefix`` was listed at the last step (its marks are kept). O(1)."""
        index = prefix.slot - self._base
        return 0 <= index < len(self._prefixes) and self._prefixes[index] is prefix

    def blocks(self, requests: Iterable[Any], max_blocks: int) -> list[Any]:
        """:func:`full_walk`'s blocks for ``requests`` (in scheduling order), looking up
        only what may have changed since the last call. Complexity: module doc."""
        marked = self._mark_changed()
        queued = requests if isinstance(requests, list) else list(requests)
        run, k, capped = self._unchanged_run(queued), 0, False
        if run:  # queued[:run] is the last queue's [k:k + run], in order
            k = self._by_request[id(queued[0])].slot - self._base
            for prefix in marked:
                if prefix.redo is not None and k <= prefix.slot - self._base < k + run:
                    self._walk(prefix)
            prefixes = self._prefixes[k : k + run]
            ends = list(accumulate(map(len, map(_BLOCKS, prefixes))))
            capped = ends[-1] >= max_blocks
            if capped:  # the listing stops inside the run
                run = bisect_left(ends, max_blocks) + 1
                prefixes = prefixes[:run]
            listed = list(chain.from_iterable(map(_BLOCKS, prefixes)))
        else:
            prefixes, listed = [], []
        base = self._base + (k if run else len(self._prefixes) + 1)
        reached = run
        if not capped:  # the rest, request by request
            reached = self._walk_rest(queued, run, base, prefixes, listed, max_blocks)
        candidates = dict.fromkeys([*self._complete, *marked, *prefixes[run:]])
        self._queue, self._prefixes, self._base = queued[:reached], prefixes, base
        self._complete = [p for p in candidates if p.found == p.size and self._listed(p)]
        self._tidy()
        return listed

    def _unchanged_run(self, queued: list[Any]) -> int:
        """How many of ``queued``'s first requests are the last queue's from one of them
        on, in the same order, none with every hash cached and more hashes now (vLLM's
        ``block_hashes`` only grow: a stale output of a preempted request). O(that
        many) in C, plus O(prefixes with every hash cached)."""
        head = self._by_request.get(id(queued[0])) if queued else None
        if head is None or head.request is not queued[0] or not self._listed(head):
            return 0
        k = head.slot - self._base
        run = min(len(self._queue) - k, len(queued))
        if not all(map(is_, queued[:run], self._queue[k : k + run])):
            return 0
        for prefix in self._complete:  # such a one is walked again from its end
            index = prefix.slot - self._base - k
            if 0 <= index < run and len(prefix.request.block_hashes) != prefix.size:
                run = index
        return run

    def _walk_rest(
        self,
        queued: list[Any],
        start: int,
        base: int,
        prefixes: list[_Prefix],
        listed: list[Any],
        max_blocks: int,
    ) -> int:
        """:func:`full_walk` from ``queued[start]`` on, appending; return the requests
        reached. A request listed at the last step keeps its prefix (marks applied)."""
        by_request, listed_last = self._by_request, self._listed
        for index in range(start, len(queued)):
            request = queued[index]
            prefix = by_request.get(id(request))
            hashes = request.block_hashes
            if (
                prefix is None
                or prefix.request is not request
                or not listed_last(prefix)
                or prefix.hashes is not hashes
                or len(hashes) < prefix.size
            ):
                prefix = by_request[id(request)] = _Prefix(request)
            elif len(hashes) > prefix.size and prefix.found == prefix.size:
                prefix.redo = prefix.found if prefix.redo is None else prefix.redo
            if prefix.redo is not None:
                self._walk(prefix)
            prefixes.append(prefix)
            listed += prefix.blocks
            if len(listed) >= max_blocks:
                break
        for index, prefix in enumerate(prefixes[start:], start):  # after: listed_last reads
            prefix.slot = base + index
        return len(prefixes)

    def _mark_changed(self) -> list[_Prefix]:
        """Mark, in last step's prefixes, the first position whose lookup may differ;
        return the prefixes marked."""
        dirty, index, listed_last = self._dirty, self._index, self._listed
        marked: list[_Prefix] = []
        cut = -_GROUP_ID_BYTES
        for key in dirty:
            for prefix, position in index.get(key[:cut], ()):
                if position <= prefix.found and listed_last(prefix):
                    if prefix.redo is None:
                        marked.append(prefix)
                        prefix.redo = position
                    elif position < prefix.redo:
                        prefix.redo = position
        dirty.clear()
        return marked

    def _walk(self, prefix: _Prefix) -> None:
        """Look ``prefix``'s hashes up again from ``prefix.redo`` to the first miss."""
        hashes = prefix.hashes = prefix.request.block_hashes  # vLLM never replaces it
        start, groups = prefix.redo or 0, self.group_ids
        blocks, index, lookup = prefix.blocks, self._index, self._lookup
        del blocks[start * len(groups) :]
        size, position = len(hashes), start
        while position < size:
            block_hash = hashes[position]
            entries = index.get(block_hash)
            if entries is None:
                index[block_hash] = [(prefix, position)]
            else:
                entries.append((prefix, position))
            cached = lookup(block_hash, groups)
            if cached is None:
                break
            blocks += cached
            position += 1
        prefix.found, prefix.size, prefix.redo = position, size, None
        self._entries += position - start + (position < size)

    def _tidy(self) -> None:
        """Drop what only requests no longer listed hold, when it outgrows the rest
        (amortised O(1) an index entry or request)."""
        if len(self._by_request) > 2 * len(self._prefixes) + 64:
            self._by_request = {id(prefix.request): prefix for prefix in self._prefixes}
        if self._entries <= self._check_at:
            return
        live = sum(prefix.looked_up() for prefix in self._prefixes)
        if self._entries > 2 * live + 1024:
            index: dict[Any, list[tuple[_Prefix, int]]] = {}
            for prefix in self._prefixes:
                for position in range(prefix.looked_up()):
                    index.setdefault(prefix.hashes[position], []).append((prefix, position))
            self._index, self._entries = index, live
        self._check_at = self._entries + live + 1024


def prefix_walk(pool: Any, group_ids: Sequence[int]) -> PrefixWalk | None:
    """``pool``'s :class:`PrefixWalk`, made on first use or when vLLM replaced its hash
    map (``reset_prefix_cache``); None when the map cannot be recorded. O(1)."""
    walk: PrefixWalk | None = getattr(pool, _ATTR, None)
    cache_map = getattr(pool, "cached_block_hash_to_block", None)
    if (
        walk is not None
        and walk.recording
        and walk.cache_map is cache_map
        and walk.group_ids == list(group_ids)
    ):
        return walk
    if walk is not None:
        walk.close()
    if not (hasattr(cache_map, "insert") and hasattr(cache_map, "pop")):
        return None
    if not hasattr(cache_map, "__dict__"):  # no room for the recording methods
        return None
    walk = PrefixWalk(pool, group_ids)
    setattr(pool, _ATTR, walk)
    return walk


def close_all() -> None:
    """Stop every walk's recording (hints turned off, the plugin uninstalled). O(walks)."""
    for walk in list(_WALKS):
        walk.close()
