#!/usr/bin/env bash
# The call after device_train_heads.sh, on the same warm machine: make the better Hydra heads the
# default, check CUDA greedy equality, tune, and bench Hydra (T=0, T=0.7) and the shipped Medusa
# heads (T=0) side by side on MT-Bench turn 1.
set -uo pipefail
CARRY=${CARRY:-.lead-carry}
OUT=${OUT:-/tmp/out}
W=${WORK:-/root/heads}
mkdir -p "$OUT" /tmp/p/elesium
test -f "$W/hydra_concat/manifest.json" || { echo "no trained heads on this machine (it went back?)"; exit 3; }
python3 -m pip install -q --no-index --no-deps --target /tmp/site "$CARRY"/*.whl >/dev/null 2>&1
cp -r elesium/* /tmp/p/elesium/
for d in inference kernels state graphs api; do rm -rf "/tmp/p/elesium/$d"; cp -r "$d" "/tmp/p/elesium/$d"; done
WIN=$(python3 - "$W" <<'PY'
import json, sys, pathlib
best = max(pathlib.Path(sys.argv[1]).glob("hydra_*/manifest.json"),
           key=lambda m: sum(h["top1"] for h in json.loads(m.read_text())["eval"]["prompts"]["heads"]))
print(best.parent)
PY
)
echo "default heads for this run: $WIN"
R=/root/results; mkdir -p $R
cp "$WIN"/heads.safetensors "$WIN"/manifest.json /tmp/p/elesium/inference/heads/smollm2-135m-instruct/
export PYTHONPATH=/tmp/p:/tmp/site PYTHONUNBUFFERED=1
P="$CARRY/mt_bench_questions.jsonl"
E="python3 -P -m elesium.cli"
ELESIUM_CACHE_DIR=/root/cache_hydra timeout 150 python3 -P scripts/device_smoke.py "$P" 2>&1 | tee "$OUT/smoke.log"
export ELESIUM_CACHE_DIR=/root/cache_hydra
$E tune --out "$R/profile_hydra.json" 2>&1 | tail -8 | tee "$OUT/tune.log"
$E bench --prompts "$P" --max-tokens 128 --temperature 0 --out "$R/hydra_t0" 2>"$R/hydra_t0.log" | tail -12
$E bench --prompts "$P" --max-tokens 128 --temperature 0.7 --out "$R/hydra_t07" 2>"$R/hydra_t07.log" | tail -12
ELESIUM_CACHE_DIR=/root/cache_medusa $E bench --heads inference/heads/smollm2-135m-instruct --prompts "$P" --max-tokens 128 --temperature 0 --out "$R/medusa_t0" 2>"$R/medusa_t0.log" | tail -12
tar czf "$OUT/results.tgz" -C "$R" .
ls "$OUT"
