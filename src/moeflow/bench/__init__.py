"""Benchmarks: each prints one JSON object per measurement and a summary line."""
