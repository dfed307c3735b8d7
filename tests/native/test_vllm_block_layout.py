"""The native vLLM queue's slot reads without vLLM (so the sanitizer build runs them).

``engine/native/vllm_block.cpp`` reads a block type named ``KVCacheBlock`` from a ``vllm.``
module at its ``__slots__``' offsets. A look-alike of that name and module, its slots in
another order (:data:`~prefixcache.testing.vllm_queue_driver.LookAlike`), must be read at
its own offsets with its own values, take no reference and keep none; a type of another
name takes the generic path with the same answers. vLLM's own type:
``tests/integrations/test_vllm_block_slots.py``.
"""

from __future__ import annotations

import sys

import pytest

from prefixcache.engine.native_engine import native_available, native_module
from prefixcache.testing.vllm_queue_driver import Block, LookAlike, look_alike

pytestmark = pytest.mark.skipif(not native_available(), reason="the native engine is not built")


def read(block: object) -> tuple[int, int, bool, object, bool]:
    result: tuple[int, int, bool, object, bool] = native_module().VllmQueue.read_block(block)
    return result


@pytest.mark.parametrize(
    ("block_id", "ref_cnt", "is_null", "key"),
    [(0, 0, False, None), (12345, 7, True, b"h" * 32), (3, 2**40, False, ("k", 1))],
)
def test_a_look_alike_is_read_at_its_own_slots(
    block_id: int, ref_cnt: int, is_null: bool, key: object
) -> None:
    assert read(look_alike(block_id, ref_cnt, is_null, key)) == (
        block_id,
        ref_cnt,
        is_null,
        key,
        True,
    )


def test_slot_reads_take_no_reference_and_keep_none() -> None:
    block_id, refs, key = 10**6 + 1, 10**6 + 2, b"key" * 11  # not cached small ints
    block = look_alike(block_id, refs, False, key)
    before = [sys.getrefcount(value) for value in (block_id, refs, key)]
    for _ in range(1000):
        result = read(block)
    assert result[3] is key
    del result
    assert [sys.getrefcount(value) for value in (block_id, refs, key)] == before


def test_other_types_and_odd_values_take_the_generic_path() -> None:
    stand_in = Block(6, b"s")
    stand_in.ref_cnt = 2  # type: ignore[attr-defined]
    assert read(stand_in) == (6, 2, False, b"s", False)
    block = look_alike(4, 1, False, None)
    block.ref_cnt, block.is_null = True, 1  # a bool count, an int flag: read as Python does
    assert read(block)[:3] == (4, 1, True)
    del block.ref_cnt  # an empty slot: the AttributeError Python raises
    with pytest.raises(AttributeError, match="ref_cnt"):
        read(block)
    assert LookAlike.__name__ == "KVCacheBlock"
