"""Attention kernels for verifying token trees.

`tree_attention` is the one entry point the engine calls: it dispatches to the Triton kernel on CUDA
and to the plain-torch reference everywhere else.
"""

from elesium.kernels.tree_attention import tree_attention, tree_attention_reference

__all__ = ["tree_attention", "tree_attention_reference"]
