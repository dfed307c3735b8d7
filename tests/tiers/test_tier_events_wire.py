"""Host-tier events go on the wire as vLLM's BlockStored/BlockRemoved with medium "CPU"."""

from __future__ import annotations

import pytest

msgspec = pytest.importorskip("msgspec", reason="the events extra (msgspec) is not installed")

from prefixcache.wire.publisher import encode_batch  # noqa: E402


# vLLM's structs, re-declared (module level: msgspec resolves the annotations here).
class _Event(msgspec.Struct, tag=True, omit_defaults=True):
    pass


class BlockStoredV(_Event, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list | None = None


class BlockRemovedV(_Event, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class ClearedV(_Event, tag="AllBlocksCleared"):
    pass


class Batch(msgspec.Struct, array_like=True):
    ts: float
    events: list[BlockStoredV | BlockRemovedV | ClearedV]
    data_parallel_rank: int | None = None


def test_host_events_decode_as_vllm_events_with_their_medium(make_loop):
    loop = make_loop(5, 2, events=64)  # 4 device blocks, 2 host slots: both tiers evict
    for seed in range(3):
        loop.admit(seed, [seed * 100 + i for i in range(16)])
        loop.requests.finish(seed)
    batch = msgspec.msgpack.decode(encode_batch(loop.tiered.take_events(), 1.0), type=Batch)
    media = {(type(e).__name__, e.medium) for e in batch.events}
    assert ("BlockStoredV", "CPU") in media and ("BlockRemovedV", "CPU") in media
    assert ("BlockStoredV", "GPU") in media and ("BlockRemovedV", "GPU") in media
