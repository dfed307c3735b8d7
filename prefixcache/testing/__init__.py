"""Public test kit: what a project building on prefixcache needs to test against it.

Sections:

- **Policy contract** (:class:`PolicyContract`): a pytest mixin that checks
  the laws every eviction policy keeps, for the built-in policies and
  third-party ones alike, as cachetools ships a mixin for its caches.
- **State digest** (:func:`state_digest`, :func:`changed_fields`,
  :func:`pool_digest`, :func:`deep_state`): one description of an allocator's
  (or any object's) whole state, to check that a refused or failed call changes
  nothing (DESIGN.md invariant 6) and to compare two allocators, on either engine.
- **Reference model** (:class:`ReferenceModel`): the references a caller
  holds, one entry per reference, and the hashes it saw registered: the much
  simpler model a stateful test checks the allocator against.
- **Hosts' request steps** (:mod:`~prefixcache.testing.vllm_pool`,
  :mod:`~prefixcache.testing.megatron_requests`): a request through vLLM's
  ``BlockPool`` and Megatron's ``add_request`` bookkeeping, as their engines
  do it, for testing and timing the integrations; :mod:`~prefixcache.testing.fake_vllm`,
  a vLLM 0.33 block pool, queue and scheduler written to a folder, for testing the
  vLLM plugin where vLLM is not installed.
- **A composed request** (:func:`~prefixcache.testing.composed_request.serve_composed`):
  hash, match and pin, allocate, register, release, as an engine calls them one by one.
- **Pages** (:mod:`~prefixcache.testing.pages`): a fragmented full pool and its
  count of whole free pages, for page-aware eviction.
- **Engine test setup** (:mod:`~prefixcache.testing.engine_setup`): a small
  allocator on either engine, a cached chain, a session of each kind and a call's
  outcome, shared by the test modules that run every case on both engines.

Nothing here is imported by the library itself; pytest is imported only
when a law is skipped.
"""

from prefixcache.testing.digest import changed_fields, deep_state, pool_digest, state_digest
from prefixcache.testing.policy_contract import PolicyContract
from prefixcache.testing.policy_driver import eviction_order
from prefixcache.testing.reference_model import ReferenceModel

__all__ = [
    "PolicyContract",
    "ReferenceModel",
    "changed_fields",
    "deep_state",
    "eviction_order",
    "pool_digest",
    "state_digest",
]
