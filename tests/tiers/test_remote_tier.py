"""The remote tier: shared by two instances, pipelined lookups, bounded writes, a server down."""

from __future__ import annotations

import sys
import threading
import warnings

import pytest

from prefixcache.errors import ConfigError, InvalidArgumentError
from prefixcache.tiers import KVTransfer, TransferPlan
from prefixcache.tiers.remote import RemoteTier, connect
from prefixcache.tiers.transfer import LOAD, STORE

BLOCK = 4


class FakeRedis:
    """The two methods of ``redis.Redis`` the remote tier uses, over a dict; failures on demand."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.down = False
        self.num_round_trips = 0
        self.gate: threading.Event | None = None  # writes wait on it when set

    def mget(self, keys):
        if self.down:
            raise ConnectionError("server down")
        self.num_round_trips += 1
        return [self.data.get(key) for key in keys]

    def pipeline(self, transaction=False):
        return _Pipeline(self)


class _Pipeline:
    def __init__(self, server: FakeRedis) -> None:
        self.server, self.pending = server, []

    def set(self, key, value):
        self.pending.append((key, value))

    def execute(self):
        if self.server.gate is not None:
            self.server.gate.wait()
        if self.server.down:
            raise TimeoutError("server slow")
        self.server.num_round_trips += 1
        self.server.data.update(self.pending)
        return [True] * len(self.pending)


def prompt(seed: int, num_blocks: int) -> list[int]:
    return [seed * 1000 + i for i in range(num_blocks * BLOCK)]


def test_a_prefix_computed_by_one_instance_is_promoted_by_another(make_loop):
    server = FakeRedis()
    remote_a = RemoteTier(server, namespace="model-x")
    remote_b = RemoteTier(server, namespace="model-x")
    a = make_loop(5, 2, remote=remote_a)  # 4 device blocks, 2 host slots: both spill
    a.admit("doc", prompt(1, 4))
    doc = a.requests.hashes_of("doc")
    a.requests.finish("doc")
    for seed in range(2, 6):  # doc: device -> host -> (host full) remote
        a.admit(seed, prompt(seed, 4))
        a.requests.finish(seed)
    remote_a.flush()
    assert all(remote_a.key(h) in server.data for h in doc)
    b = make_loop(9, 8, remote=remote_b)  # a fresh instance: nothing cached
    trips = server.num_round_trips
    admission = b.requests.admit("doc", prompt(1, 4))
    assert admission is not None and admission.num_remote_cached_tokens == 16
    assert server.num_round_trips == trips + 1  # one pipelined lookup
    b.block_ids["doc"] = admission.block_ids.tolist()
    b.copy()
    b.check("doc")  # the K/V instance a computed, byte for byte
    assert b.requests.counters()["default"]["num_remote_hit_tokens"] == 16
    b.tiered.check()
    for remote in (remote_a, remote_b):
        remote.close()
        remote.close()


def test_a_server_that_is_down_is_a_miss_with_one_warning(make_loop):
    server = FakeRedis()
    remote = RemoteTier(server, namespace="m")
    loop = make_loop(5, 2, remote=remote)
    server.down = True
    # One recorder over the whole run: the write warning comes from the writer thread, so
    # it may be raised before or after any narrower block.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert loop.admit("a", prompt(1, 4)) == 0
        loop.requests.finish("a")
        assert loop.admit("b", prompt(2, 4)) == 0
        loop.requests.finish("b")
        loop.admit("c", prompt(3, 4))  # host evictions write to the remote tier: they fail
        remote.flush()
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len([m for m in messages if "lookup failed" in m]) == 1
    stats = remote.stats()
    assert stats.num_lookup_errors >= 2 and stats.num_write_errors >= 1
    assert stats.num_written == 0
    loop.tiered.check()
    remote.close()


def test_a_full_write_queue_drops_and_counts():
    server = FakeRedis()
    server.gate = threading.Event()
    remote = RemoteTier(server, namespace="m", queue_capacity=2, batch_size=1)
    results = [remote.submit(h, b"x") for h in range(6)]
    assert results.count(False) >= 3
    server.gate.set()
    remote.flush()
    stats = remote.stats()
    assert stats.num_dropped_writes == results.count(False)
    assert stats.num_written == stats.num_submitted == results.count(True)
    assert stats.as_dict()["num_written"] == stats.num_written
    remote.close()


def test_lookup_returns_the_leading_run_only():
    server = FakeRedis()
    remote = RemoteTier(server, namespace="m")
    server.data[remote.key(1)] = b"a"
    server.data[remote.key(3)] = b"c"
    assert remote.lookup([1, 2, 3]) == [b"a"]
    assert remote.lookup([]) == []
    assert remote.stats().num_lookups == 1 and remote.stats().num_hit_blocks == 1
    remote.close()


def test_bytes_of_another_layout_are_a_miss(make_loop):
    server = FakeRedis()
    remote = RemoteTier(server, namespace="m")
    loop = make_loop(9, 8, remote=remote)
    hashes = loop.requests.tiered.allocator.hash_tokens(
        prompt(1, 2), extra_keys=loop.tiered.epochs.hash_keys()
    )
    server.data[remote.key(hashes[0])] = b"short"
    assert loop.admit("a", prompt(1, 2)) == 0
    remote.close()


def test_misconfiguration_is_refused(make_loop):
    server = FakeRedis()
    for kwargs in (
        {"namespace": ""},
        {"namespace": "m", "queue_capacity": 0},
        {"namespace": "m", "batch_size": 0},
    ):
        with pytest.raises(ConfigError):
            RemoteTier(server, **kwargs)
    remote = RemoteTier(server, namespace="m")
    loop = make_loop(5, 2)
    from prefixcache.tiers import TieredCache

    with pytest.raises(ConfigError):
        TieredCache(loop.allocator, loop.host, remote=remote)  # no store
    plain = KVTransfer(loop.kv, loop.store)
    with pytest.raises(InvalidArgumentError):
        plain.run(TransferPlan(((STORE, 0, 99),)))  # no remote tier to store to
    with pytest.raises(InvalidArgumentError):
        plain.run(TransferPlan(((LOAD, 0, 0),), (b"short",)))
    with pytest.raises(InvalidArgumentError):
        plain.run(TransferPlan(((LOAD, 1, 0),)))
    with pytest.raises(InvalidArgumentError):
        loop.store.load_slot(0, b"short")
    remote.close()


def test_connect_needs_the_redis_client(monkeypatch):
    monkeypatch.setitem(sys.modules, "redis", None)  # as if the client were not installed
    with pytest.raises(ConfigError, match="prefixcache\\[remote\\]"):
        connect("redis://127.0.0.1:6379/0", namespace="m")


def test_a_close_that_arrives_during_a_send_still_sends_what_was_queued():
    server = FakeRedis()
    remote = RemoteTier(server, namespace="m", batch_size=8)
    original = server.pipeline

    def pipeline(transaction=False):
        server.pipeline = original  # once: the next sends go straight through
        remote.submit(2, b"b")
        remote.submit(3, b"c")
        remote._queue.put(None)  # close() arriving while the first batch is on the wire
        return original(transaction)

    server.pipeline = pipeline
    remote.submit(1, b"a")
    remote._writer.join()
    assert sorted(server.data) == [remote.key(h) for h in (1, 2, 3)]
    remote.close()  # the writer is gone: nothing to do


def test_a_host_tier_with_no_free_slot_loads_nothing_from_the_remote_tier(make_loop):
    server = FakeRedis()
    remote = RemoteTier(server, namespace="m")
    loop = make_loop(9, 1, remote=remote)
    hashes = loop.allocator.hash_tokens(prompt(1, 2), extra_keys=loop.tiered.epochs.hash_keys())
    loop.host.put(hashes[0], None, depth=0)  # the only slot: pinned while it is promoted
    server.data[remote.key(hashes[1])] = b"\0" * loop.store.bytes_per_slot()
    match = loop.tiered.match(hashes)
    assert (match.num_host_blocks, match.num_remote_blocks) == (1, 0)
    remote.close()


@pytest.mark.parametrize("timeout_s", [0, -1.0, True, float("inf"), float("nan"), "1", None])
def test_connect_refuses_a_timeout_that_is_not_a_positive_number(timeout_s: object) -> None:
    with pytest.raises(ConfigError, match="timeout_s must be a number > 0"):
        connect("redis://127.0.0.1:1/0", namespace="t", timeout_s=timeout_s)  # type: ignore[arg-type]


def test_a_submit_after_close_is_dropped_and_flush_returns():
    """Issue 28, item 5: work accepted after close() was never sent, and flush() hung."""
    server = FakeRedis()
    remote = RemoteTier(server, namespace="m")
    remote.close()
    assert remote.submit(1, b"x") is False
    remote.flush()  # returns: nothing is waiting for a writer that is gone
    assert remote.stats().num_dropped_writes == 1 and remote.stats().num_submitted == 0


def test_a_client_that_decodes_replies_is_a_miss_not_a_raise():
    """Issue 28, item 5: ``str`` replies (decode_responses=True) raised TypeError in lookup."""
    server = FakeRedis()
    remote = RemoteTier(server, namespace="m")
    server.data[remote.key(1)] = "text"
    with pytest.warns(RuntimeWarning, match="decode_responses"):
        assert remote.lookup([1]) == []
    assert remote.stats().num_lookup_errors == 1
    remote.close()
