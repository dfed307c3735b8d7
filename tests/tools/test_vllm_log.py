"""Issue 29, item 5: ``prefixcache convert --from vllm`` reads the prompts a vLLM server logs.

The lines are vLLM's own: ``RequestLogger.log_inputs`` of vLLM 0.33 (``--enable-log-requests
--log-level DEBUG``; vllm/entrypoints/serve/utils/request_logger.py), with its default log
format, and the one-line INFO form of vLLM 0.6 to 0.10 (vllm/entrypoints/logger.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from prefixcache.errors import InvalidArgumentError
from prefixcache.reference.trace import load_mooncake_trace
from prefixcache.tools import cli
from prefixcache.tools.vllm_log import read_vllm_log

PREFIX = "(APIServer pid=4242) DEBUG 11-29 03:22:{second:02d} [request_logger.py:56] "
LOG = [
    "(APIServer pid=4242) INFO 11-29 03:22:00 [api_server.py:1900] Starting vLLM API server",
    PREFIX.format(second=1) + "Request cmpl-a details: prompt: 'x, prompt_token_ids: [9]', "
    "prompt_token_ids: [1, 2, 3, 4, 5], prompt_embeds shape: None.",
    "(APIServer pid=4242) INFO 11-29 03:22:01 [request_logger.py:67] Received request cmpl-a: "
    "params: SamplingParams(n=1, max_tokens=16), lora_request: None.",
    PREFIX.format(second=3)
    + "Request cmpl-b details: prompt: None, prompt_token_ids: [1, 2, 3, 4, 6, 7], "
    "prompt_embeds shape: None.",
    "(APIServer pid=4242) DEBUG 11-29 03:22:04 [request_logger.py:112] Generated response "
    "cmpl-b details: output_token_ids: [11, 12, 13]",
    "INFO 11-29 03:22:05 logger.py:39] Received request chat-c: prompt: 'Hi', params: "
    "SamplingParams(n=1), prompt_token_ids: [1, 2, 3, 4, 5, 6], lora_request: None, "
    "prompt_adapter_request: None.",
]


def test_requests_outputs_and_times_come_from_the_log() -> None:
    requests = list(read_vllm_log(LOG))
    assert [list(r.token_ids) for r in requests] == [
        [1, 2, 3, 4, 5],  # the last marker: the prompt's text holds one too
        [1, 2, 3, 4, 6, 7],
        [1, 2, 3, 4, 5, 6],
    ]
    assert [r.line for r in requests] == [2, 4, 6]
    assert [r.output_length for r in requests] == [0, 3, 0]
    times = [r.timestamp_ms for r in requests]
    assert times[1] - times[0] == 2000.0 and times[2] - times[0] == 4000.0


def test_a_vllm_log_converts_to_a_trace_with_shared_prefixes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "vllm.log"
    log.write_text("\n".join(LOG) + "\n", encoding="utf-8")
    out = tmp_path / "trace.jsonl"
    argv = ["convert", str(log), "--from", "vllm", "--block-size", "2", "-o", str(out)]
    assert cli.main(argv) == 0
    a, b, c = load_mooncake_trace(out)
    assert a.hash_ids[:2] == b.hash_ids[:2] == c.hash_ids[:2]
    assert a.hash_ids[2] != b.hash_ids[2]  # [5] (partial) against [6, 7]
    assert [r.timestamp_ms for r in (a, b, c)] == [0, 2000, 4000]
    assert b.output_length == 3
    assert "wrote 3 requests" in capsys.readouterr().out


def test_a_log_without_prompt_ids_says_which_flags_write_them() -> None:
    with pytest.raises(InvalidArgumentError, match="--enable-log-requests --log-level DEBUG"):
        list(read_vllm_log(LOG[:1] + LOG[2:3]))


def test_an_unreadable_id_list_names_its_line() -> None:
    broken = PREFIX.format(second=9) + "Request x details: prompt: None, prompt_token_ids: [1, 2"
    with pytest.raises(InvalidArgumentError, match="line 2: unreadable prompt_token_ids"):
        list(read_vllm_log([LOG[0], broken]))
    cut = PREFIX.format(second=9) + "Request x details: prompt: None, prompt_token_ids: [1, a]"
    with pytest.raises(InvalidArgumentError, match="line 1: unreadable prompt_token_ids"):
        list(read_vllm_log([cut]))
