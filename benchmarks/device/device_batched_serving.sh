#!/usr/bin/env bash
# 2026-12-06: batched serving on CUDA (inference/runtime/batched_cuda_step.py). STAGE=3 runs, with the model
# (device_model_parts.sh: three calls):
#   1. pytest -m gpu tests/test_gpu.py -k "batched_cuda" (the batched rows bitwise equal to the one-sequence
#      graphs, 12 staggered generations get their solo tokens) and, with FULL_GPU_TESTS=1, the whole file;
#   2. benchmarks/gpu/batched_step_device.py: the step's cost per batch size beside the one-sequence graphs;
#   3. (WHAT=serving or all) benchmarks/serving.py at concurrency 1..64 with max_batch 64, vanilla, 128 tokens, MT-Bench prompts,
#      then the same with max_batch 1 (one generation at a time on the captured graphs) at concurrency 1.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/device_model_parts.sh"
[ "$STAGE" = 3 ] || exit 0
export ELESIUM_INVARIANT_NUMERICS=on ELESIUM_CACHE_DIR=/root/cache
run_logged() {  # log name, timeout, command...
  local log=$1 limit=$2; shift 2
  { header; echo "command: $*"; } >"$OUT/$log"
  timeout "$limit" "$@" >>"$OUT/$log" 2>&1
  echo "exit $?" >>"$OUT/$log"
  tail -4 "$OUT/$log"
}
WHAT=${WHAT:-all}  # tests | serving | all | steady: a call may run at most 10 minutes, so they can be split
if [ "$WHAT" = knobs ]; then  # the batched CUDA tests (TESTS=0 skips them), then the loop's host-side knobs side by side
  # (benchmarks/gpu/serving_knobs.py: greedy chains among them; KNOB_SETTINGS picks some, e.g. 0,4)
  [ "${TESTS:-1}" = 1 ] && run_logged pytest_gpu_batched.log "${PYTEST_S:-240}" python3 -P -m pytest -m gpu \
    tests/test_gpu.py -ra -s -p no:cacheprovider -k "${TEST_K:-batched_cuda}"
  run_logged serving_knobs.log "${SERVING_S:-330}" env ELESIUM_MAX_BATCH=64 python3 -P benchmarks/gpu/serving_knobs.py \
    "$P" "$OUT/serving_knobs.json"
  exit 0
fi
if [ "$WHAT" = sampled ]; then  # the invariant matmul's GPU test, then serving sampled rows (T = 0.7) at 1 and 32
  run_logged pytest_gpu_invariant.log 120 python3 -P -m pytest -m gpu tests/test_invariant_kernels.py -ra \
    -p no:cacheprovider -k on_gpu
  run_logged serving_sampled.log "${SERVING_S:-200}" env ELESIUM_MAX_BATCH=64 python3 -P benchmarks/serving.py \
    --device cuda --mode vanilla --concurrency 1,32 --requests-per-level 256 --max-tokens 128 \
    --temperature 0.7 --prompts "$P" --out "$OUT/serving_cuda_sampled.json"
  exit 0
fi
if [ "$WHAT" = wide ]; then  # taller matmul tiles and whole tile configs (benchmarks/gpu/wide_tiles.py): bits and times
  run_logged wide_tiles.log 200 python3 -P benchmarks/gpu/wide_tiles.py "$OUT/wide_tiles.json"
  run_logged wide_sweep.log 200 python3 -P benchmarks/gpu/wide_tiles.py --sweep "$OUT/wide_sweep.json"
  exit 0
fi
if [ "$WHAT" = profile ]; then  # the batched CUDA tests (TESTS=0 skips them), then a prefill's time per kernel
  # (and the ragged kernels' GPU test: the causal prompt-block kernel bitwise against the per-node one)
  # TEST_K narrows them (short of device time: TEST_K=ragged runs the kernel test alone).
  [ "${TESTS:-1}" = 1 ] && run_logged pytest_gpu_batched.log "${PYTEST_S:-240}" python3 -P -m pytest -m gpu tests/test_gpu.py \
    tests/test_ragged_attention.py -ra -s -p no:cacheprovider -k "${TEST_K:-batched_cuda or on_gpu}"
  run_logged prefill_profile.log 200 python3 -P benchmarks/gpu/prefill_profile.py "$P" "$OUT/prefill_profile.json"
  exit 0
fi
if [ "$WHAT" = steady ]; then  # the batched CUDA tests (deadlines too; TESTS=0 skips them), then serving at steady state: REQUESTS
  # requests per level (default 256: 8 waves at 32 concurrent, 4 at 64), so a level's ramp-up and tail weigh
  # little; the default sweep runs 2 x concurrency requests, under a second of wall at 32 and 64
  [ "${TESTS:-1}" = 1 ] && run_logged pytest_gpu_batched.log "${PYTEST_S:-300}" python3 -P -m pytest -m gpu \
    tests/test_gpu.py -ra -s -p no:cacheprovider -k batched_cuda
  run_logged serving_steady.log "${SERVING_S:-400}" env ELESIUM_MAX_BATCH=64 python3 -P benchmarks/serving.py \
    --device cuda --mode vanilla --concurrency "${LEVELS:-1,32,64}" --requests-per-level "${REQUESTS:-256}" \
    --max-tokens 128 --prompts "$P" --out "$OUT/serving_cuda_steady.json"
  exit 0
fi
k=batched_cuda; [ "${FULL_GPU_TESTS:-0}" = 1 ] && k=""
if [ "$WHAT" != serving ]; then
run_logged pytest_gpu_batched.log "${PYTEST_S:-300}" python3 -P -m pytest -m gpu tests/test_gpu.py -ra -s \
  -p no:cacheprovider ${k:+-k "$k"}
run_logged batched_step.log 180 python3 -P benchmarks/gpu/batched_step_device.py "$OUT/batched_step.json"
fi
[ "$WHAT" = tests ] && exit 0
run_logged serving_batched.log "${SERVING_S:-300}" env ELESIUM_MAX_BATCH=64 python3 -P benchmarks/serving.py \
  --device cuda --mode vanilla --concurrency "${LEVELS:-1,2,4,8,16,32,64}" --max-tokens 128 --prompts "$P" \
  --out "$OUT/serving_cuda_max_batch_64.json"
run_logged serving_solo.log 120 env ELESIUM_MAX_BATCH=1 python3 -P benchmarks/serving.py --device cuda \
  --mode vanilla --concurrency 1 --max-tokens 128 --prompts "$P" --out "$OUT/serving_cuda_max_batch_1.json"
