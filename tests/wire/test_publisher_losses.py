"""Issue 15, item 7: the publisher counts every batch a slow subscriber could not take.

Real sockets on loopback (127.0.0.1) only, bounded in count: a subscriber
that stops reading fills its queues, the publisher's sends are refused and
counted, and the replay socket gives back every counted batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

zmq = pytest.importorskip("zmq")
msgspec = pytest.importorskip("msgspec")

from prefixcache.engine.events import BlockRemoved, BlockStored  # noqa: E402
from prefixcache.wire.publisher import END_SEQ, ZmqEventPublisher, encode_event  # noqa: E402

LOOPBACK = "tcp://127.0.0.1:0"
MAX_BATCHES = 3000  # a bound on the flood: about 100 MB at most
BIG = BlockRemoved(tuple(range(1, 4097)))  # about 36 KB of msgpack per batch


def test_a_slow_subscriber_makes_counted_and_replayable_drops(
    context: zmq.Context, subscribe: Callable[..., Any], replay_from: Callable[..., Any]
) -> None:
    with ZmqEventPublisher(
        LOOPBACK, LOOPBACK, send_high_water_mark=4, buffer_size=MAX_BATCHES + 400
    ) as pub:
        assert pub.replay_endpoint is not None
        slow, first = subscribe(context, pub, hwm=4)
        sent = 0
        while pub.num_dropped_batches < 5 and sent < MAX_BATCHES:
            pub.publish([BIG])  # the subscriber reads nothing meanwhile
            sent += 1
        assert pub.num_dropped_batches >= 5, "the PUB high-water mark lost batches unseen"
        assert pub.num_dropped_events == pub.num_dropped_batches
        assert pub.num_published_batches + pub.num_dropped_batches == pub.next_seq
        received = set()
        while slow.poll(200):  # drain what did get through
            received.add(int.from_bytes(slow.recv_multipart()[1], "big"))
        expected = set(range(first, pub.next_seq))
        missing = expected - received
        assert len(missing) == pub.num_dropped_batches  # every loss is counted, and only losses
        replayed = {
            int.from_bytes(frames[2], "big")
            for frames in replay_from(context, pub.replay_endpoint, first.to_bytes(8, "big"))[:-1]
        }
        assert missing <= replayed  # a consumer that saw the gap gets every lost batch back


def test_a_fast_subscriber_sees_no_drops(
    context: zmq.Context, subscribe: Callable[..., Any]
) -> None:
    with ZmqEventPublisher(LOOPBACK) as pub:
        sub, first = subscribe(context, pub)
        for block_hash in range(1, 201):
            pub.publish([BlockRemoved((block_hash,))])
        seqs = [int.from_bytes(sub.recv_multipart()[1], "big") for _ in range(200)]
        assert seqs == list(range(first, first + 200))
        assert pub.num_dropped_batches == 0
        assert pub.num_published_batches == pub.next_seq


@pytest.mark.parametrize(
    ("start", "expected"),
    [(b"", [0, 1, 2]), (b"\x02", [2]), ((1).to_bytes(4, "big"), [1, 2]), (b"\x00" * 9, [0, 1, 2])],
)
def test_replay_start_frames_of_any_length_are_answered_as_vllm_does(
    context: zmq.Context, start: bytes, expected: list[int], replay_from: Callable[..., Any]
) -> None:
    with ZmqEventPublisher(LOOPBACK, LOOPBACK) as pub:
        assert pub.replay_endpoint is not None
        for block_hash in (1, 2, 3):
            pub.publish([BlockRemoved((block_hash,))])
        replies = replay_from(context, pub.replay_endpoint, start)
    assert [int.from_bytes(frames[2], "big") for frames in replies[:-1]] == expected
    assert replies[-1] == [b"", b"", END_SEQ, b""]


def test_block_stored_carries_group_idx_as_vllm_sends_it() -> None:
    stored = encode_event(BlockStored((11,), None, (1, 2, 3, 4), 4))
    assert isinstance(stored, dict)
    assert stored["group_idx"] == 0
    assert list(stored)[-1] == "group_idx"  # vLLM's field order, extra_keys (None) left out

    class BlockStoredV(msgspec.Struct, tag="BlockStored", omit_defaults=True):
        block_hashes: list[int]
        parent_block_hash: int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list | None = None
        group_idx: int | None = None

    decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(stored), type=BlockStoredV)
    assert decoded.group_idx == 0
