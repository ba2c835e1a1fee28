#!/usr/bin/env bash
# One device call: self-distil the bundled model, train Hydra heads (concat and chain conditioning)
# on the same data, and score them and the shipped Medusa heads side by side on MT-Bench turn 1.
# Expects the model at $ELESIUM_MODEL and the prompts + gguf wheel in $CARRY; results go to $OUT.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
W=${WORK:-/root/heads}
export ELESIUM_CACHE_DIR=/root/cache ELESIUM_TREE_ATTENTION=reference
COMMON="--device cuda --kind hydra --loss kl --steps ${STEPS:-2000} --batch-size 4096 --eval-every 500 --ckpt-every 1000 --gen-batch 512 --eval-prompts $P"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
$E train-heads $COMMON --conditioning concat --prompts 3000 --time-budget 420 --out "$W/hydra_concat" 2>&1 | grep -v "it/s\]" | tail -12 | tee "$OUT/hydra_concat.log"
tar czf "$OUT/hydra_concat.tgz" -C "$W" hydra_concat/heads.safetensors hydra_concat/manifest.json hydra_concat/distill.jsonl.gz
$E train-heads $COMMON --conditioning chain --data "$W/hydra_concat/distill.jsonl.gz" --time-budget 150 --out "$W/hydra_chain" 2>&1 | grep -v "it/s\]" | tail -8 | tee "$OUT/hydra_chain.log"
tar czf "$OUT/hydra_chain.tgz" -C "$W" hydra_chain/heads.safetensors hydra_chain/manifest.json
$E eval-heads --device cuda --prompts "$P" --json > "$OUT/medusa_shipped_eval.json" 2>"$OUT/medusa_eval.log"
cat "$OUT/medusa_shipped_eval.json"
ls -la "$OUT"
