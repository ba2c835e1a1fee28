"""Where the CPU goes while 32 ticket-triage runs go through the API: ``perf`` by thread role.

Why: the together phase of ``triage_api_concurrent.py`` was no faster than running the same work one
run after another, and the step loop's own timers cannot say why (they count wall time, not what the
other threads of the server took from it). This runs that benchmark under ``perf record -a`` (199 Hz,
monotonic clock, so the samples can be cut to each phase's window, which the benchmark records) with
a thread-name recorder in the server (``benchmarks/profiling/sitecustomize.py``), and sums each
phase's samples by thread role: the step loop, torch's OpenMP worker (unnamed), workflow run threads,
the event pump, the heartbeat, Valkey, idle. Needs ``perf`` and permission to record system-wide.

    .venv/bin/python benchmarks/triage_profile.py --out benchmarks/serving/triage_profile.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
HZ = 199


def role(tid: str, comm: str, names: dict[str, str]) -> str:
    if tid == "0":
        return "idle"
    name = names.get(tid)
    if name is None:
        return "unnamed python thread (torch's OpenMP worker)" if comm == "python" else comm
    name = re.sub(r"_\d+$", "_N", name)
    return re.sub(r"ThreadPoolExecutor-\d+_N", "ThreadPoolExecutor-N_N", name)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=32)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "serving" / "triage_profile.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="elesium-triage-profile-") as tmp:
        names_path, perf_data = Path(tmp) / "threads.tsv", Path(tmp) / "perf.data"
        bench_out = Path(tmp) / "triage_api.json"
        env = dict(os.environ, ELESIUM_PROFILE_THREAD_NAMES=str(names_path),
                   PYTHONPATH=os.pathsep.join(p for p in (str(ROOT / "benchmarks" / "profiling"),
                                                          os.environ.get("PYTHONPATH", "")) if p))
        subprocess.run(["perf", "record", "-a", "-F", str(HZ), "--clockid", "monotonic", "-o", str(perf_data),
                        "--", sys.executable, str(ROOT / "benchmarks" / "triage_api_concurrent.py"),
                        "--runs", str(args.runs), "--out", str(bench_out)], env=env, check=True)
        bench = json.loads(bench_out.read_text())
        names = dict(line.split("\t", 1) for line in names_path.read_text().splitlines() if "\t" in line)
        windows = {name: p["monotonic_window_s"] for name, p in bench["phases"].items()}
        lo, hi = min(w[0] for w in windows.values()), max(w[1] for w in windows.values())
        script = subprocess.run(["perf", "script", "-i", str(perf_data), "-F", "comm,tid,time",
                                 "--time", f"{lo},{hi}"], capture_output=True, text=True, check=True).stdout
    samples = []
    for line in script.splitlines():
        parts = line.split()
        if len(parts) >= 3:
            samples.append((parts[0], parts[1], float(parts[2].rstrip(":"))))
    phases: dict[str, Any] = {}
    for name, (start, end) in windows.items():
        counts = collections.Counter(role(tid, comm, names) for comm, tid, t in samples if start <= t < end)
        phases[name] = {"wall_s": bench["phases"][name]["wall_s"],
                        "core_s_by_role": {k: round(v / HZ, 2) for k, v in counts.most_common()}}
        print(f"{name}: {phases[name]['wall_s']:.2f} s")
        for k, v in counts.most_common(10):
            print(f"   {k:<48} {v / HZ:6.2f} core-s")
    ratio = phases["sequential"]["wall_s"] / phases["together"]["wall_s"]
    print(f"sequential / together: {ratio:.2f}x")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"hz": HZ, "benchmark": bench, "phases": phases}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
