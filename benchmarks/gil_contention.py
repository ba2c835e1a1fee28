"""How much Python on other threads slows the engine's eager forward (GIL hand-offs per torch op).

Why: in ``elesium serve`` every workflow run has a thread, and the step loop runs the engine's eager
prompt forwards (``hidden_states``, prefill blocks) on another. Each torch op releases the GIL and
takes it back when it ends; if another thread holds it then, the loop waits for that thread to drop
it, up to the switch interval (5 ms). This times one ``Engine.hidden_states`` forward over a ticket
(memo cleared each time) alone and while N threads each run Python in bursts (``--burst-ms`` of work,
then ``--sleep-ms`` asleep), at the default switch interval and shorter ones.

    .venv/bin/python benchmarks/gil_contention.py --out benchmarks/serving/gil_contention.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

TICKET = ("Subject: Mobile licenses on invoice?\n\nMorning! Since October our invoice includes 40 'Mobile "
          "add-on' licenses at $6 each. We only use the web app, nobody here uses the mobile apps. Can you "
          "remove these and credit us? Cheers, Rafael Nunes. ")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", default="0,1,4", help="busy threads per level (default 0,1,4)")
    parser.add_argument("--intervals-ms", default="5,0.5,0.1", help="switch intervals to try (ms)")
    parser.add_argument("--burst-ms", type=float, default=5.0)
    parser.add_argument("--sleep-ms", type=float, default=20.0)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()

    from elesium.inference.engine import Engine

    engine = Engine.load()
    ids = engine.encode_prompt(TICKET * 2)
    layers = [engine.model.config.num_layers]  # the whole stack, as the category probe's deepest layer

    def forward() -> float:
        engine._hidden_memo.clear()  # a miss each time: the forward itself is what is timed
        started = time.perf_counter()
        engine.hidden_states(ids, layers)
        return time.perf_counter() - started

    stop = threading.Event()

    def busy() -> None:
        while not stop.is_set():
            end = time.perf_counter() + args.burst_ms / 1000
            x = 0
            while time.perf_counter() < end:
                x += sum(range(50))
            time.sleep(args.sleep_ms / 1000)

    forward(), forward()
    rows: list[dict[str, Any]] = []
    default_interval = sys.getswitchinterval()
    for interval_ms in (float(v) for v in args.intervals_ms.split(",")):
        sys.setswitchinterval(interval_ms / 1000)
        for n in (int(v) for v in args.threads.split(",")):
            stop.clear()
            threads = [threading.Thread(target=busy, daemon=True) for _ in range(n)]
            for t in threads:
                t.start()
            times = [forward() for _ in range(args.repeats)]
            stop.set()
            for t in threads:
                t.join()
            row = {"switch_interval_ms": interval_ms, "busy_threads": n,
                   "median_ms": statistics.median(times) * 1000, "times_ms": [t * 1000 for t in times]}
            rows.append(row)
            print(f"interval {interval_ms:>4} ms, {n:>2} busy threads: "
                  f"forward median {row['median_ms']:7.1f} ms", flush=True)
    sys.setswitchinterval(default_interval)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "machine": platform.platform(), "tokens": len(ids), "layers": layers,
            "burst_ms": args.burst_ms, "sleep_ms": args.sleep_ms, "rows": rows}, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
