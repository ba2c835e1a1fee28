"""A Llama-family transformer with a static KV cache, written for verifying token trees.

The one primitive is ``forward(tokens, positions, cache, offset, ancestors)``: N new tokens with
explicit RoPE positions are written into the cache at slots ``[offset, offset + N)`` and attend to
every slot before ``offset`` plus the new slots their ``ancestors`` row allows. A prompt chunk is a
chain (causal), a decode step is N = 1, and a Medusa tree is any parent structure with positions
``prefix + depth``. All shapes are static given N, so a CUDA graph captures a step once and replays
it for any ``offset`` held in a device tensor.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from elesium.inference.runtime.config import ModelConfig
from elesium.kernels.tree_attention import masked_attention, tree_attention, tree_attention_mask

Offset = int | torch.Tensor


class KVCache:
    """Preallocated keys and values for every layer: ``[layers, batch, kv_heads, max_len, head_dim]``.

    Zero-initialised, not empty: masked slots get zero attention weight, and 0 * NaN would still
    poison the output.
    """

    def __init__(self, config: ModelConfig, batch: int, max_len: int, device: torch.device | str,
                 dtype: torch.dtype) -> None:
        shape = (config.num_layers, batch, config.num_kv_heads, max_len, config.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)

    @classmethod
    def of(cls, k: torch.Tensor, v: torch.Tensor) -> KVCache:
        """A cache over tensors the caller owns (one sequence's view of a ``SlotPool``)."""
        cache = cls.__new__(cls)
        cache.k, cache.v = k, v
        return cache

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy slots ``src`` to slots ``dst`` in every layer (accepted tree path -> contiguous slots)."""
        self.k.index_copy_(3, dst, self.k.index_select(3, src))
        self.v.index_copy_(3, dst, self.v.index_select(3, src))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.weight.float()).to(x.dtype)


def rope_tables(config: ModelConfig, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables ``[length, head_dim]`` in float32, in rotate_half layout."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling.get("low_freq_factor", 1.0)), float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        inv_freq = torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    elif kind not in (None, "default"):
        raise ValueError(f"unsupported rope_scaling type {kind!r}")
    angles = torch.outer(torch.arange(length, dtype=torch.float64), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x``: ``[B, H, N, D]``; ``cos``/``sin``: ``[B, 1, N, D]`` float32."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


class Attention(nn.Module):
    invariant = False  # shape-invariant tree attention on CUDA (set by runtime/invariant.py)

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.wqkv = nn.Linear(config.hidden_size, config.q_size + 2 * config.kv_size, bias=config.qkv_bias)
        self.wo = nn.Linear(config.q_size, config.hidden_size, bias=False)

    def project(self, x: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys (both rotated) and values, ``[B, heads, N, head_dim]``, for inputs ``[B, N, H]``."""
        c = self.config
        b, n, _ = x.shape
        q, k, v = self.wqkv(x).split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        q = apply_rope(q.view(b, n, c.num_heads, c.head_dim).transpose(1, 2), cos, sin)
        k = apply_rope(k.view(b, n, c.num_kv_heads, c.head_dim).transpose(1, 2), cos, sin)
        v = v.view(b, n, c.num_kv_heads, c.head_dim).transpose(1, 2)
        return q, k, v

    def merge(self, out: torch.Tensor) -> torch.Tensor:
        """Attention output ``[B, heads, N, head_dim]`` back to the residual stream ``[B, N, H]``."""
        b, _, n, _ = out.shape
        return self.wo(out.transpose(1, 2).reshape(b, n, self.config.q_size))

    def causal(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Whole sequences from slot 0, no cache: fused causal attention, differentiable (training).

        The cached ``forward`` computes the same function for a causal ``ancestors``.
        """
        c = self.config
        q, k, v = self.project(x, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                             enable_gqa=c.num_heads != c.num_kv_heads)
        return self.merge(out)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, offset: Offset, ancestors: torch.Tensor,
                kv_valid: torch.Tensor | None) -> torch.Tensor:
        n = x.shape[1]
        q, k, v = self.project(x, cos, sin)
        if isinstance(offset, int):
            k_cache[:, :, offset:offset + n] = k
            v_cache[:, :, offset:offset + n] = v
        else:
            slots = offset + torch.arange(n, device=x.device)
            k_cache.index_copy_(2, slots, k)
            v_cache.index_copy_(2, slots, v)
        if kv_valid is None:
            out = tree_attention(q, k_cache, v_cache, offset, ancestors, invariant=self.invariant)
        else:
            out = masked_attention(q, *_live(k_cache, v_cache, offset, n),
                                   _padded_mask(offset, ancestors, kv_valid, n, k_cache.shape[2]))
        return self.merge(out)


def _live(k_cache: torch.Tensor, v_cache: torch.Tensor, offset: Offset,
          n: int) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(offset, int):
        return k_cache[:, :, :offset + n], v_cache[:, :, :offset + n]
    return k_cache, v_cache


def _padded_mask(offset: Offset, ancestors: torch.Tensor, kv_valid: torch.Tensor, n: int,
                 capacity: int) -> torch.Tensor:
    """Tree mask restricted to valid (non-padding) slots, ``[B, 1, N, S]``.

    Every token also sees its own slot, so padding rows stay finite instead of softmaxing over
    nothing (NaN values would leak through zero attention weights into later layers).
    """
    s = offset + n if isinstance(offset, int) else capacity
    mask = tree_attention_mask(offset, ancestors, s)[None, None] & kv_valid[:, None, None, :s]
    cols = torch.arange(s, device=ancestors.device)
    own = cols[None, :] == (offset + torch.arange(n, device=ancestors.device))[:, None]
    return mask | own


class Block(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn = Attention(config)
        self.mlp_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.w13 = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.w2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        """The SwiGLU feed-forward's contribution to the residual stream."""
        gate, up = self.w13(self.mlp_norm(x)).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, offset: Offset, ancestors: torch.Tensor,
                kv_valid: torch.Tensor | None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, k_cache, v_cache, offset, ancestors, kv_valid)
        return x + self.mlp(x)

    def causal(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``forward`` over whole sequences from slot 0 with causal attention and no cache (training)."""
        x = x + self.attn.causal(self.attn_norm(x), cos, sin)
        return x + self.mlp(x)


class Transformer(nn.Module):
    """The base model. ``forward`` returns final-norm hidden states; ``logits`` projects them.

    Keeping the projection separate lets callers pay for the 49k-wide ``lm_head`` only at the
    positions they need (the last prompt token, the tree nodes) and lets Medusa heads read the same
    hidden state.
    """

    rope_cos: torch.Tensor  # [max_positions, head_dim] float32 buffers (registered in __init__)
    rope_sin: torch.Tensor
    fused_pointwise = False  # CUDA forward through runtime/fused.py (set with invariant numerics)

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        cos, sin = rope_tables(config, config.max_position_embeddings)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self._causal: dict[tuple[int, torch.device], torch.Tensor] = {}

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    def new_cache(self, max_len: int | None = None, batch: int = 1) -> KVCache:
        length = min(max_len or self.config.max_position_embeddings, self.config.max_position_embeddings)
        return KVCache(self.config, batch, length, self.device, self.dtype)

    def causal(self, n: int) -> torch.Tensor:
        key = (n, self.device)
        if key not in self._causal:
            self._causal[key] = torch.ones(n, n, dtype=torch.bool, device=self.device).tril()
        return self._causal[key]

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, offset: Offset,
                ancestors: torch.Tensor | None = None, kv_valid: torch.Tensor | None = None,
                collect: list[torch.Tensor] | None = None, blocks: int | None = None) -> torch.Tensor:
        """Run N new tokens through the model; return final-norm hidden states ``[B, N, hidden]``.

        Args:
            tokens: ``[B, N]`` token ids.
            positions: ``[N]`` or ``[B, N]`` RoPE positions (a tree node's is prefix + depth).
            cache: the KV cache; slots ``[offset, offset + N)`` are overwritten.
            offset: first cache slot of the new tokens; everything before it is visible context.
                An int attends over just the live slots; a 0-d device tensor attends over the whole
                static cache under a mask (the CUDA-graph path).
            ancestors: ``[N, N]`` bool, row i marks the new tokens node i may see (itself
                included). ``None`` means causal.
            kv_valid: ``[B, max_len]`` bool marking real (non-padding) slots for batched prompts of
                different lengths; ``None`` when every slot is real.
            collect: a list that receives every block's output (the residual stream, ``[B, N, hidden]``
                each, embeddings first): what probes on hidden states read (``Engine.hidden_states``).
            blocks: run only the first ``blocks`` blocks (the return value is then the norm of a
                partial residual stream): a probe that reads block 12 need not pay for blocks 13-30,
                which cannot change it.
        """
        n = tokens.shape[1]
        if isinstance(offset, int) and offset + n > cache.max_len:
            raise ValueError(f"{offset + n} tokens do not fit the KV cache of {cache.max_len}")
        causal = ancestors is None
        if ancestors is None:
            ancestors = self.causal(n)
        if self.fused_pointwise and kv_valid is None and tokens.is_cuda and collect is None:
            from elesium.inference.runtime.fused import fused_forward

            return fused_forward(self, tokens, positions, cache, offset, ancestors, causal)
        pos = positions if positions.dim() == 2 else positions[None]
        cos = self.rope_cos[pos][:, None]
        sin = self.rope_sin[pos][:, None]
        x = self.embed(tokens)
        if collect is not None:
            collect.append(x)
        for i, layer in enumerate(self.layers):
            if blocks is not None and i >= blocks:
                break
            x = layer(x, cos, sin, cache.k[i], cache.v[i], offset, ancestors, kv_valid)
            if collect is not None:
                collect.append(x)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits for hidden states of any leading shape."""
        return self.lm_head(hidden).float()

    # -- weights ---------------------------------------------------------------------------------
    def load_hf_state(self, state: dict[str, torch.Tensor]) -> None:
        """Load HF-named tensors (``model.layers.0.self_attn.q_proj.weight`` ...), fusing QKV and gate/up."""
        own: dict[str, torch.Tensor] = {"embed.weight": state["model.embed_tokens.weight"],
                                        "norm.weight": state["model.norm.weight"]}
        if not self.config.tie_word_embeddings:
            own["lm_head.weight"] = state["lm_head.weight"]
        for i in range(self.config.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            own[f"layers.{i}.attn.wqkv.weight"] = torch.cat(
                [state[a + "q_proj.weight"], state[a + "k_proj.weight"], state[a + "v_proj.weight"]])
            if self.config.qkv_bias:
                own[f"layers.{i}.attn.wqkv.bias"] = torch.cat(
                    [state[a + "q_proj.bias"], state[a + "k_proj.bias"], state[a + "v_proj.bias"]])
            own[f"layers.{i}.attn.wo.weight"] = state[a + "o_proj.weight"]
            own[f"layers.{i}.w13.weight"] = torch.cat([state[p + "mlp.gate_proj.weight"],
                                                       state[p + "mlp.up_proj.weight"]])
            own[f"layers.{i}.w2.weight"] = state[p + "mlp.down_proj.weight"]
            own[f"layers.{i}.attn_norm.weight"] = state[p + "input_layernorm.weight"]
            own[f"layers.{i}.mlp_norm.weight"] = state[p + "post_attention_layernorm.weight"]
        missing, unexpected = self.load_state_dict(own, strict=False)
        missing = [m for m in missing if not (m == "lm_head.weight" and self.config.tie_word_embeddings)]
        if missing or unexpected:
            raise ValueError(f"weights do not fit the config: missing {missing}, unexpected {unexpected}")

    def hf_state(self) -> dict[str, torch.Tensor]:
        """The inverse of ``load_hf_state``: HF-named, unfused tensors."""
        c = self.config
        state = {"model.embed_tokens.weight": self.embed.weight, "model.norm.weight": self.norm.weight}
        if not c.tie_word_embeddings:
            state["lm_head.weight"] = self.lm_head.weight
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            q, k, v = layer.attn.wqkv.weight.split([c.q_size, c.kv_size, c.kv_size])
            state |= {p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k,
                      p + "self_attn.v_proj.weight": v, p + "self_attn.o_proj.weight": layer.attn.wo.weight}
            if c.qkv_bias:
                qb, kb, vb = layer.attn.wqkv.bias.split([c.q_size, c.kv_size, c.kv_size])
                state |= {p + "self_attn.q_proj.bias": qb, p + "self_attn.k_proj.bias": kb,
                          p + "self_attn.v_proj.bias": vb}
            gate, up = layer.w13.weight.chunk(2)
            state |= {p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
                      p + "mlp.down_proj.weight": layer.w2.weight,
                      p + "input_layernorm.weight": layer.attn_norm.weight,
                      p + "post_attention_layernorm.weight": layer.mlp_norm.weight}
        return {k: v.detach() for k, v in state.items()}


def build_model(config: ModelConfig, state: dict[str, torch.Tensor], device: torch.device | str = "cpu",
                dtype: torch.dtype = torch.float32) -> Transformer:
    """Construct on the meta device and load real weights: no seconds spent on a random init."""
    with torch.device("meta"):
        model = Transformer(config)
    model = model.to_empty(device=device)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed.weight
    cos, sin = rope_tables(config, config.max_position_embeddings)
    model.rope_cos, model.rope_sin = cos.to(device), sin.to(device)
    model.load_hf_state(state)
    model.to(dtype=dtype)
    model.rope_cos, model.rope_sin = cos.to(device), sin.to(device)  # positions stay float32
    return model.eval().requires_grad_(False)
