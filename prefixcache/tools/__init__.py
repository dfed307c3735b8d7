"""The tools layer: command line and offline studies.

Owns the ``prefixcache`` command, trace replay through every policy beside
the offline optimum, the generated workload families, and a user's own
requests turned into a trace (convert), sized in bytes (memory) and swept
over cache sizes (sweep). It may import
every other layer; nothing imports it. See DESIGN.md, "Layers".
"""
