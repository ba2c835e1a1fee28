"""Per-call sampling seeds derived from the run seed, so nobody passes seeds around.

A run has one seed. Each LLM call's seed is a hash of (run seed, node name, call index), so a
rerun or an audit replay of the same run reproduces every sampled token without recording or
threading seeds through the graph, and two calls of a run never share a random stream.
"""

from __future__ import annotations

import hashlib
import secrets

SEED_BITS = 63
"""Seeds stay below 2**63: they fit a signed 64-bit integer (Redis, JSON consumers, torch)."""


def derive_seed(run_seed: int, node: str, call_index: int) -> int:
    """The sampling seed of call ``call_index`` of node ``node`` in a run seeded ``run_seed``.

    sha256 over an unambiguous encoding (the node name is length-prefixed), truncated to 63 bits.
    """
    if call_index < 0:
        raise ValueError(f"call_index must be >= 0, got {call_index}")
    name = node.encode()
    material = f"elesium-call-seed/1:{int(run_seed)}:{len(name)}:".encode() + name + f":{call_index}".encode()
    return int.from_bytes(hashlib.sha256(material).digest()[:8], "big") >> (64 - SEED_BITS)


def fresh_run_seed() -> int:
    """A random run seed, for runs started without one (it is recorded, so they still replay)."""
    return secrets.randbits(SEED_BITS)
