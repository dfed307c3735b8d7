"""The remote tier against a real redis-server (the ``redis_server`` fixture starts one).

Bytes round-trip; two allocators in two processes share one server; a server
killed or slowed mid-run is a miss with one warning and a counter, never an
exception and never a lost device block; a full write queue drops and counts.
Without redis-server or the ``redis`` client these skip, and the integration
stage (PREFIXCACHE_INTEGRATION=1) turns that skip into a failure.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import pytest

from prefixcache.tiers import connect

BLOCK = 4
WORKER = Path(__file__).with_name("redis_worker.py")


def prompt(seed: int, num_blocks: int = 4) -> list[int]:
    return [seed * 1000 + i for i in range(num_blocks * BLOCK)]


def digest(loop, block_id: int) -> str:
    """SHA-256 of a device block's K then V, layer by layer (as redis_worker.py computes it)."""
    sha = hashlib.sha256()
    for layer in range(loop.kv.num_layers):
        for tensors in (loop.kv.k_caches, loop.kv.v_caches):
            sha.update(tensors[layer][block_id].contiguous().numpy().tobytes())
    return sha.hexdigest()


def fill(loop, seeds) -> None:
    """Admit and finish each seed's prompt: earlier prompts spill device -> host -> server."""
    for seed in seeds:
        loop.admit(seed, prompt(seed))
        loop.requests.finish(seed)
    loop.copy()  # the last host evictions' writes


def on_server(server, remote, loop, seed: int) -> bool:
    """Whether every block of ``seed``'s prompt is on the server."""
    hashes = loop.allocator.hash_tokens(prompt(seed), extra_keys=loop.tiered.epochs.hash_keys())
    client = server.client()
    try:
        return client.exists(*(remote.key(h) for h in hashes)) == len(hashes)
    finally:
        client.close()


def put_to_sleep(server, seconds: float) -> threading.Thread:
    """Block the server with DEBUG SLEEP from another thread; return once it stops answering.

    The sleeper's client connects first and says when it sends; a ping after that
    which times out means the server is inside the sleep (it serves in order).
    """
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    client = server.client()
    client.ping()  # connected: the DEBUG command goes out at once
    sending = threading.Event()

    def sleep() -> None:
        sending.set()
        client.execute_command("DEBUG", "SLEEP", str(seconds))
        client.close()

    sleeper = threading.Thread(target=sleep)
    sleeper.start()
    assert sending.wait(10)
    probe = server.client(socket_timeout=0.1, retry=Retry(NoBackoff(), 0))
    for _ in range(100):
        try:
            probe.ping()
        except redis.TimeoutError:
            probe.close()
            return sleeper
        threading.Event().wait(0.005)
    raise AssertionError("the server never went to sleep")


def test_kv_bytes_round_trip_through_the_server(redis_server, make_loop):
    remote = connect(redis_server.url, namespace="rt", timeout_s=2.0)
    loop = make_loop(5, 2, remote=remote)
    loop.admit("a", prompt(1))
    block_id = loop.block_ids["a"][0]
    loop.store.k_caches[0][0].copy_(loop.kv.k_caches[0][block_id])  # a slot with real K
    payload = loop.store.slot_bytes(0)
    assert len(payload) == loop.store.bytes_per_slot()
    before = remote.stats()
    assert remote.submit(7, payload) and remote.submit(9, b"other")
    remote.flush()
    assert remote.lookup([7, 8, 9]) == [payload]  # the leading run only
    loop.store.load_slot(1, remote.lookup([7])[0])
    assert loop.store.slot_bytes(1) == payload
    stats = remote.stats()
    assert stats.num_written == 2 and stats.num_lookups == before.num_lookups + 2
    assert stats.num_hit_blocks == before.num_hit_blocks + 2
    remote.close()


