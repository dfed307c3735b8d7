"""The reference loop's request queues: arrival, admission, pause, resume, requeue, finish.

``_RequestQueues`` is a base of :class:`~prefixcache.reference.sim.DynamicBatchingSim`
that moves a request between the loop's queues (arrivals, waiting, running,
paused) and gives and takes its blocks on the way: admission with a prefix match,
pausing under memory pressure, requeueing what the paused budget cannot take,
and releasing finished requests in one free group. Apart from the step itself
(``sim.py``) so each reads on its own.
"""

from __future__ import annotations

import heapq
from collections import deque

import numpy as np
import torch

from prefixcache.engine.hashing import compute_block_hashes
from prefixcache.errors import BudgetExceededError, InvalidArgumentError, InvariantError
from prefixcache.reference.model_serving import RequestOutput
from prefixcache.reference.sim_checks import _ModelChecks
from prefixcache.reference.sim_requests import SimRequest, _Sequence, _synthetic_token


class _RequestQueues(_ModelChecks):
    """Moves requests between the loop's queues; see the module docstring."""

    # Set by DynamicBatchingSim.__init__.
    _arrivals: list[tuple[int, int, _Sequence]]  # heap by (arrival_step, order)
    _waiting: deque[_Sequence]
    _running: list[_Sequence]
    _paused: list[_Sequence]  # oldest pause first
    _awaiting: dict[int, list[_Sequence]]  # queue hints: next uncached hash -> waiting
    _clock: int
    outputs: list[RequestOutput]

    # ------------------------------------------------------------------ requests

    def _new_sequence(self, request: SimRequest) -> _Sequence:
        block_size = self.config.block_size
        num_full = request.input_length // block_size
        if request.prompt_tokens is not None:
            tokens = list(request.prompt_tokens)
            block_hashes = self.allocator.hash_tokens(tokens)
            tail_tokens = tokens[num_full * block_size :]
        else:
            given = request.block_hashes or ()
            if not num_full <= len(given) <= -(-request.input_length // block_size):
                raise InvalidArgumentError(
                    f"request {request.request_id!r}: {len(given)} block hashes for "
                    f"{request.input_length} tokens in blocks of {block_size}"
                )
            block_hashes = list(given[:num_full])
            # Synthetic tokens: a block's depend only on its hash, so equal hashes hold
            # equal tokens. Full blocks need them only when K/V is written.
            num_tail = request.input_length - num_full * block_size
            tail_tokens = [_synthetic_token(given[-1] if given else 0, i) for i in range(num_tail)]
            if self.model is not None:  # synthetic tokens must be in the model's vocabulary
                tail_tokens = [token % self.model.config.vocab_size for token in tail_tokens]
            tokens = []
            if self.kv_cache is not None:
                tokens = [_synthetic_token(h, i) for h in block_hashes for i in range(block_size)]
                if self.model is not None:
                    tokens = [token % self.model.config.vocab_size for token in tokens]
            tokens += tail_tokens
        sequence = _Sequence(
            request,
            block_hashes,
            tail_tokens,
            None,
            num_tokens=request.input_length,
            prompt_length=request.input_length,
        )
        if self.model is None:
            if self.kv_cache is not None:
                sequence.token_hashes = compute_block_hashes(tokens, 1)
        else:
            total = request.input_length + request.output_length
            sequence.tokens = tokens
            sequence.logits = [] if self.config.record_logits else None
            sequence.routing = np.zeros((total, 1, self.model.config.top_k), dtype=np.int64)
        return sequence

    def _arrive(self) -> None:
        if self._arrivals and not (self._waiting or self._running or self._paused):
            self._clock = max(self._clock, self._arrivals[0][0])  # idle: skip to the next arrival
        while self._arrivals and self._arrivals[0][0] <= self._clock:
            sequence = heapq.heappop(self._arrivals)[2]
            self._waiting.append(sequence)
            self._hint(sequence)

    def _hint(self, sequence: _Sequence) -> None:
        """With ``queue_hints``: protect the prefix admission will match while it waits.

        When only a head of it is cached, the request waits in :attr:`_awaiting` on
        the first hash past that head, and :meth:`_extend_hints` hints it again once
        a running request registers that hash (a previous turn of its conversation).
        """
        if not self.config.queue_hints:
            return
        num_matchable = (sequence.num_tokens - 1) // self.config.block_size
        hashes = sequence.block_hashes[:num_matchable]
        num_held = self.allocator.hint_upcoming(sequence.order, hashes)
        sequence.hinted = True
        if num_held < num_matchable:
            self._awaiting.setdefault(hashes[num_held], []).append(sequence)

    def _extend_hints(self, registered: list[int]) -> None:
        """Hint again the waiting requests whose next uncached block was just registered."""
        for block_hash in registered:
            for sequence in self._awaiting.pop(block_hash, ()):
                if sequence.hinted:  # else admitted since: nothing to extend
                    self._hint(sequence)

    def _unhint(self, sequence: _Sequence) -> None:
        """Withdraw the hint of an admitted request (its own references hold the blocks now)."""
        if sequence.hinted:
            self.allocator.withdraw_hint(sequence.order)
            sequence.hinted = False

    def _admit_waiting(self, events: dict[str, int]) -> None:
        while self._waiting and self.block_table.num_free_slots and self._admit(self._waiting[0]):
            sequence = self._waiting.popleft()
            self._unhint(sequence)
            self._running.append(sequence)
            events["prompt_tokens"] += sequence.prompt_length
            events["prefill_tokens_saved"] += sequence.num_computed

    def _admit(self, sequence: _Sequence) -> bool:
        """Give ``sequence`` its cached prefix and fresh blocks for the rest, or nothing."""
        block_size = self.config.block_size
        # Leave at least one prompt token to compute: its forward pass yields the next token.
        num_matchable = (sequence.prompt_length - 1) // block_size
        hit_ids = self.allocator.match_prefix(sequence.block_hashes[:num_matchable], acquire=True)
        num_blocks = -(-sequence.prompt_length // block_size)
        new_ids = self.allocator.allocate_memory_blocks(num_blocks - len(hit_ids))
        if new_ids is None:
            self.allocator.release_memory_blocks(hit_ids)  # undo the acquire; retry next step
            return False
        if self.config.verify and len(hit_ids):
            self._check_hit(sequence, hit_ids)
        if self.model is not None:
            self._replay_routing(sequence, hit_ids)
        sequence.slot = self.block_table.add_request(torch.cat([hit_ids, new_ids]))
        sequence.num_computed = len(hit_ids) * block_size
        sequence.num_registered = len(hit_ids)
        return True

    def _replay_routing(self, sequence: _Sequence, hit_ids: torch.Tensor) -> None:
        """Copy the stored routing of the prefix-hit tokens into the request's routing."""
        num_tokens = len(hit_ids) * self.config.block_size
        sequence.num_cached = num_tokens
        if not num_tokens:
            return
        routing = self.allocator.reconstruct_routing_from_blocks(hit_ids, num_tokens)
        if routing is None:
            raise InvariantError(
                f"request {sequence.request.request_id!r}: prefix hit on blocks "
                f"{hit_ids.tolist()} whose routing is not all stored"
            )
        assert sequence.routing is not None  # kept in model mode
        sequence.routing[:num_tokens] = routing.numpy()

    def _pause(self, sequence: _Sequence, events: dict[str, int]) -> None:
        self._running.remove(sequence)
        try:
            self.allocator.pause(self.block_table.blocks_of(sequence.slot))
        except BudgetExceededError:
            self._requeue(sequence, paused=False)
            events["num_preemptions"] += 1
            return
        self._paused.append(sequence)
        events["num_pauses"] += 1

    def _resume_paused(self) -> int:
        num_resumed = 0
        for sequence in list(self._paused):
            # Each paused request stopped for want of one block: resume only those that get one.
            if not self.allocator.is_memory_available(num_resumed + 1):
                break
            try:
                self.allocator.resume(self.block_table.blocks_of(sequence.slot))
            except BudgetExceededError:
                break
            self._paused.remove(sequence)
            self._running.append(sequence)
            num_resumed += 1
        return num_resumed

    def _requeue(self, sequence: _Sequence, *, paused: bool) -> None:
        """Release every block of ``sequence`` and queue it to recompute all its tokens."""
        self._hint(sequence)  # before the release: its blocks never turn evictable
        block_ids = self.block_table.remove_request(sequence.slot)
        self.allocator.release_memory_blocks(block_ids, paused=paused)
        sequence.slot = -1
        sequence.prompt_length = sequence.num_tokens
        sequence.num_computed = 0
        sequence.num_registered = 0
        self._waiting.appendleft(sequence)

    def _finish(self) -> int:
        finished = [sequence for sequence in self._running if sequence.is_finished]
        if not finished:
            return 0
        with self.allocator.free_group():
            for sequence in finished:
                self.allocator.release_memory_blocks(self.block_table.remove_request(sequence.slot))
        if self.config.conversation_ends:  # after the group: its releases made the blocks cached
            for sequence in finished:
                if sequence.request.ends_conversation:
                    self.allocator.end_conversation(sequence.block_hashes)
        if self.model is not None:
            self.outputs += [self._output_of(sequence) for sequence in finished]
        self._running = [sequence for sequence in self._running if not sequence.is_finished]
        return len(finished)
