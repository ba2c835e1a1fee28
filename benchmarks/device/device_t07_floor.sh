#!/usr/bin/env bash
# Issue 17 on the H200, the two measurements the "after" run (benchmarks/h200-2026-12-01-after-matmul) left out,
# in one call:
#   1. `elesium bench` on the 80 MT-Bench prompts, 128 tokens, T = 0.7 (seeds: the prompt's index), bf16,
#      CUDA graphs, invariant numerics on: vanilla against speculative when sampling;
#   2. `benchmarks/forward_floor.py`: the floor under a decode step, i.e. the engine's captured 1-token step and
#      forward-only graphs against a torch.compile(max-autotune-no-cudagraphs) plain forward of the same
#      weights in a CUDA graph (gpt-fast's recipe), at 256 and 1024 cached positions.
# Each step has its own `timeout` so that a hang in one leaves the other its time (defaults sum to 450 s).
# Model transfer as in device_after_matmul.sh: call 1 carried .model/z_00, .model/SHA256 and .whl and ran
# `mkdir -p /root/m /root/whl && cp .model/z_00 .model/SHA256 /root/m/ && cp .whl/*.whl /root/whl/`; call 2
# carries .model/z_01 and runs this script, which unpacks the xz stream z_00 + z_01 to
# /root/m/SmolLM2-135M-Instruct.Q4_1.gguf and checks its sha256 first (skipped if the model is already there).
# Writes under $OUT: summary.md, bench.log, bench.json, forward_floor.json, forward_floor.log.
set -uo pipefail
CARRY=${CARRY:-/root/whl}
source "$(dirname "$0")/device_model.sh"
source "$(dirname "$0")/device_env.sh"
export ELESIUM_MODEL=$M ELESIUM_INVARIANT_NUMERICS=on
source "$(dirname "$0")/device_bench_fns.sh"

echo "== 1. elesium bench, 80 MT-Bench prompts x 128 tokens, T=0.7, bf16, graphs, invariant on ($(date -u +%T))" \
  | tee -a "$S"
ELESIUM_CACHE_DIR=/root/cache_bench timeout ${BENCH_S:-180} python3 -P -c "$BENCH" bench \
  --prompts tests/data/mt_bench_questions.jsonl --max-tokens 128 --temperature 0.7 --out /root/bench_t07 \
  >"$OUT/bench.log" 2>&1
echo "exit $?" | tee -a "$S"
cp /root/bench_t07/bench.json "$OUT/bench.json" 2>/dev/null
python3 - "$OUT/bench.json" <<'PY' 2>&1 | tee -a "$S"
import json, sys
d = json.load(open(sys.argv[1]))
s = d.get("speculative", {})
print("T | identical/80 | vanilla ms/token | speculative ms/token | speedup | tau | accept by depth")
print(d.get("temperature"), "|", d.get("identical_outputs"), "|", d["vanilla"].get("ms_per_token"), "|",
      s.get("ms_per_token"), "|", d.get("speedup"), "|", s.get("mean_accepted"), "|",
      s.get("accept_rate_by_depth"))
PY

echo "== 2. forward floor: engine graphs vs compiled plain forward ($(date -u +%T))" | tee -a "$S"
# shellcheck disable=SC2086
ELESIUM_CACHE_DIR=/root/cache_floor timeout ${FLOOR_S:-270} python3 -P benchmarks/forward_floor.py \
  ${FLOOR_ARGS:-} --out "$OUT/forward_floor.json" 2>"$OUT/forward_floor.log" | tee -a "$S"
echo "exit ${PIPESTATUS[0]}; end $(date -u +%FT%TZ)" | tee -a "$S"
ls -la "$OUT"
