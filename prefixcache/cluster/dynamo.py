"""NVIDIA Dynamo's standalone KV indexer as the prefix-aware router's index.

:class:`DynamoIndexerClient` speaks the indexer's HTTP API (standard library
only), :func:`start_dynamo_indexer` runs ``python -m dynamo.indexer`` and
:class:`DynamoPrefixIndex` is an
:class:`~prefixcache.cluster.prefix_index.OverlapIndex` that publishes the
workers' events over ZMQ and asks the indexer for overlaps. Needs the
``dynamo`` extra (``ai-dynamo-runtime``, ``pyzmq``, ``msgspec``) at use, not
at import.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from prefixcache.engine.events import BlockStored, KVCacheEvent, wire_hash
from prefixcache.errors import PrefixCacheError

if TYPE_CHECKING:
    from prefixcache.wire.publisher import ZmqEventPublisher

__all__ = [
    "DynamoIndexerClient",
    "DynamoPrefixIndex",
    "free_tcp_port",
    "start_dynamo_indexer",
    "synthetic_block_tokens",
]


def synthetic_block_tokens(block_hash: int, block_size: int) -> list[int]:
    """Token IDs standing in for a trace block, a function of its chained hash alone.

    Dynamo's indexer keys blocks by a hash of their tokens, and trace
    requests carry no tokens; equal chained hashes give equal tokens, so
    equal prefixes stay equal on the indexer's side.

    Complexity: O(block_size).
    """
    mask = (1 << 64) - 1
    return [(((block_hash ^ i) * 0x9E3779B97F4A7C15) & mask) >> 49 for i in range(block_size)]


class DynamoIndexerClient:
    """HTTP client of NVIDIA Dynamo's standalone KV indexer (``python -m dynamo.indexer``).

    Uses only the standard library. Endpoints (ai-dynamo-runtime 1.6):
    ``POST /register`` a worker's ZMQ (and replay) endpoint, ``POST /unregister``,
    ``GET /workers``, ``POST /query`` with ``token_ids`` for per-worker
    overlap in tokens, ``GET /health``.

    Args:
        url: e.g. ``"http://127.0.0.1:8090"``.
        model_name: the radix tree to use (one per model).
        block_size: tokens per block; the first registration fixes it.
        timeout: seconds per HTTP request.
    """

    def __init__(
        self, url: str, model_name: str = "prefixcache", block_size: int = 16, timeout: float = 5.0
    ) -> None:
        self.url = url.rstrip("/")
        self.model_name = model_name
        self.block_size = block_size
        self.timeout = timeout

    def _call(self, method: str, path: str, body: object = None) -> object:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.url + path, data=data, method=method, headers={"content-type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                text = response.read().decode()
        except urllib.error.HTTPError as exc:
            raise PrefixCacheError(
                f"indexer {method} {path}: HTTP {exc.code} {exc.read().decode()!r}"
            ) from exc
        return json.loads(text) if text else None

    def is_healthy(self) -> bool:
        """Whether ``GET /health`` answers. Complexity: one HTTP request."""
        try:
            self._call("GET", "/health")
        except (OSError, PrefixCacheError):
            return False
        return True

    def register(self, worker_id: int, endpoint: str, replay_endpoint: str | None = None) -> None:
        """Have the indexer subscribe to a worker's events.

        Raises:
            PrefixCacheError: the indexer refused (e.g. another block size).
        """
        body: dict[str, object] = {
            "instance_id": worker_id,
            "endpoint": endpoint,
            "model_name": self.model_name,
            "block_size": self.block_size,
        }
        if replay_endpoint is not None:
            body["replay_endpoint"] = replay_endpoint
        self._call("POST", "/register", body)

    def workers(self) -> list[dict[str, object]]:
        """The registered workers and their listeners' status."""
        result = self._call("GET", "/workers")
        return result if isinstance(result, list) else []

    def overlap_tokens(
        self, token_ids: Sequence[int], lora_name: str | None = None
    ) -> dict[int, int]:
        """Per worker ID, how many leading tokens of ``token_ids`` it holds (whole blocks).

        Workers holding nothing are absent. Raises PrefixCacheError on an HTTP error.
        """
        body: dict[str, object] = {"token_ids": list(token_ids), "model_name": self.model_name}
        if lora_name is not None:
            body["lora_name"] = lora_name
        result = self._call("POST", "/query", body)
        scores = result.get("scores", {}) if isinstance(result, dict) else {}
        return {int(worker): max(ranks.values(), default=0) for worker, ranks in scores.items()}


