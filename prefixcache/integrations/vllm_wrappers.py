"""The vLLM plugin's wrappers of vLLM's ``BlockPool`` and ``Scheduler`` methods.

:func:`prefixcache.integrations.vllm.install` puts them in place; each learns what the
free-block queue cannot see (prefix hits, newly cached blocks, hashes removed or moved, a
reset) and counts the plugin's metrics (:mod:`.vllm_metrics`). The three that vLLM calls on
its serving path (``touch``, ``cache_full_blocks``, and ``_remove_cached_block_hashes`` per
block) stand behind ``_native.BlockPoolHook`` when the extension is built: a C method
descriptor that does the wrapper's work in C for a pool with the native queue (its counts
kept in the queue until the metrics are read) and calls the Python wrapper for any other.
``get_new_blocks`` stands behind one too: for vLLM's own pool with the native queue it runs
vLLM's steps in C, calling vLLM's ``_remove_cached_block_hashes`` per block directly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from prefixcache.engine.native_engine import native_available, native_module
from prefixcache.integrations import vllm_hints, vllm_metrics
from prefixcache.integrations.vllm_queue import PolicyFreeBlockQueue

_MARK = "__prefixcache_original__"  # on a wrapper: the vLLM function it wraps


# ---------------------------------------------------------------- BlockPool wrappers


def _queue(pool: Any) -> PolicyFreeBlockQueue | None:
    queue = pool.free_block_queue
    return queue if isinstance(queue, PolicyFreeBlockQueue) else None


def _wrap_touch(original: Callable[..., Any]) -> Callable[..., Any]:
    def touch(self: Any, blocks: Sequence[Any]) -> None:
        blocks = blocks if isinstance(blocks, (list, tuple)) else list(blocks)
        queue = _queue(self)
        free = queue.num_free_blocks if queue is not None else 0
        original(self, blocks)
        if queue is not None:
            queue.note_hits(blocks)
            counts = getattr(queue, vllm_metrics.COUNTS, None)
            if counts is not None:  # the blocks taken out of the free queue: policy hits
                counts.hits += free - queue.num_free_blocks
                counts.evictions += queue.take_evictions()
                counts.flush()

    setattr(touch, _MARK, original)
    return _native_hook("touch", original, touch)


def _wrap_cache_full_blocks(original: Callable[..., Any]) -> Callable[..., Any]:
    def cache_full_blocks(
        self: Any,
        request: Any,
        blocks: list[Any],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        kv_cache_group_id: int,
        block_mask: list[bool] | None = None,
    ) -> None:
        original(
            self,
            request,
            blocks,
            num_cached_blocks,
            num_full_blocks,
            block_size,
            kv_cache_group_id,
            block_mask=block_mask,
        )
        queue = _queue(self)
        if queue is not None:
            queue.note_registered(blocks, num_cached_blocks, num_full_blocks)
            counts = getattr(queue, vllm_metrics.COUNTS, None)
            if counts is not None:  # the step's evictions (get_new_blocks came before)
                counts.evictions += queue.take_evictions()
                counts.flush()

    setattr(cache_full_blocks, _MARK, original)
    return _native_hook("cache_full_blocks", original, cache_full_blocks)


def _wrap_remove_hashes(original: Callable[..., Any]) -> Callable[..., Any]:
    def _remove_cached_block_hashes(self: Any, block: Any) -> Any:
        removed = original(self, block)
        queue = self.free_block_queue
        if isinstance(queue, PolicyFreeBlockQueue):
            if queue.knows(block.block_id):
                queue.note_hash_removed(block)
            elif removed and block.ref_cnt == 0:
                # A victim: get_new_blocks drops the hash of a cached block popleft_n
                # handed out (and forgot) before counting it in use.
                counts = getattr(queue, vllm_metrics.COUNTS, None)
                if counts is not None:
                    counts.evictions += 1
        return removed

    setattr(_remove_cached_block_hashes, _MARK, original)
    return _native_hook("_remove_cached_block_hashes", original, _remove_cached_block_hashes)


def _wrap_get_new_blocks(original: Callable[..., Any]) -> Callable[..., Any]:
    """vLLM's ``get_new_blocks``; for a pool with the native queue its steps run in C
    (``engine/native/vllm_get_new_blocks.cpp``: vLLM's ``_remove_cached_block_hashes`` and
    the hook's work per block, no Python frame between), the same calls and results."""

    def get_new_blocks(self: Any, num_blocks: int) -> list[Any]:
        return original(self, num_blocks)

    setattr(get_new_blocks, _MARK, original)
    return _native_hook("get_new_blocks", original, get_new_blocks)


def _native_hook(
    method: str, original: Callable[..., Any], wrapper: Callable[..., Any]
) -> Callable[..., Any]:
    """``wrapper``'s work in C for a pool with the native queue (``_native.BlockPoolHook``:
    no Python frame per vLLM call, the counts kept in the queue), ``wrapper`` for any other
    pool; ``wrapper`` itself when the extension is not built."""
    if not native_available():
        return wrapper
    hook: Callable[..., Any] = native_module().BlockPoolHook(method, original, wrapper)
    return hook


def _wrap_move(original: Callable[..., Any]) -> Callable[..., Any]:
    def move_block_hashes(self: Any, src_block: Any, dst_block: Any) -> None:
        queue = _queue(self)
        if queue is not None:
            queue.note_moved(src_block, dst_block)
        original(self, src_block, dst_block)

    setattr(move_block_hashes, _MARK, original)
    return move_block_hashes


def _wrap_reset(original: Callable[..., Any]) -> Callable[..., Any]:
    def reset_prefix_cache(self: Any) -> bool:
        done = bool(original(self))
        queue = _queue(self)
        if done and queue is not None:
            queue.note_reset()
        return done

    setattr(reset_prefix_cache, _MARK, original)
    return reset_prefix_cache


def _wrap_scheduler_init(original: Callable[..., Any]) -> Callable[..., Any]:
    """vLLM's scheduler builds its block pools: they get its model and engine labels."""

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        config = kwargs["vllm_config"] if "vllm_config" in kwargs else (args or (None,))[0]
        with vllm_metrics.labelled(config):
            original(self, *args, **kwargs)

    setattr(__init__, _MARK, original)
    return __init__


def _wrap_schedule(original: Callable[..., Any]) -> Callable[..., Any]:
    """Before each scheduler step the queued requests' cached prefixes are hinted in the
    pool's queue when hints are on (:mod:`.vllm_hints`: before the step's allocations, so
    the blocks the last step registered or freed are protected too); after it the counts
    waiting in the native queues go to Prometheus (an engine-core process writes them to
    the multiprocess directory then)."""

    def schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
        vllm_hints.refresh(self)
        output = original(self, *args, **kwargs)
        vllm_metrics.flush_all()
        return output

    setattr(schedule, _MARK, original)
    return schedule


_WRAPPERS: dict[str, Callable[[Callable[..., Any]], Callable[..., Any]]] = {
    "touch": _wrap_touch,
    "cache_full_blocks": _wrap_cache_full_blocks,
    "_remove_cached_block_hashes": _wrap_remove_hashes,
    "get_new_blocks": _wrap_get_new_blocks,
    "move_block_hashes": _wrap_move,
    "reset_prefix_cache": _wrap_reset,
}
