#!/usr/bin/env bash
# Everything the H200 measures for the engine, in one device call (the lease is short):
# smoke checks on CUDA, vanilla eager vs CUDA graphs, the verify cost curve (tune), and
# `elesium bench` at T=0 and T=0.7 on MT-Bench turn 1. Expects the model at $ELESIUM_MODEL and
# the prompts + gguf wheel in $CARRY. Writes JSON and logs under $OUT.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
export ELESIUM_CACHE_DIR=/root/cache
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -P benchmarks/device/device_smoke.py 2>&1 | tee "$OUT/smoke.log"
$E bench --prompts "$P" --limit ${EAGER_PROMPTS:-12} --max-tokens 128 --vanilla-only --no-cuda-graphs --out "$OUT/vanilla_eager" 2>"$OUT/vanilla_eager.log" | tail -8
$E bench --prompts "$P" --max-tokens 128 --vanilla-only --out "$OUT/vanilla_graphs" 2>"$OUT/vanilla_graphs.log" | tail -8
$E tune --out "$OUT/profile.json" 2>&1 | tail -8
$E bench --prompts "$P" --max-tokens 128 --temperature 0 --out "$OUT/medusa_t0" 2>"$OUT/medusa_t0.log" | tail -20
$E bench --prompts "$P" --max-tokens 128 --temperature 0.7 --out "$OUT/medusa_t07" 2>"$OUT/medusa_t07.log" | tail -20
