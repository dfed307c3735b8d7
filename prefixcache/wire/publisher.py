"""Publishing KV cache events over ZeroMQ in vLLM's wire format, with replay.

Routers that place requests by cached prefix (NVIDIA Dynamo's KV router and
standalone indexer, llm-d's KV cache manager) subscribe to the events an
engine publishes. :class:`ZmqEventPublisher` speaks the protocol of vLLM's
``ZmqEventPublisher`` (``vllm/distributed/kv_events.py``, vLLM 0.33), so an
engine that embeds prefixcache plugs into those routers unchanged:

- a publishing socket sends one multipart message per batch:
  ``(topic, sequence number as 8 bytes big-endian, payload)``; sequence numbers
  start at 0 and grow by one per batch. It is an XPUB socket with
  ``ZMQ_XPUB_NODROP`` (SUB sockets connect to it exactly as to vLLM's PUB):
  where a PUB socket silently drops what a slow subscriber cannot take, this
  one refuses the non-blocking send, and the batch is counted as dropped
  (:attr:`ZmqEventPublisher.num_dropped_batches`) while it stays in the replay
  buffer under its sequence number;
- the payload is msgpack of the array ``[timestamp, [events...], data_parallel_rank]``;
- ``encoding="vllm"`` writes each event as a map tagged by its class name,
  ``{"type": "BlockStored", "block_hashes": [...], ...}``, with vLLM 0.33's
  field names; fields prefixcache does not track are written as vLLM writes
  them when unset (``lora_id`` None) or left out (fields with defaults, as
  msgspec's ``omit_defaults`` does); ``BlockStored`` carries ``group_idx``, the
  KV cache group, as vLLM's block pool sends it (0: one group);
- ``encoding="legacy_array"`` writes the older array-like events
  (``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
  lora_id, medium]``, ``["BlockRemoved", block_hashes, medium]``,
  ``["AllBlocksCleared"]``), which llm-d's kv-cache-manager decodes;
- an optional ROUTER replay socket answers a request ``[identity, b"", start_seq]``
  with every buffered batch numbered ``start_seq`` or later, each as
  ``[identity, b"", topic, seq, payload]``, then the end marker
  ``[identity, b"", b"", seq -1, b""]``. The replay buffer keeps the last
  ``buffer_size`` batches. As vLLM's publisher does, ``start_seq`` is read as
  a big-endian unsigned int of whatever length it has (an empty frame is 0:
  everything buffered), and a request of another frame count is ignored.

Publishing stays off the allocator's hot path: the scheduler drains
``allocator.take_events()`` when it likes (after a step) and hands them to
:meth:`ZmqEventPublisher.publish`, which encodes and sends without blocking.
A router that joins late asks the replay socket, or the engine publishes
``allocator.snapshot()`` first (:meth:`ZmqEventPublisher.publish_snapshot`).

Endpoints default to the loopback interface; binding elsewhere is the
caller's explicit choice. Needs the ``events`` extra
(``pip install -e '.[events]' in a clone``: pyzmq and msgspec).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

from prefixcache.engine.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from prefixcache.engine.validation import require_int
from prefixcache.errors import ConfigError, InvalidArgumentError

if TYPE_CHECKING:
    from prefixcache.engine.allocator import KVBlockAllocator

try:
    import msgspec
    import zmq
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "prefixcache.wire.publisher needs pyzmq and msgspec: pip install -e '.[events]' in a clone"
    ) from exc

__all__ = ["ENCODINGS", "END_SEQ", "ZmqEventPublisher", "encode_batch", "encode_event"]

ENCODINGS = ("vllm", "legacy_array")
"""Event encodings: vLLM 0.33's tagged maps, or the older tagged arrays llm-d decodes."""

END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""Sequence frame of the replay socket's end marker."""

_POLL_MS = 50  # how long the replay thread waits for a request before checking for close
GROUP_IDX = 0
"""``group_idx`` of every ``BlockStored``: the allocator manages one KV cache group."""


