"""Host-tier events go on the wire as vLLM's BlockStored/BlockRemoved with medium "CPU"."""

from __future__ import annotations

import pytest

msgspec = pytest.importorskip("msgspec", reason="the events extra (msgspec) is not installed")

from prefixcache.wire.publisher import encode_batch  # noqa: E402


def test_host_events_decode_as_vllm_events_with_their_medium(make_loop, vllm_events):
    loop = make_loop(5, 2, events=64)  # 4 device blocks, 2 host slots: both tiers evict
    for seed in range(3):
        loop.admit(seed, [seed * 100 + i for i in range(16)])
        loop.requests.finish(seed)
    payload = encode_batch(loop.tiered.take_events(), 1.0)
    batch = msgspec.msgpack.decode(payload, type=vllm_events.Batch)
    media = {(type(e).__name__, e.medium) for e in batch.events}
    assert ("BlockStoredV", "CPU") in media and ("BlockRemovedV", "CPU") in media
    assert ("BlockStoredV", "GPU") in media and ("BlockRemovedV", "GPU") in media
