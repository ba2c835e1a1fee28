#!/usr/bin/env bash
# Issue 17, greedy tree steps as one self-feeding CUDA graph (inference/runtime/tree_chain.py) on the H200:
# the GPU tests of the tree chain and of speculative == vanilla, benchmarks/tree_chain.py (vanilla, the host
# tree step and the device tree step at several sizes, side by side) on MT-Bench and on the enterprise
# prompts, then `elesium bench` at T = 0 on MT-Bench. bf16, CUDA graphs, invariant numerics on. Model
# transfer: device_model.sh (calls 1 and 2 carried the first two pieces of the model and the wheels; this
# call carries .model/z_02). Writes summary.md and one JSON per step; the logs travel as logs.tar.gz.
# Knobs: TESTS=0/1 and TESTS_K (the -k filter), SETS and NODES for benchmarks/tree_chain.py and CHAIN_TS
# (its temperatures) and CHAIN_ARGS (more flags: --topk-chunk 1024), PROFILE=1 for the step profile and
# PROFILE_RUNNER (step_profile.py --runner: chain-pair, sliced-pair), BENCHES=0/1 and BENCH_TS (`elesium bench`'s
# temperatures, MT-Bench).
set -uo pipefail
CARRY=${CARRY:-/root/whl}
source "$(dirname "$0")/device_model.sh"
source "$(dirname "$0")/device_env.sh"
export ELESIUM_MODEL=$M ELESIUM_INVARIANT_NUMERICS=on
source "$(dirname "$0")/device_bench_fns.sh"
if [ "${TESTS:-1}" = 1 ]; then
  echo "== pytest -m gpu tests/test_gpu.py -k '${TESTS_K:-tree_chain or speculative_greedy}' ($(date -u +%T))" | tee -a "$S"
  ELESIUM_CACHE_DIR=/root/cache_pytest timeout ${PYTEST_S:-200} python3 -P -m pytest -m gpu tests/test_gpu.py -ra -q \
    -p no:cacheprovider --durations=8 -k "${TESTS_K:-tree_chain or speculative_greedy}" >"$OUT/pytest_gpu.log" 2>&1
  echo "exit $?; $(tail -1 "$OUT/pytest_gpu.log")" | tee -a "$S"
fi
for t in ${CHAIN_TS:-0}; do
  for set in ${SETS:-mt_bench_questions enterprise_prompts}; do
    echo "== tree chain against host tree steps and vanilla, $set, T=$t ($(date -u +%T))" | tee -a "$S"
    ELESIUM_CACHE_DIR=/root/cache_bench timeout ${CHAIN_S:-150} python3 -P benchmarks/tree_chain.py \
      --prompts tests/data/$set.jsonl --max-tokens 128 --nodes ${NODES:-16,32,48} --temperature "$t" ${CHAIN_ARGS:-} \
      --out "$OUT/tree_chain_${set}_t$t.json" 2>"$OUT/tree_chain_${set}_t$t.log" | tee -a "$S"
    echo "exit ${PIPESTATUS[0]}" | tee -a "$S"
  done
done
if [ "${PROFILE:-0}" = 1 ]; then
  echo "== step profile, host tree steps then the device tree chain ($(date -u +%T))" | tee -a "$S"
  ELESIUM_CACHE_DIR=/root/cache_bench timeout ${STEP_S:-200} python3 -P benchmarks/step_profile.py --runner ${PROFILE_RUNNER:-chain-pair} \
    --out "$OUT/step_profile.json" 2>"$OUT/step_profile.log" | tee -a "$S"
  echo "exit ${PIPESTATUS[0]}" | tee -a "$S"
fi
if [ "${BENCHES:-1}" = 1 ]; then
  for t in ${BENCH_TS:-0}; do
    bench "t${t}_mt_bench" ${BENCH_S:-100} tests/data/mt_bench_questions.jsonl --temperature "$t"
  done
fi
echo "end $(date -u +%FT%TZ)" | tee -a "$S"
(cd "$OUT" && tar czf logs.tar.gz ./*.log summary.md && rm -f ./*.log)
cat "$S"; ls -la "$OUT"
