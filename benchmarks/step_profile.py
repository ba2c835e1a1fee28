"""Profile one decode step: kernel count and time by kernel class, vanilla and speculative (issue 17).

Why: issue 17 ("GPU decode step") asks for a profile of one step before and after its changes. On an
H200 the 135M model's step is launch- and latency-bound, so the number of kernels per step and where
their time goes (matmuls, attention, norms, pointwise glue, reductions, copies) is what a fused step
must move. This script measures that, the same way every time, so "before" and "after" compare.

How: the engine is built the way ``elesium bench`` builds it (``add_model_args`` + ``load_engine``:
bundled model, shipped heads, the device's tuning profile, ``ELESIUM_*`` settings), with CUDA graphs on
by default on CUDA. For each mode (vanilla, then speculative with the engine's own tree policy) it

1. warms up (one ``generate`` per prompt: captures every CUDA-graph bucket, autotunes Triton),
2. times ``--steps`` greedy decode steps without the profiler (host wall clock; each step ends in a
   readback, and the script synchronises around it as well),
3. replays exactly the same steps (greedy, so the same trees) under ``torch.profiler`` with CUDA
   activity, each step inside a ``record_function`` marker, and reads the exported Chrome trace.

GPU work is attributed to a step through CUPTI's correlation id (the launching runtime or driver
call lies inside the step's marker); work without one falls back to its own GPU timestamp. Kernels
launched by ``cudaGraphLaunch`` are counted separately: that count says whether CUDA-graph replays
show their kernels to the profiler. If none do, the script says so and profiles eager steps too
(``--runner both`` always does).

Per step: GPU ops (kernels + memcpy + memset), their summed time, the same by class
(``KERNEL_CLASSES``), the wall time, and the host time around and between kernels (``gpu_span`` is
first kernel start to last kernel end; ``gpu_idle_in_span`` the gaps inside it, i.e. launch latency
and host work the GPU waited for; ``host_outside`` the wall time before the first and after the last
kernel). Medians over the steps; per-class medians need not add up to the total's median.

On a CPU (smoke tests) there is no GPU activity: each step's innermost computing ``aten::`` ops stand
in for kernels (``self_times``), classified with the same table.

``--selftest-cuda`` (alone) checks the trace reading on a tiny captured graph, without a model.

Run: ``python3 -P benchmarks/step_profile.py --out step_profile.json`` (``-P`` on the device, where
the package is a shim on PYTHONPATH); ``benchmarks/device/device_step_profile.sh`` runs it on the H200.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import dataclasses
import functools
import gzip
import json
import math
import re
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from elesium.cli.commands.common import add_model_args, load_engine
from elesium.inference.engine import Engine
from elesium.inference.prompts import read_prompts
from elesium.inference.sampling import Sampler, SamplingParams

MARKER = "step_profile.step"
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")

# Kernel class by name: the first regex that matches (case-insensitive search) wins, so the order
# matters (split-K reduces are matmul, not reduction; the attention kernels before "matmul"). Each
# regex covers CUDA kernel names (cuBLAS nvjet/xmma/gemv, CUTLASS, ATen's templates, this project's
# Triton kernels in kernels/) and, for CPU smoke runs, ATen op names. Torch's eager RoPE and (with
# invariant numerics off) RMSNorm are chains of ATen pointwise/reduction kernels whose names say
# nothing of the layer: they land in "elementwise" and "reduction"; a fused kernel named for its
# layer lands in its own class.
VIEW = "view/alloc (CPU ops only)"  # CPU runs: ops that compute nothing (no GPU kernel has such a name)
KERNEL_CLASSES: tuple[tuple[str, str], ...] = (
    ("memcpy/memset", r"^memcpy|^memset|aten::(copy_|_to_copy|clone|zero_|fill_)$"),
    ("attention", r"attn|attention|flash|fmha|_invariant_split_kernel|scaled_dot_product"),
    ("norm", r"norm"),
    ("rope", r"rope|rotary"),
    ("matmul", r"gemm|gemv|nvjet|cutlass|xmma|matmul|splitk|cublas|dot_kernel"
               r"|aten::(mm|addmm|bmm|linear|_weight_int4pack_mm\w*)$"),
    ("reduction/softmax/topk/sort", r"reduce|softmax|topk|sort|argmax|argmin|logsumexp|radix|scan|cub::"
                                    r"|aten::(sum|mean|amax|amin|max|min|cumsum|all|any)$"),
    (VIEW, r"aten::(empty\w*|view|_unsafe_view|as_strided|reshape|resize_|slice|select"
                                  r"|unsqueeze|squeeze|transpose|t|permute|expand|detach|alias|lift_fresh"
                                  r"|split\w*|chunk|narrow|unbind|movedim|diagonal|set_|item"
                                  r"|_local_scalar_dense|result_type|is_nonzero|resolve_\w+)$"),
    ("elementwise/pointwise", r"elementwise|vectorized|unrolled|pointwise|triton_poi|catarray|index|gather"
                              r"|scatter|embedding|fill|aten::\w+"),
)
_CLASS_RES = tuple((name, re.compile(rx, re.IGNORECASE)) for name, rx in KERNEL_CLASSES)
OTHER = "other"
CLASS_NAMES = tuple(name for name, _ in KERNEL_CLASSES) + (OTHER,)


@functools.lru_cache(maxsize=4096)
def classify(name: str) -> str:
    """The class of one kernel (or CPU op) name: the first matching row of ``KERNEL_CLASSES``."""
    return next((cls for cls, rx in _CLASS_RES if rx.search(name)), OTHER)


# -- driving the engine ---------------------------------------------------------------------------


@dataclasses.dataclass
class StepRun:
    """One measured decode step as the host saw it."""

    index: int
    prompt: int
    tree_size: int
    tokens: int
    wall_us: float
    captured: bool  # a CUDA graph was captured inside this step: not a steady-state step, left out


def graph_count(engine: Engine) -> int:
    """Captured graphs so far (0 for the eager runner): a change inside a step means it captured."""
    runner = engine.runner
    return len(getattr(runner, "_graphs", {})) + len(getattr(runner, "_expanders", {}))


def sync(engine: Engine) -> None:
    """Wait for the device, so a host clock brackets exactly one step's work."""
    if engine.model.device.type == "cuda":
        torch.cuda.synchronize(engine.model.device)


