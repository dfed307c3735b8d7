"""Wire test fixtures: a ZeroMQ context, and a subscriber and replay client for the publisher.

The publisher tests talk to :class:`~prefixcache.wire.publisher.ZmqEventPublisher`
over real loopback sockets. zmq is imported inside the fixtures, so the wire
tests that need no sockets still run where pyzmq (the events extra) is absent.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

TIMEOUT_MS = 5000
"""A bound on waiting for a replay answer, never a timing assertion."""


@pytest.fixture
def context() -> Iterator[Any]:
    """A ``zmq.Context``, destroyed without linger after the test; skips without pyzmq."""
    zmq = pytest.importorskip("zmq")
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def connected_subscriber(
    context: Any, publisher: Any, *, topic: bytes = b"", hwm: int = 0
) -> tuple[Any, int]:
    """A SUB socket that provably receives; returns it and the next sequence number it reads.

    A SUB socket misses what is sent before its subscription reaches the
    publisher (ZeroMQ's slow joiner), so the publisher sends probe batches
    until one arrives, and the probes are read off. ``hwm`` (when not 0) sets
    a small receive queue and kernel buffer, for tests of a slow subscriber.
    """
    import zmq

    sub = context.socket(zmq.SUB)
    if hwm:
        sub.setsockopt(zmq.RCVHWM, hwm)
        sub.setsockopt(zmq.RCVBUF, 4096)  # a small kernel buffer: the backlog reaches zmq soon
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.connect(publisher.endpoint)
    from prefixcache.engine.events import AllBlocksCleared

    for _ in range(200):
        publisher.publish([AllBlocksCleared()])
        if sub.poll(25):
            while sub.poll(25):
                sub.recv_multipart()
            return sub, publisher.next_seq
    raise AssertionError("subscriber never connected")


def replay_batches(context: Any, endpoint: str, start: bytes) -> list[list[bytes]]:
    """Ask the replay socket at ``endpoint`` for the batches from ``start`` on, as vLLM does.

    Returns every reply's frames, the end marker's last.
    """
    import zmq

    from prefixcache.wire.publisher import END_SEQ

    dealer = context.socket(zmq.DEALER)
    dealer.connect(endpoint)
    dealer.send_multipart([b"", start])
    replies = []
    while True:
        assert dealer.poll(TIMEOUT_MS), "replay did not answer"
        frames = dealer.recv_multipart()
        replies.append(frames)
        if frames[2] == END_SEQ:
            dealer.close(linger=0)
            return replies


@pytest.fixture(scope="session")
def subscribe() -> Callable[..., tuple[Any, int]]:
    """The :func:`connected_subscriber` function."""
    return connected_subscriber


@pytest.fixture(scope="session")
def replay_from() -> Callable[..., list[list[bytes]]]:
    """The :func:`replay_batches` function."""
    return replay_batches
