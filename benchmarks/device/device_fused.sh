#!/usr/bin/env bash
# Issue 17, the fused elementwise forward (kernels/fused_pointwise.py, inference/runtime/fused.py) on the H200.
#   part 1 (`device_fused.sh 1`): GPU tests (test_gpu.py, then test_invariant_kernels.py in its own process:
#     it sets TRITON_INTERPRET=1 at import); the step profile with the fused forward on and off side by side
#     (`--runner fused-pair`, one process); `elesium bench` at T = 0 on the 80 MT-Bench prompts and on the 40
#     prompts of tests/data/enterprise_prompts.jsonl.
#   part 2 (`device_fused.sh 2`): `elesium bench` at T = 0.7 on MT-Bench, and the floor (benchmarks/forward_floor.py).
#   part 4 (`device_fused.sh 4`): `elesium tune` for the fused forward (its profile, `profile.json`, is what
#     inference/tuning/profiles/cuda-nvidia-h200.json ships), then the T = 0 and T = 0.7 benches under it.
#   part 5 (`device_fused.sh 5`): T = 0.7 on MT-Bench under the shipped profile with its tree cap at 32 (as
#     shipped), 16 and 8, side by side in one call: does a smaller tree make sampling pay?
#   part 6 (`device_fused.sh 6`): benchmarks/drafter_acceptance.py on MT-Bench and the enterprise prompts (issue 18's
#     per-depth acceptance of the whole drafter, under the shipped policy and as a top-1 chain).
#   part 3 (`device_fused.sh 3`, after the array tree choice, inference/decoding/expanded_tree.py): GPU tests,
#     benchmarks/host_profile.py (cProfile of the host per step), the step profile, and the three benches again.
# bf16, CUDA graphs, invariant numerics on (which turns the fused forward on). Each step has its own `timeout`.
# Model transfer: device_model.sh. Writes under $OUT: summary_<part>.md and one log / JSON per step.
set -uo pipefail
PART=${1:?part 1 or 2}
CARRY=${CARRY:-/root/whl}
source "$(dirname "$0")/device_model.sh"
source "$(dirname "$0")/device_env.sh"
export ELESIUM_MODEL=$M ELESIUM_INVARIANT_NUMERICS=on
SUMMARY="summary_$PART.md" HEADER_NOTE="part $PART checkout $(git rev-parse --short HEAD 2>/dev/null)"
source "$(dirname "$0")/device_bench_fns.sh"

gpu_tests() {  # tests/test_gpu.py alone: the interpreter tests set TRITON_INTERPRET=1 at import
  echo "== pytest -m gpu tests/test_gpu.py ($(date -u +%T))" | tee -a "$S"
  ELESIUM_CACHE_DIR=/root/cache_pytest timeout ${PYTEST_S:-170} python3 -P -m pytest -m gpu tests/test_gpu.py -ra -q \
    -p no:cacheprovider --durations=14 >"$OUT/pytest_gpu.log" 2>&1
  echo "exit $?; $(tail -1 "$OUT/pytest_gpu.log")" | tee -a "$S"
}

if [ "$PART" = 1 ]; then
  gpu_tests
  echo "== pytest -m gpu tests/test_invariant_kernels.py ($(date -u +%T))" | tee -a "$S"
  timeout ${KERNELS_S:-60} python3 -P -m pytest -m gpu tests/test_invariant_kernels.py -ra -q -p no:cacheprovider \
    >"$OUT/pytest_kernels.log" 2>&1
  echo "exit $?; $(tail -1 "$OUT/pytest_kernels.log")" | tee -a "$S"
  echo "== step profile, fused on and off ($(date -u +%T))" | tee -a "$S"
  ELESIUM_CACHE_DIR=/root/cache_step_profile timeout ${STEP_S:-110} python3 -P benchmarks/step_profile.py \
    --limit 3 --steps 20 --skip 4 --max-tokens 64 --runner fused-pair \
    --out "$OUT/step_profile_fused.json" 2>"$OUT/step_profile_fused.log" | tee -a "$S"
  echo "exit ${PIPESTATUS[0]}" | tee -a "$S"
  bench t0_mt_bench ${BENCH_S:-130} tests/data/mt_bench_questions.jsonl
  bench t0_enterprise ${BENCH2_S:-90} tests/data/enterprise_prompts.jsonl