def encode_event(event: KVCacheEvent, encoding: str = "vllm") -> dict[str, Any] | list[Any]:
    """One event as the plain structure msgpack writes (a tagged map or a tagged array).

    Args:
        event: a :class:`~prefixcache.engine.events.BlockStored`, ``BlockRemoved``
            or ``AllBlocksCleared``.
        encoding: ``"vllm"`` or ``"legacy_array"``.

    Raises:
        InvalidArgumentError: an unknown event type or encoding.

    Complexity: O(hashes + tokens of the event).
    """
    if encoding not in ENCODINGS:
        raise InvalidArgumentError(f"unknown encoding {encoding!r}; valid: {', '.join(ENCODINGS)}")
    legacy = encoding == "legacy_array"
    if isinstance(event, BlockStored):
        hashes, tokens = list(event.block_hashes), list(event.token_ids)
        if legacy:
            fields = [hashes, event.parent_block_hash, tokens, event.block_size, None, event.medium]
            # lora_name came after medium, with a default: omitted when unset.
            tail = [] if event.lora_name is None else [event.lora_name]
            return ["BlockStored", *fields, *tail]
        return {
            "type": "BlockStored",
            "block_hashes": hashes,
            "parent_block_hash": event.parent_block_hash,
            "token_ids": tokens,
            "block_size": event.block_size,
            "lora_id": None,  # deprecated in vLLM; lora_name carries the adapter
            "medium": event.medium,
            "lora_name": event.lora_name,
            "group_idx": GROUP_IDX,  # after extra_keys, which is left out when None
        }
    if isinstance(event, BlockRemoved):
        if legacy:
            return ["BlockRemoved", list(event.block_hashes), event.medium]
        return {
            "type": "BlockRemoved",
            "block_hashes": list(event.block_hashes),
            "medium": event.medium,
        }
    if isinstance(event, AllBlocksCleared):
        return ["AllBlocksCleared"] if legacy else {"type": "AllBlocksCleared"}
    raise InvalidArgumentError(f"not a KV cache event: {event!r}")


def encode_batch(
    events: Sequence[KVCacheEvent],
    timestamp: float,
    data_parallel_rank: int = 0,
    encoding: str = "vllm",
) -> bytes:
    """The msgpack payload ``[timestamp, [events...], data_parallel_rank]`` of one batch.

    Raises:
        InvalidArgumentError: an unknown event type or encoding.

    Complexity: O(size of the events).
    """
    body = [encode_event(event, encoding) for event in events]
    return msgspec.msgpack.encode([timestamp, body, data_parallel_rank])


