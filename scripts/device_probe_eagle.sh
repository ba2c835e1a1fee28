#!/usr/bin/env bash
# With the model at $ELESIUM_MODEL: the EAGLE-style head-1 probe (scripts/probe_eagle_head1.py), and
# eval-heads for the fp16 Hydra heads ($CARRY/heads-fp16) against the shipped quantised ones.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
export ELESIUM_CACHE_DIR=/root/cache_probe
for h in "$CARRY/heads-fp16" inference/heads/smollm2-135m-instruct; do
  $E eval-heads --device cuda --heads "$h" --prompts "$P" --json 2>/dev/null | tee -a "$OUT/eval_heads.jsonl"
done
timeout 480 python3 -P scripts/probe_eagle_head1.py /root/distill.jsonl.gz "$P" "$OUT/probe.json" --seconds ${SECONDS_TRAIN:-200} 2>&1 | grep -v "it/s" | tail -30 | tee "$OUT/probe.log"
