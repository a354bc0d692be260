"""Benchmark scripts (``python -m loadtest.benchmarks.NAME``; fixed seeds; each prints a table
and writes JSON), kept out of the installed router."""