class ZmqEventPublisher:
    """Publishes batches of KV cache events on a ZMQ XPUB socket, with a replay socket.

    Methods by purpose:

    - Publishing: :meth:`publish`, :meth:`publish_snapshot`, :meth:`drain`.
    - Life cycle: :meth:`close`, or use it as a context manager.
    - Counters: :attr:`num_published_batches`, :attr:`num_published_events`,
      :attr:`num_dropped_batches`, :attr:`num_dropped_events`,
      :attr:`num_replay_requests`, :attr:`next_seq`.

    Every batch gets a sequence number and goes into the replay buffer; it
    is then either sent (``num_published_*``) or dropped (``num_dropped_*``):
    the socket's queue towards some subscriber holds ``send_high_water_mark``
    messages already (a slow or stalled subscriber), and ZeroMQ's
    ``XPUB_NODROP`` refuses the send for all of them rather than losing it
    silently for one. A dropped batch leaves a gap in the sequence numbers
    that every subscriber sees; it recovers the batch from the replay socket
    while it is among the last ``buffer_size`` batches, else resynchronises
    from a snapshot. ``num_published_batches + num_dropped_batches ==
    next_seq`` always.

    ``publish`` is called from one thread (the scheduler's). When a replay
    endpoint is given, a daemon thread answers replay requests; the replay
    buffer is shared with it under a lock.

    Args:
        endpoint: PUB address to bind, e.g. ``"tcp://127.0.0.1:5557"``; port 0
            picks a free port (read the bound address from :attr:`endpoint`).
        replay_endpoint: ROUTER address to bind for replay requests, or None.
        topic: first frame of every message (subscribers filter on it).
        data_parallel_rank: written into every batch.
        buffer_size: batches kept for replay (>= 1).
        encoding: ``"vllm"`` (default) or ``"legacy_array"``.
        clock: returns the batch timestamp in seconds (injected by tests).
        send_high_water_mark: messages the socket queues per subscriber
            before a send is refused and counted as dropped.

    Raises:
        ConfigError: a bad option.
        zmq.ZMQError: an endpoint cannot be bound.
    """

    def __init__(
        self,
        endpoint: str = "tcp://127.0.0.1:5557",
        replay_endpoint: str | None = None,
        *,
        topic: str = "",
        data_parallel_rank: int = 0,
        buffer_size: int = 10_000,
        encoding: str = "vllm",
        clock: Callable[[], float] = time.time,
        send_high_water_mark: int = 100_000,
    ) -> None:
        if encoding not in ENCODINGS:
            raise ConfigError(f"unknown encoding {encoding!r}; valid: {', '.join(ENCODINGS)}")
        buffer_size = require_int(buffer_size, "buffer_size", minimum=1, error=ConfigError)
        data_parallel_rank = require_int(
            data_parallel_rank, "data_parallel_rank", minimum=0, error=ConfigError
        )
        send_high_water_mark = require_int(
            send_high_water_mark, "send_high_water_mark", minimum=1, error=ConfigError
        )
        self.encoding = encoding
        self.topic = topic
        self.data_parallel_rank = data_parallel_rank
        self.buffer_size = buffer_size
        self._topic_bytes = topic.encode("utf-8")
        self._clock = clock
        self._context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        # XPUB, not PUB: with XPUB_NODROP a full queue refuses the send (EAGAIN
        # under NOBLOCK) instead of dropping the message unseen.
        self._pub = self._context.socket(zmq.XPUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.XPUB_NODROP, 1)
        self._pub.set_hwm(send_high_water_mark)
        self._replay: zmq.Socket[bytes] | None = None
        try:
            self.endpoint = self._bind(self._pub, endpoint)
            self.replay_endpoint: str | None = None
            if replay_endpoint is not None:
                self._replay = self._context.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                # Room for a whole replay plus its end marker, as vLLM sizes it.
                self._replay.setsockopt(zmq.SNDHWM, 2 * (buffer_size + 1))
                self.replay_endpoint = self._bind(self._replay, replay_endpoint)
        except zmq.ZMQError:
            self._close_sockets()
            raise
        # (seq, payload) of the last buffer_size batches, shared with the replay thread.
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_size)
        self._lock = threading.Lock()
        self.next_seq = 0
        self.num_published_batches = 0
        self.num_published_events = 0
        self.num_dropped_batches = 0
        self.num_dropped_events = 0
        self.num_replay_requests = 0
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        if self._replay is not None:
            self._thread = threading.Thread(
                target=self._serve_replay, name="prefixcache-kv-replay", daemon=True
            )
            self._thread.start()

    @staticmethod
    def _bind(socket: zmq.Socket[bytes], endpoint: str) -> str:
        socket.bind(endpoint)
        return socket.getsockopt_string(zmq.LAST_ENDPOINT)

    # ------------------------------------------------------------------ publishing

    def publish(self, events: Sequence[KVCacheEvent]) -> int | None:
        """Send ``events`` as one batch and keep it for replay.

        An empty sequence sends nothing. A batch the socket cannot queue for
        every subscriber (one of them is at the high-water mark) is sent to
        none, counted in :attr:`num_dropped_batches` and
        :attr:`num_dropped_events`, and stays in the replay buffer under its
        sequence number, so a subscriber that notices the gap can replay it.

        Args:
            events: events in the order the allocator recorded them.

        Returns:
            The batch's sequence number, or None when ``events`` is empty.

        Raises:
            InvalidArgumentError: the publisher is closed, or an event is not a
                KV cache event (nothing is sent, the sequence does not advance).

        Complexity: O(size of the events), one non-blocking send.
        """
        if self._closed.is_set():
            raise InvalidArgumentError("publisher is closed")
        if not events:
            return None
        payload = encode_batch(events, self._clock(), self.data_parallel_rank, self.encoding)
        seq = self.next_seq
        self.next_seq += 1
        with self._lock:
            self._buffer.append((seq, payload))
        self._discard_subscriptions()
        try:
            self._pub.send_multipart(
                (self._topic_bytes, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK
            )
        except zmq.Again:
            self.num_dropped_batches += 1
            self.num_dropped_events += len(events)
            return seq
        self.num_published_batches += 1
        self.num_published_events += len(events)
        return seq

    def _discard_subscriptions(self) -> None:
        """Read the (un)subscription messages XPUB queues for us, so they never pile up."""
        try:
            while True:
                self._pub.recv(flags=zmq.NOBLOCK)
        except zmq.Again:
            return

    def drain(self, allocator: KVBlockAllocator) -> int | None:
        """Publish whatever ``allocator.take_events()`` returns, as one batch.

        Raises:
            ConfigError: the allocator records no events.

        Complexity: O(queued events).
        """
        return self.publish(allocator.take_events())

    def publish_snapshot(self, allocator: KVBlockAllocator) -> int | None:
        """Publish ``AllBlocksCleared`` then every resident hash, parents first.

        Resynchronises subscribers that joined late or saw the allocator's
        event queue drop events. Drain queued events first: they describe
        changes older than the snapshot.

        Raises:
            ConfigError: the allocator records no events.

        Complexity: O(n log n) in registered blocks.
        """
        return self.publish([AllBlocksCleared(), *allocator.snapshot()])

    # ------------------------------------------------------------------ replay

    def _serve_replay(self) -> None:
        replay = self._replay
        assert replay is not None  # the thread runs only with a replay socket
        while not self._closed.is_set():
            try:
                if not replay.poll(_POLL_MS):
                    continue
                frames = replay.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                return  # the socket was closed under us
            if len(frames) != 3:
                continue  # not a replay request; vLLM ignores these too
            identity, _, start = frames
            # Any length, as vLLM reads it: b"" is 0, a short frame a small number.
            self._answer_replay(replay, identity, int.from_bytes(start, "big"))

    def _answer_replay(self, replay: zmq.Socket[bytes], identity: bytes, start_seq: int) -> None:
        with self._lock:
            batches = [(seq, payload) for seq, payload in self._buffer if seq >= start_seq]
            self.num_replay_requests += 1
        for seq, payload in batches:
            replay.send_multipart(
                (identity, b"", self._topic_bytes, seq.to_bytes(8, "big"), payload)
            )
        replay.send_multipart((identity, b"", b"", END_SEQ, b""))

    # ------------------------------------------------------------------ life cycle

    def close(self) -> None:
        """Stop the replay thread and close the sockets. Idempotent.

        Complexity: O(1), waits at most one replay poll interval.
        """
        if self._closed.is_set():
            return
        self._closed.set()
        if self._thread is not None:
            self._thread.join()
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    @property
    def is_closed(self) -> bool:
        """Whether :meth:`close` was called. O(1)."""
        return self._closed.is_set()

    def __enter__(self) -> ZmqEventPublisher:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"ZmqEventPublisher(endpoint={self.endpoint!r}, replay_endpoint="
            f"{self.replay_endpoint!r}, encoding={self.encoding!r}, next_seq={self.next_seq})"
        )
