#!/usr/bin/env bash
# A short second device call: greedy equality on CUDA after the capture fix (fp32 and bf16), then
# the side-by-side bench at T=0 on MT-Bench with the tuned profile. Everything lands in one tarball.
set -uo pipefail
CARRY=${CARRY:-.lead-carry}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/r" /tmp/p/elesium /root/cache/profiles
python3 -m pip install -q --no-index --no-deps --target /tmp/site "$CARRY"/*.whl >/dev/null 2>&1
cp -r elesium/* /tmp/p/elesium/
for d in inference kernels state graphs api; do rm -rf "/tmp/p/elesium/$d"; cp -r "$d" "/tmp/p/elesium/$d"; done
cp "$CARRY"/profile-h200.json /root/cache/profiles/b179c9523d0e6a0f-cuda-nvidia-h200-bfloat16.json
export PYTHONPATH=/tmp/p:/tmp/site PYTHONUNBUFFERED=1 ELESIUM_CACHE_DIR=/root/cache
python3 -P benchmarks/device/device_smoke.py "$CARRY/mt_bench_questions.jsonl" 2>&1 | tee "$OUT/r/smoke.log"
python3 -P -m elesium.cli bench --prompts "$CARRY/mt_bench_questions.jsonl" --limit 40 --dtype float32 --max-tokens 128 --out "$OUT/r/medusa_t0_fp32" \
  2>"$OUT/r/medusa_t0_fp32.log" | tail -22
tar -C "$OUT" -czf "$OUT/results.tgz" r && rm -rf "$OUT/r"
