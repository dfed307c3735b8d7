"""KVCache: per-layer K/V storage by block and offset, and sizing from a memory budget."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from prefixcache import CapacityError, ConfigError, InvalidArgumentError, InvalidTensorError
from prefixcache.serving.kv_cache import KVCache, blocks_for_memory_budget

LAYOUTS = {
    "mha": {"k_heads": 4, "k_head_dim": 8},
    "gqa": {"k_heads": 2, "k_head_dim": 8},
    "mla": {"k_heads": 1, "k_head_dim": 12, "v_head_dim": 0},
    "v_narrower": {"k_heads": 2, "k_head_dim": 6, "v_heads": 1, "v_head_dim": 4},
}


def make_cache(layout: str = "mha", **kwargs: object) -> KVCache:
    options: dict[str, object] = {
        "num_layers": 2,
        "num_blocks": 6,
        "block_size": 4,
        "dtype": torch.float32,
        "device": "cpu",
    }
    options.update(LAYOUTS[layout])
    options.update(kwargs)
    return KVCache(**options)  # type: ignore[arg-type]


def rows(cache: KVCache, num_tokens: int, start: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct K and V rows for ``num_tokens`` tokens."""
    k_size = cache.k_heads * cache.k_head_dim
    v_size = cache.v_heads * cache.v_head_dim
    k = torch.arange(num_tokens * k_size, dtype=cache.dtype) + start
    v = -torch.arange(num_tokens * v_size, dtype=cache.dtype) - start
    return (
        k.reshape(num_tokens, cache.k_heads, cache.k_head_dim),
        v.reshape(num_tokens, cache.v_heads, cache.v_head_dim),
    )


def contents(cache: KVCache) -> list[torch.Tensor]:
    return [t.clone() for t in (*cache.k_caches, *cache.v_caches)]


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_shapes_follow_the_layout(layout: str) -> None:
    cache = make_cache(layout)
    spec = LAYOUTS[layout]
    v_heads = spec.get("v_heads", spec["k_heads"])
    v_dim = spec.get("v_head_dim", spec["k_head_dim"])
    assert len(cache.k_caches) == len(cache.v_caches) == 2
    assert cache.k_caches[1].shape == (6, 4, spec["k_heads"], spec["k_head_dim"])
    assert cache.v_caches[1].shape == (6, 4, v_heads, v_dim)
    values_per_token = spec["k_heads"] * spec["k_head_dim"] + v_heads * v_dim
    assert cache.bytes_per_block() == 2 * 4 * values_per_token * 4


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_gather_returns_what_write_stored(layout: str) -> None:
    cache = make_cache(layout)
    k, v = rows(cache, 3)
    cache.write(1, [5, 2, 5], [3, 0, 0], k, v)
    gathered_k, gathered_v = cache.gather(1, [5, 2])
    assert gathered_k.shape == (8, cache.k_heads, cache.k_head_dim)
    assert gathered_v.shape == (8, cache.v_heads, cache.v_head_dim)
    # Block 5 holds tokens 2 (offset 0) and 0 (offset 3); block 2 holds token 1 at offset 0.
    assert torch.equal(gathered_k[0], k[2]) and torch.equal(gathered_k[3], k[0])
    assert torch.equal(gathered_k[4], k[1]) and torch.equal(gathered_v[4], v[1])
    assert not gathered_k[5:].any() and not gathered_k[1:3].any()
    # Layer 0 is separate storage.
    assert not cache.gather(0, [5, 2])[0].any()


def test_gather_is_a_copy_in_the_order_asked() -> None:
    cache = make_cache()
    k, v = rows(cache, 2)
    cache.write(0, [1, 3], [0, 0], k, v)
    gathered, _ = cache.gather(0, torch.tensor([3, 1, 3]))
    assert torch.equal(gathered[0], k[1]) and torch.equal(gathered[4], k[0])
    assert torch.equal(gathered[8], k[1])
    gathered.zero_()
    assert torch.equal(cache.gather(0, [3])[0][0], k[1])


def test_dtype_and_device_are_configurable() -> None:
    cache = make_cache(dtype=torch.bfloat16, device="meta")
    assert cache.k_caches[0].dtype == torch.bfloat16
    assert cache.v_caches[1].device.type == "meta"
    assert cache.bytes_per_block() == 2 * 4 * (32 + 32) * 2
    # On the meta device writes and gathers run without reading any value.
    k, v = (t.to("meta", torch.bfloat16) for t in rows(make_cache(), 2))
    cache.write(0, [1, 2], [0, 3], k, v)
    cache.write(0, torch.tensor([1], device="meta"), torch.tensor([2], device="meta"), k[:1], v[:1])
    assert cache.gather(0, [1, 2])[0].shape == (8, 4, 8)


