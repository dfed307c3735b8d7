"""to_block_ids checks the ID range in Python for small batches and with numpy for large ones."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from prefixcache.engine.block_ids import _CHECK_IN_PYTHON_UP_TO, to_block_ids
from prefixcache.errors import InvalidBlockIdError

NUM_USABLE = 100
SIZES = [1, _CHECK_IN_PYTHON_UP_TO, _CHECK_IN_PYTHON_UP_TO + 1, 3 * NUM_USABLE]


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("bad_id", [-1, -(2**40), NUM_USABLE, NUM_USABLE + 1, 2**40])
@pytest.mark.parametrize("position", [0, -1])
def test_a_bad_id_anywhere_is_refused_at_every_size(size: int, bad_id: int, position: int) -> None:
    ids = np.arange(size, dtype=np.int64) % NUM_USABLE
    ids[position] = bad_id
    with pytest.raises(InvalidBlockIdError, match=str(bad_id)):
        to_block_ids(ids, NUM_USABLE)


@pytest.mark.parametrize("size", SIZES)
def test_the_dummy_block_is_named_at_every_size(size: int) -> None:
    ids = torch.zeros(size, dtype=torch.int32)
    ids[-1] = NUM_USABLE
    with pytest.raises(InvalidBlockIdError, match="dummy"):
        to_block_ids(ids, NUM_USABLE)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint16, np.uint64])
def test_valid_ids_come_back_as_intp_with_their_values(size: int, dtype: type) -> None:
    values = (np.arange(size) * 7) % NUM_USABLE
    ids = to_block_ids(values.astype(dtype), NUM_USABLE)
    assert ids.dtype == np.intp
    assert ids.tolist() == values.tolist()
