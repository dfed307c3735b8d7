"""vLLM 0.33's real ``Scheduler`` on a CPU without a model, for tests and benchmarks.

A scheduler needs a ``VllmConfig`` (a model config, which reads a Hugging Face
``config.json``: a tiny Llama's is written to a folder given), a ``KVCacheConfig`` (one
full-attention group: the scheduler never touches the tensors) and a structured-output
manager. :func:`make_scheduler` builds one; :func:`make_request` a ``Request`` whose
``block_hashes`` vLLM's own hasher fills on arrival. No model runs: callers advance
requests by scheduling them (chunked prefill moves ``num_computed_tokens``) and end them
with ``finish_requests``, or let :func:`run_step` stand in for the model runner. Needs
vLLM 0.33 (imported on call).
"""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["make_request", "make_scheduler", "run_step"]

_TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_hidden_layers": 2,
    "vocab_size": 1000,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-6,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
}
_hasher: Any = None


def make_scheduler(
    folder: Path,
    num_blocks: int,
    *,
    block_size: int = 16,
    max_num_seqs: int = 4,
    max_num_batched_tokens: int = 64,
    max_model_len: int = 8192,
) -> Any:
    """vLLM's ``Scheduler`` over a pool of ``num_blocks`` blocks (the null block one of
    them), prefix caching and chunked prefill on; the tiny model's config in ``folder``."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(_TINY_LLAMA))
    torch = importlib.import_module("torch")
    config = importlib.import_module("vllm.config")
    interface = importlib.import_module("vllm.v1.kv_cache_interface")
    scheduler = importlib.import_module("vllm.v1.core.sched.scheduler")
    structured = importlib.import_module("vllm.v1.structured_output")
    model = config.ModelConfig(
        model=str(folder),
        tokenizer=str(folder),
        skip_tokenizer_init=True,
        max_model_len=max_model_len,
        dtype="float32",
    )
    cache = config.CacheConfig(block_size=block_size, enable_prefix_caching=True)
    cache.num_gpu_blocks = num_blocks
    vllm_config = config.VllmConfig(
        model_config=model,
        scheduler_config=config.SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            is_encoder_decoder=False,
            enable_chunked_prefill=True,
        ),
        cache_config=cache,
        device_config=config.DeviceConfig(device="cpu"),
    )
    spec = interface.FullAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32
    )
    kv_cache_config = interface.KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[interface.KVCacheGroupSpec(["layer"], spec)],
    )
    return scheduler.Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=structured.StructuredOutputManager(vllm_config),
        block_size=block_size,
    )


def make_request(
    request_id: str,
    tokens: list[int],
    block_size: int = 16,
    max_tokens: int = 1,
    *,
    resumable: bool = False,
) -> Any:
    """A ``Request`` for ``tokens`` that stops after ``max_tokens`` output tokens (no
    end-of-sequence token stops it), hashed by vLLM's block hasher; ``resumable``: a
    streaming session's turn (added again under the same ID, the session's next input)."""
    global _hasher
    utils = importlib.import_module("vllm.v1.core.kv_cache_utils")
    if _hasher is None:
        sha256 = importlib.import_module("vllm.utils.hashing").sha256
        utils.init_none_hash(sha256)
        _hasher = utils.get_request_block_hasher(block_size, sha256)
    request = importlib.import_module("vllm.v1.request")
    sampling = importlib.import_module("vllm.sampling_params")
    params = sampling.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return request.Request(
        request_id,
        prompt_token_ids=tokens,
        sampling_params=params,
        pooling_params=None,
        block_hasher=_hasher,
        resumable=resumable,
    )


def run_step(
    scheduler: Any, live: dict[str, Any], on_scheduled: Callable[[Any], None] | None = None
) -> Any:
    """One scheduler step with a stand-in model runner; returns the ``SchedulerOutput``.

    Schedules (then calls ``on_scheduled(output)``, while the requests' counts are the
    schedule's), samples one token (5) for each scheduled request whose prompt is
    computed, hands that to ``update_from_output``, and drops the requests that finished
    from ``live`` (request ID -> ``Request``, the requests the caller added).
    """
    output = scheduler.schedule()
    if on_scheduled is not None:
        on_scheduled(output)
    ids = list(output.num_scheduled_tokens)
    sampled = [[5] if live[i].num_computed_tokens >= live[i].num_tokens else [] for i in ids]
    result = importlib.import_module("vllm.v1.outputs").ModelRunnerOutput(
        req_ids=ids,
        req_id_to_index={i: n for n, i in enumerate(ids)},
        sampled_token_ids=sampled,
    )
    scheduler.update_from_output(output, result)
    for request_id in ids:
        if live[request_id].is_finished():
            del live[request_id]
    return output
