# Sourced by the device scripts after device_env.sh: the summary file's header, and the `elesium bench`
# helpers (`bench NAME TIMEOUT PROMPTS [ARGS...]` runs it and adds one row to the summary).
# Needs $OUT; sets $S (the summary file) and $BENCH.
S="$OUT/${SUMMARY:-summary.md}"
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', \
triton.__version__)"
  echo "start $(date -u +%FT%TZ)${HEADER_NOTE:+ $HEADER_NOTE}"
} 2>&1 | tee "$S"
# The bench command through its module: `elesium.cli` imports every subcommand, some of them langgraph,
# which the device lacks (and the bench does not need).
BENCH="import argparse, sys; from elesium.cli.commands import bench; p = argparse.ArgumentParser(); \
bench.register(p.add_subparsers()); a = p.parse_args(sys.argv[1:]); sys.exit(a.handler(a))"
summary() {  # bench.json -> one table row
  python3 - "$1" <<'PY' 2>&1 | tee -a "$S"
import json, sys
d = json.load(open(sys.argv[1]))
s = d.get("speculative", {})
print("T | prompts | identical | vanilla ms/token | speculative ms/token | speedup | tau | accept by depth")
print(d.get("temperature"), "|", d.get("prompts"), "|", d.get("identical_outputs"),
      "|", d["vanilla"].get("ms_per_token"), "|", s.get("ms_per_token"), "|", d.get("speedup"), "|",
      s.get("mean_accepted"), "|", s.get("accept_rate_by_depth"))
PY
}
bench() {  # name, timeout, prompts file, extra args
  local name=$1 limit=$2 prompts=$3; shift 3
  echo "== bench $name ($(date -u +%T))" | tee -a "$S"
  ELESIUM_CACHE_DIR=/root/cache_bench timeout "$limit" python3 -P -c "$BENCH" bench --prompts "$prompts" \
    --max-tokens 128 --out "/root/bench_$name" "$@" >"$OUT/bench_$name.log" 2>&1
  echo "exit $?" | tee -a "$S"
  cp "/root/bench_$name/bench.json" "$OUT/bench_$name.json" 2>/dev/null && summary "$OUT/bench_$name.json"
}