def start_dynamo_indexer(
    port: int, log_path: Path | None = None, timeout: float = 20.0
) -> subprocess.Popen[bytes]:
    """Start ``python -m dynamo.indexer --port port`` and wait until it answers.

    The caller must terminate the returned process. Note: the indexer binds
    its HTTP port on all interfaces (it has no host option).

    Raises:
        PrefixCacheError: it did not answer within ``timeout`` seconds (it is killed).
    """
    log = open(log_path, "wb") if log_path is not None else subprocess.DEVNULL  # noqa: SIM115
    process = subprocess.Popen(
        [sys.executable, "-m", "dynamo.indexer", "--port", str(port), "--threads", "1"],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    client = DynamoIndexerClient(f"http://127.0.0.1:{port}")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            break
        if client.is_healthy():
            return process
        time.sleep(0.05)
    process.kill()
    process.wait()
    raise PrefixCacheError(f"dynamo.indexer did not come up on port {port} in {timeout} s")


def free_tcp_port() -> int:
    """A TCP port free on 127.0.0.1 now (for the indexer's HTTP server)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class DynamoPrefixIndex:
    """An :class:`OverlapIndex` backed by Dynamo's standalone indexer.

    Every worker gets a :class:`~prefixcache.wire.publisher.ZmqEventPublisher` on
    127.0.0.1 (with replay), registered with the indexer; :meth:`apply`
    publishes, :meth:`overlaps` asks ``POST /query``. Trace blocks carry no
    tokens, so stored events and queries use :func:`synthetic_block_tokens`.
    The indexer applies events asynchronously: :meth:`apply` waits
    ``settle_seconds`` so that the next query sees them (a real router
    accepts that lag instead).

    Args:
        client: the indexer's client; its ``block_size`` must be the workers'.
        num_workers: workers to register (IDs ``1..num_workers``).
        settle_seconds: pause after each publish.
    """

    def __init__(
        self, client: DynamoIndexerClient, num_workers: int, settle_seconds: float = 0.002
    ) -> None:
        from prefixcache.wire.publisher import ZmqEventPublisher

        self.client = client
        self.settle_seconds = settle_seconds
        self.publishers: list[ZmqEventPublisher] = []
        for worker in range(num_workers):
            publisher = ZmqEventPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0")
            self.publishers.append(publisher)
            client.register(worker + 1, publisher.endpoint, publisher.replay_endpoint)
        self._tokens: Callable[[int], list[int]] = lambda h: synthetic_block_tokens(
            h, client.block_size
        )

    def apply(self, worker: int, events: Sequence[KVCacheEvent]) -> None:
        """Publish ``events`` for ``worker``, tokens filled in; then settle."""
        filled = [
            BlockStored(
                event.block_hashes,
                event.parent_block_hash,
                tuple(t for h in event.block_hashes for t in self._tokens(h)),
                event.block_size,
                event.lora_name,
                event.medium,
            )
            if isinstance(event, BlockStored) and not event.token_ids
            else event
            for event in events
        ]
        self.publishers[worker].publish(filled)
        time.sleep(self.settle_seconds)

    def overlaps(self, block_hashes: Sequence[int], num_workers: int) -> list[int]:
        """Per worker, leading blocks held, from the indexer (one HTTP request)."""
        tokens = [t for h in block_hashes for t in self._tokens(wire_hash(h))]
        scores = self.client.overlap_tokens(tokens) if tokens else {}
        size = self.client.block_size
        return [scores.get(worker + 1, 0) // size for worker in range(num_workers)]

    def close(self) -> None:
        """Close every publisher."""
        for publisher in self.publishers:
            publisher.close()
