"""A fake vLLM 0.33 with the real one's interface, written to a folder, for the plugin's tests.

CI's unit stage does not install vLLM, so the plugin's tests import this package instead:
``KVCacheBlock``, ``FreeKVCacheBlockQueue`` and the ``BlockPool`` methods the plugin wraps or
that call the queue, with vLLM's behaviour in each (the free order, hash-less blocks
prepended, cached ones appended, evict-on-reuse, ``unpin_blocks`` appending), and a
``Scheduler`` that builds its pool in its constructor, as vLLM's does. Written as files and
put first on ``sys.path`` so that ``importlib.reload`` works on it as on the real one
(``tests/integrations/conftest.py`` does that; ``test_vllm_integration.py`` drives the real
``BlockPool``).
"""

from __future__ import annotations

import textwrap
from pathlib import Path

__all__ = ["BLOCK_POOL", "KV_CACHE_UTILS", "SCHEDULER", "write_fake_vllm"]

KV_CACHE_UTILS = '''
from dataclasses import dataclass


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    _block_hash: bytes | None = None
    prev_free_block: "KVCacheBlock | None" = None
    next_free_block: "KVCacheBlock | None" = None
    is_null: bool = False

    @property
    def block_hash(self):
        return self._block_hash

    def reset_hash(self):
        self._block_hash = None


class FreeKVCacheBlockQueue:
    """vLLM's order, kept in a Python list."""

    def __init__(self, blocks):
        self.blocks = list(blocks)
        self.num_free_blocks = len(self.blocks)

    def popleft(self):
        if not self.blocks:
            raise ValueError("No free blocks available")
        return self.popleft_n(1)[0]

    def popleft_n(self, n):
        taken, self.blocks = self.blocks[:n], self.blocks[n:]
        self.num_free_blocks -= n
        return taken

    def remove(self, block):
        self.blocks = [b for b in self.blocks if b is not block]
        self.num_free_blocks -= 1

    def append(self, block):
        self.append_n([block])

    def append_n(self, blocks):
        self.blocks += blocks
        self.num_free_blocks += len(blocks)

    def prepend_n(self, blocks):
        self.blocks[:0] = blocks
        self.num_free_blocks += len(blocks)

    def get_all_free_blocks(self):
        return list(self.blocks)
'''

BLOCK_POOL = """
from vllm.v1.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock


def key_of(block_hash, group_id):
    return block_hash + group_id.to_bytes(4, "big")


class BlockPool:
    def __init__(self, num_gpu_blocks, enable_caching=True, hash_block_size=1):
        self.blocks = [KVCacheBlock(i) for i in range(num_gpu_blocks)]
        self.enable_caching = enable_caching
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached = {}  # key -> {block_id: block}
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        self.reused = []  # blocks whose unpin watcher fired

    def get_cached_block(self, block_hash, kv_cache_group_ids):
        found = []
        for group_id in kv_cache_group_ids:
            blocks = self.cached.get(key_of(block_hash, group_id))
            if not blocks:
                return None
            found.append(next(iter(blocks.values())))
        return found

    def cache_full_blocks(self, request, blocks, num_cached_blocks, num_full_blocks,
                          block_size, kv_cache_group_id, block_mask=None):
        for i, blk in enumerate(blocks[num_cached_blocks:num_full_blocks]):
            if blk.is_null or (block_mask is not None and not block_mask[i]):
                continue
            key = key_of(request.block_hashes[num_cached_blocks + i], kv_cache_group_id)
            assert blk.block_hash is None
            blk._block_hash = key
            self.cached.setdefault(key, {})[blk.block_id] = blk

    def _remove_cached_block_hashes(self, block):
        removed = []
        if block.block_hash is not None:
            blocks = self.cached.get(block.block_hash, {})
            if blocks.pop(block.block_id, None) is not None:
                removed.append(block.block_hash)
            if not blocks:
                self.cached.pop(block.block_hash, None)
        block.reset_hash()
        return removed

    def _maybe_evict_cached_block(self, block):
        return bool(self._remove_cached_block_hashes(block))

    def get_new_blocks(self, num_blocks):
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool")
        ret = self.free_block_queue.popleft_n(num_blocks)
        for block in ret:
            if self.enable_caching:
                self._maybe_evict_cached_block(block)
            assert block.ref_cnt == 0
            block.ref_cnt += 1
        return ret

    def touch(self, blocks):
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks):
        first, last = [], []
        for block in ordered_blocks:
            if block.is_null:
                continue
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                hashless = block.block_hash is None or not self.enable_caching
                (first if hashless else last).append(block)
        self.free_block_queue.prepend_n(first)
        self.free_block_queue.append_n(last)

    def unpin_blocks(self, blocks, on_reuse):
        released = []
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                released.append(block)
        self.free_block_queue.append_n(released)

    def evict_blocks(self, block_ids):
        for block_id in block_ids:
            self._maybe_evict_cached_block(self.blocks[block_id])

    def move_block_hashes(self, src_block, dst_block):
        assert dst_block.block_hash is None
        key = src_block.block_hash
        self._remove_cached_block_hashes(src_block)
        dst_block._block_hash = key
        self.cached.setdefault(key, {})[dst_block.block_id] = dst_block

    def reset_prefix_cache(self):
        if self.get_num_free_blocks() != len(self.blocks) - 1:
            return False
        self.cached.clear()
        for block in self.blocks:
            block.reset_hash()
        return True

    def get_num_free_blocks(self):
        return self.free_block_queue.num_free_blocks
"""

SCHEDULER = """
from vllm.v1.core.block_pool import BlockPool


class Scheduler:
    def __init__(self, vllm_config, kv_cache_config=None, num_blocks=8):
        self.vllm_config = vllm_config
        self.block_pool = BlockPool(num_blocks)
"""


def write_fake_vllm(root: Path, version: str, *, drop: tuple[str, ...] = ()) -> None:
    """A ``vllm`` package under ``root``: the block pool, its queue and the scheduler.

    ``drop`` names ``BlockPool`` methods left out (a vLLM whose pool differs).
    """
    core = root / "vllm" / "v1" / "core"
    (core / "sched").mkdir(parents=True)
    (root / "vllm" / "__init__.py").write_text(f"__version__ = {version!r}\n")
    for package in (root / "vllm" / "v1", core, core / "sched"):
        (package / "__init__.py").write_text("")
    (core / "kv_cache_utils.py").write_text(textwrap.dedent(KV_CACHE_UTILS))
    pool = textwrap.dedent(BLOCK_POOL)
    for name in drop:
        pool = pool.replace(f"    def {name}(", f"    def _dropped_{name}(")
    (core / "block_pool.py").write_text(pool)
    (core / "sched" / "scheduler.py").write_text(textwrap.dedent(SCHEDULER))