elif [ "$PART" = 4 ]; then
  TUNE="import argparse, sys; from elesium.cli.commands import tune; p = argparse.ArgumentParser(); \
tune.register(p.add_subparsers()); a = p.parse_args(sys.argv[1:]); sys.exit(a.handler(a))"
  echo "== tune ($(date -u +%T))" | tee -a "$S"
  ELESIUM_CACHE_DIR=/root/cache_tuned timeout ${TUNE_S:-240} python3 -P -c "$TUNE" tune --out "$OUT/profile.json" \
    >"$OUT/tune.log" 2>&1
  echo "exit $?; $(tail -3 "$OUT/tune.log" | tr '\n' ' ')" | tee -a "$S"
  for t in 0 0.7; do
    echo "== bench T=$t under the new profile ($(date -u +%T))" | tee -a "$S"
    ELESIUM_CACHE_DIR=/root/cache_tuned timeout ${BENCH_S:-100} python3 -P -c "$BENCH" bench \
      --prompts tests/data/mt_bench_questions.jsonl --max-tokens 128 --temperature $t --out "/root/bench_tuned_$t" \
      >"$OUT/bench_tuned_t$t.log" 2>&1
    echo "exit $?" | tee -a "$S"
    cp "/root/bench_tuned_$t/bench.json" "$OUT/bench_tuned_t$t.json" 2>/dev/null && summary "$OUT/bench_tuned_t$t.json"
  done
elif [ "$PART" = 5 ]; then
  for cap in 32 16 8; do
    mkdir -p "/root/cache_cap$cap/profiles"
    python3 - "$cap" "/root/cache_cap$cap/profiles/b179c9523d0e6a0f-cuda-nvidia-h200-bfloat16.json" <<'PY'
import json, sys
d = json.load(open("inference/tuning/profiles/cuda-nvidia-h200.json"))
d["max_nodes"] = int(sys.argv[1])
json.dump(d, open(sys.argv[2], "w"))
PY
    echo "== bench T=0.7, dynamic trees <= $cap nodes ($(date -u +%T))" | tee -a "$S"
    ELESIUM_CACHE_DIR=/root/cache_cap$cap timeout ${BENCH_S:-100} python3 -P -c "$BENCH" bench \
      --prompts tests/data/mt_bench_questions.jsonl --max-tokens 128 --temperature 0.7 --out "/root/bench_cap$cap" \
      >"$OUT/bench_t07_cap$cap.log" 2>&1
    echo "exit $?" | tee -a "$S"
    cp "/root/bench_cap$cap/bench.json" "$OUT/bench_t07_cap$cap.json" 2>/dev/null && summary "$OUT/bench_t07_cap$cap.json"
  done
elif [ "$PART" = 6 ]; then
  echo "== drafter acceptance ($(date -u +%T))" | tee -a "$S"
  ELESIUM_CACHE_DIR=/root/cache_bench timeout ${DRAFT_S:-300} python3 -P benchmarks/drafter_acceptance.py \
    --prompts tests/data/mt_bench_questions.jsonl tests/data/enterprise_prompts.jsonl --max-tokens 128 \
    --out "$OUT/drafter_acceptance.json" 2>"$OUT/drafter_acceptance.log" | tee -a "$S"
  echo "exit ${PIPESTATUS[0]}" | tee -a "$S"
elif [ "$PART" = 3 ]; then
  gpu_tests
  echo "== host profile ($(date -u +%T))" | tee -a "$S"
  ELESIUM_CACHE_DIR=/root/cache_bench timeout ${HOST_S:-90} python3 -P benchmarks/host_profile.py --limit 4 \
    --max-tokens 128 --top 25 --out "$OUT/host_profile.json" >"$OUT/host_profile.log" 2>&1
  echo "exit $?" | tee -a "$S"
  echo "== step profile ($(date -u +%T))" | tee -a "$S"
  ELESIUM_CACHE_DIR=/root/cache_step_profile timeout ${STEP_S:-80} python3 -P benchmarks/step_profile.py \
    --limit 3 --steps 20 --skip 4 --max-tokens 64 --runner graphs \
    --out "$OUT/step_profile.json" 2>"$OUT/step_profile.log" | tee -a "$S"
  echo "exit ${PIPESTATUS[0]}" | tee -a "$S"
  bench t0_mt_bench ${BENCH_S:-100} tests/data/mt_bench_questions.jsonl
  bench t07_mt_bench ${BENCH_S:-100} tests/data/mt_bench_questions.jsonl --temperature 0.7
  bench t0_enterprise ${BENCH2_S:-70} tests/data/enterprise_prompts.jsonl
else
  bench t07_mt_bench ${BENCH_S:-150} tests/data/mt_bench_questions.jsonl --temperature 0.7
  echo "== forward floor ($(date -u +%T))" | tee -a "$S"
  ELESIUM_CACHE_DIR=/root/cache_floor timeout ${FLOOR_S:-270} python3 -P benchmarks/forward_floor.py \
    --out "$OUT/forward_floor.json" 2>"$OUT/forward_floor.log" | tee -a "$S"
  echo "exit ${PIPESTATUS[0]}" | tee -a "$S"
fi
echo "end $(date -u +%FT%TZ)" | tee -a "$S"
ls -la "$OUT"