def drive(engine: Engine, mode: str, prompts: list[str], opts: argparse.Namespace,
          marker: Callable[[int], contextlib.AbstractContextManager[Any]]) -> list[StepRun]:
    """Greedy decode steps as ``GenerationStream`` runs them, ``opts.steps`` of them measured.

    Each prompt gives at most ``ceil(steps / prompts)`` measured steps, after ``opts.skip``
    unmeasured ones (the first steps after a prefill run at a short context). Greedy decoding and a
    fresh decoder per prompt make two calls run the very same steps (same trees, same buckets).
    """
    per_prompt = math.ceil(opts.steps / len(prompts))
    eos = engine.tokenizer.eos_ids
    runs: list[StepRun] = []
    for p, prompt in enumerate(prompts):
        params = SamplingParams(temperature=0.0, max_tokens=opts.max_tokens, seed=0)
        with torch.inference_mode():
            decoder = engine.make_decoder(mode, params, Sampler(0))
            decoder.prefill(engine.encode_prompt(prompt))
        produced, taken, k = 1, 0, 0
        while produced < opts.max_tokens and taken < per_prompt and len(runs) < opts.steps:
            room = engine.context_length - decoder.offset
            if room < 1:
                break
            measured = k >= opts.skip
            before = graph_count(engine)
            sync(engine)
            with marker(len(runs)) if measured else contextlib.nullcontext():
                start = time.perf_counter()
                with torch.inference_mode():
                    tokens, record = decoder.step(room)
                sync(engine)
                wall = time.perf_counter() - start
            k += 1
            produced += len(tokens)
            if measured:
                runs.append(StepRun(len(runs), p, record.tree_size, len(tokens), 1e6 * wall,
                                    graph_count(engine) != before))
                taken += 1
            if any(t in eos for t in tokens):
                break
    return runs


