"""The tools layer: command line and offline studies.

Owns the ``prefixcache`` command, trace replay through every policy beside
the offline optimum, and the generated workload families. It may import
every other layer; nothing imports it. See DESIGN.md, "Layers".
"""
