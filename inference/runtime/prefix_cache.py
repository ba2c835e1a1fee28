"""Keys, values and hidden states of prompt prefixes already prefilled, reused by later prompts.

Many prompts repeat what came before them: a workflow's system prompt opens every one of its calls,
and each turn of a chat repeats the whole conversation so far. Prefilling costs ~1.7 ms a token on
the 2-core CPU, so a 500-token conversation pays most of a second for keys it computed last turn.

**Exact by construction.** The prefill (``ForwardRunner.prefill``) runs in blocks of ``block``
tokens counted from position 0, and the bits of block ``i``'s keys, values and hidden states depend
only on the tokens ``[0, (i + 1) * block)`` (same shapes, same inputs, same kernels). A later prompt
that starts with the same tokens therefore gets exactly what recomputing would give, so greedy and
seeded outputs are the same with or without a hit, and an audit replay does not depend on what the
cache held when the run was recorded. Only whole blocks are kept and served, and the block holding
the last prompt token is always recomputed: its hidden state picks the first new token.

**Index.** Hash-keyed blocks, as vLLM's automatic prefix caching: block ``i``'s key is a 128-bit
BLAKE2b of block ``i - 1``'s key and block ``i``'s token ids, so one dict lookup per block finds the
longest cached prefix, and a collision would need a second preimage of BLAKE2b. A hit refreshes
its blocks deepest first, so a prefix's first blocks are the last to be evicted and the least
recently used block (usually a chain's tail) goes first when the byte budget is full.
"""

from __future__ import annotations

import hashlib
import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from elesium.inference.runtime.model import KVCache

_ROOT = b"elesium-prefix-cache-v1"


@dataclass(frozen=True)
class CachedBlock:
    """One block of a prefix: keys and values ``[layers, kv_heads, block, head_dim]``, hidden states
    ``[block, hidden]`` (the speculative decoder's heads read every prompt position's)."""

    k: torch.Tensor
    v: torch.Tensor
    hidden: torch.Tensor

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.hidden))


def block_keys(ids: Sequence[int], block: int, count: int) -> list[bytes]:
    """The chained keys of the first ``count`` whole blocks of ``ids``."""
    keys: list[bytes] = []
    parent = _ROOT
    for i in range(count):
        digest = hashlib.blake2b(parent, digest_size=16)
        digest.update(array("q", ids[i * block:(i + 1) * block]).tobytes())
        parent = digest.digest()
        keys.append(parent)
    return keys


class PrefixCache:
    """A byte-bounded LRU of prefilled blocks, shared by every sequence of one engine.

    One thread prefills at a time (the step loop, or the gate's holder), but metrics read the
    counters from others, so the index is guarded by a lock.
    """

    def __init__(self, capacity_bytes: int, block: int) -> None:
        if capacity_bytes < 0 or block < 1:
            raise ValueError(f"a prefix cache needs capacity >= 0 and block >= 1: {capacity_bytes}, {block}")
        self.capacity_bytes = capacity_bytes
        self.block = block
        self._blocks: OrderedDict[bytes, CachedBlock] = OrderedDict()
        self._lock = threading.Lock()
        self.bytes = 0
        self.queries = 0  # prompt tokens looked up (vLLM's prefix_cache_queries)
        self.hits = 0  # of those, tokens served from the cache (prefix_cache_hits)

    def __len__(self) -> int:
        return len(self._blocks)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def match(self, ids: Sequence[int]) -> list[CachedBlock]:
        """The longest cached run of whole blocks that starts ``ids`` and leaves its last token out."""
        usable = (len(ids) - 1) // self.block
        keys = block_keys(ids, self.block, usable)
        with self._lock:
            found: list[bytes] = []
            for key in keys:
                if key not in self._blocks:
                    break
                found.append(key)
            for key in reversed(found):  # deepest first: the chain's head ends most recently used
                self._blocks.move_to_end(key)
            self.queries += len(ids)
            self.hits += len(found) * self.block
            return [self._blocks[key] for key in found]

    def store(self, ids: Sequence[int], cache: KVCache, hidden: torch.Tensor, first: int) -> None:
        """Keep blocks ``first`` … of ``ids``'s whole blocks from ``cache`` (batch row 0) and ``hidden``."""
        if self.capacity_bytes == 0:
            return
        count = len(ids) // self.block
        keys = block_keys(ids, self.block, count)
        b = self.block
        with self._lock:
            for i in reversed(range(first, count)):
                key = keys[i]
                if key in self._blocks:
                    self._blocks.move_to_end(key)
                    continue
                lo, hi = i * b, (i + 1) * b
                entry = CachedBlock(cache.k[:, 0, :, lo:hi].clone(), cache.v[:, 0, :, lo:hi].clone(),
                                    hidden[lo:hi].clone())
                if entry.nbytes > self.capacity_bytes:
                    return
                self._blocks[key] = entry
                self.bytes += entry.nbytes
            while self.bytes > self.capacity_bytes and self._blocks:
                _, old = self._blocks.popitem(last=False)
                self.bytes -= old.nbytes

    def clear(self) -> None:
        with self._lock:
            self._blocks.clear()
            self.bytes = 0
