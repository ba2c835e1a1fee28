#!/usr/bin/env bash
# `elesium bench` at T=0 and T=0.7 with everything as shipped (heads, H200 profile), model at $ELESIUM_MODEL.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
R=/root/results_shipped; mkdir -p $R
export ELESIUM_CACHE_DIR=/root/cache_shipped
for T in 0.7 0; do
  $E bench --prompts "$P" --max-tokens 128 --temperature $T --out "$R/t$T" 2>"$R/t$T.log" | grep -E '"speedup"|mean_accepted"|identical|tokens_per_s' | tee -a "$OUT/summary.txt"
done
tar czf "$OUT/results.tgz" -C "$R" .
