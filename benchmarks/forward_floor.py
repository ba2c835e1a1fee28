"""Floor under the engine's CUDA decode step (issue 17): how fast can a 1-token forward of the weights be?

The engine replays a captured CUDA graph per step (``inference/runtime/forward.py``), through its
shape-invariant Triton kernels and a masked attention over the whole static cache. To know how much of
a step is left to win, this script times, at realistic cache lengths (prefix of 256 and 1024 tokens):

* ``engine_step``: replay of the engine's own captured vanilla step graph (bucket 1, no drafts), which
  is forward + ``lm_head`` (49k-wide) + float cast + argmax, the graph ``elesium bench`` replays;
* ``engine_forward``: a graph of the engine's ``Transformer.forward`` alone (same model, same cache, offset
  as a device tensor, exactly the step graph's body minus the logits), invariant numerics as loaded;
* ``engine_forward_std``: the same with invariant numerics switched off (cuBLAS, torch norms, the
  ordinary tree attention), to separate the kernels' cost from the graph's structure;
* ``floor_forward`` / ``floor_step``: the gpt-fast recipe: a plain-PyTorch Llama 1-token forward over the
  engine's own weight tensors (shared storage, no copies) with a static KV cache of exactly
  ``prefix + 1`` slots, compiled with ``torch.compile(mode="max-autotune-no-cudagraphs")`` (plus
  coordinate-descent tuning) and captured in a CUDA graph; ``floor_step`` adds the ``lm_head`` + argmax.

The floor is not bitwise the engine's function (its kernels are not shape-invariant); it is checked
only to agree to bf16 tolerance with the engine's hidden state and greedy token, so the number
measures the same computation. Timings are medians of per-replay CUDA-event times (plus the mean of
a back-to-back run of replays), after warm-up, with nothing else on the GPU.

CUDA only: on a machine without it, the script says so in one line and exits.
Usage (device scripts set ``ELESIUM_MODEL``): ``python3 -P benchmarks/forward_floor.py --out floor.json``
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def time_graph(graph: torch.cuda.CUDAGraph, reps: int, warmup: int = 20) -> dict[str, float]:
    """Median and spread of one replay, in ms, from CUDA events around each replay.

    Events per replay measure GPU time without host launch gaps hiding in it; the back-to-back mean
    (one event pair around ``reps`` replays) shows what a loop of replays sustains.
    """
    for _ in range(warmup):
        graph.replay()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for s, e in zip(starts, ends):
        s.record()
        graph.replay()
        e.record()
    torch.cuda.synchronize()
    each = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
    first, last = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    first.record()
    for _ in range(reps):
        graph.replay()
    last.record()
    torch.cuda.synchronize()
    return {"median_ms": statistics.median(each), "p10_ms": each[len(each) // 10],
            "p90_ms": each[(9 * len(each)) // 10], "back_to_back_ms": first.elapsed_time(last) / reps}


def capture(body: Callable[[], Any], pool: Any = None) -> tuple[torch.cuda.CUDAGraph, Any]:
    """Warm ``body`` on a side stream (allocator, autotuning, lazy inits), then capture it."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            body()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = body()
    torch.cuda.synchronize()
    return graph, out


