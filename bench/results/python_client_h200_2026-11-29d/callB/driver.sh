#!/bin/bash
# Session 12, head-to-head part B: slidedp (window_slots 40) ckpt on b8/b16, no recompute b16, half recompute b16; FSDP2 + CPUOffloadPolicy b8.
set -u
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
B=.carry/bundle; R=$OUT/h2h; mkdir -p $R
S="--slidedp-opt bundle=$B --slidedp-opt update_threads=12 --slidedp-opt max_pending_grads=16 --slidedp-opt window_slots=40"
log() { echo "$(date +%T) $*" | tee -a $R/driver.log; }
log start
timeout 200 python3 bench/hf_head_to_head/run.py --systems slidedp --batches 8,16 --ckpt on --timeout 98 $S --out $R/slidedp_ckpt > $R/slidedp_ckpt.log 2>&1; log "slidedp ckpt rc=$?"
grep -E '\[hh2h\] slidedp' $R/slidedp_ckpt.log | tail -2 | cut -c1-200
timeout 100 python3 bench/hf_head_to_head/run.py --systems slidedp --batches 16 --ckpt off --timeout 98 $S --out $R/slidedp_nockpt > $R/slidedp_nockpt.log 2>&1; log "slidedp nockpt rc=$?"
grep -E '\[hh2h\] slidedp' $R/slidedp_nockpt.log | tail -1 | cut -c1-300
timeout 100 python3 bench/hf_head_to_head/run.py --systems slidedp --batches 16 --ckpt off --timeout 98 $S --slidedp-opt checkpointing=0.5 --out $R/slidedp_ckpt05 > $R/slidedp_ckpt05.log 2>&1; log "slidedp ckpt05 rc=$?"
grep -E '\[hh2h\] slidedp' $R/slidedp_ckpt05.log | tail -1 | cut -c1-200
timeout 170 python3 bench/hf_head_to_head/run.py --systems fsdp2_offload --batches 8 --ckpt on --warmup 1 --steps 3 --timeout 165 --out $R/offload > $R/offload.log 2>&1; log "offload rc=$?"
grep -E '\[hh2h\] fsdp2' $R/offload.log | tail -1 | cut -c1-200
cd $OUT && tar czf h2hB.tgz h2h && rm -rf h2h
