"""The reference loop's model step and its end-to-end checks of every prefix hit.

``_ModelChecks`` is a base of :class:`~prefixcache.reference.sim.DynamicBatchingSim`
holding what the loop does with K/V: in model mode one paged forward per step and
each finished request's output, otherwise the reference K/V written per token;
and the check that a prefix hit serves the K/V a fresh computation gives
(``verify``), with :meth:`~_ModelChecks.corrupt_block_kv` to show that the check
can fail. Apart from the scheduling (``sim.py``, ``sim_queues.py``) because it is
the verification half of the loop.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

from prefixcache.engine.allocator import KVBlockAllocator
from prefixcache.engine.validation import require_int
from prefixcache.errors import ConfigError, InvalidArgumentError, InvariantError
from prefixcache.reference.model import TinyDecoder
from prefixcache.reference.model_serving import RequestOutput, logits_tolerance
from prefixcache.reference.paged_batch import StepEntry, build_paged_batch
from prefixcache.reference.sim_requests import SimConfig, _Sequence
from prefixcache.serving.block_table import BlockTable
from prefixcache.serving.kv_cache import KVCache


class _ModelChecks:
    """The model step and the hit checks of the reference loop; see the module docstring."""

    # Set by DynamicBatchingSim.__init__.
    config: SimConfig
    model: TinyDecoder | None
    allocator: KVBlockAllocator
    block_table: BlockTable
    kv_cache: KVCache | None

    # ------------------------------------------------------------------ the model

    def _run_model(self, writes: list[tuple[_Sequence, int, int]], num_decode: int) -> None:
        """One paged forward over the step's tokens (decodes first), then keep what it chose.

        The forward reads nothing back; the step then copies the chosen tokens and
        the routing to the host once, stores the routing per block, and sets each
        request's next token.
        """
        if not writes:
            return
        assert self.model is not None and self.kv_cache is not None  # model mode builds both
        entries = []
        for sequence, start, stop in writes:
            assert sequence.tokens is not None
            wants_logits = (
                stop == sequence.num_tokens
                and sequence.num_generated < sequence.request.output_length
            )
            entries.append(
                StepEntry(sequence.slot, start, stop, sequence.tokens[start:stop], wants_logits)
            )
        plan = build_paged_batch(
            entries[:num_decode],
            entries[num_decode:],
            self.block_table,
            self.config.block_size,
            self.model.device,
        )
        output = self.model.forward_paged(plan.batch, self.kv_cache)
        next_tokens = output.logits.argmax(dim=-1).cpu().tolist()  # the step's one wait
        routing = output.routing.cpu().numpy()
        self.allocator.store_routing_per_block(routing, plan.block_ids, plan.offsets)
        row = 0
        for sequence, start, stop in writes:
            assert sequence.routing is not None
            sequence.routing[start:stop] = routing[row : row + stop - start]
            row += stop - start
        logits = output.logits.cpu() if self.config.record_logits else None
        for index, entry in enumerate(plan.logit_entries):
            sequence = writes[entry][0]
            sequence.next_token = next_tokens[index]
            if sequence.logits is not None and logits is not None:
                del sequence.logits[sequence.num_generated :]  # recomputed after a requeue
                sequence.logits.append(logits[index])

    def _output_of(self, sequence: _Sequence) -> RequestOutput:
        assert self.model is not None and sequence.tokens is not None
        assert sequence.routing is not None
        prompt_length = sequence.request.input_length
        logits = None
        if sequence.logits is not None:
            vocab_size = self.model.config.vocab_size
            logits = torch.stack(sequence.logits) if sequence.logits else torch.empty(0, vocab_size)
        return RequestOutput(
            request_id=sequence.request.request_id,
            prompt_tokens=tuple(sequence.tokens[:prompt_length]),
            tokens=tuple(sequence.tokens[prompt_length:]),
            routing=sequence.routing[: sequence.num_tokens].copy(),
            logits=logits,
            num_cached_tokens=sequence.num_cached,
        )

    def _check_hit_against_model(self, sequence: _Sequence, hit_ids: torch.Tensor) -> None:
        """Compare the K/V of prefix-hit blocks with the dense forward's, within tolerance."""
        assert self.model is not None and self.kv_cache is not None
        assert sequence.tokens is not None
        num_tokens = len(hit_ids) * self.config.block_size
        dense = self.model.forward_dense(torch.tensor(sequence.tokens[:num_tokens]))
        tolerance = logits_tolerance(self.model.dtype)
        for layer in range(self.kv_cache.num_layers):
            cached_kv = self.kv_cache.gather(layer, hit_ids)
            fresh_kv = (dense.keys[layer], dense.values[layer])
            for name, cached, fresh in zip("KV", cached_kv, fresh_kv, strict=True):
                error = (cached - fresh).abs().reshape(num_tokens, -1).amax(dim=1)
                wrong = error > tolerance
                if wrong.any():
                    self._raise_wrong_hit(sequence, hit_ids, wrong, name, layer)

    def _raise_wrong_hit(
        self, sequence: _Sequence, hit_ids: torch.Tensor, wrong: torch.Tensor, name: str, layer: int
    ) -> None:
        position = int(wrong.nonzero()[0, 0])
        block_id = int(hit_ids[position // self.config.block_size])
        raise InvariantError(
            f"request {sequence.request.request_id!r}: prefix hit on block "
            f"{block_id} serves wrong {name} at token {position} (offset "
            f"{position % self.config.block_size} in the block), layer {layer}"
        )

    def corrupt_block_kv(self, block_id: int, *, seed: int = 0) -> None:
        """Test hook: overwrite ``block_id``'s K and V in every layer with seeded noise.

        For showing that the checks can fail: a later prefix hit on the block
        serves K/V that no forward computed, which ``verify`` reports at the hit
        and :func:`~prefixcache.reference.model_serving.compare_with_reference`
        reports in the outputs. Changes nothing but the cache.

        Raises:
            ConfigError: the loop has no KV cache.
            InvalidArgumentError: ``block_id`` is not a usable block ID.

        Complexity: O(layers * block_size * K/V width).
        """
        cache = self.kv_cache
        if cache is None:
            raise ConfigError("the loop has no KV cache to corrupt")
        block_id = require_int(block_id, "block_id", minimum=0)
        if block_id >= self.allocator.dummy_block_id:
            raise InvalidArgumentError(
                f"block_id {block_id} is not below the dummy block {self.allocator.dummy_block_id}"
            )
        generator = torch.Generator().manual_seed(seed)
        size = cache.block_size
        for layer in range(cache.num_layers):
            k, v = (
                (torch.randn((size, heads, dim), generator=generator) * 10).to(
                    cache.device, cache.dtype
                )
                for heads, dim in (
                    (cache.k_heads, cache.k_head_dim),
                    (cache.v_heads, cache.v_head_dim),
                )
            )
            cache.write(layer, [block_id] * size, list(range(size)), k, v)

    # ------------------------------------------------------------------ K/V

    def _write_kv(self, writes: list[tuple[_Sequence, int, int]]) -> None:
        """Write the reference K/V of every token computed in this step, one call per layer."""
        if self.kv_cache is None or not writes:
            return
        block_size = self.config.block_size
        block_ids, offsets, token_hashes = [], [], []
        for sequence, start, stop in writes:
            assert sequence.token_hashes is not None  # kept whenever there is a KV cache
            positions = np.arange(start, stop)
            table_row = self.block_table.blocks_of(sequence.slot).numpy()
            block_ids.append(table_row[positions // block_size])
            offsets.append(positions % block_size)
            token_hashes.append(sequence.token_hashes[start:stop])
        ids, offs = np.concatenate(block_ids), np.concatenate(offsets)
        hashes = np.fromiter(itertools.chain.from_iterable(token_hashes), dtype=np.uint64)
        for layer in range(self.kv_cache.num_layers):
            k, v = _reference_kv(self.kv_cache, layer, hashes)
            self.kv_cache.write(layer, ids, offs, k, v)

    def _check_hit(self, sequence: _Sequence, hit_ids: torch.Tensor) -> None:
        """Compare the K/V of prefix-hit blocks with freshly computed values."""
        if self.model is not None:
            self._check_hit_against_model(sequence, hit_ids)
            return
        cache = self.kv_cache
        assert cache is not None and sequence.token_hashes is not None  # verify builds both
        num_tokens = len(hit_ids) * self.config.block_size
        hashes = np.array(sequence.token_hashes[:num_tokens], dtype=np.uint64)
        for layer in range(cache.num_layers):
            expected = _reference_kv(cache, layer, hashes)
            for name, cached, fresh in zip(
                "KV", cache.gather(layer, hit_ids), expected, strict=True
            ):
                wrong = (cached != fresh).reshape(num_tokens, -1).any(dim=1)
                if wrong.any():
                    self._raise_wrong_hit(sequence, hit_ids, wrong, name, layer)


def _reference_kv(
    cache: KVCache, layer: int, token_hashes: np.ndarray
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of tokens whose prefixes hash to ``token_hashes``, as a model would compute them.

    Each value is 24 bits of the prefix hash times an odd constant per layer,
    head and dimension, so every element differs and float32 holds it exactly.
    """
    k_width = cache.k_heads * cache.k_head_dim
    width = k_width + cache.v_heads * cache.v_head_dim
    multipliers = (np.arange(width, dtype=np.uint64) + np.uint64(1 + layer * width)) * np.uint64(
        0x9E3779B97F4A7C15
    ) | np.uint64(1)
    mixed = token_hashes[:, None] * multipliers[None, :]  # wraps modulo 2**64
    values = torch.from_numpy((mixed >> np.uint64(40)).astype(np.float32) / (1 << 24))
    values = values.to(device=cache.device, dtype=cache.dtype)
    num_tokens = len(token_hashes)
    k = values[:, :k_width].reshape(num_tokens, cache.k_heads, cache.k_head_dim)
    v = values[:, k_width:].reshape(num_tokens, cache.v_heads, cache.v_head_dim)
    return k, v