def warm_up(engine: Engine, mode: str, prompts: list[str], max_tokens: int) -> None:
    """One generation per prompt: captures the graph buckets the measured steps will replay."""
    for prompt in prompts:
        engine.generate(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, seed=0), mode=mode)
    sync(engine)


def profiled_trace(engine: Engine, mode: str, prompts: list[str], opts: argparse.Namespace,
                   trace_path: Path) -> list[StepRun]:
    """The same steps under ``torch.profiler`` (CPU + CUDA activity); writes the Chrome trace."""
    activities = [ProfilerActivity.CPU]
    if engine.model.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        runs = drive(engine, mode, prompts, opts, lambda i: record_function(f"{MARKER}{i}"))
    prof.export_chrome_trace(str(trace_path))
    return runs


# -- reading the trace ------------------------------------------------------------------------------


@dataclasses.dataclass
class StepEvents:
    """What the trace holds for one step: its marker, its GPU work (or CPU ops), its launches."""

    start: float
    end: float
    tid: Any = None  # the host thread that ran the step (CPU runs: whose ops count)
    ops: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    launches: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    graph_ops: int = 0


class StepIndex:
    """Finds the step whose marker window holds a host timestamp (windows never overlap)."""

    def __init__(self, markers: dict[int, StepEvents]) -> None:
        self.ids = sorted(markers, key=lambda i: markers[i].start)
        self.starts = [markers[i].start for i in self.ids]
        self.markers = markers

    def find(self, ts: float) -> int | None:
        pos = bisect.bisect_right(self.starts, ts) - 1
        if pos < 0:
            return None
        step = self.ids[pos]
        return step if ts <= self.markers[step].end else None


def read_markers(events: list[dict[str, Any]]) -> dict[int, StepEvents]:
    """Step windows from the host-side ``record_function`` markers."""
    out: dict[int, StepEvents] = {}
    for e in events:
        name = e.get("name", "")
        if e.get("ph") == "X" and e.get("cat") == "user_annotation" and name.startswith(MARKER):
            out[int(name[len(MARKER):])] = StepEvents(e["ts"], e["ts"] + e["dur"], e.get("tid"))
    return out


def attribute_gpu(events: list[dict[str, Any]], steps: dict[int, StepEvents]) -> None:
    """GPU kernels/copies to steps, through the correlation id of the call that launched them."""
    index = StepIndex(steps)
    launch_ts: dict[int, float] = {}
    graph_corr: set[int] = set()
    for e in events:
        if e.get("cat") in LAUNCH_CATS and e.get("ph") == "X":
            corr = e.get("args", {}).get("correlation")
            if corr is not None:
                launch_ts[corr] = e["ts"]
                if "GraphLaunch" in e.get("name", ""):
                    graph_corr.add(corr)
            step = index.find(e["ts"])
            if step is not None:
                steps[step].launches.append(e)
    for e in events:
        if e.get("cat") not in GPU_CATS or e.get("ph") != "X":
            continue
        corr = e.get("args", {}).get("correlation")
        step = index.find(launch_ts[corr]) if corr in launch_ts else index.find(e["ts"])
        if step is not None:
            steps[step].ops.append(e)
            steps[step].graph_ops += corr in graph_corr


def attribute_cpu_ops(events: list[dict[str, Any]], steps: dict[int, StepEvents]) -> None:
    """CPU runs: each step's ``aten::`` ops on the marker's thread stand in for kernels."""
    index = StepIndex(steps)
    by_step: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        if e.get("cat") == "cpu_op" and e.get("ph") == "X":
            step = index.find(e["ts"])
            if step is not None and e.get("tid") == steps[step].tid:
                by_step[step].append(e)
    for step, ops in by_step.items():
        steps[step].ops.extend(self_times(ops))


