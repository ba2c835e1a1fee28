"""Serving benchmark: one engine, N concurrent generations, throughput and latency per concurrency.

Why: the engine used to serve one generation at a time (FIFO), so N concurrent callers got the same
aggregate tokens/s as one and each waited its turn; continuous batching should raise aggregate
tokens/s with concurrency at a bounded cost in time to first token (TTFT) and inter-token latency
(ITL). This script measures whatever the engine does, from the caller's side: it calls
``engine.stream`` from ``concurrency`` threads at once, exactly as a server's request threads do, so
the same script gives the FIFO baseline and the batched result.

For each concurrency level, ``--requests-per-level`` requests (default 2 x concurrency, at least 4)
go through a thread pool of ``concurrency`` workers, each taking the next prompt as soon as its last
one finished, so ``concurrency`` requests are in flight until the queue runs dry. Prompts are
MT-Bench first turns, the same ones (in order, cycled) at every level. Per level: wall time, output
tokens, aggregate tokens/s and its speedup over concurrency 1, per-request TTFT (first chunk's
arrival minus submit time), ITL from chunk arrival times (a chunk carrying k tokens after a gap g
counts as k intervals of g/k; the first chunk's own tokens are covered by TTFT, not ITL), p50/p99 of
each, per-request tokens/s, errors. Warm-up generations (``--warmup`` levels, default 1 and 2,
because a batched engine may compile a second graph) run before anything is timed.

Writes JSON to ``--out`` and a PNG beside it (when matplotlib is installed); prints a short table.

    .venv/bin/python benchmarks/serving.py                        # 1,2,4,8,16; 128 tokens, greedy
    .venv/bin/python benchmarks/serving.py --concurrency 1,2 --max-tokens 8 --requests-per-level 2 \\
        --out /tmp/serving-smoke/serving.json                      # smoke
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from elesium.inference.engine import Engine
from elesium.inference.sampling import SamplingParams

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PROMPTS = Path("/work/shared/data/mt_bench_questions.jsonl")
DEFAULT_OUT = ROOT / "benchmarks" / "serving" / "serving.json"
WARMUP_PROMPT = "Write one sentence about the sea."


@dataclasses.dataclass
class RequestResult:
    """One request as the caller saw it (times on the ``time.perf_counter()`` clock)."""

    index: int
    prompt_index: int
    submitted_at: float
    first_chunk_at: float | None = None
    finished_at: float | None = None
    output_tokens: int = 0
    chunk_tokens: int = 0  # tokens counted from the chunks (should equal output_tokens)
    prompt_tokens: int = 0
    finish_reason: str | None = None
    itl_s: list[float] = dataclasses.field(default_factory=list)
    engine_ttft_s: float | None = None  # the engine's own GenerationTiming.ttft_s, when it has one
    engine_queue_s: float | None = None  # GenerationTiming.queue_s: waiting for the engine (FIFO gate)
    error: str | None = None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_chunk_at is None else self.first_chunk_at - self.submitted_at

    @property
    def e2e_s(self) -> float | None:
        return None if self.finished_at is None else self.finished_at - self.submitted_at

    @property
    def tokens_per_s(self) -> float | None:
        """Output tokens over the request's end-to-end time (queueing and prefill included)."""
        e2e = self.e2e_s
        return self.output_tokens / e2e if e2e and self.output_tokens else None

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Tokens after the first over the time after the first chunk (the decode rate it got)."""
        if self.first_chunk_at is None or self.finished_at is None or self.output_tokens < 2:
            return None
        span = self.finished_at - self.first_chunk_at
        return (self.output_tokens - 1) / span if span > 0 else None


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) by linear interpolation between order statistics; None if empty."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def load_prompts(path: Path) -> list[str]:
    """First turns of an MT-Bench style JSONL (one object per line with a ``turns`` list)."""
    prompts: list[str] = []
    with path.open() as fh:
        for line in fh:
            if line.strip():
                turns = json.loads(line).get("turns") or []
                if turns and isinstance(turns[0], str) and turns[0].strip():
                    prompts.append(turns[0])
    if not prompts:
        raise SystemExit(f"no prompts with a first turn in {path}")
    return prompts


def one_request(engine: Engine, prompt: str, params: SamplingParams, mode: str | None,
                index: int, prompt_index: int) -> RequestResult:
    """Run one generation to the end, timing every chunk's arrival; never raises (errors are recorded)."""
    res = RequestResult(index=index, prompt_index=prompt_index, submitted_at=time.perf_counter())
    try:
        stream = engine.stream(prompt, params, mode=mode)
        res.prompt_tokens = len(stream.prompt_ids)
        prev: float | None = None
        with stream:
            for chunk in stream:
                now = time.perf_counter()
                k = len(chunk.token_ids)
                if k == 0:
                    continue  # text only (held-back characters): its gap goes to the next chunk's tokens
                res.chunk_tokens += k
                if res.first_chunk_at is None:
                    res.first_chunk_at = now
                elif prev is not None:
                    res.itl_s.extend([(now - prev) / k] * k)
                prev = now
            res.finished_at = time.perf_counter()
            result = stream.result
        res.output_tokens = len(result.token_ids)
        res.finish_reason = result.finish_reason
        timing = stream.timing
        res.engine_ttft_s = getattr(timing, "ttft_s", None)
        res.engine_queue_s = getattr(timing, "queue_s", None)
    except Exception as exc:  # noqa: BLE001 - a benchmark counts failures, it does not stop on them
        res.error = f"{type(exc).__name__}: {exc}"
        if res.finished_at is None:
            res.finished_at = time.perf_counter()
        traceback.print_exc(file=sys.stderr)
    return res