class PlainBlock(nn.Module):
    """One decoder layer over the engine's fused weights, with its own static K/V cache of ``slots`` slots.

    GQA without copies: with one query token, the ``group`` query heads that share a KV head are just
    ``group`` query rows against that head, so attention runs as ``[1, kv_heads, group, D]`` against the
    cache as stored (head h uses KV head h // group, HF's ``repeat_kv`` order).
    """

    def __init__(self, layer: nn.Module, cfg: Any, slots: int) -> None:
        super().__init__()
        share = lambda t: nn.Parameter(t.detach(), requires_grad=False)  # noqa: E731 - same storage
        self.wqkv, self.wo = share(layer.attn.wqkv.weight), share(layer.attn.wo.weight)
        self.bqkv = share(layer.attn.wqkv.bias) if layer.attn.wqkv.bias is not None else None
        self.w13, self.w2 = share(layer.w13.weight), share(layer.w2.weight)
        self.n1, self.n2 = share(layer.attn_norm.weight), share(layer.mlp_norm.weight)
        self.eps, self.cfg = layer.attn_norm.eps, cfg
        dt, dev = self.wqkv.dtype, self.wqkv.device
        self.register_buffer("k_cache", torch.zeros(1, cfg.num_kv_heads, slots, cfg.head_dim, dtype=dt,
                                                    device=dev), persistent=False)
        self.register_buffer("v_cache", torch.zeros_like(self.k_cache), persistent=False)

    def norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * w.float()).to(x.dtype)

    def forward(self, x: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        q, k, v = F.linear(self.norm(x, self.n1), self.wqkv, self.bqkv).split(
            [c.q_size, c.kv_size, c.kv_size], dim=-1)
        group = c.num_heads // c.num_kv_heads
        q = rope(q.view(1, c.num_kv_heads, group, c.head_dim), cos, sin)
        k = rope(k.view(1, c.num_kv_heads, 1, c.head_dim), cos, sin)
        self.k_cache.index_copy_(2, pos, k)
        self.v_cache.index_copy_(2, pos, v.view(1, c.num_kv_heads, 1, c.head_dim))
        out = F.scaled_dot_product_attention(q, self.k_cache, self.v_cache)  # every slot is live
        x = x + F.linear(out.reshape(1, 1, c.q_size), self.wo)
        gate, up = F.linear(self.norm(x, self.n2), self.w13).chunk(2, dim=-1)
        return x + F.linear(F.silu(gate) * up, self.w2)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """rotate_half RoPE in float32, as the engine's ``apply_rope``."""
    xf = x.float()
    half = xf.shape[-1] // 2
    return (xf * cos + torch.cat([-xf[..., half:], xf[..., :half]], dim=-1) * sin).to(x.dtype)


class PlainLlama(nn.Module):
    """A 1-token Llama forward, nothing else: the shape of code torch.compile does best on (gpt-fast)."""

    def __init__(self, model: nn.Module, slots: int) -> None:
        super().__init__()
        share = lambda t: nn.Parameter(t.detach(), requires_grad=False)  # noqa: E731
        self.embed, self.norm_w = share(model.embed.weight), share(model.norm.weight)
        self.lm_head = share(model.lm_head.weight)
        self.register_buffer("rope_cos", model.rope_cos, persistent=False)
        self.register_buffer("rope_sin", model.rope_sin, persistent=False)
        self.layers = nn.ModuleList(PlainBlock(layer, model.config, slots) for layer in model.layers)
        self.eps = model.norm.eps

    def hidden(self, token: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """``token`` ``[1, 1]``, ``pos`` ``[1]`` (slot == RoPE position): final-norm hidden ``[1, 1, H]``."""
        cos, sin = self.rope_cos[pos], self.rope_sin[pos]
        x = F.embedding(token, self.embed)
        for layer in self.layers:
            x = layer(x, pos, cos, sin)
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.norm_w.float()).to(x.dtype)

    def greedy(self, hidden: torch.Tensor) -> torch.Tensor:
        """The engine's step tail: float32 logits over the vocabulary, then argmax."""
        return F.linear(hidden, self.lm_head).float().argmax(-1)


def write(doc: dict[str, Any], out: Path) -> None:
    out.write_text(json.dumps(doc, indent=1))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefix", type=int, nargs="+", default=[256, 1024],
                    help="cache positions before the token")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--no-coordinate-descent", action="store_true", help="skip inductor's coordinate descent")
    ap.add_argument("--skip-floor", action="store_true", help="engine graphs only (no torch.compile)")
    ap.add_argument("--out", type=Path, default=Path("forward_floor.json"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("forward_floor.py measures CUDA graphs; torch sees no CUDA device here, nothing to do")
        return 0

    from elesium.inference.engine import Engine
    from elesium.inference.runtime.invariant import apply_invariant_numerics, is_invariant

    t0 = time.perf_counter()
    engine = Engine.load(heads=None, cuda_graphs=True)  # as `elesium bench` on CUDA, minus the heads
    model, runner, cache = engine.model, engine.runner, engine.cache
    cfg = model.config
    doc: dict[str, Any] = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "dtype": str(model.dtype),
        "engine": engine.describe(), "cache_slots": cache.max_len, "reps": args.reps, "rows": [],
        "load_s": round(time.perf_counter() - t0, 1)}
    invariant = is_invariant(model)
    prefix_max = max(args.prefix)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, cfg.vocab_size - 100, (prefix_max + 1,), generator=gen).tolist()
    with torch.inference_mode():
        runner.prefill(prompt[:prefix_max])  # real K/V in every slot the measurements read
    torch.cuda.synchronize()

    # Static inputs for the engine's forward-only graph: the step graph's body minus the logits.
    buf = torch.zeros(4, dtype=torch.long, device="cuda")  # token | position | offset | ancestor (1x1)

    def engine_forward() -> torch.Tensor:
        return model(buf[:1].view(1, 1), buf[1:2], cache, buf[2], buf[3:4].view(1, 1).bool())[0]

    floor_graphs: dict[int, Any] = {}
    if not args.skip_floor:
        import torch._inductor.config as inductor_config

        inductor_config.coordinate_descent_tuning = not args.no_coordinate_descent
        inductor_config.triton.unique_kernel_names = True
        inductor_config.fx_graph_cache = True
        doc["floor_compile"] = {"mode": "max-autotune-no-cudagraphs",
                                "coordinate_descent_tuning": not args.no_coordinate_descent}

    for L in args.prefix:
        row: dict[str, Any] = {"prefix": L}
        doc["rows"].append(row)
        token = prompt[L]
        # 1. The engine's captured vanilla step (what decode() replays), at offset L.
        with torch.inference_mode():
            apply_invariant_numerics(model, invariant)
            out = runner.decode([token], [L], L)
            graph, io, step_out = runner._graphs[(1, False)]
            staging = io["staging"]
            staging[0], staging[1], staging[2] = token, L, L
            io["device"].copy_(staging)
            row["engine_step"] = time_graph(graph, args.reps)
            ref_hidden = out.hidden[0].float().clone()
            ref_greedy = int(out.greedy[0])
            host = []
            for _ in range(50):  # the whole decode() call from the host: staging copy, replay, greedy read
                t = time.perf_counter()
                int(runner.decode([token], [L], L).greedy[0])
                host.append((time.perf_counter() - t) * 1e3)
            row["engine_decode_call_ms"] = statistics.median(host)
            # 2. Forward only, same model and cache, invariant numerics as loaded; 3. with them off.
            buf.copy_(torch.tensor([token, L, L, 1]))
            for key, inv in (("engine_forward", invariant), ("engine_forward_std", False)):
                apply_invariant_numerics(model, inv)
                g, h = capture(engine_forward)
                row[key] = time_graph(g, args.reps)
                row[key + "_max_abs_diff"] = float((h[0].float() - ref_hidden).abs().max())
                del g
            apply_invariant_numerics(model, invariant)
        write(doc, args.out)
        print(f"prefix {L}: engine step {row['engine_step']['median_ms']:.3f} ms, forward "
              f"{row['engine_forward']['median_ms']:.3f}, "
              f"forward std {row['engine_forward_std']['median_ms']:.3f}",
              flush=True)
        if args.skip_floor:
            continue
        # 4. The floor: compiled plain forward over the same weights, cache of exactly L + 1 live slots.
        try:
            with torch.no_grad():
                plain = PlainLlama(model, L + 1)
                for i, layer in enumerate(plain.layers):
                    layer.k_cache[:, :, :L].copy_(cache.k[i][:, :, :L])
                    layer.v_cache[:, :, :L].copy_(cache.v[i][:, :, :L])
                tok = torch.tensor([[token]], device="cuda")
                pos = torch.tensor([L], device="cuda")
                hidden_fn = torch.compile(plain.hidden, mode="max-autotune-no-cudagraphs", fullgraph=True)
                greedy_fn = floor_graphs.get("greedy") or torch.compile(
                    plain.greedy, mode="max-autotune-no-cudagraphs", fullgraph=True)
                floor_graphs["greedy"] = greedy_fn
                t = time.perf_counter()
                g, h = capture(lambda: hidden_fn(tok, pos))
                row["floor_compile_s"] = round(time.perf_counter() - t, 1)
                row["floor_forward"] = time_graph(g, args.reps)
                row["floor_max_abs_diff"] = float((h[0, 0].float() - ref_hidden).abs().max())
                del g

                def step() -> tuple[torch.Tensor, torch.Tensor]:
                    hh = hidden_fn(tok, pos)
                    return hh, greedy_fn(hh)

                g, (h, greedy) = capture(step)
                row["floor_step"] = time_graph(g, args.reps)
                row["floor_greedy"], row["engine_greedy"] = int(greedy.view(-1)[0]), ref_greedy
                del g, plain
        except Exception as exc:  # noqa: BLE001 - a failed compile is a result to report, not a crash
            row["floor_error"] = f"{type(exc).__name__}: {str(exc)[:2000]}"
            print(f"prefix {L}: floor failed: {row['floor_error'][:300]}", file=sys.stderr, flush=True)
        write(doc, args.out)
        if "floor_step" in row:
            print(f"prefix {L}: floor forward {row['floor_forward']['median_ms']:.3f} ms, floor step "
                  f"{row['floor_step']['median_ms']:.3f} (compile {row['floor_compile_s']} s)", flush=True)

    cols = ("engine_step", "engine_forward", "engine_forward_std", "floor_forward", "floor_step")
    print("\nmedian ms per replay (back-to-back mean in brackets), 1 new token, bf16, CUDA graphs")
    print("| prefix | " + " | ".join(cols) + " | decode() call ms |")
    print("| --- " * (len(cols) + 2) + "|")
    for row in doc["rows"]:
        cells = [f"{row[c]['median_ms']:.3f} ({row[c]['back_to_back_ms']:.3f})" if c in row else "-"
                 for c in cols]
        print(f"| {row['prefix']} | " + " | ".join(cells) + f" | {row['engine_decode_call_ms']:.3f} |")
    write(doc, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
