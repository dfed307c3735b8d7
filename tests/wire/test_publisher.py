"""ZmqEventPublisher: vLLM's wire format over PUB/SUB and the ROUTER replay socket, on loopback."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

zmq = pytest.importorskip("zmq")
msgspec = pytest.importorskip("msgspec")

from prefixcache import KVBlockAllocator  # noqa: E402
from prefixcache.engine.events import AllBlocksCleared, BlockRemoved, BlockStored  # noqa: E402
from prefixcache.errors import ConfigError, InvalidArgumentError  # noqa: E402
from prefixcache.wire.publisher import END_SEQ, ZmqEventPublisher, encode_batch  # noqa: E402

LOOPBACK = "tcp://127.0.0.1:0"
TIMEOUT_MS = 3000
STORED = BlockStored((11, 12), None, tuple(range(8)), 4, lora_name=None, medium="GPU")
REMOVED = BlockRemoved((12,), "GPU")
VLLM_STORED_KEYS = [
    "type",
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "group_idx",
]


def receive(sub: zmq.Socket) -> list[bytes]:
    assert sub.poll(TIMEOUT_MS), "no message"
    return sub.recv_multipart()


def test_round_trip_vllm_encoding(context: zmq.Context, subscribe: Callable[..., Any]) -> None:
    with ZmqEventPublisher(LOOPBACK, topic="kv", data_parallel_rank=3, clock=lambda: 12.5) as pub:
        assert pub.endpoint.startswith("tcp://127.0.0.1:")
        sub, _ = subscribe(context, pub, topic=b"kv")
        first = pub.publish([STORED, REMOVED])
        second = pub.publish([AllBlocksCleared()])
        frames = [receive(sub), receive(sub)]
    assert second == first + 1
    (topic, seq, payload), (_, seq2, payload2) = frames
    assert topic == b"kv"
    assert len(seq) == 8 and int.from_bytes(seq, "big") == first
    assert int.from_bytes(seq2, "big") == first + 1
    timestamp, events, rank = msgspec.msgpack.decode(payload)
    assert (timestamp, rank) == (12.5, 3)
    stored, removed = events
    assert list(stored) == VLLM_STORED_KEYS
    assert stored == {
        "type": "BlockStored",
        "block_hashes": [11, 12],
        "parent_block_hash": None,
        "token_ids": list(range(8)),
        "block_size": 4,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "group_idx": 0,
    }
    assert removed == {"type": "BlockRemoved", "block_hashes": [12], "medium": "GPU"}
    assert msgspec.msgpack.decode(payload2)[1] == [{"type": "AllBlocksCleared"}]


def test_vllm_decodes_our_payload(vllm_events: SimpleNamespace) -> None:
    """vLLM 0.33's own msgspec structs (re-declared in conftest) decode the payload."""

    batch = msgspec.msgpack.decode(
        encode_batch([STORED, REMOVED, AllBlocksCleared()], 1.0), type=vllm_events.Batch
    )
    assert batch.events[0].block_hashes == [11, 12]
    assert batch.events[0].extra_keys is None
    assert isinstance(batch.events[1], vllm_events.BlockRemovedV)
    assert isinstance(batch.events[2], vllm_events.ClearedV)
    assert batch.data_parallel_rank == 0


def test_round_trip_legacy_array_encoding(
    context: zmq.Context, subscribe: Callable[..., Any]
) -> None:
    lora = BlockStored((5,), 4, (1, 2, 3, 4), 4, lora_name="ad", medium="GPU")
    with ZmqEventPublisher(LOOPBACK, encoding="legacy_array") as pub:
        sub, _ = subscribe(context, pub)
        pub.publish([STORED, lora, REMOVED, AllBlocksCleared()])
        _, _, payload = receive(sub)
    _, events, _ = msgspec.msgpack.decode(payload)
    assert events == [
        ["BlockStored", [11, 12], None, list(range(8)), 4, None, "GPU"],
        ["BlockStored", [5], 4, [1, 2, 3, 4], 4, None, "GPU", "ad"],
        ["BlockRemoved", [12], "GPU"],
        ["AllBlocksCleared"],
    ]


def test_replay_sends_buffered_batches_then_end_marker(
    context: zmq.Context, replay_from: Callable[..., Any]
) -> None:
    with ZmqEventPublisher(LOOPBACK, LOOPBACK, topic="t", buffer_size=3) as pub:
        assert pub.replay_endpoint is not None
        for block_hash in range(1, 6):  # seqs 0..4; the buffer keeps 2, 3, 4
            pub.publish([BlockRemoved((block_hash,))])
        late = replay_from(context, pub.replay_endpoint, (3).to_bytes(8, "big"))
        everything = replay_from(context, pub.replay_endpoint, (0).to_bytes(8, "big"))
        assert pub.num_replay_requests == 2
    assert [frames[:3] for frames in late[:-1]] == [
        [b"", b"t", (3).to_bytes(8, "big")],
        [b"", b"t", (4).to_bytes(8, "big")],
    ]
    assert msgspec.msgpack.decode(late[0][3])[1] == [
        {"type": "BlockRemoved", "block_hashes": [4], "medium": "GPU"}
    ]
    assert late[-1] == [b"", b"", END_SEQ, b""]
    assert [int.from_bytes(f[2], "big") for f in everything[:-1]] == [2, 3, 4]


def test_counts_and_empty_batches(make: Callable[..., KVBlockAllocator]) -> None:
    allocator = make(kv_events_capacity=10)
    with ZmqEventPublisher(LOOPBACK) as pub:
        assert pub.drain(allocator) is None  # nothing queued: nothing sent
        ids = allocator.allocate_memory_blocks(2)
        allocator.register_kv_block_hashes(ids, [11, 12])
        allocator.release_memory_blocks(ids)
        allocator.evict_cached_blocks(1)
        assert pub.drain(allocator) == 0
        assert pub.publish_snapshot(allocator) == 1
        assert (pub.num_published_batches, pub.num_published_events) == (2, 4)
        assert pub.num_dropped_events == 0
        with pytest.raises(InvalidArgumentError):
            pub.publish(["not an event"])  # type: ignore[list-item]
        assert pub.next_seq == 2
    assert pub.is_closed
    with pytest.raises(InvalidArgumentError):
        pub.publish([REMOVED])
    pub.close()  # idempotent


def test_bad_options_are_refused() -> None:
    with pytest.raises(ConfigError):
        ZmqEventPublisher(LOOPBACK, encoding="json")
    with pytest.raises(ConfigError):
        ZmqEventPublisher(LOOPBACK, buffer_size=0)


def test_a_busy_port_raises_and_leaks_nothing() -> None:
    with ZmqEventPublisher(LOOPBACK) as pub, pytest.raises(zmq.ZMQError):
        ZmqEventPublisher(pub.endpoint)
