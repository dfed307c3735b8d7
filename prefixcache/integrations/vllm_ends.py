"""Conversation ends in the vLLM plugin: a streaming session's own cached blocks go first
once the session ends.

prefixcache's ``end_conversation`` and ``Session.end()`` (DESIGN.md, "Scheduler hints")
free a conversation's cached tail when its client says it ended. vLLM 0.33 knows one kind
of conversation: a resumable (streaming-input) request, one ``Request`` across turns that
holds its blocks between them. The session ends when its client closes it (the end marker
of its streaming queue, ``add_request`` with no update, or an abort: the scheduler finishes
it), and only then does vLLM free its blocks (``Scheduler._free_blocks``). With ends on,
the plugin's wrapper of ``_free_blocks`` then walks the session's blocks from the end, in
every KV-cache group, and removes the hash of each block the plugin's queue holds as a free
leaf, through vLLM's own ``BlockPool._maybe_evict_cached_block`` (so vLLM's hash map, its
``BlockRemoved`` events and the plugin's hash-removal hook see an eviction): the queue
hands the block out first, and its parent, left a leaf, is the walk's next block.

Kept, as ``Session.end()`` keeps them: the blocks the session's first turn hit (a prefix
other conversations share, e.g. a system prompt), counted by the wrapper of
``KVCacheManager.get_computed_blocks`` at the session's admission (a session admitted
without that call, e.g. through a KV connector's own lookup, is left alone); blocks in use
(another request hit them); inner blocks (another chain hangs off them); blocks whose free
vLLM defers (an asynchronous KV connector: they are still held when the walk runs).
Requests that are not resumable (a conversation sent as one request per turn) carry no end
in vLLM and are never touched. Off by default (:data:`ENDS_ENV`, ``install(...,
conversation_ends=True)``).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from prefixcache.integrations.vllm_queue import PolicyFreeBlockQueue
from prefixcache.integrations.vllm_wrappers import _MARK

__all__ = ["ENDS_ENV", "end_session", "ends_enabled", "set_ends", "wrap_computed", "wrap_free"]

ENDS_ENV = "PREFIXCACHE_VLLM_CONVERSATION_ENDS"
"""Environment variable the plugin reads: ``1`` frees a streaming session's own cached
blocks first when the session ends (unset, empty or ``0``: off)."""

_state = {"on": False}
# A session's first-turn hits, per KV-cache group, until its blocks are freed.
_first_hits: weakref.WeakKeyDictionary[Any, tuple[int, ...]] = weakref.WeakKeyDictionary()


def set_ends(on: bool) -> None:
    """Turn conversation ends on or off for every scheduler, from the next call on."""
    _state["on"] = bool(on)
    if not on:
        _first_hits.clear()


def ends_enabled() -> bool:
    """Whether streaming sessions' ends free their own cached blocks first."""
    return _state["on"]


def end_session(pool: Any, groups: Sequence[Sequence[Any]], kept: Sequence[int]) -> int:
    """Remove the hashes of the blocks of ``groups`` (one list a KV-cache group, in chain
    order) after the first ``kept[g]`` of each, from the end, while each is a free leaf of
    ``pool``'s plugin queue; return how many lost their hashes.

    Nothing happens where the pool's queue is not the plugin's or caching is off.
    Complexity: O(blocks) queue checks, O(1) vLLM work a block freed.
    """
    queue = getattr(pool, "free_block_queue", None)
    if not isinstance(queue, PolicyFreeBlockQueue) or not getattr(pool, "enable_caching", False):
        return 0
    freed = 0
    for index, group in enumerate(groups):
        first = kept[index] if index < len(kept) else 0
        for block in reversed(group[first:]):
            if queue.is_free_leaf(block.block_id):  # not in use, no cached child
                freed += bool(pool._maybe_evict_cached_block(block))
    return freed


def wrap_computed(original: Callable[..., Any]) -> Callable[..., Any]:
    """``KVCacheManager.get_computed_blocks`` that notes a resumable request's hits per
    group while it was never preempted (the last call before its admission counts)."""

    @functools.wraps(original)
    def get_computed_blocks(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, request, *args, **kwargs)
        if _state["on"] and request.resumable and request.num_preemptions <= 0:
            _first_hits[request] = tuple(len(group) for group in result[0].blocks)
        return result

    setattr(get_computed_blocks, _MARK, original)
    return get_computed_blocks


def wrap_free(original: Callable[..., Any]) -> Callable[..., Any]:
    """``Scheduler._free_blocks`` that, for a streaming session that ends, frees its own
    cached blocks first after vLLM freed them (:func:`end_session`)."""

    @functools.wraps(original)
    def _free_blocks(self: Any, request: Any) -> Any:
        kept = _first_hits.pop(request, None)
        if kept is None or not _state["on"] or not request.resumable:
            return original(self, request)
        manager = self.kv_cache_manager
        groups = [list(group) for group in manager.get_blocks(request.request_id).blocks]
        result = original(self, request)
        end_session(manager.block_pool, groups, kept)
        return result

    setattr(_free_blocks, _MARK, original)
    return _free_blocks
