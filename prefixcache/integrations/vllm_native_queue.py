"""The vLLM plugin's free-block queue with its bookkeeping native: one C call per request step.

:class:`~prefixcache.integrations.vllm_queue.PolicyFreeBlockQueue` keeps the free blocks'
sections, parent links, free clock, use counts and depths in Python dicts and asks its
policy per block; inside vLLM that bookkeeping, not the policy, was most of the plugin's
cost. ``NativeFreeBlockQueue`` (:func:`native_queue_class`) is the same queue with all of
it in the compiled extension (``_native.VllmQueue``, ``engine/native/vllm_queue.h``):
arrays indexed by block ID, the native policy unit called in C++, and each of vLLM's calls
(``append_n`` of a request's blocks, ``popleft_n``, ``remove``) and each learning call
(``note_registered``, ``note_hits``) one C call, whatever the number of blocks. Same
sections, same calls to the policy in the same order, so the same blocks handed out
(``tests/integrations/test_vllm_native_queue.py`` runs the two side by side per policy).
:func:`~prefixcache.integrations.vllm.install` uses it for every built-in policy installed
by name when the extension is built and ``PREFIXCACHE_ENGINE`` is not ``python``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from prefixcache.engine.native_engine import native_module
from prefixcache.integrations.vllm_queue import PolicyFreeBlockQueue, _End

__all__ = ["native_queue", "native_queue_class"]

_CLASS: type[PolicyFreeBlockQueue] | None = None


def native_queue(
    blocks: Iterable[Any], policy: str, options: Mapping[str, float], *, on_register: bool
) -> PolicyFreeBlockQueue:
    """A ``NativeFreeBlockQueue`` over ``blocks`` running the native unit of ``policy``.

    Raises:
        ConfigError: unknown policy or option (as ``_native.NativePolicy``).
        InvalidBlockIdError: later, for a block ID above the largest in ``blocks``.

    Complexity: O(num_blocks).
    """
    return native_queue_class()(list(blocks), policy, dict(options), on_register)


def native_queue_class() -> type[PolicyFreeBlockQueue]:
    """``NativeFreeBlockQueue``: ``_native.VllmQueue`` with the Python queue's views.

    Built on first use (the extension is optional). Its queue and learning methods are
    the extension's; the views vLLM's tests read (``fake_free_list_head``,
    ``get_all_free_blocks``, ``iter_blocks_after``) are the Python queue's, over the
    extension's ``eviction_order()``. ``isinstance(queue, PolicyFreeBlockQueue)`` holds.
    """
    global _CLASS
    if _CLASS is None:
        base: Any = native_module().VllmQueue

        class _NativeFreeBlockQueue(base, PolicyFreeBlockQueue):  # type: ignore[misc]
            def __init__(
                self, blocks: list[Any], policy: str, options: dict[str, float], on_register: bool
            ) -> None:
                num_blocks = 1 + max((block.block_id for block in blocks), default=0)
                base.__init__(self, num_blocks, policy, options, on_register)
                self.policy_name = policy
                self._on_register = on_register
                self._head, self._tail = _End(), _End()
                self.prepend_n(blocks)

            def _eviction_order(self) -> list[Any]:
                return list(self.eviction_order())

        _NativeFreeBlockQueue.__name__ = _NativeFreeBlockQueue.__qualname__ = "NativeFreeBlockQueue"
        _CLASS = _NativeFreeBlockQueue
    return _CLASS
