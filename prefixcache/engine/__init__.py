"""The engine layer: the block manager itself.

Owns every block's state (free stack, reference counts, active/paused
partitions, hash registry, cached-leaf tracking), the eviction planning
through a policy, hashing, and the :class:`KVBlockAllocator` facade with its
collaborators (routing storage, KV event log, thread-safe wrapper). It may
import :mod:`prefixcache.errors` and :mod:`prefixcache.policies`, never the
serving, wire, cluster or tools layers. See DESIGN.md, "Layers".
"""
