# Sourced by device_gpu_tests.sh (STAGE=4), after device_env.sh built the current tree's shim in /tmp/p:
# builds 69e4f35's shim in /tmp/pold from /root/old (its shipped heads are the current ones, unchanged
# since), then runs `elesium bench` at T = 0 (MT-Bench, --limit 20, 128 tokens) ROUNDS times per tree,
# alternating current/old, each run a fresh process with its own cache dir; medians in bench_summary.md.
# The bench command through its module, old layout (elesium.commands) or new (elesium.cli.commands).
rm -rf /tmp/pold && mkdir -p /tmp/pold/elesium
cp -r /root/old/elesium/* /tmp/pold/elesium/
for d in inference kernels state graphs api; do cp -r "/root/old/$d" "/tmp/pold/elesium/$d"; done
cp -r inference/drafters/shipped /tmp/pold/elesium/inference/drafters/shipped
AB="import argparse, sys
try:
    from elesium.cli.commands import bench
except ImportError:
    from elesium.commands import bench
p = argparse.ArgumentParser(); bench.register(p.add_subparsers()); a = p.parse_args(sys.argv[1:])
sys.exit(a.handler(a))"
mkdir -p /root/ab "$OUT/ab"
header >"$OUT/bench_summary.md"
for r in $(seq 1 "${ROUNDS:-3}"); do
  for tree in new old; do
    path=/tmp/p; [ "$tree" = old ] && path=/tmp/pold
    name=${tree}_r$r
    echo "== bench $name ($(date -u +%T))" | tee -a "$OUT/bench_summary.md"
    PYTHONPATH=$path:/tmp/site ELESIUM_CACHE_DIR=/root/cache_$tree timeout "${BENCH_S:-150}" python3 -P -c "$AB" \
      bench --prompts tests/data/mt_bench_questions.jsonl --limit 20 --max-tokens 128 --out "/root/ab/$name" \
      >"$OUT/ab/$name.log" 2>&1
    echo "exit $?" | tee -a "$OUT/bench_summary.md"
    cp "/root/ab/$name/bench.json" "$OUT/ab/bench_$name.json" 2>/dev/null
  done
done
python3 - "$OUT/ab" <<'PY' 2>&1 | tee -a "$OUT/bench_summary.md"
import json, pathlib, statistics, sys
d = pathlib.Path(sys.argv[1])
rows = {"new": [], "old": []}
print("run | prompts | identical | vanilla ms/token | speculative ms/token | speedup | tau")
for f in sorted(d.glob("bench_*.json")):
    j = json.loads(f.read_text())
    s, v = j.get("speculative", {}), j.get("vanilla", {})
    rows[f.stem.split("_")[1]].append((v.get("ms_per_token"), s.get("ms_per_token"), j.get("speedup")))
    print(f.stem, "|", j.get("prompts"), "|", j.get("identical_outputs"), "|", v.get("ms_per_token"), "|",
          s.get("ms_per_token"), "|", j.get("speedup"), "|", s.get("mean_accepted"))
med = {k: [statistics.median(x[i] for x in r) for i in range(3)] for k, r in rows.items() if r}
for k, m in med.items():
    print(f"median {k}: vanilla {m[0]:.4f} ms/token, speculative {m[1]:.4f} ms/token, speedup {m[2]:.3f}")
if len(med) == 2:
    print(f"new/old: vanilla {med['new'][0] / med['old'][0]:.3f}, speculative {med['new'][1] / med['old'][1]:.3f} "
          "(ms/token ratios; < 1: the current tree is faster)")
PY
tar -C "$OUT" -czf "$OUT/bench.tgz" ab && rm -rf "$OUT/ab"
