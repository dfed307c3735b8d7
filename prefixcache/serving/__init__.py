"""The serving layer: what an inference engine builds around the block manager.

Owns the block table (request slot -> block IDs for kernels), the KV storage
indexed by block ID, and the hybrid-model memory: recurrent-state slots and
their checkpoints, layer groups with sliding windows, copy-on-write partial
blocks and forks (``state_pool.py``, ``checkpoints.py``, ``layer_groups.py``
with ``layer_group_rows.py`` and ``layer_group_spec.py``, ``hybrid_memory.py``
built by ``hybrid.py``, ``cow.py``, ``shared_tails.py``). What checks and
demonstrates these pieces (the reference batching loops, the toy models, the
request-trace model) is :mod:`prefixcache.reference`, one layer up. It may
import the engine layer and :mod:`prefixcache.errors`, never reference,
wire, tiers, cluster or tools. See DESIGN.md, "Layers".
"""
