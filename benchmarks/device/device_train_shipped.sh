#!/usr/bin/env bash
# The shipped heads' recipe on the H200, in two calls because of the device tool's 10-minute limit per
# call. Both calls run the same `train-heads` command: the first with --distill-only (the answers land in
# $W/distill.jsonl.gz), the second finds that file, trains, scores the heads as stored on MT-Bench
# turn 1, and writes heads.safetensors + manifest.json. Without the limit, the one command does both.
# (The 2026-11-30 runs spelled the recipe's flags out, before they became the defaults; the manifest
# records that literal command, which is equivalent to this one.)
#   bash benchmarks/device/device_train_shipped.sh distill|train
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
W=${WORK:-/root/shipped}
export ELESIUM_CACHE_DIR=/root/cache_shipped ELESIUM_TREE_ATTENTION=reference
# train-heads' defaults are the shipped recipe; EXTRA varies it (EXTRA="--num-layers 1" was the 1-block run).
CMD="train-heads --device cuda --gen-batch 512 --eval-every 1000 --ckpt-every 1000 --eval-prompts $P --out $W ${EXTRA:-}"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
# A distillation file carried from an earlier call (same command, --distill-only) saves its 5 minutes.
if [ -f "$CARRY/distill.jsonl.gz" ] && [ ! -f "$W/distill.jsonl.gz" ]; then mkdir -p "$W" && cp "$CARRY/distill.jsonl.gz" "$W/"; fi
case "$1" in
  distill) $E $CMD --distill-only 2>&1 | grep -v "it/s\]" | tail -6 | tee "$OUT/distill.log"
           ls -la "$W" | tee -a "$OUT/distill.log" ;;
  train)   $E $CMD 2>&1 | grep -v "it/s\]" | tail -24 | tee "$OUT/train.log"
           tar czf "$OUT/heads.tgz" -C "$W" heads.safetensors manifest.json $(cd "$W" && ls drafter.safetensors 2>/dev/null) ;;
  *) echo "usage: $0 distill|train" >&2; exit 2 ;;
esac
