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

import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from prefixcache.engine.native_engine import native_available, native_module
from prefixcache.engine.selection import ENGINE_ENV, native_policy_spec
from prefixcache.errors import ConfigError
from prefixcache.integrations.vllm_queue import PolicyFreeBlockQueue
from prefixcache.integrations.vllm_queue_views import _End
from prefixcache.policies import EvictionPolicy, has_hook

__all__ = ["native_queue", "native_queue_class", "native_queue_spec"]

_CLASS: Any = None


def native_queue_spec(
    name: str, by_name: bool, options: dict[str, Any], sample: EvictionPolicy
) -> tuple[str, dict[str, float], bool] | None:
    """What the native queue runs for policy ``name``: its native unit's name and options
    and whether it takes ``on_register`` calls; None: the Python queue runs ``sample``'s class.

    A built-in policy given by name runs natively, as in the allocator
    (:func:`~prefixcache.engine.selection.native_policy_spec`), unless the native
    engine is not built or ``PREFIXCACHE_ENGINE=python`` asks for the reference.
    """
    if not by_name or os.environ.get(ENGINE_ENV, "").strip().lower() == "python":
        return None
    spec = native_policy_spec({"name": name, **options}, sample)
    if spec is None or spec[0] == "ref_zero" or not native_available():
        return None
    try:
        native_module().NativePolicy(spec[0], 1, spec[1])
    except ConfigError:  # an option the Python class takes but the native one refuses
        return None
    return spec[0], spec[1], has_hook(sample, "on_register")


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


def native_queue_class() -> Callable[..., PolicyFreeBlockQueue]:
    """``NativeFreeBlockQueue``: ``_native.VllmQueue`` with the Python queue's views.

    Built on first use (the extension is optional). Its queue and learning methods are
    the extension's; the views vLLM's tests read (``fake_free_list_head``,
    ``get_all_free_blocks``, ``iter_blocks_after``) are the Python queue's, over the
    extension's ``eviction_order()``. ``isinstance(queue, PolicyFreeBlockQueue)`` holds.
    """
    global _CLASS
    if _CLASS is None:
        base: Any = native_module().VllmQueue

        class _NativeFreeBlockQueue(base, PolicyFreeBlockQueue):
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
