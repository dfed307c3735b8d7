"""RemoteTier: a key-value server (Redis) behind the host tier, shared by several instances.

Keys are ``namespace:hash`` (the chained, salted block hashes, equal on every
instance for the same prefix, model and weights); values are a block's K/V
bytes as :meth:`~prefixcache.tiers.transfer.HostKVStore.slot_bytes` writes
them. A match that runs past the host tier asks for the following hashes in
one ``MGET`` round trip (:meth:`RemoteTier.lookup`). Writes go through a
bounded queue to a writer thread that sends them in pipelined batches, so the
scheduling thread never waits on the network; a full queue drops the write
and counts it. A server that is down or slow degrades to a miss: one warning,
a counter, never an exception on the hot path, never a device block lost.

The client is any object with Redis's ``mget(keys)`` and
``pipeline(transaction=False)`` (whose ``set(key, value)`` calls are sent by
``execute()``): :func:`connect` builds a ``redis.Redis``, importing the
``redis`` package only then; tests use an in-memory fake. See DESIGN.md, "Tiers".
"""

from __future__ import annotations

import queue
import threading
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from prefixcache.engine.validation import require_int, require_positive_number
from prefixcache.errors import ConfigError


class RemoteClient(Protocol):
    """The part of ``redis.Redis`` the remote tier uses."""

    def mget(self, keys: Sequence[str]) -> list[bytes | None]:
        """Values of ``keys`` (None where missing), one round trip."""
        ...

    def pipeline(self, transaction: bool = ...) -> Any:
        """A pipeline: ``set(key, value)`` calls queued, sent by ``execute()``."""
        ...


@dataclass(frozen=True, slots=True)
class RemoteTierStats:
    """Counters of the remote tier, plain ints."""

    num_lookups: int  # round trips asked
    num_queried_blocks: int
    num_hit_blocks: int
    num_lookup_errors: int  # round trips that failed or timed out: counted as misses
    num_submitted: int  # writes queued
    num_dropped_writes: int  # writes refused by a full queue
    num_written: int  # writes the server acknowledged
    num_write_errors: int  # writes lost to a server error

    def as_dict(self) -> dict[str, int]:
        """The counters as a plain dict."""
        return {name: getattr(self, name) for name in self.__slots__}


