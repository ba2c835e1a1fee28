#!/usr/bin/env bash
# The "after" of issue 17 on the H200, once the invariant matmul got per-weight launch configs (16-row tiles,
# fixed split-K = 3 for w2; benchmarks/h200-2026-12-01-invariant-matmul): in one call,
#   1. `pytest -m gpu tests/test_gpu.py` and, in a second pytest process (test_invariant_kernels.py sets
#      TRITON_INTERPRET=1 at import, which would skip every test_gpu.py test in a shared session),
#      `pytest -m gpu tests/test_invariant_kernels.py`;
#   2. `elesium bench` on the 80 MT-Bench prompts, 128 tokens, T = 0, bf16, CUDA graphs, invariant numerics on;
#   3. `benchmarks/step_profile.py` (vanilla + speculative, graphs and eager runners) with invariant numerics on.
# Each step has its own `timeout` so that one hang leaves the others their time (defaults sum to 560 s).
# Model transfer as in device_invariant.sh / device_step_profile.sh: call 1 carried .model/z_00, .model/SHA256
# and .whl and ran `mkdir -p /root/m /root/whl && cp .model/z_00 .model/SHA256 /root/m/ && cp .whl/*.whl
# /root/whl/`; call 2 carries .model/z_01 and runs this script, which unpacks the xz stream z_00 + z_01 to
# /root/m/SmolLM2-135M-Instruct.Q4_1.gguf and checks its sha256 first (skipped if the model is already there).
# Writes under $OUT (at most 8 files come back): summary.md, pytest_gpu.log, pytest_kernels.log, bench.log,
# bench.json, step_profile_on.json, step_profile_on.log.
set -uo pipefail
CARRY=${CARRY:-/root/whl}
source "$(dirname "$0")/device_model.sh"
source "$(dirname "$0")/device_env.sh"
export ELESIUM_MODEL=$M ELESIUM_INVARIANT_NUMERICS=on
source "$(dirname "$0")/device_bench_fns.sh"

echo "== 1. pytest -m gpu tests/test_gpu.py ($(date -u +%T))" | tee -a "$S"
ELESIUM_CACHE_DIR=/root/cache_pytest timeout ${PYTEST_S:-170} python3 -P -m pytest -m gpu tests/test_gpu.py -ra -q \
  -p no:cacheprovider --durations=12 >"$OUT/pytest_gpu.log" 2>&1
echo "exit $?; $(tail -1 "$OUT/pytest_gpu.log")" | tee -a "$S"
echo "== 1b. pytest -m gpu tests/test_invariant_kernels.py ($(date -u +%T))" | tee -a "$S"
timeout ${KERNELS_S:-80} python3 -P -m pytest -m gpu tests/test_invariant_kernels.py -ra -q -p no:cacheprovider \
  >"$OUT/pytest_kernels.log" 2>&1
echo "exit $?; $(tail -1 "$OUT/pytest_kernels.log")" | tee -a "$S"

echo "== 2. elesium bench, 80 MT-Bench prompts x 128 tokens, T=0, bf16, graphs, invariant on ($(date -u +%T))" | tee -a "$S"
ELESIUM_CACHE_DIR=/root/cache_bench timeout ${BENCH_S:-200} python3 -P -c "$BENCH" bench \
  --prompts tests/data/mt_bench_questions.jsonl --max-tokens 128 --out /root/bench_after >"$OUT/bench.log" 2>&1
echo "exit $?" | tee -a "$S"
cp /root/bench_after/bench.json "$OUT/bench.json" 2>/dev/null
python3 - "$OUT/bench.json" <<'EOF' 2>&1 | tee -a "$S"
import json, sys
d = json.load(open(sys.argv[1]))
s = d.get("speculative", {})
print("identical/80 | vanilla ms/token | speculative ms/token | speedup | tau")
print(d.get("identical_outputs"), "|", d["vanilla"].get("ms_per_token"), "|", s.get("ms_per_token"), "|",
      d.get("speedup"), "|", s.get("mean_accepted"))
EOF

echo "== 3. step profile, invariant on ($(date -u +%T))" | tee -a "$S"
# shellcheck disable=SC2086
ELESIUM_CACHE_DIR=/root/cache_step_profile timeout ${STEP_S:-110} python3 -P benchmarks/step_profile.py \
  ${STEP_PROFILE_ARGS:---limit 3 --steps 20 --skip 4 --max-tokens 64 --runner both} \
  --out "$OUT/step_profile_on.json" 2>"$OUT/step_profile_on.log" | tee -a "$S"
echo "exit ${PIPESTATUS[0]}; end $(date -u +%FT%TZ)" | tee -a "$S"
ls -la "$OUT"
