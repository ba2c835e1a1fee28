#!/usr/bin/env bash
# Side by side on the H200: the shipped heads with their attention drafter, and the same heads with the
# drafter removed, under one and the same tree profile (the committed H200 profile with its heads pin
# cleared), so the drafter is the only difference. Then the fp32 CUDA checks with the drafter.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
R=/root/results_drafter; mkdir -p $R
export ELESIUM_CACHE_DIR=/root/cache_drafter
mkdir -p $ELESIUM_CACHE_DIR/profiles
python3 - "$ELESIUM_CACHE_DIR/profiles/b179c9523d0e6a0f-cuda-nvidia-h200-bfloat16.json" <<'EOF'
import json, sys
p = json.load(open("inference/profiles/cuda-nvidia-h200.json"))
p["heads_sha256"] = ""
json.dump(p, open(sys.argv[1], "w"))
EOF
H=inference/heads/smollm2-135m-instruct ND=/root/heads-nodrafter
rm -rf $ND && cp -r $H $ND && rm $ND/drafter.safetensors
python3 -c "import json; p='$ND/manifest.json'; m=json.load(open(p)); del m['heads']['drafter']; json.dump(m, open(p, 'w'))"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
for T in 0 0.7; do
  for v in drafter nodrafter; do
    heads=$H; [ $v = nodrafter ] && heads=$ND
    echo "== $v T=$T" | tee -a "$OUT/summary.txt"
    $E bench --heads $heads --prompts "$P" --max-tokens 128 --temperature $T --out "$R/$v-t$T" 2>"$R/$v-t$T.log" \
      | grep -E '"speedup"|mean_accepted"|mean_tree_size|identical|tokens_per_s' | tee -a "$OUT/summary.txt"
  done
done
tar czf "$OUT/results.tgz" -C "$R" .
SMOKE_DTYPES=float32 timeout 150 python3 -P benchmarks/device/device_smoke.py "$P" 2>&1 | tee "$OUT/smoke32.log"
