"""The wire layer: what leaves the process.

Owns publishing KV cache events over ZeroMQ in vLLM's format and the metrics
exporters. Their optional dependencies (``prefixcache[events]``,
``prefixcache[metrics]``) are imported only when used. It may import the
engine layer and :mod:`prefixcache.errors`, never serving, cluster or tools.
See DESIGN.md, "Layers".
"""
