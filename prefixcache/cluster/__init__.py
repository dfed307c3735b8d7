"""The cluster layer: many engine instances behind a router.

Owns the routers (round-robin, least-loaded, prefix-aware), the in-process
prefix index and the client of NVIDIA Dynamo's indexer, and the multi-worker
replay that compares them. It may import serving, wire and engine, never
tools. See DESIGN.md, "Layers".
"""
