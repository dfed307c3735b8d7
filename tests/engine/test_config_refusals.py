"""Configuration mistakes are ConfigErrors, whichever way the configuration arrives.

Issue 28, item 6: out-of-range policy options raised the policy's bare ValueError (also
through ``AllocatorConfig.from_dict``), ``eviction_policy="belady"`` did not say it is
offline-only, ``device="cuda"`` on a torch without CUDA raised a bare AssertionError
at the first tensor, and ``engine=np.array([])`` a bare ValueError (item 4). Each is refused
before anything is built.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from prefixcache import ConfigError, KVBlockAllocator
from prefixcache.engine.config import AllocatorConfig

OUT_OF_RANGE = [
    {"name": "s3fifo", "ghost_capacity": -5},
    {"name": "s3fifo", "small_fraction": 1.5},
    {"name": "arc", "initial_recency_share": 2.0},
    {"name": "lfu", "frequency_weight": 0},
    {"name": "slru", "protected_fraction": -0.1},
    {"name": "reuse_lru", "age_smoothing": 0},
    {"name": "protected_lru", "history_capacity": -1},
    {"name": "hazard", "half_life": 0},
    {"name": "priority", "max_retained_fraction": 3},
]


@pytest.mark.parametrize("spec", OUT_OF_RANGE, ids=lambda spec: "-".join(map(str, spec.values())))
def test_out_of_range_policy_options_are_config_errors(spec: dict[str, object]) -> None:
    option = next(key for key in spec if key != "name")
    with pytest.raises(ConfigError, match=option):
        KVBlockAllocator(total_count=16, eviction_policy=spec)
    with pytest.raises(ConfigError, match=option):
        AllocatorConfig.from_dict({"total_count": 16, "eviction_policy": spec})


def test_belady_by_name_says_it_is_offline_only() -> None:
    with pytest.raises(ConfigError, match="offline"):
        KVBlockAllocator(total_count=16, eviction_policy="belady")
    with pytest.raises(ConfigError, match="offline"):
        KVBlockAllocator(total_count=16, eviction_policy={"name": "belady"})


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:0", torch.device("cuda")])
def test_a_cuda_device_without_cuda_is_a_config_error(device: object) -> None:
    with pytest.raises(ConfigError, match="CUDA"):
        KVBlockAllocator(total_count=16, device=device)


@pytest.mark.parametrize("key", ["engine", "free_list"])
@pytest.mark.parametrize("value", [np.array([]), np.array(["auto"]), ["auto"], 3])
def test_non_string_modes_are_config_errors(key: str, value: object) -> None:
    with pytest.raises(ConfigError, match=key):
        KVBlockAllocator(total_count=16, **{key: value})
