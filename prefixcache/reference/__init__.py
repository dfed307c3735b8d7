"""The reference layer: what verifies and demonstrates the library, above serving.

Owns the request-trace model (``trace.py``: Mooncake traces, chained block
hashes), the reference dynamic-batching loop (``sim.py`` and its parts) with
the small paged-attention decoder it can serve (``model.py``,
``model_serving.py``), and the toy hybrid model with its batching loop
(``toy_hybrid.py``, ``sim_hybrid.py``). An engine embeds
:mod:`prefixcache.serving`; it copies from here. It may import serving, the
engine layer and :mod:`prefixcache.errors`, never wire, tiers, cluster or
tools; it sits below tiers because the tiered replay reads traces. See
DESIGN.md, "Layers".
"""