def run_level(engine: Engine, prompts: list[str], concurrency: int, requests: int, max_tokens: int,
              temperature: float, seed: int, mode: str | None) -> tuple[float, list[RequestResult]]:
    """``requests`` requests through ``concurrency`` workers; (wall seconds, results in submit order)."""
    def task(i: int) -> RequestResult:
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed + i)
        return one_request(engine, prompts[i % len(prompts)], params, mode, i, i % len(prompts))

    with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix=f"serve-c{concurrency}") as pool:
        start = time.perf_counter()
        futures = [pool.submit(task, i) for i in range(requests)]
        results = [f.result() for f in futures]
        wall = time.perf_counter() - start
    return wall, results


def loop_counters(engine: Engine) -> dict[str, float]:
    """The batcher's counters (steps, rows, seconds per kind of work): a level's difference says where the
    step loop's time went and how full its batches were."""
    batcher = engine.batcher
    if batcher is None:
        return {}
    return {"batched_steps": batcher.batched_steps, "batched_rows": batcher.batched_rows,
            "solo_steps": batcher.solo_steps, "ahead_rows": batcher.ahead_rows,
            "folded_blocks": batcher.folded_blocks, "prefill_rows": batcher.prefill_rows,
            "early_prefills": batcher.early_prefills,
            **{f"busy_{k}_s": v for k, v in batcher.busy_s.items()},
            # CUDA: the prefill forwards and the host seconds inside them (BatchedCudaStep.prefill_host_s)
            "prefill_forwards": getattr(batcher._step, "prefill_forwards", 0),
            **{f"prefill_{k}_s": v for k, v in getattr(batcher._step, "prefill_host_s", {}).items()}}


def loop_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    delta = {k: after[k] - before[k] for k in after}
    if delta.get("batched_steps"):
        delta["mean_rows"] = delta["batched_rows"] / delta["batched_steps"]
        delta["ms_per_batched_step"] = 1e3 * delta["busy_batched_step_s"] / delta["batched_steps"]
    return delta


