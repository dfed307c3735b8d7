"""SGLang's Rust radix tree core (the default tree of its ``UnifiedRadixCache``) on W2/W3.

SGLang 0.5.23 ships the tree as a PyO3 extension inside its wheel
(``sglang.srt.mem_cache.rust_tree_core``). The tree holds token slots, not
blocks: SGLang's own ``PagedTokenToKVPoolAllocator`` (page size 16, CPU) hands
them out, and the tree returns the slots it drops as actions the cache applies
to that allocator. Per request, the calls ``UnifiedRadixCache`` makes, without its
Python wrapper objects (its ``RustUnifiedTreeCore`` dataclass conversions):

1. ``match_prefix(key[:n - 1])`` (a prompt is never served whole from cache);
2. ``collect_full_device_indices`` of the matched path, ``inc_lock_ref`` on its node;
3. if the allocator is short, the eviction walk of ``evict_for_alloc``
   (``evict_device_start``, ``evict_device_next_node`` / ``evict_device_leaf`` until
   the allocator has room, ``evict_device_end``), each step's frees applied;
4. ``alloc`` of the rest, then a stepped insert of the whole prompt
   (``begin_insert`` with ``prev_prefix_len`` = the hit, ``resume_insert`` to the
   result, ``end_insert``), its actions applied;
5. ``dec_lock_ref``. The slots stay in the tree (cached) until evicted.

A token radix tree does not hash, so there is no hash share. W1 is not mapped: the
tree has no allocator of its own (SGLang's allocator alone is the shared harness's
``sglang`` W1 peer). Hit blocks are the matched tokens divided by 16.
"""

from __future__ import annotations

import importlib
from array import array
from typing import Any

from peerbench.peers import NoMapping, require_module, version_of

FULL = 0  # ComponentType.FULL, checked against SGLang's enum at load


class SglangRustPeer:
    """``RustUnifiedTreeCoreBinding`` over ``PagedTokenToKVPoolAllocator``, LRU eviction."""

    name = "sglang-rust"
    hash_s = 0.0

    def __init__(self) -> None:
        self._torch = require_module("torch")
        self._bindings = require_module("sglang.srt.mem_cache.rust_tree_core.extension").bindings
        self._allocator_class = require_module(
            "sglang.srt.mem_cache.allocator.paged"
        ).PagedTokenToKVPoolAllocator
        component_type = importlib.import_module(
            "sglang.srt.mem_cache.unified_cache.component_type"
        ).ComponentType
        if int(component_type.FULL) != FULL:
            raise NoMapping(f"ComponentType.FULL is {int(component_type.FULL)}, not {FULL}")

    def version(self) -> str:
        """SGLang's installed version."""
        return version_of("sglang")

    def churn_init(self, pool_blocks: int, block_size: int) -> None:
        """W1 is not mapped: the tree core has no allocator."""
        raise NoMapping("no allocator in the tree core; W1 would time SGLang's allocator alone")

    def prefix_init(self, pool_blocks: int, block_size: int) -> None:
        """A fresh tree and a fresh allocator of ``pool_blocks - 1`` pages of ``block_size``."""
        bindings = self._bindings
        self._block_size = block_size
        self._allocator = self._allocator_class(
            size=(pool_blocks - 1) * block_size,
            page_size=block_size,
            dtype=self._torch.int64,
            device="cpu",
            kvcache=None,
            need_sort=False,
        )
        self._tree = bindings.RustUnifiedTreeCoreBinding(
            bindings.TreeCoreInitParamsBinding(
                eviction_policy="lru",
                slru_protected_threshold=2,
                tlru_tail_budget=0,
                tlru_float_config=None,
                page_size=block_size,
                is_write_back=False,
                enable_hicache=False,
                write_through_threshold=256,
                device="cpu",
                swa_sliding_window_size=None,
                swa_req_ring=False,
                enable_kv_cache_events=False,
                dynamo_kv_event_format=False,
                mamba_cache_chunk_size=None,
                mamba_max_states_per_path=None,
            ),
            [FULL],
        )
        self._root = self._tree.empty_match_result().last_device_node_id  # fixed per tree

    @staticmethod
    def prepare(tokens: list[int]) -> array:
        """The tree's key: the prompt as an int64 ``array`` (what SGLang's ``RadixKey`` holds)."""
        return array("q", tokens)

    def serve(self, key: array) -> int:
        """Match, lock, evict if short, allocate, insert, unlock; the number of hit blocks."""
        bindings, tree, allocator = self._bindings, self._tree, self._allocator
        match = tree.match_prefix(bindings.MatchParamsBinding(key=key[: len(key) - 1]))
        hit_tokens = match.device_prefix_len
        node = match.last_device_node_id
        prefix = tree.collect_full_device_indices(node, self._root)
        lock = tree.inc_lock_ref(node, [])
        need = len(key) - hit_tokens
        if allocator.available_size() < need:
            self._evict(need)
        fresh = allocator.alloc(need)
        if fresh is None:
            raise RuntimeError(f"sglang-rust: cannot allocate {need} slots")
        value = self._torch.cat((prefix, fresh))
        step = tree.begin_insert(
            bindings.InsertParamsBinding(key=key, value=value, prev_prefix_len=hit_tokens)
        )
        self._apply(step.actions)
        while step.result is None:
            step = tree.resume_insert()
            self._apply(step.actions)
        self._apply(tree.end_insert())
        tree.dec_lock_ref(
            node,
            bindings.DecLockRefParamsBinding(
                node_id=node,
                skipped_lock_components=list(lock.skipped_lock_components),
                component_lock_uuids=dict(lock.component_lock_uuids),
                component_host_lock_uuids=dict(lock.component_host_lock_uuids),
            ),
            False,
        )
        return hit_tokens // self._block_size

    def _evict(self, need: int) -> None:
        """``evict_for_alloc``'s walk: evict LRU leaves until the allocator has ``need``."""
        tree, allocator = self._tree, self._allocator
        tracker = {FULL: 0}
        tree.evict_device_start(FULL, max(need, tree.full_evictable_size()))
        try:
            while allocator.available_size() < need:
                step = tree.evict_device_next_node(FULL, tracker)
                self._take(step, tracker)
                if step.node_id is None:
                    if not step.made_progress:
                        break
                    continue
                self._take(tree.evict_device_leaf(step.node_id), tracker)
        finally:
            tree.evict_device_end(FULL)

    def _take(self, step: Any, tracker: dict[int, int]) -> None:
        for segments in step.new_device_frees.values():
            for segment in segments:
                self._allocator.free_segment(segment, start_pos=0)
        self._apply(step.cache_actions)
        for component, delta in step.tracker.items():
            tracker[component] = tracker.get(component, 0) + delta

    def _apply(self, actions: Any) -> None:
        for action in actions:
            if action[0] != "free_device_kv":
                raise NoMapping(f"unexpected tree action {action[0]!r}")
            for segment in action[1]:
                self._allocator.free_segment(segment, start_pos=0)
