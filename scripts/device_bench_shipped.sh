#!/usr/bin/env bash
# `elesium bench` at T=0 and T=0.7 with everything as shipped (heads, H200 profile), model at $ELESIUM_MODEL.
set -uo pipefail
CARRY=${CARRY:-.lead-carry}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" /tmp/p/elesium
python3 -m pip install -q --no-index --no-deps --target /tmp/site "$CARRY"/*.whl >/dev/null 2>&1
cp -r elesium/* /tmp/p/elesium/
for d in inference kernels state graphs api; do rm -rf "/tmp/p/elesium/$d"; cp -r "$d" "/tmp/p/elesium/$d"; done
R=/root/results_shipped; mkdir -p $R
export PYTHONPATH=/tmp/p:/tmp/site PYTHONUNBUFFERED=1 ELESIUM_CACHE_DIR=/root/cache_shipped
P="$CARRY/mt_bench_questions.jsonl"
E="python3 -P -m elesium.cli"
for T in 0.7 0; do
  $E bench --prompts "$P" --max-tokens 128 --temperature $T --out "$R/t$T" 2>"$R/t$T.log" | grep -E '"speedup"|mean_accepted"|identical|tokens_per_s' | tee -a "$OUT/summary.txt"
done
tar czf "$OUT/results.tgz" -C "$R" .
