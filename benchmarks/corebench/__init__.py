"""The sections of ``benchmarks/bench_core.py``, one module each, and what they share."""