def test_two_allocators_in_two_processes_share_one_server(redis_server, make_loop):
    namespace = f"two-processes-{os.getpid()}"
    remote = connect(redis_server.url, namespace=namespace, timeout_s=2.0)
    a = make_loop(9, 8, remote=remote)  # room to load a whole prompt; later prompts spill
    a.admit("doc", prompt(1))
    computed = [digest(a, block_id) for block_id in a.block_ids["doc"]]
    a.requests.finish("doc")
    fill(a, range(2, 8))
    remote.flush()
    assert on_server(redis_server, remote, a, 1)

    run = subprocess.run(
        [sys.executable, str(WORKER), redis_server.url, namespace, "1", "4", "100"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    other = json.loads(run.stdout.strip().splitlines()[-1])
    assert other["remote_tokens"] == other["cached_tokens"] == 16
    assert other["digests"] == computed  # the K/V process A computed, byte for byte
    assert other["stats"]["num_written"] >= 1 and other["stats"]["num_lookup_errors"] == 0

    admission = a.requests.admit("theirs", prompt(100))  # computed by the other process
    assert admission is not None and admission.num_remote_cached_tokens == 16
    a.block_ids["theirs"] = admission.block_ids.tolist()
    a.copy()
    a.check("theirs")
    a.tiered.check()
    remote.close()


def test_a_killed_server_is_a_miss_with_one_warning(redis_server, make_loop):
    remote = connect(redis_server.url, namespace="killed", timeout_s=0.5)
    loop = make_loop(5, 2, remote=remote)
    fill(loop, range(1, 6))
    remote.flush()
    assert on_server(redis_server, remote, loop, 1)
    redis_server.kill()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        admission = loop.requests.admit("again", prompt(1))  # was a remote hit a moment ago
        assert admission is not None and admission.num_remote_cached_tokens == 0
        loop.block_ids["again"] = admission.block_ids.tolist()
        loop.copy()
        loop.compute("again", admission.num_cached_tokens // BLOCK)
        loop.check("again")
        loop.requests.finish("again")
        fill(loop, range(6, 10))  # more misses, and host evictions whose writes fail
        remote.flush()
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len([m for m in messages if "lookup failed" in m]) == 1
    assert len([m for m in messages if "write failed" in m]) == 1
    stats = remote.stats()
    assert stats.num_lookup_errors >= 5 and stats.num_write_errors >= 1
    device = loop.allocator.stats()
    assert device.num_active == 0  # every request finished: no block still held
    assert device.num_free + device.num_cached == device.num_usable  # and none lost
    loop.tiered.check()
    remote.close()


def test_a_slow_server_is_a_miss_then_serves_again(redis_server, make_loop):
    remote_a = connect(redis_server.url, namespace="slow", timeout_s=2.0)
    a = make_loop(5, 2, remote=remote_a)
    fill(a, range(1, 8))
    remote_a.flush()
    assert on_server(redis_server, remote_a, a, 1) and on_server(redis_server, remote_a, a, 2)

    remote_b = connect(redis_server.url, namespace="slow", timeout_s=0.3)
    b = make_loop(9, 8, remote=remote_b)
    sleeper = put_to_sleep(redis_server, 2.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        admission = b.requests.admit("slow", prompt(1))  # times out: a miss
    sleeper.join()
    assert admission is not None and admission.num_cached_tokens == 0
    assert any("lookup failed (TimeoutError" in str(w.message) for w in caught)
    assert remote_b.stats().num_lookup_errors == 1
    b.requests.finish("slow")

    admission = b.requests.admit("awake", prompt(2))  # the server answers again
    assert admission is not None and admission.num_remote_cached_tokens == 16
    b.block_ids["awake"] = admission.block_ids.tolist()
    b.copy()
    b.check("awake")
    b.requests.finish("awake")
    device = b.allocator.stats()
    assert device.num_active == 0 and device.num_free + device.num_cached == device.num_usable
    b.tiered.check()
    remote_a.close()
    remote_b.close()


def test_a_full_write_queue_drops_and_counts_on_a_real_server(redis_server):
    remote = connect(
        redis_server.url, namespace="drops", timeout_s=5.0, queue_capacity=2, batch_size=1
    )
    sleeper = put_to_sleep(redis_server, 1.0)  # the writer blocks on its first send
    accepted = [remote.submit(h, b"v%d" % h) for h in range(20)]
    sleeper.join()
    remote.flush()
    stats = remote.stats()
    assert stats.num_dropped_writes == accepted.count(False) >= 16  # 1 on the wire + 2 queued
    assert stats.num_written == stats.num_submitted == accepted.count(True)
    client = redis_server.client()
    stored = {h for h in range(20) if client.get(remote.key(h)) == b"v%d" % h}
    client.close()
    assert stored == {h for h, ok in enumerate(accepted) if ok}
    remote.close()


def test_connect_refuses_a_bad_timeout():
    from prefixcache.errors import ConfigError

    for timeout in (0, -1.0, True, "1"):
        with pytest.raises(ConfigError):
            connect("redis://127.0.0.1:1/0", namespace="m", timeout_s=timeout)