def test_default_dtype_is_half_precision() -> None:
    cache = KVCache(1, 2, 4, 1, 2, device="cpu")
    assert cache.dtype == torch.float16 and cache.v_caches[0].dtype == torch.float16


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({"layer": 2}, InvalidArgumentError),
        ({"layer": -1}, InvalidArgumentError),
        ({"layer": True}, InvalidArgumentError),
        ({"block_ids": [0, 6]}, InvalidArgumentError),
        ({"block_ids": [-1, 0]}, InvalidArgumentError),
        ({"offsets": [0, 4]}, InvalidArgumentError),
        ({"offsets": [0]}, InvalidTensorError),
        ({"block_ids": [[0, 1]]}, InvalidTensorError),
        ({"block_ids": torch.tensor([0, 1], device="meta")}, InvalidTensorError),
        ({"k": "k_wrong_shape"}, InvalidTensorError),
        ({"v": "v_wrong_heads"}, InvalidTensorError),
        ({"k": "k_half"}, InvalidTensorError),
        ({"v": "v_meta"}, InvalidTensorError),
        ({"k": None}, InvalidTensorError),
    ],
)
def test_bad_writes_are_refused_before_any_change(change: dict[str, object], error: type) -> None:
    cache = make_cache()
    k, v = rows(cache, 2)
    variants = {
        "k_wrong_shape": k[:, :, :4],
        "v_wrong_heads": v[:, :1],
        "k_half": k.half(),
        "v_meta": v.to("meta"),
    }
    args: dict[str, object] = {"layer": 0, "block_ids": [0, 1], "offsets": [0, 1], "k": k, "v": v}
    for name, value in change.items():
        args[name] = variants.get(value, value) if isinstance(value, str) else value
    cache.write(0, [2], [1], *rows(cache, 1, start=100.0))
    before = contents(cache)
    with pytest.raises(error):
        cache.write(**args)  # type: ignore[arg-type]
    assert all(torch.equal(a, b) for a, b in zip(before, contents(cache), strict=True))


@pytest.mark.parametrize(
    ("layer", "block_ids", "error"),
    [
        (3, [0], InvalidArgumentError),
        (0, [6], InvalidArgumentError),
        (0, [0.5], InvalidTensorError),
    ],
)
def test_bad_gathers_are_refused(layer: int, block_ids: list[float], error: type) -> None:
    with pytest.raises(error):
        make_cache().gather(layer, block_ids)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_layers": 0},
        {"num_blocks": 0},
        {"block_size": 0},
        {"k_heads": 0},
        {"k_head_dim": 0},
        {"v_heads": 0},
        {"v_head_dim": -1},
        {"dtype": torch.int32},
        {"dtype": "float16"},
        {"device": "nonsense"},
    ],
)
def test_bad_shapes_are_config_errors(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        make_cache(**kwargs)


def test_budget_sizes_the_pool_exactly() -> None:
    shape: dict[str, Any] = {"num_layers": 32, "block_size": 16, "k_heads": 8, "k_head_dim": 128}
    # 32 layers * 16 tokens * (8 * 128) * 2 (K and V) * 2 bytes = 2 MiB per block.
    assert blocks_for_memory_budget(2**30, **shape, dtype=torch.bfloat16) == 512
    assert blocks_for_memory_budget(2**30 - 1, **shape, dtype=torch.bfloat16) == 511
    assert blocks_for_memory_budget(2**30, **shape, dtype=torch.float32) == 256
    mla: dict[str, Any] = {
        "num_layers": 2,
        "block_size": 4,
        "k_heads": 1,
        "k_head_dim": 12,
        "v_head_dim": 0,
    }
    cache = KVCache(**mla, num_blocks=2, dtype=torch.float32, device="cpu")
    budget = 10 * cache.bytes_per_block() + 5
    assert blocks_for_memory_budget(budget, **mla, dtype=torch.float32) == 10


def test_budget_errors() -> None:
    shape: dict[str, Any] = {"num_layers": 1, "block_size": 4, "k_heads": 1, "k_head_dim": 2}
    with pytest.raises(CapacityError, match="at least 2"):  # 32 bytes a block
        blocks_for_memory_budget(63, **shape)
    assert blocks_for_memory_budget(64, **shape) == 2
    with pytest.raises(InvalidArgumentError):
        blocks_for_memory_budget(-1, **shape)
    with pytest.raises(InvalidArgumentError):
        blocks_for_memory_budget(1.5e9, **shape)  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        blocks_for_memory_budget(2**20, **shape, dtype=torch.int8)
    with pytest.raises(ConfigError):
        blocks_for_memory_budget(2**20, **{**shape, "k_heads": 0})


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_copy_tokens_copies_the_leading_slots_in_every_layer(layout: str) -> None:
    cache = make_cache(layout)
    generator = torch.Generator().manual_seed(3)
    for layer in range(cache.num_layers):
        for block in (1, 2):
            k = torch.randn((4, cache.k_heads, cache.k_head_dim), generator=generator)
            v = torch.randn((4, cache.v_heads, cache.v_head_dim), generator=generator)
            cache.write(layer, [block] * 4, [0, 1, 2, 3], k, v)
    before = [tuple(t.clone() for t in cache.gather(layer, [1, 2])) for layer in range(2)]
    cache.copy_tokens(1, 2, 3)
    for layer in range(cache.num_layers):
        for old, new in zip(before[layer], cache.gather(layer, [1, 2]), strict=True):
            assert torch.equal(new[:4], old[:4])  # the source is unchanged
            assert torch.equal(new[4:7], old[:3])  # three slots copied
            assert torch.equal(new[7], old[7])  # the fourth kept
    with pytest.raises(InvalidArgumentError):
        cache.copy_tokens(1, 6, 1)
    with pytest.raises(InvalidArgumentError):
        cache.copy_tokens(1, 2, 5)
