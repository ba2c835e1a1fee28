#!/usr/bin/env bash
# Issue 17, vanilla as a self-feeding CUDA graph (inference/runtime/decode_chain.py) on the H200: the GPU
# tests, benchmarks/decode_chain.py at T = 0 and T = 0.7 (chained against synchronous steps, side by side),
# then `elesium bench` at T = 0 on MT-Bench and on the enterprise prompts, and at T = 0.7 on MT-Bench.
# bf16, CUDA graphs, invariant numerics on. Model transfer: device_model.sh (call 1 carried .model/z_00,
# .model/SHA256 and .whl and ran `mkdir -p /root/m /root/whl && cp .model/z_00 .model/SHA256 /root/m/ &&
# cp .whl/*.whl /root/whl/`; this call carries .model/z_01). Writes summary.md and one log / JSON per step.
set -uo pipefail
CARRY=${CARRY:-/root/whl}
source "$(dirname "$0")/device_model.sh"
source "$(dirname "$0")/device_env.sh"
export ELESIUM_MODEL=$M ELESIUM_INVARIANT_NUMERICS=on
source "$(dirname "$0")/device_bench_fns.sh"
echo "== pytest -m gpu tests/test_gpu.py ($(date -u +%T))" | tee -a "$S"
ELESIUM_CACHE_DIR=/root/cache_pytest timeout ${PYTEST_S:-200} python3 -P -m pytest -m gpu tests/test_gpu.py -ra -q \
  -p no:cacheprovider --durations=14 >"$OUT/pytest_gpu.log" 2>&1
echo "exit $?; $(tail -1 "$OUT/pytest_gpu.log")" | tee -a "$S"
for t in 0 0.7; do
  echo "== decode chain against synchronous steps, T = $t ($(date -u +%T))" | tee -a "$S"
  ELESIUM_CACHE_DIR=/root/cache_bench timeout ${CHAIN_S:-120} python3 -P benchmarks/decode_chain.py \
    --prompts tests/data/mt_bench_questions.jsonl --max-tokens 128 --temperature $t \
    --out "$OUT/decode_chain_t$t.json" 2>"$OUT/decode_chain_t$t.log" | tee -a "$S"
  echo "exit ${PIPESTATUS[0]}" | tee -a "$S"
done
if [ "${BENCHES:-1}" = 1 ]; then
  bench t0_mt_bench ${BENCH_S:-100} tests/data/mt_bench_questions.jsonl
  bench t0_enterprise ${BENCH2_S:-70} tests/data/enterprise_prompts.jsonl
  bench t07_mt_bench ${BENCH_S:-100} tests/data/mt_bench_questions.jsonl --temperature 0.7
fi
echo "end $(date -u +%FT%TZ)" | tee -a "$S"
# Few files come back from a call: the logs travel as one archive beside the JSON results.
(cd "$OUT" && tar czf logs.tar.gz ./*.log summary.md && rm -f ./*.log)
cat "$S"; ls -la "$OUT"
