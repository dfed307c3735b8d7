"""integrations: adapters that plug prefixcache into other engines; imports any layer;
nothing imports it. Each module adapts one engine (vLLM, Megatron-core) and imports that
engine lazily, so the package imports without it. See DESIGN.md, "Layers".
"""
