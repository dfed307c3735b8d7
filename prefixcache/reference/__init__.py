"""The reference layer: what verifies and demonstrates the library, above serving.

Owns the request-trace model (``trace.py``: Mooncake traces, chained block
hashes), the reference dynamic-batching loop (``sim.py`` with its parts
``sim_requests.py``, ``sim_report.py``, ``sim_queues.py``, ``sim_checks.py``)
with the small paged-attention decoder it can serve (``model.py``,
``model_types.py``; ``model_serving.py`` for its outputs and the identity
check; ``paged_batch.py`` for a step's layout, below both), and the toy hybrid
model with its batching loop (``toy_hybrid.py``, ``sim_hybrid.py``,
``sim_hybrid_records.py``). An engine embeds
:mod:`prefixcache.serving`; it copies from here. It may import serving, the
engine layer and :mod:`prefixcache.errors`, never wire, tiers, cluster or
tools; it sits below tiers because the tiered replay reads traces. See
DESIGN.md, "Layers".
"""