def summarize(concurrency: int, wall: float, results: list[RequestResult]) -> dict[str, Any]:
    ok = [r for r in results if r.error is None]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    itl = [x for r in ok for x in r.itl_s]
    rates = [r.tokens_per_s for r in ok if r.tokens_per_s is not None]
    decode_rates = [r.decode_tokens_per_s for r in ok if r.decode_tokens_per_s is not None]
    e2e = [r.e2e_s for r in ok if r.e2e_s is not None]
    queue = [r.engine_queue_s for r in ok if r.engine_queue_s is not None]
    tokens = sum(r.output_tokens for r in ok)

    def stats(values: list[float]) -> dict[str, float | None]:
        return {"p50": percentile(values, 50), "p99": percentile(values, 99),
                "mean": sum(values) / len(values) if values else None,
                "min": min(values) if values else None, "max": max(values) if values else None}

    return {
        "concurrency": concurrency,
        "requests": len(results),
        "errors": len(results) - len(ok),
        "error_samples": [r.error for r in results if r.error is not None][:5],
        "wall_s": wall,
        "output_tokens": tokens,
        "prompt_tokens": sum(r.prompt_tokens for r in ok),
        "aggregate_tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "finish_reasons": {k: sum(1 for r in ok if r.finish_reason == k)
                           for k in sorted({r.finish_reason or "" for r in ok})},
        "ttft_s": stats(ttft),
        "itl_s": stats(itl),
        "e2e_s": stats(e2e),
        "engine_queue_s": stats(queue),
        "request_tokens_per_s": stats(rates),
        "request_decode_tokens_per_s": stats(decode_rates),
        "per_request": [{
            "index": r.index, "prompt_index": r.prompt_index, "prompt_tokens": r.prompt_tokens,
            "output_tokens": r.output_tokens, "chunk_tokens": r.chunk_tokens,
            "finish_reason": r.finish_reason, "ttft_s": r.ttft_s, "e2e_s": r.e2e_s,
            "tokens_per_s": r.tokens_per_s, "decode_tokens_per_s": r.decode_tokens_per_s,
            "itl_p50_s": percentile(r.itl_s, 50), "itl_p99_s": percentile(r.itl_s, 99),
            "engine_ttft_s": r.engine_ttft_s, "engine_queue_s": r.engine_queue_s, "error": r.error,
        } for r in results],
    }


