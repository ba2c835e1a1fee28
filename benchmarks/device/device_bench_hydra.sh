#!/usr/bin/env bash
# With the model at $ELESIUM_MODEL: check CUDA greedy equality with the shipped (Hydra) heads, tune,
# and bench them (T=0, T=0.7) and the earlier Medusa heads (T=0) side by side on MT-Bench turn 1.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
R=/root/results; mkdir -p $R
ELESIUM_CACHE_DIR=/root/cache_hydra timeout 150 python3 -P benchmarks/device/device_smoke.py "$P" 2>&1 | tee "$OUT/smoke.log"
export ELESIUM_CACHE_DIR=/root/cache_hydra
$E tune --out "$R/profile_hydra.json" 2>&1 | tail -8 | tee "$OUT/tune.log"
$E bench --prompts "$P" --max-tokens 128 --temperature 0 --out "$R/hydra_t0" 2>"$R/hydra_t0.log" | tail -12
$E bench --prompts "$P" --max-tokens 128 --temperature 0.7 --out "$R/hydra_t07" 2>"$R/hydra_t07.log" | tail -12
ELESIUM_CACHE_DIR=/root/cache_medusa $E bench --heads inference/heads/smollm2-135m-instruct-medusa --prompts "$P" --max-tokens 128 --temperature 0 --out "$R/medusa_t0" 2>"$R/medusa_t0.log" | tail -12
tar czf "$OUT/results.tgz" -C "$R" .
ls "$OUT"
