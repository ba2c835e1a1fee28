"""An attention drafter for every depth (EAGLE's design): the drafter feeds its own features back.

Why it exists. With Hydra heads only level 1 reads real features (the attention drafter); levels 2..K
guess from an MLP state, and on the H200 depths 3 and 4 accept 0.24 and 0.13 of the time (BENCHMARKS
§6j). Here the one drafter layer (``attention_drafter.FeatureDrafter``) drafts every level:

    level 1   f_t      = Layer(fc([h_t; e(x_{t+1})]))          over the accepted entries 0..t
    level k   f'_{t+k-1} = Layer(fc([f_parent; e(x̂_{t+k})]))   over entries 0..t plus its ancestors

so a level-k candidate is conditioned on the real context, the whole drafted path and the features
that drafted it. Training unrolls the same computation over whole sequences
(``FeatureDrafter.unrolled``: EAGLE-3's training-time test), so the drafter learns to read its own
features rather than the base model's.

The tree is expanded as in ``HydraHeads.expand`` (EAGLE-2: keep the ``width`` paths of highest
cumulative log-probability per level) and returned in the same layout, so everything downstream (the
tree choice, verification, acceptance) is shared. Level rows are written to the drafter cache's slots
just past the accepted ones and attend, through the tree-attention kernel, to the accepted slots plus
their own ancestors. Shapes are static and nothing syncs, so CUDA graphs capture it.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from torch import nn

from elesium.config import MAX_DRAFT_DEPTH
from elesium.errors import SettingsError
from elesium.inference.drafters.attention_drafter import FeatureDrafter
from elesium.inference.drafters.path_proposer import PathProposer
from elesium.inference.drafters.top_logprobs import best_paths, level_candidates
from elesium.inference.runtime.drafting import Drafted, DrafterCache
from elesium.inference.runtime.model import Transformer
from elesium.kernels.tree_attention import tree_attention

MAX_WIDTH = 32
"""Most paths one level may keep: the drafter cache keeps ``(depth - 1) * MAX_WIDTH`` slots of slack past
the context for the level rows."""


class DrafterTree(PathProposer, nn.Module):
    """``depth`` draft levels, every one drafted by ``drafter`` (manifest kind ``eagle``)."""

    source_sha256: str = ""  # set by load_heads to the drafter file's sha256
    # ``expand``'s default for ``fused`` (None: auto). Set before the first step, because a captured
    # graph keeps the levels it was recorded with; benchmarks set False for the plain levels' A/B.
    fused_levels: bool | None = None
    # Each level's draft distribution is softmax(logit_scale * logits) (top_logprobs.level_candidates);
    # read when a step is drafted or captured. Not a setting: the engine's fingerprint does not record
    # it, and at T > 0 another tree consumes other draws, so anything but 1.0 is for experiments
    # (benchmarks/drafter_tree.py --logit-scales; BENCHMARKS.md §2i).
    logit_scale: float = 1.0

    def __init__(self, drafter: FeatureDrafter, depth: int = 5) -> None:
        super().__init__()
        if depth < 1:
            raise ValueError(f"need depth >= 1, got {depth}")
        self.drafter: FeatureDrafter | None = drafter
        self.num_heads = depth
        self.manifest_depth = depth  # the depth its files name; set_depth may draft deeper or shallower
        self._files_sha256 = ""

    def set_depth(self, depth: int) -> None:
        """Draft ``depth`` levels instead of the manifest's: one drafter runs at any depth (it feeds its
        own features back). Call before the heads go to an engine (its runner sizes the drafter cache's
        slack by the depth). ``source_sha256`` changes with the depth, so run fingerprints record it and a
        tuning profile measured at another depth is not applied (BENCHMARKS §2j: 7 levels raise τ and
        cost ~0.2 ms a step per level past the fifth)."""
        if not isinstance(depth, int) or not 1 <= depth <= MAX_DRAFT_DEPTH:
            raise ValueError(f"draft depth must be an integer from 1 to {MAX_DRAFT_DEPTH}, got {depth!r}")
        if not self._files_sha256:
            self._files_sha256 = self.source_sha256
        self.num_heads = depth
        self.source_sha256 = self._files_sha256 if depth == self.manifest_depth else hashlib.sha256(
            f"{self._files_sha256}:depth={depth}".encode()).hexdigest()

    @property
    def feature_drafter(self) -> FeatureDrafter:
        assert self.drafter is not None  # always set: the drafter is this module
        return self.drafter

    @property
    def hidden_size(self) -> int:
        return self.feature_drafter.layer_config.hidden_size

    @property
    def dtype(self) -> torch.dtype:
        return self.feature_drafter.dtype

    @property
    def scratch_slots(self) -> int:
        """Drafter-cache slots the level rows may need past the last real slot."""
        return (self.num_heads - 1) * MAX_WIDTH

    def draft_tree(self, model: Transformer, rows: torch.Tensor, tokens: torch.Tensor,
                   start: int | torch.Tensor, last: torch.Tensor, width: int, topk: int,
                   cache: DrafterCache | None, topk_chunk: int | None = None,
                   levels: int | None = None) -> Drafted:
        """``StepDrafter.draft_tree``: the drafter reads the new rows, then drafts every level through
        its own cache from row ``last``'s feature."""
        first = self.feature_drafter.advance(model, rows, tokens, start, last, cache)
        assert cache is not None  # advance raised otherwise
        token = tokens.index_select(0, last)
        # Eager callers pass no padding rows: the host knows the root slot, and attention spans the live
        # slots only. The graphs' root stays on the device.
        root = start + int(last) if isinstance(start, int) else (start + last).reshape(())
        return self.expand(model, first, token, width, topk, cache, root, topk_chunk, levels)

    def config(self) -> dict[str, Any]:
        return {"kind": "eagle", "num_heads": self.num_heads, "num_layers": 1,
                "hidden_size": self.hidden_size}

    def teacher_forced(self, model: Transformer, hidden: torch.Tensor,
                       next_tokens: torch.Tensor) -> torch.Tensor:
        """Not defined: every level attends over the whole context, not over ``h_t`` alone. Score
        whole sequences with ``FeatureDrafter.unrolled`` (``tuner.head_acceptance`` and ``eval-heads``
        do)."""
        raise TypeError("eagle drafters read the whole context; use FeatureDrafter.unrolled on sequences")

    def expand(self, model: Transformer, first: torch.Tensor, token: torch.Tensor, width: int, topk: int,
               cache: tuple[torch.Tensor, torch.Tensor], root: int | torch.Tensor,
               topk_chunk: int | None = None, levels: int | None = None,
               fused: bool | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Draft a tree from ``first`` (``[1, H]``, the drafter's feature at the accepted slot ``root``,
        which is also its RoPE position) and ``token`` (``x_{t+1}``, which ``first`` was computed
        with). Returns ``HydraHeads.expand``'s layout.

        ``cache`` is the drafter's ``(k, v)``. Level ``k``'s rows go to the ``width`` slots from
        ``root + 1 + (k - 1) * width``: slots past the accepted ones, which the next step's accepted
        rows overwrite before anything reads them. Each level is one tree-attention call over every
        level's rows, each row seeing the accepted slots, its ancestors and itself: the kernel the
        verification forward uses, split over the prefix, so a long context costs what it costs there.
        ``root``: an ``int`` attends over the live slots only (eager); a 0-d tensor over the whole
        cache under the mask (CUDA graphs). ``fused``: each level's elementwise work through the fused
        kernels (``_level_fused``); None: where the base model's forward uses them (CUDA with
        ``model.fused_pointwise``).
        """
        if fused is None:
            fused = self.fused_levels
        if fused is None:
            fused = bool(getattr(model, "fused_pointwise", False)) and first.is_cuda
        if width > MAX_WIDTH:
            raise ValueError(f"expand width {width} exceeds the drafter tree's slack of {MAX_WIDTH} "
                             "slots per level")
        k_cache, v_cache = cache
        dev = first.device
        depth = self.num_heads if levels is None else max(1, min(levels, self.num_heads))
        rows_total = (depth - 1) * width
        # ancestors[i, j]: level row i sees level row j (its ancestors and itself); static [N, N].
        ancestors = torch.zeros(rows_total, rows_total, dtype=torch.bool, device=dev)
        eye = torch.eye(rows_total, dtype=torch.bool, device=dev)
        c = self.feature_drafter.layer_config
        queries = torch.zeros(1, c.num_heads, rows_total, c.head_dim, device=dev, dtype=k_cache.dtype)

        scored = state = first.to(model.dtype)
        cum = torch.zeros(1, device=dev)
        parent = torch.full((1,), -1, dtype=torch.long, device=dev)
        rope = self._level_rope(model, root, rows_total, width) if fused and rows_total else None
        all_tokens, all_logprobs, all_parents = [], [], []
        for k in range(depth):
            # lm_head's own dtype: every top-k form reads it as float32 (model.logits would copy it first).
            logits = model.lm_head(scored)
            top_tokens, top_values = level_candidates(logits, topk, topk_chunk, self.logit_scale)
            all_tokens.append(top_tokens)
            all_logprobs.append(top_values)
            all_parents.append(parent)
            if k + 1 == depth:
                break
            best, rows, cum = best_paths(cum, top_values, width, topk)
            n = best.numel()
            lo = k * width  # this level's first row among the level rows
            if k > 0:  # a row sees what its parent (row lo - width + rows) sees
                ancestors[lo:lo + n] = ancestors[lo - width + rows]
            ancestors[lo:lo + n] |= eye[lo:lo + n]
            if rope is not None:
                state = self._level_fused(model, state[rows], top_tokens.flatten()[best], root, lo, k_cache,
                                          v_cache, queries, ancestors, rope)
            else:
                state = self._level(model, state[rows], top_tokens.flatten()[best], root, k, lo, k_cache,
                                    v_cache, queries, ancestors)
            state = state.to(model.dtype)
            scored, parent = state, best
        return torch.cat(all_tokens), torch.cat(all_logprobs), torch.cat(all_parents)

    def _level(self, model: Transformer, state: torch.Tensor, tokens: torch.Tensor, root: int | torch.Tensor,
               k: int, lo: int, k_cache: torch.Tensor, v_cache: torch.Tensor, queries: torch.Tensor,
               ancestors: torch.Tensor) -> torch.Tensor:
        """Level ``k + 1``'s rows (``lo...`` among the level rows) through the drafter layer: keys to
        their slots, attention over the accepted slots and their ``ancestors``, features ``[rows, H]``.
        ``queries`` holds every level row's query; only this level's are read back."""
        drafter = self.feature_drafter
        layer = drafter.layer
        n = tokens.shape[0]
        pos = (root + 1 + k) + torch.zeros(n, dtype=torch.long, device=tokens.device)
        cos, sin = model.rope_cos[pos][None, None], model.rope_sin[pos][None, None]
        x = drafter.inputs(model, state[None], tokens[None])
        q, key, value = layer.attn.project(layer.attn_norm(x), cos, sin)
        slots = (root + 1 + lo) + torch.arange(n, device=tokens.device)
        k_cache.index_copy_(2, slots, key.to(k_cache.dtype))
        v_cache.index_copy_(2, slots, value.to(v_cache.dtype))
        queries[:, :, lo:lo + n] = q.to(queries.dtype)
        out = tree_attention(queries, k_cache, v_cache, root + 1, ancestors)[:, :, lo:lo + n]
        x = x + layer.attn.merge(out.to(x.dtype))
        return (x + layer.mlp(x))[0]

    @staticmethod
    def _level_rope(model: Transformer, root: int | torch.Tensor, rows: int,
                    width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin ``[rows, D]`` of every level row, gathered once a step: level ``k``'s ``width`` rows
        (``k * width ...``) sit at position ``root + 1 + k``. Four launches a level fewer than gathering
        each level's positions on its own, as ``_level`` does."""
        dev = model.rope_cos.device
        pos = torch.div(torch.arange(rows, device=dev), width, rounding_mode="floor") + (root + 1)
        return model.rope_cos[pos], model.rope_sin[pos]

    def _level_fused(self, model: Transformer, state: torch.Tensor, tokens: torch.Tensor,
                     root: int | torch.Tensor, lo: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     queries: torch.Tensor, ancestors: torch.Tensor,
                     rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """``_level`` with the elementwise work in the fused kernels of ``runtime/fused.py``'s forward:
        the norms, RoPE with the cache write (queries straight into ``queries``), SwiGLU; cos/sin from
        ``_level_rope``. About 15 launches a level instead of about 45, inside a graph that replays
        every level of a step."""
        from elesium.kernels.fused_pointwise import add_rms_norm, rope_qkv_to_cache, swiglu
        from elesium.kernels.invariant_norm import invariant_rms_norm

        drafter = self.feature_drafter
        layer, c = drafter.layer, drafter.layer_config
        n = tokens.shape[0]
        cos, sin = rope[0][lo:lo + n][None], rope[1][lo:lo + n][None]
        x = drafter.inputs(model, state[None], tokens[None])
        normed = invariant_rms_norm(x, layer.attn_norm.weight, layer.attn_norm.eps)
        rope_qkv_to_cache(layer.attn.wqkv(normed), cos, sin, k_cache, v_cache, root + 1 + lo, c.num_heads,
                          c.num_kv_heads, q_out=queries[:, :, lo:lo + n])
        out = tree_attention(queries, k_cache, v_cache, root + 1, ancestors)[:, :, lo:lo + n]
        attn = layer.attn.wo(out.transpose(1, 2).reshape(1, n, c.q_size).to(x.dtype))
        x, normed = add_rms_norm(x, attn, layer.mlp_norm.weight, layer.mlp_norm.eps)
        return (x + layer.w2(swiglu(layer.w13(normed))))[0]


def apply_draft_depth(heads: object, depth: int) -> None:
    """``--draft-depth`` on loaded heads (``Engine.load`` and ``eval-heads``): ``set_depth`` on a drafter
    tree, a user error for anything else, which has no depth to change."""
    if not isinstance(heads, DrafterTree):
        have = "no draft heads are loaded" if heads is None else f"these are {type(heads).__name__}"
        raise SettingsError("--draft-depth applies to an eagle drafter tree (heads kind 'eagle'); " + have)
    try:
        heads.set_depth(depth)
    except ValueError as exc:
        raise SettingsError(str(exc)) from None
