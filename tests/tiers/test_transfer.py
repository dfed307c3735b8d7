"""Transfer plans run in order, per block or batched, into a host store shaped like the cache."""

from __future__ import annotations

import pytest
import torch

from prefixcache.errors import ConfigError, InvalidArgumentError
from prefixcache.serving.kv_cache import KVCache
from prefixcache.tiers import DEMOTE, PROMOTE, HostKVStore, KVTransfer, TransferPlan
from prefixcache.tiers.transfer import LOAD, STORE


def cache(num_blocks: int = 6, layers: int = 2) -> KVCache:
    kv = KVCache(layers, num_blocks, 2, k_heads=1, k_head_dim=2, dtype=torch.float32, device="cpu")
    for layer in range(layers):
        kv.k_caches[layer].copy_(
            torch.arange(kv.k_caches[layer].numel()).view_as(kv.k_caches[layer])
        )
        kv.v_caches[layer].copy_(-kv.k_caches[layer])
    return kv


def test_runs_split_by_direction_and_keep_the_last_write():
    plan = TransferPlan(((DEMOTE, 1, 0), (DEMOTE, 2, 0), (PROMOTE, 0, 3), (DEMOTE, 4, 1)))
    assert list(plan.runs()) == [(DEMOTE, [2], [0]), (PROMOTE, [0], [3]), (DEMOTE, [4], [1])]
    assert plan.demotions == [(1, 0), (2, 0), (4, 1)] and plan.promotions == [(0, 3)]
    assert len(plan) == 4 and list(TransferPlan().runs()) == []
    remote = TransferPlan(((STORE, 1, 99), (LOAD, 0, 1), (LOAD, 1, 2)), (b"a", b"b"))
    assert remote.stores == [(1, 99)] and remote.loads == [(0, 1), (1, 2)]
    assert [run[0] for run in remote.runs()] == [STORE, LOAD, LOAD]


@pytest.mark.parametrize("batched", [True, False])
def test_a_round_trip_restores_the_blocks(batched):
    kv = cache()
    want = [t[[1, 2]].clone() for t in (*kv.k_caches, *kv.v_caches)]
    store = HostKVStore(kv, 3)
    transfer = KVTransfer(kv, store, batched=batched)
    transfer.run(TransferPlan(((DEMOTE, 1, 2), (DEMOTE, 2, 0))))
    for tensor in (*kv.k_caches, *kv.v_caches):
        tensor[[1, 2]] = 0  # the blocks' next owners write them
    transfer.run(TransferPlan(((PROMOTE, 2, 4), (PROMOTE, 0, 5))))
    transfer.wait()
    transfer.synchronize()
    got = [t[[4, 5]] for t in (*kv.k_caches, *kv.v_caches)]
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert (transfer.num_demoted, transfer.num_promoted) == (2, 2)
    assert store.bytes_per_slot() == kv.bytes_per_block()


def test_a_slot_reused_after_a_promotion_read_it_is_copied_in_order():
    kv = cache()
    store = HostKVStore(kv, 1)
    transfer = KVTransfer(kv, store)
    before = kv.k_caches[0][1].clone()
    transfer.run(TransferPlan(((DEMOTE, 1, 0), (PROMOTE, 0, 4), (DEMOTE, 2, 0))))
    assert torch.equal(kv.k_caches[0][4], before)
    assert torch.equal(store.k_caches[0][0], kv.k_caches[0][2])


def test_a_bad_plan_copies_nothing():
    kv = cache()
    store = HostKVStore(kv, 2)
    transfer = KVTransfer(kv, store)
    for ops in (((DEMOTE, 6, 0),), ((DEMOTE, 0, 2),), ((PROMOTE, -1, 0),), ((7, 0, 0),)):
        with pytest.raises(InvalidArgumentError):
            transfer.run(TransferPlan(((DEMOTE, 0, 1), *ops)))
        assert not store.k_caches[0].any()
    with pytest.raises(InvalidArgumentError):
        transfer.run([(DEMOTE, 0, 0)])  # type: ignore[arg-type]


def test_stores_that_do_not_match_are_refused():
    kv = cache()
    with pytest.raises(ConfigError):
        KVTransfer(kv, HostKVStore(cache(layers=1), 2))
    other = KVCache(2, 6, 4, k_heads=1, k_head_dim=2, dtype=torch.float32, device="cpu")
    with pytest.raises(ConfigError):
        KVTransfer(kv, HostKVStore(other, 2))
    half = KVCache(2, 6, 2, k_heads=1, k_head_dim=2, dtype=torch.float16, device="cpu")
    with pytest.raises(ConfigError):
        KVTransfer(kv, HostKVStore(half, 2))
    with pytest.raises(ConfigError):
        HostKVStore(kv, 0)
    meta = KVCache(2, 6, 2, k_heads=1, k_head_dim=2, dtype=torch.float32, device="meta")
    with pytest.raises(ConfigError):
        KVTransfer(meta, HostKVStore(meta, 2), batched=True)  # would read the device on the host
    assert KVTransfer(meta, HostKVStore(meta, 2)).batched is False
