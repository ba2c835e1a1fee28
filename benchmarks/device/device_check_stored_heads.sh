#!/usr/bin/env bash
# With the model at $ELESIUM_MODEL: the CUDA checks (graphs == eager, speculative greedy == vanilla),
# then tune for the shipped (quantised) heads and bench them at T=0 and T=0.7 on MT-Bench turn 1.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
R=/root/results_stored; mkdir -p $R
export ELESIUM_CACHE_DIR=/root/cache_stored
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
timeout 150 python3 -P benchmarks/device/device_smoke.py "$P" 2>&1 | tee "$OUT/smoke.log"
$E tune --out "$R/profile.json" 2>&1 | tail -8 | tee "$OUT/tune.log"
for T in 0 0.7; do
  $E bench --prompts "$P" --max-tokens 128 --temperature $T --out "$R/t$T" 2>"$R/t$T.log" | tail -12 | tee -a "$OUT/summary.txt"
done
tar czf "$OUT/results.tgz" -C "$R" .
