"""Benchmarks: python -m benchmarks.<name>. Each prints a table of ratios against a baseline run alternately."""
