"""The project's own peer benchmark: W1-W3 of ``../shared/bench/WORKLOADS.md``.

``workloads`` generates the operations from the spec (checked against its test
vectors), ``peers`` maps them onto each library, ``runner`` times them, ``report``
prints the table. ``benchmarks/bench_peers.py`` is the command line.
"""
