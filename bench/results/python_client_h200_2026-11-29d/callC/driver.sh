#!/bin/bash
# Session 12 call C: FSDP2 best (no recompute, b8) side by side with slidedp b16 partial recompute; checkpoint stall of a 4B python_client job (resident embeddings uploaded for the checkpoint).
set -u
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
B=.carry/bundle; R=$OUT/c; mkdir -p $R
S="--slidedp-opt bundle=$B --slidedp-opt update_threads=12 --slidedp-opt max_pending_grads=16"
log() { echo "$(date +%T) $*" | tee -a $R/driver.log; }
log start
timeout 60 python3 bench/hf_head_to_head/run.py --systems fsdp2 --batches 8 --ckpt off --timeout 55 --out $R/fsdp2 > $R/fsdp2.log 2>&1; log "fsdp2 rc=$?"
grep -E '\[hh2h\] fsdp2.*: ok' $R/fsdp2.log | tail -1
for c in 0.25 0.5; do
timeout 100 python3 bench/hf_head_to_head/run.py --systems slidedp --batches 16 --ckpt off --timeout 95 $S --slidedp-opt checkpointing=$c --out $R/slidedp_ckpt$c > $R/slidedp_ckpt$c.log 2>&1; log "slidedp ckpt=$c rc=$?"
grep -E '\[hh2h\] slidedp.*: (ok|oom|error)' $R/slidedp_ckpt$c.log | tail -1 | cut -c1-250
done
timeout 250 bash bench/checkpoint/hf_checkpoint_stall.sh $B $R/stall qwen3-4b 8 40 6 > $R/stall.log 2>&1; log "stall rc=$?"
tail -2 $R/stall.log | cut -c1-1500; grep -E "asking|uploaded|committed|failed" $R/stall/hostd.log | cut -c1-200; grep -i "upload" $R/stall/train.log | head -3
df -h /tmp | tail -1
cd $OUT && tar czf c.tgz c && rm -rf c
