"""Issue 29, item 5: capacities in bytes for ``replay`` and ``compare``, through a model shape.

Bytes per block = 2 (K and V) x layers x kv_heads x head_dim x dtype bytes x block tokens;
a capacity in bytes holds that many whole blocks. The command prints what it resolved.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prefixcache.tools import cli
from prefixcache.tools.memory import ByteSize, parse_capacity, parse_model_shape, parse_size

LLAMA_8B = "layers=32,kv_heads=8,head_dim=128,dtype=bf16"


def test_bytes_per_block_is_k_and_v_for_every_layer_head_and_token() -> None:
    shape = parse_model_shape(LLAMA_8B)
    assert shape.bytes_per_token() == 2 * 32 * 8 * 128 * 2 == 131072
    assert shape.bytes_per_block(512) == 131072 * 512 == 64 * 2**20
    assert shape.bytes_per_block(16) == 2 * 2**20
    fp8 = parse_model_shape("dtype=FP8,head_dim=64,kv_heads=1,layers=2")  # any order, any case
    assert fp8.bytes_per_block(10) == 2 * 2 * 1 * 64 * 1 * 10


def test_sizes_and_capacities_parse() -> None:
    assert parse_size("8GiB") == 8 * 2**30
    assert parse_size("1.5 gb") == 1_500_000_000
    assert parse_size("4096") == 4096
    assert parse_capacity("5000") == 5000 and not isinstance(parse_capacity("5000"), ByteSize)
    assert isinstance(parse_capacity("2MiB"), ByteSize)
    for bad in ("8 parsecs", "GiB", "-1GiB", "0.1B", ""):
        with pytest.raises(ValueError):
            parse_size(bad)
    for bad in (
        "layers=32,kv_heads=8,head_dim=128",  # dtype missing
        "layers=32,layers=2,kv_heads=8,head_dim=128,dtype=bf16",
        "layers=0,kv_heads=8,head_dim=128,dtype=bf16",
        "layers=32,kv_heads=8,head_dim=128,dtype=fp64",
        "layers=32,heads=8,head_dim=128,dtype=bf16",
    ):
        with pytest.raises(ValueError):
            parse_model_shape(bad)


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    path = tmp_path / "trace.jsonl"
    request = {"timestamp": 0, "input_length": 1000, "output_length": 1, "hash_ids": [1, 2]}
    path.write_text(json.dumps(request) + "\n" + json.dumps(request) + "\n", encoding="utf-8")
    return path


def test_replay_resolves_gib_to_blocks_and_says_so(
    trace: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["replay", "--trace", str(trace), "--capacity", "8GiB", "--model-shape", LLAMA_8B]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "= 64 MiB" in out  # 2 x 32 x 8 x 128 x 2 bytes x 512 tokens
    assert "capacity 8 GiB = 128 blocks" in out
    assert "capacity 128 blocks" in out
    assert "hit rate:      0.500 (2/4)" in out


def test_block_size_sets_bytes_per_block_and_tokens_saved(
    trace: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["replay", "--trace", str(trace), "--capacity", "10MiB", "--model-shape", LLAMA_8B]
    assert cli.main([*argv, "--block-size", "16"]) == 0
    out = capsys.readouterr().out
    assert "capacity 10 MiB = 5 blocks" in out  # 2 MiB a 16-token block
    assert "tokens saved:  32 of 2000" in out  # 2 hit blocks of 16 tokens


def test_compare_takes_bytes_and_blocks_together(
    trace: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["compare", "--trace", str(trace), "--policies", "lru", "--no-plot"]
    assert cli.main([*argv, "--capacities", "128MiB,1,1GiB", "--model-shape", LLAMA_8B]) == 0
    out = capsys.readouterr().out
    assert "capacity 128 MiB = 2 blocks" in out and "capacity 1 GiB = 16 blocks" in out
    rows = [line.split("|")[1:3] for line in out.splitlines() if line.startswith("| lru")]
    assert [capacity.strip() for _, capacity in rows] == ["2", "1", "16"]


@pytest.mark.parametrize(
    ("extra", "argument", "reason"),
    [
        (["--capacity", "8GiB"], "--capacity", "needs --model-shape"),
        (["--capacity", "1MiB", "--model-shape", LLAMA_8B], "--capacity", "holds no block"),
        (["--capacity", "8 parsecs"], "--capacity", "a size such as 8GiB"),
        (["--model-shape", "layers=32"], "--model-shape", "missing kv_heads"),
    ],
)
def test_bad_byte_capacities_are_refused(
    trace: Path,
    capsys: pytest.CaptureFixture[str],
    extra: list[str],
    argument: str,
    reason: str,
) -> None:
    try:
        status = cli.main(["replay", "--trace", str(trace), *extra])
    except SystemExit as exit_:
        status = int(exit_.code or 0)
    out, err = capsys.readouterr()
    assert status == 2 and out == ""
    assert argument in err and reason in err, err


def test_bytes_are_refused_where_workers_size_the_cluster_in_blocks(
    trace: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["compare", "--trace", str(trace), "--workers", "2", "--capacities", "8GiB"]
    assert cli.main([*argv, "--model-shape", LLAMA_8B]) == 2
    assert "--workers sizes the cluster in blocks" in capsys.readouterr().err


def test_another_block_size_is_refused_where_a_replay_assumes_512(
    trace: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["compare", "--trace", str(trace), "--concurrency", "--block-size", "16", "--no-plot"]
    assert cli.main(argv) == 2
    assert "--concurrency replays 512-token blocks only" in capsys.readouterr().err
