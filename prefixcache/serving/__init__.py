"""The serving layer: what an inference engine builds around the block manager.

Owns the block table (request slot -> block IDs for kernels), the KV storage
indexed by block ID, the request-trace data model and the reference
dynamic-batching simulator. It may import the engine layer and
:mod:`prefixcache.errors`, never wire, cluster or tools. See DESIGN.md, "Layers".
"""