def self_times(ops: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """CPU ops nest (``linear`` > ``matmul`` > ``mm`` > ``t``, ``empty``): every op keeps its self time
    (``time``: its duration less its children's) in its own class, so each microsecond counts once,
    and an op is ``counted`` as one "kernel" when it computes (not a view/alloc op) and no computing
    op is nested inside it (``mm`` is, ``matmul`` and ``linear`` are not)."""
    ops = sorted(ops, key=lambda e: (e["ts"], -e["dur"]))
    child_time = [0.0] * len(ops)
    has_compute_child = [False] * len(ops)
    stack: list[int] = []
    for i, e in enumerate(ops):
        while stack and ops[stack[-1]]["ts"] + ops[stack[-1]]["dur"] <= e["ts"]:
            stack.pop()
        if stack:
            child_time[stack[-1]] += e["dur"]
            if classify(e["name"]) != VIEW:
                for j in stack:
                    has_compute_child[j] = True
        stack.append(i)
    return [{**e, "time": max(e["dur"] - child_time[i], 0.0),
             "counted": classify(e["name"]) != VIEW and not has_compute_child[i]} for i, e in enumerate(ops)]


def outermost(ops: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ops not nested in another (their intervals cover the rest: what ``busy_time`` needs)."""
    out: list[dict[str, Any]] = []
    for e in sorted(ops, key=lambda e: (e["ts"], -e["dur"])):
        if not out or e["ts"] >= out[-1]["ts"] + out[-1]["dur"]:
            out.append(e)
    return out


def busy_time(ops: list[dict[str, Any]]) -> float:
    """Length of the union of the ops' intervals (µs): time the device had something running."""
    total, cur_start, cur_end = 0.0, None, None
    for e in sorted(ops, key=lambda e: e["ts"]):
        s, t = e["ts"], e["ts"] + e["dur"]
        if cur_end is None or s > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = s, t
        else:
            cur_end = max(cur_end, t)
    return total + (cur_end - cur_start if cur_end is not None else 0.0)


def step_metrics(ev: StepEvents) -> dict[str, Any]:
    """One step's numbers from its events (times in µs)."""
    by_class: dict[str, list[float]] = {c: [0, 0.0] for c in CLASS_NAMES}
    for e in ev.ops:
        row = by_class[classify(e["name"])]
        row[0] += e.get("counted", True)
        row[1] += e.get("time", e["dur"])
    wall = ev.end - ev.start
    first = min((e["ts"] for e in ev.ops), default=ev.start)
    last = max((e["ts"] + e["dur"] for e in ev.ops), default=ev.start)
    span, busy = max(last - first, 0.0), busy_time(outermost(ev.ops))
    return {
        "ops": sum(e.get("counted", True) for e in ev.ops),
        "kernels": sum(e.get("cat") == "kernel" for e in ev.ops),
        "memcpy": sum(e.get("cat") == "gpu_memcpy" for e in ev.ops),
        "memset": sum(e.get("cat") == "gpu_memset" for e in ev.ops),
        "graph_ops": ev.graph_ops,
        "op_time_us": sum(e.get("time", e["dur"]) for e in ev.ops),
        "wall_profiled_us": wall,
        "span_us": span,
        "busy_us": busy,
        "idle_in_span_us": span - busy,
        "host_before_first_us": max(first - ev.start, 0.0),
        "host_after_last_us": max(ev.end - last, 0.0),
        "by_class": {c: {"count": n, "time_us": t} for c, (n, t) in by_class.items()},
        "launches": dict(Counter(e["name"] for e in ev.launches)),
    }


# -- summarising ----------------------------------------------------------------------------------


def med(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def summarise(runs: list[StepRun], timed: list[StepRun], steps: dict[int, StepEvents]) -> dict[str, Any]:
    """Medians over the steady-state steps (no graph capture in either pass)."""
    keep = [r.index for r in runs if not r.captured and r.index in steps
            and not (r.index < len(timed) and timed[r.index].captured)]
    per_step = {i: step_metrics(steps[i]) for i in keep}
    scalars = ("ops", "kernels", "memcpy", "memset", "graph_ops", "op_time_us", "wall_profiled_us", "span_us",
               "busy_us", "idle_in_span_us", "host_before_first_us", "host_after_last_us")
    out: dict[str, Any] = {"steps": len(keep), "left_out_captures": len(runs) - len(keep)}
    out["wall_unprofiled_us"] = med([timed[i].wall_us for i in keep if i < len(timed)])
    out["tree_size"] = med([runs[i].tree_size for i in keep])
    out["tokens_per_step"] = med([runs[i].tokens for i in keep])
    out |= {k: med([per_step[i][k] for i in keep]) for k in scalars}
    out["by_class"] = {c: {"count": med([per_step[i]["by_class"][c]["count"] for i in keep]),
                           "time_us": med([per_step[i]["by_class"][c]["time_us"] for i in keep])}
                       for c in CLASS_NAMES}
    names = {n for i in keep for n in per_step[i]["launches"]}
    out["launches"] = {n: med([per_step[i]["launches"].get(n, 0) for i in keep]) for n in sorted(names)}
    out["top_ops"] = top_ops([steps[i] for i in keep])
    out["per_step"] = [{"index": i, "tree_size": runs[i].tree_size, "tokens": runs[i].tokens,
                        **{k: per_step[i][k] for k in scalars}} for i in keep]
    return out


def top_ops(steps: list[StepEvents], n: int = 20) -> list[dict[str, Any]]:
    """The kernels (or ops) with the most time per step, mean over the steps."""
    count: Counter[str] = Counter()
    time_us: Counter[str] = Counter()
    for ev in steps:
        for e in ev.ops:
            count[e["name"]] += e.get("counted", True)
            time_us[e["name"]] += e.get("time", e["dur"])
    k = max(len(steps), 1)
    return [{"name": name, "class": classify(name), "per_step": count[name] / k, "time_us": t / k}
            for name, t in time_us.most_common(n)]


def profile_mode(engine: Engine, mode: str, prompts: list[str], opts: argparse.Namespace,
                 tag: str) -> dict[str, Any]:
    """Warm up, time, profile and summarise one mode on one engine."""
    warm_up(engine, mode, prompts, opts.max_tokens)
    timed = drive(engine, mode, prompts, opts, lambda i: contextlib.nullcontext())
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        runs = profiled_trace(engine, mode, prompts, opts, trace)
        events = json.loads(trace.read_text())["traceEvents"]
        if opts.trace_dir is not None:
            opts.trace_dir.mkdir(parents=True, exist_ok=True)
            kept = opts.trace_dir / f"trace_{tag}_{mode}.json.gz"
            with trace.open("rb") as src, gzip.open(kept, "wb") as dst:
                shutil.copyfileobj(src, dst)
    steps = read_markers(events)
    if engine.model.device.type == "cuda":
        attribute_gpu(events, steps)
    else:
        attribute_cpu_ops(events, steps)
    return summarise(runs, timed, steps)


def profile_engine(engine: Engine, prompts: list[str], opts: argparse.Namespace, tag: str) -> dict[str, Any]:
    """Vanilla and (where heads are loaded) speculative steps on one engine."""
    out: dict[str, Any] = {}
    for mode in ("vanilla", "speculative"):
        if mode not in engine.modes:
            out[mode] = {"skipped": f"{mode} needs draft heads; none loaded"}
            continue
        print(f"[{tag}] profiling {mode} ...", file=sys.stderr, flush=True)
        try:
            out[mode] = profile_mode(engine, mode, prompts, opts, tag)
        except Exception as exc:  # one failed mode must not cost the others' numbers (device time)
            traceback.print_exc()
            out[mode] = {"skipped": f"failed: {exc!r}"}
    return out


# -- output ---------------------------------------------------------------------------------------


def fmt(x: float, scale: float = 1.0, digits: int = 1) -> str:
    return "n/a" if x != x else f"{x / scale:.{digits}f}"


def markdown(doc: dict[str, Any]) -> str:
    """The two short tables: per-step totals, then count and time by class."""
    cpu = doc["meta"]["device"] == "cpu"
    unit = "CPU ops" if cpu else "GPU ops"
    lines = [f"numerics: {doc['meta']['numerics']}, device {doc['meta']['device_name']}, "
             f"{doc['meta']['dtype']}; medians over steps; times in µs",
             "", f"| runner | mode | steps | tree | wall unprof. | wall prof. | {unit} | of them in graphs | "
             "op time | busy | idle in span | host before/after |", "| --- " * 12 + "|"]
    for runner, modes in doc["results"].items():
        for mode, r in modes.items():
            if "skipped" in r:
                continue
            lines.append(f"| {runner} | {mode} | {r['steps']} | {fmt(r['tree_size'], digits=0)} | "
                         f"{fmt(r['wall_unprofiled_us'])} | {fmt(r['wall_profiled_us'])} | "
                         f"{fmt(r['ops'], digits=0)} | "
                         f"{fmt(r['graph_ops'], digits=0)} | {fmt(r['op_time_us'])} | {fmt(r['busy_us'])} | "
                         f"{fmt(r['idle_in_span_us'])} | {fmt(r['host_before_first_us'])} / "
                         f"{fmt(r['host_after_last_us'])} |")
    cols = [(runner, mode) for runner, modes in doc["results"].items() for mode, r in modes.items()
            if "skipped" not in r]
    lines += ["", "| class | " + " | ".join(f"{r} {m} n | {r} {m} µs" for r, m in cols) + " |",
              "| --- " * (1 + 2 * len(cols)) + "|"]
    for c in CLASS_NAMES:
        cells = []
        for runner, mode in cols:
            row = doc["results"][runner][mode]["by_class"][c]
            cells += [fmt(row["count"], digits=0), fmt(row["time_us"])]
        if any(cell not in ("0", "0.0") for cell in cells):
            lines.append(f"| {c} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def meta(engine: Engine, opts: argparse.Namespace, prompts: list[str]) -> dict[str, Any]:
    """What the numbers depend on: engine description, tree policy, versions, device."""
    d = engine.describe()
    cuda = engine.model.device.type == "cuda"
    return {
        "device": d["device"], "dtype": d["dtype"], "numerics": d["numerics"], "engine": d,
        "device_name": torch.cuda.get_device_name(engine.model.device) if cuda else "cpu",
        "torch": torch.__version__, "cuda": torch.version.cuda, "policy": dataclasses.asdict(engine.policy),
        "prompts": len(prompts), "steps_asked": opts.steps, "skip": opts.skip, "max_tokens": opts.max_tokens,
        "kernel_classes": [list(row) for row in KERNEL_CLASSES],
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=Path, default=Path("tests/data/mt_bench_questions.jsonl"))
    p.add_argument("--limit", type=int, default=3, help="prompts used (steps are spread over them)")
    p.add_argument("--steps", type=int, default=20, help="measured steps per mode")
    p.add_argument("--skip", type=int, default=4, help="unmeasured steps after each prefill")
    p.add_argument("--max-tokens", type=int, default=128, help="warm-up length; caps each prompt's steps")
    p.add_argument("--runner", choices=["graphs", "eager", "both", "unfused", "fused-pair", "host-tree",
                                        "chain-pair", "sliced", "sliced-pair"], default="graphs",
                   help="graphs: the default runner (CUDA graphs on CUDA); eager: cuda_graphs=False; both; "
                        "unfused: graphs with the fused elementwise forward (runtime/fused.py) turned off; "
                        "fused-pair: graphs, then unfused, side by side; host-tree: graphs with greedy tree "
                        "steps through the host instead of the device tree chain (runtime/tree_chain.py); "
                        "chain-pair: host-tree, then graphs, side by side; sliced: graphs with the chain's "
                        "drafting top-k in --topk-chunk slices (drafters/top_logprobs.py; on CUDA 1,024 "
                        "is the default since BENCHMARKS §6j); sliced-pair: graphs, then sliced")
    p.add_argument("--topk-chunk", type=int, default=1024,
                   help="the slice width of --runner sliced; 0: the reference topk(log_softmax) form")
    p.add_argument("--out", type=Path, default=Path("bench-out/step_profile.json"))
    p.add_argument("--trace-dir", type=Path, default=None, help="keep the Chrome traces here (gzipped)")
    add_model_args(p)
    return p.parse_args(argv)


def engines(opts: argparse.Namespace, runners: list[str]) -> Iterator[tuple[str, Engine]]:
    """One engine per runner, loaded as ``elesium bench`` loads it; each freed before the next."""
    for runner in runners:
        engine = load_engine(opts, cuda_graphs=False if runner == "eager" else None)
        if runner == "unfused":  # graphs are captured at first use, so the switch still applies
            engine.model.fused_pointwise = False
        if runner == "host-tree" and hasattr(engine.runner, "tree_chains"):
            engine.runner.tree_chains = False
        if runner == "sliced" and hasattr(engine.runner, "draft_topk_chunk"):
            engine.runner.draft_topk_chunk = opts.topk_chunk or None
        tag = runner if engine.model.device.type == "cuda" or runner == "eager" else "cpu"
        yield tag, engine
        del engine
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def graphs_visible(results: dict[str, Any]) -> bool | None:
    """Whether kernels launched by ``cudaGraphLaunch`` reached the trace (None: no graph runner ran)."""
    graph = results.get("graphs")
    if graph is None:
        return None
    return any(r.get("graph_ops", 0) > 0 for r in graph.values())


def selftest_cuda() -> int:
    """No model needed: a captured graph of a few typical kernels (a bf16 linear at M = 1, a norm's
    pointwise/reduction chain, softmax, top-k, a cat), replayed under the profiler inside step
    markers, and read back through the same code as the engine's steps. Prints every GPU op with its
    class, so the trace path and the regex table are checked before model-sized device calls."""
    dev = torch.device("cuda")
    w = torch.randn(1536, 576, device=dev, dtype=torch.bfloat16) / 24
    x = torch.randn(1, 576, device=dev, dtype=torch.bfloat16)

    def body() -> torch.Tensor:
        h = torch.nn.functional.linear(x, w).float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)
        top = torch.softmax(h, -1).topk(4)
        return torch.cat([top.indices.float(), top.values], -1)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        body()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = body()
    torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for i in range(4):
                with record_function(f"{MARKER}{i}"):
                    if i % 2 == 0:
                        graph.replay()
                    else:
                        body()
                    out.cpu()
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    steps = read_markers(events)
    attribute_gpu(events, steps)
    for i in sorted(steps):
        m = step_metrics(steps[i])
        print(f"step {i} ({'graph replay' if i % 2 == 0 else 'eager'}): {m['ops']} GPU ops, "
              f"{m['graph_ops']} from graph launches, {m['op_time_us']:.1f} us; launches {m['launches']}")
        for e in steps[i].ops:
            print(f"    {classify(e['name']):<28} {e['dur']:8.2f} us  {e['name'][:150]}")
    return 0


def main(argv: list[str] | None = None) -> int:
    if argv is None and sys.argv[1:] == ["--selftest-cuda"]:
        return selftest_cuda()
    opts = parse_args(argv)
    prompts = read_prompts(opts.prompts, opts.limit)
    pairs = {"both": ["graphs", "eager"], "fused-pair": ["graphs", "unfused"],
             "chain-pair": ["host-tree", "graphs"], "sliced-pair": ["graphs", "sliced"]}
    runners = pairs.get(opts.runner, [opts.runner])
    doc: dict[str, Any] = {"results": {}}
    for tag, engine in engines(opts, runners):
        doc.setdefault("meta", meta(engine, opts, prompts))
        doc["results"][tag] = profile_engine(engine, prompts, opts, tag)
        cuda = engine.model.device.type == "cuda"
        if tag == "graphs" and cuda and opts.runner == "graphs" and not graphs_visible(doc["results"]):
            print("CUDA-graph replays showed no kernels to the profiler: profiling eager steps instead",
                  file=sys.stderr, flush=True)
            runners.append("eager")
    # ``runners`` may grow inside the loop above (the eager fallback); ``engines`` reads it lazily.
    doc["graph_kernels_visible"] = graphs_visible(doc["results"])
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    opts.out.write_text(json.dumps(doc, indent=1, default=str))
    print(markdown(doc))
    print(f"\ngraph kernels visible to the profiler: {doc['graph_kernels_visible']}; JSON: {opts.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