def jsonable(value: Any) -> Any:
    """A JSON-safe rendering of an arbitrary attribute (``engine.batching`` may be any object)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [jsonable(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    describe = getattr(value, "describe", None)
    if callable(describe):
        try:
            return jsonable(describe())
        except Exception:  # noqa: BLE001 - fall back to repr
            pass
    return repr(value)


def git(*args: str) -> str:
    try:
        return subprocess.run(["git", "-C", str(ROOT), *args], check=True, capture_output=True,
                              text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {
        "platform": platform.platform(), "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "python": sys.version.split()[0], "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "env": {k: v for k, v in sorted(os.environ.items())
                if k.startswith("ELESIUM_") or k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")},
    }
    if torch.cuda.is_available():
        info["cuda_device"] = torch.cuda.get_device_name(0)
    return info


def warm_up(engine: Engine, levels: list[int], max_tokens: int, mode: str | None) -> list[dict[str, Any]]:
    """Untimed generations at each warm-up concurrency (compiles whatever graphs each level needs)."""
    done = []
    for level in levels:
        start = time.perf_counter()
        barrier = threading.Barrier(level)

        def task(i: int, barrier: threading.Barrier = barrier) -> RequestResult:
            barrier.wait()  # start together, so a batching engine really sees `level` at once
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, seed=i)
            return one_request(engine, WARMUP_PROMPT, params, mode, i, -1)

        with ThreadPoolExecutor(max_workers=level) as pool:
            results = list(pool.map(task, range(level)))
        wall = time.perf_counter() - start
        errors = [r.error for r in results if r.error]
        note = f" ({len(errors)} errors)" if errors else ""
        print(f"warm-up at concurrency {level}: {wall:.1f} s{note}", file=sys.stderr)
        done.append({"concurrency": level, "wall_s": wall, "max_tokens": max_tokens, "errors": errors})
    return done


def plot(report: dict[str, Any], path: Path) -> bool:
    """Aggregate tokens/s, TTFT and ITL against concurrency; False (with a note) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
        return False
    levels = report["levels"]
    xs = [lv["concurrency"] for lv in levels]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    agg = [lv["aggregate_tokens_per_s"] for lv in levels]
    ax1.plot(xs, agg, "o-", label="measured")
    if levels and levels[0]["concurrency"] == 1:
        ax1.plot(xs, [agg[0] * x for x in xs], ":", color="grey", label="linear in concurrency")
    ax1.set_xscale("log", base=2)
    ax1.set_xticks(xs, [str(x) for x in xs])
    ax1.set_xlabel("concurrent requests")
    ax1.set_ylabel("aggregate output tokens/s")
    ax1.set_title("throughput")
    ax1.legend()
    ax1.grid(alpha=0.3)

    def ms(key: str, q: str) -> list[float]:
        return [(lv[key][q] or float("nan")) * 1000 for lv in levels]

    ax2.plot(xs, ms("ttft_s", "p50"), "o-", label="TTFT p50")
    ax2.plot(xs, ms("ttft_s", "p99"), "o--", label="TTFT p99", alpha=0.6)
    ax2.plot(xs, ms("itl_s", "p50"), "s-", label="ITL p50")
    ax2.plot(xs, ms("itl_s", "p99"), "s--", label="ITL p99", alpha=0.6)
    ax2.set_xscale("log", base=2)
    ax2.set_xticks(xs, [str(x) for x in xs])
    ax2.set_yscale("log")
    ax2.set_xlabel("concurrent requests")
    ax2.set_ylabel("ms")
    ax2.set_title("latency")
    ax2.legend()
    ax2.grid(alpha=0.3)
    cfg = report["config"]
    mode = cfg["mode"] or report["engine"].get("default_mode", "?")
    fig.suptitle(f"elesium serving: {report['engine'].get('device', '?')}, mode "
                 f"{mode}, {cfg['max_tokens']} max tokens, "
                 f"commit {report['git_commit']}{' (dirty)' if report['git_dirty'] else ''}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def print_table(report: dict[str, Any]) -> None:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.0f}"

    print(f"{'conc':>4} {'reqs':>4} {'err':>3} {'wall s':>7} {'tokens':>6} {'tok/s':>7} {'speedup':>7} "
          f"{'TTFT p50':>8} {'p99':>6} {'ITL p50':>7} {'p99':>6} {'req tok/s p50':>13}")
    for lv in report["levels"]:
        rate = lv["request_tokens_per_s"]["p50"]
        speed = lv.get("speedup_vs_concurrency_1")
        print(f"{lv['concurrency']:>4} {lv['requests']:>4} {lv['errors']:>3} {lv['wall_s']:>7.2f} "
              f"{lv['output_tokens']:>6} {lv['aggregate_tokens_per_s']:>7.1f} "
              f"{'-' if speed is None else f'{speed:.2f}x':>7} {ms(lv['ttft_s']['p50']):>8} "
              f"{ms(lv['ttft_s']['p99']):>6} {ms(lv['itl_s']['p50']):>7} {ms(lv['itl_s']['p99']):>6} "
              f"{'-' if rate is None else f'{rate:.1f}':>13}")


def int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"levels must be >= 1, got {text!r}")
    return values


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--concurrency", type=int_list, default=int_list("1,2,4,8,16"),
                        help="comma-separated concurrency levels (default 1,2,4,8,16)")
    parser.add_argument("--requests-per-level", type=int, default=None,
                        help="requests at each level (default: 2 x concurrency, at least 4)")
    parser.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS,
                        help="JSONL with a `turns` list per line; the first turn is the prompt")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    parser.add_argument("--seed", type=int, default=0, help="request i uses seed + i")
    parser.add_argument("--mode", default=None, help="decoding mode (default: the engine's default)")
    parser.add_argument("--device", default="auto", help="Engine.load device (default auto)")
    parser.add_argument("--warmup", type=lambda s: [] if s.strip() in ("", "0", "none") else int_list(s),
                        default=[1, 2], help="warm-up concurrency levels, untimed (default 1,2; 'none')")
    parser.add_argument("--warmup-tokens", type=int, default=32, help="max tokens of a warm-up generation")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON report; the PNG goes beside it")
    args = parser.parse_args()
    if args.requests_per_level is not None and args.requests_per_level < 1:
        parser.error("--requests-per-level must be >= 1")
    if args.max_tokens < 1:
        parser.error("--max-tokens must be >= 1")

    prompts = load_prompts(args.prompts)
    started = dt.datetime.now(dt.timezone.utc)
    t0 = time.perf_counter()
    engine = Engine.load(device=args.device)
    load_s = time.perf_counter() - t0
    print(f"engine loaded in {load_s:.1f} s", file=sys.stderr)
    warm_s = engine.warm_up()  # what `elesium serve` does before its first request
    print(f"engine warmed up in {warm_s:.1f} s (batcher: {engine.batcher is not None})", file=sys.stderr)
    warmups = warm_up(engine, args.warmup, min(args.warmup_tokens, args.max_tokens), args.mode)

    levels: list[dict[str, Any]] = []
    for c in args.concurrency:
        n = args.requests_per_level if args.requests_per_level is not None else max(4, 2 * c)
        before = loop_counters(engine)
        wall, results = run_level(engine, prompts, c, n, args.max_tokens, args.temperature, args.seed,
                                  args.mode)
        level = summarize(c, wall, results)
        level["step_loop"] = loop_delta(before, loop_counters(engine))
        levels.append(level)
        print(f"concurrency {c}: {n} requests in {wall:.2f} s, {level['aggregate_tokens_per_s']:.1f} tok/s, "
              f"{level['errors']} errors", file=sys.stderr)
    base = next((lv["aggregate_tokens_per_s"] for lv in levels if lv["concurrency"] == 1), None)
    for lv in levels:
        lv["speedup_vs_concurrency_1"] = (lv["aggregate_tokens_per_s"] / base) if base else None

    report: dict[str, Any] = {
        "benchmark": "serving",
        "date_utc": started.isoformat(timespec="seconds"),
        "git_commit": git("rev-parse", "--short", "HEAD"),
        "git_dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
        "machine": machine(),
        "engine": engine.describe(),
        "engine_batching": jsonable(getattr(engine, "batching", None)),
        "engine_load_s": load_s,
        "config": {
            "concurrency": args.concurrency, "requests_per_level": args.requests_per_level,
            "prompts": str(args.prompts), "prompt_count": len(prompts), "max_tokens": args.max_tokens,
            "temperature": args.temperature, "seed": args.seed, "mode": args.mode,
            "device": args.device, "warmup": args.warmup, "warmup_tokens": args.warmup_tokens,
            # SamplingParams has no ignore_eos: generations may stop early at EOS; counts are actual.
            "ignore_eos": False,
        },
        "warmup": warmups,
        "engine_warm_up_s": warm_s,
        "max_batch": engine.batcher.slots if engine.batcher is not None else 1,
        "levels": levels,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    png = args.out.with_suffix(".png")
    print_table(report)
    print(f"wrote {args.out}" + (f" and {png}" if plot(report, png) else ""))
    return 0 if all(lv["errors"] == 0 for lv in levels) else 1


if __name__ == "__main__":
    sys.exit(main())
