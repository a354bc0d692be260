"""Benchmark scripts (fixed seeds; each prints a table and writes JSON)."""
