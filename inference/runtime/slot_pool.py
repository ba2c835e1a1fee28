"""KV caches of many sequences in one pair of tensors, so one forward can read any of them.

Layout ``[slots, layers, 1, kv_heads, max_len, head_dim]``: slot ``s`` is ``pool[s]``, a batch-1
:class:`KVCache` with exactly the shape and strides of a cache of its own. That is what lets the
engine's one-sequence graphs (prefill, tree steps) run on any slot without recompiling (dynamo
specialises on strides), while the batched step reads every slot through an index.

Why slots of the full context and not pages: a slot never needs a page table, and tree compaction
stays ``KVCache.move`` within one slot. Memory is reserved, not used: the pool is taken with
``torch.empty`` (a fresh anonymous mapping), and a slot's positions are zeroed the first time a
sequence reaches them (:meth:`SlotPool.reserve`), so resident memory follows the longest sequence
each slot has held (45 KiB a token for SmolLM2 in float32). The zeroing is not optional: reading
pages the kernel has never backed costs a fault per page on every step (measured: a one-token step
on untouched pool memory took 48 ms against 9 ms on touched memory). A slot reused by a later
sequence keeps the old sequence's values past its offset: finite numbers every attention masks,
as the one-sequence cache has always held between generations. Prefix sharing between slots (pages
by reference) is what this layout gives up; see ``docs/design/batched-serving.md`` §3.
"""

from __future__ import annotations

import torch

from elesium.inference.runtime.config import ModelConfig
from elesium.inference.runtime.model import KVCache


class SlotPool:
    """``slots`` KV caches of ``max_len`` positions each, zeroed on first use."""

    def __init__(self, config: ModelConfig, slots: int, max_len: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        if slots < 1:
            raise ValueError(f"a slot pool needs at least one slot, got {slots}")
        shape = (slots, config.num_layers, 1, config.num_kv_heads, max_len, config.head_dim)
        self.k = torch.empty(shape, device=device, dtype=dtype)
        self.v = torch.empty(shape, device=device, dtype=dtype)
        self._caches = [KVCache.of(self.k[s], self.v[s]) for s in range(slots)]
        self._zeroed = [0] * slots  # positions [0, n) of each slot are backed and hold finite values

    @property
    def slots(self) -> int:
        return self.k.shape[0]

    @property
    def max_len(self) -> int:
        return self.k.shape[4]

    def cache(self, slot: int) -> KVCache:
        """Slot ``slot`` as a batch-1 cache (a view: writes land in the pool)."""
        return self._caches[slot]

    def reserve(self, slot: int, length: int) -> None:
        """Make positions ``[0, length)`` of ``slot`` safe and fast to read (zero the new ones)."""
        length = min(length, self.max_len)
        done = self._zeroed[slot]
        if length > done:
            self.k[slot, :, :, :, done:length].zero_()
            self.v[slot, :, :, :, done:length].zero_()
            self._zeroed[slot] = length