class RemoteTier:
    """Blocks on a shared key-value server: pipelined lookups, asynchronous bounded writes.

    Methods: :meth:`lookup`, :meth:`submit`, :meth:`flush`, :meth:`close`,
    :meth:`stats`. :meth:`lookup` and :meth:`submit` are called by the
    scheduling thread; the writer thread is the only other thread, and it
    touches only the queue, the client and its own counters.

    Args:
        client: a ``redis.Redis`` or an object with the same two methods.
        namespace: key prefix; put the model and KV layout in it, so two
            models never read each other's bytes.
        queue_capacity: writes waiting for the writer thread before new ones
            are dropped, >= 1.
        batch_size: writes per pipelined round trip, >= 1.

    Raises:
        ConfigError: a bad count or an empty namespace.
    """

    def __init__(
        self,
        client: RemoteClient,
        *,
        namespace: str,
        queue_capacity: int = 1024,
        batch_size: int = 64,
    ) -> None:
        if not isinstance(namespace, str) or not namespace:
            raise ConfigError(f"namespace must be a non-empty str, got {namespace!r}")
        self.client = client
        self.namespace = namespace
        self.batch_size = require_int(batch_size, "batch_size", minimum=1, error=ConfigError)
        capacity = require_int(queue_capacity, "queue_capacity", minimum=1, error=ConfigError)
        self._queue: queue.Queue[tuple[str, bytes] | None] = queue.Queue(capacity)
        self._warned: set[str] = set()
        self._lock = threading.Lock()  # the writer's counters
        self._num_lookups = self._num_queried = self._num_hit = self._num_lookup_errors = 0
        self._num_submitted = self._num_dropped = self._num_written = self._num_write_errors = 0
        self._closed = False
        self._writer = threading.Thread(
            target=self._write_loop, name="prefixcache-remote", daemon=True
        )
        self._writer.start()

    def key(self, block_hash: int) -> str:
        """The server key of ``block_hash``. Complexity: O(1)."""
        return f"{self.namespace}:{block_hash:x}"

    def lookup(self, block_hashes: Sequence[int]) -> list[bytes]:
        """Values of the longest leading run of ``block_hashes`` the server holds.

        One round trip. A server error or timeout is a miss (``[]``), with one
        warning per kind of error and a counter. Complexity: O(len(block_hashes)).
        """
        if not block_hashes:
            return []
        self._num_lookups += 1
        self._num_queried += len(block_hashes)
        try:
            values = self.client.mget([self.key(h) for h in block_hashes])
        except Exception as exc:  # any client failure is a miss, never a raise
            self._num_lookup_errors += 1
            self._warn_once("lookup", exc)
            return []
        found: list[bytes] = []
        for value in values:
            if value is None:
                break
            if not isinstance(value, (bytes, bytearray, memoryview)):
                # A client that decodes replies (decode_responses=True) cannot carry K/V bytes.
                self._num_lookup_errors += 1
                self._warn_once(
                    "lookup",
                    TypeError(
                        f"the client returned {type(value).__name__}, not bytes; build it "
                        "with decode_responses=False"
                    ),
                )
                return []
            found.append(bytes(value))
        self._num_hit += len(found)
        return found

    def submit(self, block_hash: int, payload: bytes) -> bool:
        """Queue a write of ``payload`` under ``block_hash``; False (counted) if the queue is full.

        Never waits; after :meth:`close` every write is dropped (counted), since no writer
        is left to send it. Complexity: O(1).
        """
        if self._closed:
            with self._lock:
                self._num_dropped += 1
            return False
        try:
            self._queue.put_nowait((self.key(block_hash), payload))
        except queue.Full:
            with self._lock:
                self._num_dropped += 1
            return False
        with self._lock:
            self._num_submitted += 1
        return True

    def flush(self) -> None:
        """Wait until every queued write has been sent (tests, shutdown)."""
        self._queue.join()

    def close(self) -> None:
        """Send what is queued, then stop the writer thread. Idempotent."""
        self._closed = True  # submit() drops from now on: flush() must not wait for them
        if self._writer.is_alive():
            self._queue.put(None)
            self._writer.join()

    def stats(self) -> RemoteTierStats:
        """The counters now. Complexity: O(1)."""
        with self._lock:
            return RemoteTierStats(
                num_lookups=self._num_lookups,
                num_queried_blocks=self._num_queried,
                num_hit_blocks=self._num_hit,
                num_lookup_errors=self._num_lookup_errors,
                num_submitted=self._num_submitted,
                num_dropped_writes=self._num_dropped,
                num_written=self._num_written,
                num_write_errors=self._num_write_errors,
            )

    # ------------------------------------------------------------------ the writer thread

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            batch = [] if item is None else [item]
            stop = item is None
            while not stop and len(batch) < self.batch_size:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    stop = True
                else:
                    batch.append(more)
            if batch:
                self._send(batch)
            for _ in range(len(batch) + (1 if stop else 0)):
                self._queue.task_done()
            if stop:
                return

    def _send(self, batch: list[tuple[str, bytes]]) -> None:
        try:
            pipe = self.client.pipeline(transaction=False)
            for key, value in batch:
                pipe.set(key, value)
            pipe.execute()
        except Exception as exc:  # a failed write is counted, never raised
            with self._lock:
                self._num_write_errors += len(batch)
            self._warn_once("write", exc)
            return
        with self._lock:
            self._num_written += len(batch)

    def _warn_once(self, what: str, exc: Exception) -> None:
        kind = f"{what}:{type(exc).__name__}"
        if kind not in self._warned:
            self._warned.add(kind)
            warnings.warn(
                f"prefixcache remote tier: {what} failed ({type(exc).__name__}: {exc}); "
                "treated as a miss from now on, counted in stats()",
                RuntimeWarning,
                stacklevel=3,
            )


def connect(url: str, *, namespace: str, timeout_s: float = 0.05, **kwargs: Any) -> RemoteTier:
    """A :class:`RemoteTier` on the Redis server at ``url`` (``redis://host:port/db``).

    ``timeout_s`` bounds every socket operation and the client never retries,
    so a slow or dead server costs one miss of at most ``timeout_s``, not a
    stall. Other keywords go to :class:`RemoteTier`.

    Raises:
        ConfigError: the ``redis`` package is not installed (``pip install
            prefixcache[remote]``), or a bad ``timeout_s``.
    """
    timeout_s = require_positive_number(timeout_s, "timeout_s", error=ConfigError)
    try:
        import redis  # type: ignore[import-not-found,unused-ignore]
        from redis.backoff import NoBackoff  # type: ignore[import-not-found,unused-ignore]
        from redis.retry import Retry  # type: ignore[import-not-found,unused-ignore]
    except ImportError as exc:
        raise ConfigError(
            "the remote tier needs the redis client: pip install prefixcache[remote]"
        ) from exc
    client: Any = redis.Redis.from_url(  # its typed mget is wider than RemoteClient's
        url,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 0),
    )
    return RemoteTier(client, namespace=namespace, **kwargs)


__all__ = ["RemoteClient", "RemoteTier", "RemoteTierStats", "connect"]
