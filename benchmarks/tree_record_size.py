"""What recording every drafted tree costs in acceptance-log size (issue 43, item 6).

Usage: .venv/bin/python benchmarks/tree_record_size.py [--dtype float32] [--prompts N] [--out FILE.json]

A ticket-triage run (speculative decoding, to its approval interrupt) runs twice on the real bundled
model, same seed: once plain, once with ``record_trees``. Each run's acceptance stream is read back
and measured as stored: the bytes of every entry's field names and values (what ``XRANGE`` returns and
what the audit chain digests), per decode step and per LLM call, plus the server's own ``MEMORY USAGE``
of the stream key. The two runs' tokens must be identical (recording changes no token). Then a few
plain generations (``--prompts``), with and without, measured the same way from their step records,
with the wall time per step (the host work of building each tree's record).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

TICKET = {"subject": "Charged twice", "customer": "Dana",
          "body": "Our invoice INV-2231 charged us twice this month. Please refund the extra charge."}
PROMPTS = ["Name three rivers in Europe and say where each one ends.",
           "Explain in two sentences why the sky is blue.",
           "Write a short, polite reply to a customer whose parcel arrived late."]


def entry_bytes(fields: dict) -> int:
    return sum(len(k if isinstance(k, bytes) else k.encode()) + len(v if isinstance(v, bytes) else v.encode())
               for k, v in fields.items())


def summarise(step_sizes: list[int], call_sizes: list[int]) -> dict:
    return {"steps": len(step_sizes), "calls": len(call_sizes),
            "bytes_per_step_mean": round(statistics.fmean(step_sizes), 1) if step_sizes else 0,
            "bytes_per_step_median": statistics.median(step_sizes) if step_sizes else 0,
            "bytes_per_call_mean": round(statistics.fmean(call_sizes), 1) if call_sizes else 0,
            "bytes_total": sum(call_sizes)}


def measure_run(runner, record: bool, seed: int) -> dict:
    from elesium.graphs.workflows import default_registry

    runner.record_trees = record
    result = runner.start(default_registry().get("ticket-triage"), TICKET, seed=seed)
    rows = runner.log.client.xrange(runner.log.key(result.run_id))
    per_call: dict[tuple[str, str], int] = {}
    steps, tokens, tree_sizes = [], [], []
    for _, fields in rows:
        size = entry_bytes(fields)
        key = (fields[b"node_id"].decode(), fields.get(b"call_index", b"").decode())
        per_call[key] = per_call.get(key, 0) + size
        if fields.get(b"kind", b"step") == b"step":
            steps.append(size)
            rec = json.loads(fields[b"record"])
            tokens.append(rec["tokens"])
            tree_sizes.append(rec["tree_size"])
        else:
            tokens.append(json.loads(fields[b"tokens"]))
    memory = runner.log.client.memory_usage(runner.log.key(result.run_id), samples=0)
    return {"run_id": result.run_id, "status": result.status, **summarise(steps, list(per_call.values())),
            "mean_tree_size": round(statistics.fmean(tree_sizes), 2) if tree_sizes else 0,
            "stream_memory_usage_bytes": memory, "_tokens": tokens}


def measure_generation(engine, record: bool, max_tokens: int, prompt: str, seed: int) -> dict:
    """One generation's step entries as the log would store them (a run's ids, a node, a call index)."""
    from elesium.inference.sampling import SamplingParams
    from elesium.state.acceptance_log import AcceptanceEntry

    policy = dataclasses.replace(engine.policy, record_trees=record)
    gen = engine.generate(prompt, SamplingParams(max_tokens=max_tokens, seed=seed), mode="speculative",
                          policy=policy)
    sizes = [entry_bytes(AcceptanceEntry(run_id="r" * 32, node_id="node", step_id=j, record=s,
                                         call_index=0).to_fields()) for j, s in enumerate(gen.steps)]
    return {"steps": sizes, "calls": [sum(sizes)], "step_s": [s.elapsed_s for s in gen.steps],
            "tree_sizes": [s.tree_size for s in gen.steps], "_tokens": [list(gen.token_ids)]}


def measure_generations(parts: list[dict]) -> dict:
    steps = [x for p in parts for x in p["steps"]]
    step_s = [x for p in parts for x in p["step_s"]]
    return {**summarise(steps, [x for p in parts for x in p["calls"]]),
            "mean_tree_size": round(statistics.fmean(x for p in parts for x in p["tree_sizes"]), 2),
            "tokens": sum(len(t) for p in parts for t in p["_tokens"]),
            "step_ms_median": round(statistics.median(step_s) * 1000, 2),
            "_tokens": [t for p in parts for t in p["_tokens"]]}


class RecordTimer:
    """Times ``speculative.drafted_tree``, the host work recording adds to a step (nothing when off)."""

    def __init__(self) -> None:
        from elesium.inference.decoding import speculative

        self.module, self.inner, self.seconds = speculative, speculative.drafted_tree, []

        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return self.inner(*args, **kwargs)
            finally:
                self.seconds.append(time.perf_counter() - t)

        speculative.drafted_tree = timed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="auto", help="engine dtype (auto: what Engine.load() picks)")
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=3, help="plain generations, each with and without")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, default=Path(__file__).with_name("tree_record_size.json"))
    args = ap.parse_args()

    from elesium.graphs.runner import WorkflowRunner
    from elesium.inference.engine import Engine
    from elesium.state.embedded import EmbeddedValkey

    engine = Engine.load(dtype=args.dtype)
    out: dict = {"command": "benchmarks/tree_record_size.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out"),
        "date": dt.date.today().isoformat(), "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "engine": {k: v for k, v in engine.describe().items() if k in ("model", "device", "dtype", "weights",
                                                                       "heads_dir", "profile_reason")}}
    with tempfile.TemporaryDirectory() as tmp:
        server = EmbeddedValkey(Path(tmp)).start()
        try:
            runner = WorkflowRunner(engine, server.url, mode="speculative", prefix="bench")
            plain, recorded = measure_run(runner, False, args.seed), measure_run(runner, True, args.seed)
        finally:
            server.stop()
    assert plain.pop("_tokens") == recorded.pop("_tokens"), "recording trees changed a token"
    ratio = {f"ratio_per_{w}": round(recorded[f"bytes_per_{w}_mean"] / plain[f"bytes_per_{w}_mean"], 2)
             for w in ("step", "call")}
    out["ticket_triage"] = {"without_trees": plain, "with_trees": recorded, **ratio}
    prompts = (PROMPTS * args.prompts)[:args.prompts]
    timer = RecordTimer()
    parts: dict[bool, list[dict]] = {False: [], True: []}
    for i, prompt in enumerate(prompts):  # interleaved, so that a busy neighbour slows both alike
        for record in (False, True):
            parts[record].append(measure_generation(engine, record, args.max_tokens, prompt, i))
    off, on = measure_generations(parts[False]), measure_generations(parts[True])
    assert off.pop("_tokens") == on.pop("_tokens"), "recording trees changed a token"
    extra = on["bytes_per_step_mean"] - off["bytes_per_step_mean"]
    out["generations"] = {"prompts": len(prompts), "max_tokens": args.max_tokens, "without_trees": off,
                          "with_trees": on,
                          "ratio_per_step": round(on["bytes_per_step_mean"] / off["bytes_per_step_mean"], 2),
                          "tree_bytes_per_node": round(extra / on["mean_tree_size"], 1),
                          "record_ms_per_step_median": round(statistics.median(timer.seconds) * 1000, 3)}
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    started = time.perf_counter()
    main()
    print(f"({time.perf_counter() - started:.0f} s)")
