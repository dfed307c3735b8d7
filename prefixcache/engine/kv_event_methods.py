"""KVEventMethods: the allocator's KV cache event calls over its KVEventLog."""

from __future__ import annotations

from typing import Any

from prefixcache.engine.block_ids import to_int_array
from prefixcache.engine.core import EngineCore
from prefixcache.engine.events import BlockStored, KVCacheEvent, KVEventLog
from prefixcache.errors import ConfigError, InvalidArgumentError


class KVEventMethods:
    """KV cache events (vLLM's format), a collaborator above the engine.

    Mixed into :class:`~prefixcache.KVBlockAllocator`: the facade records a
    ``BlockStored`` per run of newly registered hashes and a ``BlockRemoved``
    for the hashes the engine reports removed (``EngineCore.take_changes``),
    so both engines produce the same events.
    """

    events: KVEventLog | None
    block_size_tokens: int
    _engine: EngineCore

    def _event_tokens(self, token_ids: Any, num_blocks: int) -> list[int] | None:
        """Validate the optional token IDs of a registration (kept only for events)."""
        if token_ids is None:
            return None
        tokens: list[int] = to_int_array(token_ids, "token_ids").tolist()
        expected = num_blocks * self.block_size_tokens
        if len(tokens) != expected:
            raise InvalidArgumentError(
                f"token_ids has {len(tokens)} tokens; {num_blocks} blocks of "
                f"{self.block_size_tokens} need {expected}"
            )
        return tokens

    def _record_stored_runs(
        self,
        stored_runs: list[tuple[int, list[int]]],
        hashes: list[int],
        parent_hash: int | None,
        tokens: list[int] | None,
        lora_name: str | None,
    ) -> None:
        assert self.events is not None
        size = self.block_size_tokens
        for first, run in stored_runs:
            parent = hashes[first - 1] if first else parent_hash
            run_tokens = None
            if tokens is not None:
                run_tokens = tokens[first * size : (first + len(run)) * size]
            self.events.record_stored(run, parent, run_tokens, lora_name)

    def _event_log(self) -> KVEventLog:
        if self.events is None:
            raise ConfigError("KV cache events are off; set kv_events_capacity > 0")
        return self.events

    def take_events(self) -> list[KVCacheEvent]:
        """Drain the queued KV cache events, oldest first.

        Raises:
            ConfigError: events are not enabled (``kv_events_capacity`` is 0).

        Complexity: O(queued events).
        """
        return self._event_log().take()

    def snapshot(self) -> list[BlockStored]:
        """BlockStored events for every resident hash, parents first, for a late router.

        Not queued: the caller sends them before the events it drains next.

        Raises:
            ConfigError: events are not enabled.

        Complexity: O(n log n) in registered blocks.
        """
        log = self._event_log()
        return [
            log.stored_event_for(block_hash, parent_hash)
            for block_hash, parent_hash in self._engine.registered_chains()
        ]
