"""Elesium: deterministic agent workflows on an exact speculative-decoding engine."""

__version__ = "0.1.0"
