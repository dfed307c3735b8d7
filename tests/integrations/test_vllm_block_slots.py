"""The native vLLM queue reads vLLM 0.33's ``KVCacheBlock`` at its slots' offsets.

``engine/native/vllm_block.cpp`` reads ``block_id``, ``ref_cnt``, ``is_null`` and
``_block_hash`` (and writes ``ref_cnt``) at the offsets of the type's ``__slots__`` member
descriptors, found once per type; anything else takes the generic attribute path. These tests
compare what it reads (``VllmQueue.read_block``) with what Python reads, for vLLM's type, for
types that must take the generic path, and for values the fast path does not cover; and check
that a pool keeps vLLM's hand-out order with blocks of each kind. Skipped without vLLM 0.33
(run as ``test_vllm_integration.py`` says).
"""

from __future__ import annotations

import gc
import importlib
import operator
import random
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from prefixcache.engine.native_engine import native_available, native_module
from prefixcache.integrations import vllm as plugin
from prefixcache.testing.vllm_pool import admit, chain
from prefixcache.testing.vllm_queue_driver import look_alike

vllm = pytest.importorskip("vllm", reason="vLLM is not installed (CI)")
if not str(vllm.__version__).startswith(plugin.SUPPORTED_VERSION + "."):
    pytest.skip(
        f"vLLM {vllm.__version__} is not {plugin.SUPPORTED_VERSION}.x", allow_module_level=True
    )
if not native_available():
    pytest.skip("the native engine is not built", allow_module_level=True)

block_pool = importlib.import_module("vllm.v1.core.block_pool")
KVCacheBlock = importlib.import_module("vllm.v1.core.kv_cache_utils").KVCacheBlock
read_block = native_module().VllmQueue.read_block


@pytest.fixture(autouse=True)
def _uninstalled() -> Iterator[None]:
    plugin.uninstall()
    yield
    plugin.uninstall()


def python_reads(block: Any) -> tuple[int, int, bool, Any]:
    """What the native code must read: vLLM's attributes, as integers and a truth value."""
    return (
        operator.index(block.block_id),
        operator.index(block.ref_cnt),
        bool(block.is_null),
        block.block_hash,
    )


class SubBlock(KVCacheBlock):  # type: ignore[misc, valid-type]
    """A subclass that changes nothing: read generically, with the same values."""

    __slots__ = ()


class HashedSubBlock(SubBlock):
    """A subclass: its own ``block_hash`` must be called, not the slot read."""

    __slots__ = ()

    @property
    def block_hash(self) -> Any:
        return ("sub", KVCacheBlock.block_hash.fget(self))


class PlainBlock:
    """A stand-in with an instance dict (no slots)."""

    def __init__(self, block_id: int) -> None:
        self.block_id, self.ref_cnt, self.is_null, self.block_hash = block_id, 0, False, None


def test_vllms_block_is_read_at_its_slots_with_its_values() -> None:
    """Distinct values in each slot: a wrong or swapped offset reads another one."""
    for block_id, refs, null, key in [
        (0, 0, False, None),
        (12345, 7, True, b"h" * 32),
        (3, 2**40, False, ("k", 1)),
    ]:
        block = KVCacheBlock(block_id, ref_cnt=refs, is_null=null)
        block._block_hash = key
        assert read_block(block) == (*python_reads(block), True)
    assert read_block(look_alike(9, 4, True, b"x"))[:4] == (9, 4, True, b"x")


def test_reading_takes_no_reference_and_keeps_none() -> None:
    """The slot reads hand out new references to the slots' objects, nothing more."""
    block_id, refs, key = 10**6 + 1, 10**6 + 2, b"key" * 11  # not cached small ints
    block = KVCacheBlock(block_id, ref_cnt=refs)
    block._block_hash = key
    before = [sys.getrefcount(value) for value in (block_id, refs, key)]
    for _ in range(1000):
        read = read_block(block)
    assert read[3] is key
    del read
    assert [sys.getrefcount(value) for value in (block_id, refs, key)] == before


