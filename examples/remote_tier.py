"""Two engine instances sharing prefixes through a Redis server: one computes, the other copies.

Each instance has its own device pool and host tier; blocks its host tier
evicts are written to Redis (asynchronously, through a bounded queue), and a
match that runs past the host tier asks Redis for the following blocks in
one round trip. Needs ``pip install -e '.[remote]' in a clone`` and a server:

    python examples/remote_tier.py                        # starts a redis-server of its own
    python examples/remote_tier.py redis://127.0.0.1:6379/0   # or uses yours

A server that is down or slow costs misses (one warning, counted), never an
exception: the last lines stop the server and show it.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import tempfile
import time
import warnings

import torch

from prefixcache import KVBlockAllocator
from prefixcache.serving.kv_cache import KVCache
from prefixcache.tiers import HostKVStore, HostTier, KVTransfer, RequestCache, TieredCache, connect
from prefixcache.tiers.metrics import collect_tiers

BLOCK = 4


class Instance:
    """One engine: 8 device blocks, 8 host slots, a KV cache, the shared remote tier."""

    def __init__(self, name: str, url: str) -> None:
        self.name = name
        self.remote = connect(url, namespace="example-model-v1", timeout_s=0.2)
        allocator = KVBlockAllocator(total_count=9, block_size_tokens=BLOCK, device="cpu")
        self.kv = KVCache(2, 9, BLOCK, k_heads=2, k_head_dim=8, dtype=torch.float32, device="cpu")
        store = HostKVStore(self.kv, 8)
        self.tiered = TieredCache(
            allocator, HostTier(8, block_size=BLOCK), remote=self.remote, store=store
        )
        self.requests = RequestCache(self.tiered)
        self.transfer = KVTransfer(self.kv, store, remote=self.remote)

    def serve(self, request: str, tokens: list[int]) -> None:
        """Admit, run the copies, "compute" what missed, check every block, finish."""
        admission = self.requests.admit(request, tokens)
        assert admission is not None
        self.transfer.run(self.tiered.take_transfer())
        self.transfer.wait()
        hashes = self.requests.hashes_of(request)
        for index, block_hash in enumerate(hashes):
            block = int(admission.block_ids[index])
            if index >= admission.num_cached_tokens // BLOCK:  # a forward pass writes these
                self.kv.k_caches[0][block] = float(block_hash % 997)
            assert torch.all(self.kv.k_caches[0][block] == float(block_hash % 997))
        print(
            f"{self.name} {request}: {admission.num_cached_tokens} of {len(tokens)} tokens "
            f"cached (device {admission.num_device_cached_tokens}, "
            f"host {admission.num_host_cached_tokens}, "
            f"remote {admission.num_remote_cached_tokens})"
        )
        self.requests.finish(request)

    def spill(self) -> None:
        """Serve other documents until the first one has left this instance for Redis."""
        for seed in range(1, 5):
            self.serve(f"filler-{seed}", [seed * 1000 + i for i in range(4 * BLOCK)])
        self.transfer.run(self.tiered.take_transfer())
        self.remote.flush()


def start_server() -> tuple[str, subprocess.Popen[bytes], tempfile.TemporaryDirectory[str]]:
    """A throwaway redis-server on a free loopback port, no persistence."""
    binary = shutil.which("redis-server")
    if binary is None:
        sys.exit("redis-server not found: install it or pass a redis:// URL")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    folder = tempfile.TemporaryDirectory()
    command = [
        binary,
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
    ]
    server = subprocess.Popen([*command, "--dir", folder.name], stdout=subprocess.DEVNULL)
    import redis

    for _ in range(500):
        try:
            redis.Redis(port=port).ping()
            break
        except redis.ConnectionError:
            time.sleep(0.01)
    return f"redis://127.0.0.1:{port}/0", server, folder


def main(argv: list[str]) -> None:
    """Run the two instances against ``argv[0]`` (or a server of the example's own)."""
    server = folder = None
    url = argv[0] if argv else None
    if url is None:
        url, server, folder = start_server()
    document = list(range(100, 100 + 4 * BLOCK))
    a, b = Instance("A", url), Instance("B", url)
    a.serve("document", document)  # computed once, by A
    a.spill()  # A's device and host fill up: the document goes to Redis
    b.serve("document", document)  # B has never seen it: copied from Redis
    print("B's tier metrics:", {k: v for k, v in collect_tiers(b.tiered).items() if v})
    if server is not None:
        server.kill()  # the server goes away: misses, one warning, no exception
        server.wait()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            b.serve("new document", list(range(7000, 7000 + 4 * BLOCK)))
        failed = b.remote.stats().num_lookup_errors
        print(f"server down: {len(caught)} warning, {failed} failed lookup")
    for instance in (a, b):
        instance.remote.close()
        instance.tiered.check()
    if folder is not None:
        folder.cleanup()


if __name__ == "__main__":
    main(sys.argv[1:])
