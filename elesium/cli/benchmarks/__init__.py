"""Benchmarks behind the `elesium bench-*` commands: measurement code, not library code."""