def test_other_types_and_uncovered_values_take_the_generic_path() -> None:
    sub = HashedSubBlock(5, ref_cnt=1)
    sub._block_hash = b"s"
    assert read_block(sub) == (5, 1, False, ("sub", b"s"), False)
    assert read_block(SubBlock(5, ref_cnt=1)) == (5, 1, False, None, False)
    assert read_block(PlainBlock(6)) == (6, 0, False, None, False)
    block = KVCacheBlock(4)
    block.ref_cnt, block.is_null = True, 1  # a bool ref count, an int null flag
    assert read_block(block) == (4, 1, True, None, True)
    block.block_id, block.is_null = 2**70, []
    with pytest.raises(OverflowError):
        read_block(block)
    block.block_id = 8
    assert read_block(block)[:3] == (8, 1, False)
    del block.ref_cnt  # an empty slot: vLLM's own AttributeError
    with pytest.raises(AttributeError, match="ref_cnt"):
        read_block(block)


def run_workload(pool: Any, seed: int, steps: int = 300) -> tuple[list[int], list[Any]]:
    """Concurrent requests on shared prefixes, freed in reverse as vLLM frees them."""
    rng = random.Random(seed)
    running: list[list[Any]] = []
    hits = []
    for _ in range(steps):
        if running and (rng.random() < 0.45 or pool.get_num_free_blocks() < 8):
            pool.free_blocks(reversed(running.pop(rng.randrange(len(running)))))
            continue
        blocks, num_hit = admit(
            pool, chain(rng.randrange(4), *(rng.randrange(3) for _ in range(4)))
        )
        hits.append(num_hit)
        running.append(blocks)
    held = sorted((block.block_id, block.ref_cnt) for blocks in running for block in blocks)
    return hits, held


@pytest.mark.parametrize("kind", [KVCacheBlock, SubBlock])
def test_lru_in_the_native_queue_keeps_vllms_order_with_each_block_type(
    kind: type, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's pool built of ``kind`` blocks: under the plugin's lru (native queue, hooks and
    get_new_blocks in C) the same hits and ref counts as vLLM's own pool."""
    monkeypatch.setattr(block_pool, "KVCacheBlock", kind)
    monkeypatch.setenv("PREFIXCACHE_ENGINE", "auto")  # the suite's default is python
    for seed in range(3):
        vanilla = run_workload(block_pool.BlockPool(24, True, 16), seed)
        plugin.install("lru")
        pool = block_pool.BlockPool(24, True, 16)
        assert isinstance(pool.free_block_queue, native_module().VllmQueue)
        assert type(pool.blocks[1]) is kind
        assert run_workload(pool, seed) == vanilla
        pool.free_block_queue.check_invariants()
        plugin.uninstall()


def test_get_new_blocks_in_c_leaves_the_pools_attributes_inline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Asking whether a pool shadows a method must not build its ``__dict__`` (on Python
    3.11 that slows every ``self.<attribute>`` of vLLM's methods for the pool's life): the
    collector sees the attribute values, not a dict holding them."""
    monkeypatch.setenv("PREFIXCACHE_ENGINE", "auto")
    plugin.install("lru")
    pool = block_pool.BlockPool(24, True, 16)
    assert isinstance(pool.free_block_queue, native_module().VllmQueue)
    pool.free_blocks(pool.get_new_blocks(3))
    assert not any(
        isinstance(item, dict) and item.get("free_block_queue") is pool.free_block_queue
        for item in gc.get_referents(pool)
    )


def test_a_changed_block_type_is_looked_at_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """The layout found for vLLM's type stands only while the type is unchanged: a property
    put over ``block_hash`` afterwards is called (the slot is no longer read)."""
    block = KVCacheBlock(2)
    assert read_block(block)[4]
    monkeypatch.setattr(KVCacheBlock, "block_hash", property(lambda self: "patched"))
    assert read_block(block) == (2, 0, False, "patched", False)
