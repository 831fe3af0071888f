"""Benchmarks: scripts that print measured figures with their ratios (never timed tests)."""
