"""The serving layer: what an inference engine builds around the block manager.

Owns the block table (request slot -> block IDs for kernels), the KV storage
indexed by block ID, the request-trace data model, the reference
dynamic-batching simulator, a small paged-attention decoder served through
it (``model.py``, ``model_serving.py``), and the hybrid-model memory:
recurrent-state slots and their checkpoints, layer groups with sliding
windows, copy-on-write partial blocks and forks (``state_pool.py``,
``checkpoints.py``, ``layer_groups.py``, ``hybrid.py``, ``cow.py``,
``shared_tails.py``), with a toy hybrid model and its batching loop
(``toy_hybrid.py``, ``sim_hybrid.py``). It may import the engine
layer and :mod:`prefixcache.errors`, never wire, cluster or tools. See
DESIGN.md, "Layers".
"""
