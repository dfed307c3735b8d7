"""Tier test fixtures: a tiny serving loop over a real KVCache, and a throwaway redis-server.

The loop's K/V is a function of each block's hash, so any process can check
bytes another computed. The server listens on a free loopback port with no
persistence, in a temporary folder, and is stopped after its test.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Hashable, Iterator
from pathlib import Path

import pytest
import torch

from prefixcache import KVBlockAllocator
from prefixcache.serving.kv_cache import KVCache
from prefixcache.tiers import HostKVStore, HostTier, KVTransfer, RequestCache, TieredCache
from prefixcache.tiers.remote import RemoteTier

BLOCK = 4


def content(block_hash: int, shape: tuple[int, ...]) -> torch.Tensor:
    """The K (or V) a forward pass computes for the block of ``block_hash``: seeded by it."""
    generator = torch.Generator().manual_seed(block_hash % (1 << 62))
    return torch.randn(shape, generator=generator)


class Loop:
    """Admit, "compute" (write hash-derived K/V), check, finish: a serving loop in miniature."""

    def __init__(
        self,
        device_blocks: int,
        host_slots: int,
        *,
        events: int = 0,
        batched: bool | None = None,
        policy: str = "lru",
        engine: str = "python",
        remote: RemoteTier | None = None,
    ) -> None:
        self.allocator = KVBlockAllocator(
            total_count=device_blocks,
            block_size_tokens=BLOCK,
            device="cpu",
            kv_events_capacity=events,
            engine=engine,
        )
        self.host = HostTier(host_slots, block_size=BLOCK, events_capacity=events, policy=policy)
        self.kv = KVCache(
            2, device_blocks, BLOCK, k_heads=2, k_head_dim=3, dtype=torch.float32, device="cpu"
        )
        self.store = HostKVStore(self.kv, host_slots)
        self.tiered = TieredCache(self.allocator, self.host, remote=remote, store=self.store)
        self.requests = RequestCache(self.tiered)
        self.transfer = KVTransfer(self.kv, self.store, batched=batched, remote=remote)
        self.num_computed_blocks = 0
        self.block_ids: dict[Hashable, list[int]] = {}

    def copy(self) -> None:
        self.transfer.run(self.tiered.take_transfer())
        self.transfer.wait()

    def compute(self, request_id: Hashable, first: int) -> None:
        """Write the K/V of the request's full blocks from ``first`` on, as a forward pass would."""
        hashes = self.requests.hashes_of(request_id)
        ids = self.block_ids[request_id]
        for index in range(first, len(hashes)):
            self.write(ids[index], hashes[index])
            self.num_computed_blocks += 1

    def write(self, block_id: int, block_hash: int) -> None:
        for layer in range(self.kv.num_layers):
            for tensors, salt in ((self.kv.k_caches, 1), (self.kv.v_caches, 2)):
                tensors[layer][block_id] = content(block_hash * 3 + salt + layer, (BLOCK, 2, 3))

    def admit(self, request_id: Hashable, tokens: object, **kwargs: object) -> int:
        """Admit, run the copies, compute what missed; return the cached tokens."""
        admission = self.requests.admit(request_id, tokens, **kwargs)  # type: ignore[arg-type]
        assert admission is not None
        self.block_ids[request_id] = admission.block_ids.tolist()
        self.copy()  # demotions read evicted blocks before the forward pass writes them
        self.compute(request_id, admission.num_cached_tokens // BLOCK)
        self.check(request_id)
        return admission.num_cached_tokens

    def check(self, request_id: Hashable) -> None:
        """Every full block of the request holds the K/V of its hash."""
        hashes = self.requests.hashes_of(request_id)
        ids = self.block_ids[request_id]
        for index, block_hash in enumerate(hashes):
            for layer in range(self.kv.num_layers):
                for tensors, salt in ((self.kv.k_caches, 1), (self.kv.v_caches, 2)):
                    want = content(block_hash * 3 + salt + layer, (BLOCK, 2, 3))
                    assert torch.equal(tensors[layer][ids[index]], want), (request_id, index)


@pytest.fixture
def make_loop() -> type[Loop]:
    """The :class:`Loop` class, to build loops of any size."""
    return Loop


class DictClient:
    """A dict behind Redis's ``mget`` and ``pipeline`` (the remote tier's whole client API)."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def mget(self, keys: list[str]) -> list[bytes | None]:
        return [self.data.get(key) for key in keys]

    def pipeline(self, transaction: bool = False) -> _DictPipeline:
        return _DictPipeline(self)


class _DictPipeline:
    def __init__(self, client: DictClient) -> None:
        self.client = client
        self.pending: list[tuple[str, bytes]] = []

    def set(self, key: str, value: bytes) -> None:
        self.pending.append((key, value))

    def execute(self) -> None:
        self.client.data.update(self.pending)


@pytest.fixture
def dict_client() -> type[DictClient]:
    """The :class:`DictClient` class: an in-memory stand-in for a Redis client."""
    return DictClient


class RedisServer:
    """One ``redis-server`` on 127.0.0.1 for one test: no persistence, DEBUG from loopback."""

    def __init__(self, binary: str, folder: Path) -> None:
        self.binary, self.folder = binary, folder
        self.port = _free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        command = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        command += ["--appendonly", "no", "--dir", str(folder), "--enable-debug-command", "local"]
        self.process = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=folder
        )

    def wait_ready(self, client_module: object, timeout_s: float = 10.0) -> None:
        """Ping until the server answers; fail with its stderr if it exits or never does."""
        client = client_module.Redis(host="127.0.0.1", port=self.port, socket_timeout=0.5)  # type: ignore[attr-defined]
        deadline = time.monotonic() + timeout_s
        while True:
            if self.process.poll() is not None:
                error = self.process.stderr.read().decode() if self.process.stderr else ""
                raise RuntimeError(f"redis-server exited with {self.process.returncode}: {error}")
            try:
                if client.ping():
                    client.close()
                    return
            except Exception:
                if time.monotonic() > deadline:
                    raise
            time.sleep(0.02)

    def client(self, **kwargs: object) -> object:
        """A plain ``redis.Redis`` on this server (for DEBUG SLEEP and inspection)."""
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, **kwargs)

    def kill(self) -> None:
        """Stop the server at once (SIGKILL), as a crash would. Idempotent."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=10)
        if self.process.stderr is not None:
            self.process.stderr.close()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A running redis-server on a free loopback port; skips without the binary or client.

    The integration stage (PREFIXCACHE_INTEGRATION=1) turns those skips into
    failures, so there the real-server tests always run.
    """
    client_module = pytest.importorskip("redis", reason="the redis client is not installed")
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip("redis-server is not installed")
    for attempt in range(3):  # another process may take the free port before the server does
        server = RedisServer(binary, tmp_path)
        try:
            server.wait_ready(client_module)
            break
        except RuntimeError:
            server.kill()
            if attempt == 2:
                raise
    try:
        yield server
    finally:
        server.kill()
