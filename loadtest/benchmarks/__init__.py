"""Benchmark scripts (``python -m loadtest.benchmarks.NAME``), kept out of the installed router."""
