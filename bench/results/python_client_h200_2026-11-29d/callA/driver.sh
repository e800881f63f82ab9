#!/bin/bash
# Session 12, head-to-head part A: FSDP2 (ckpt on/off), FSDP2 + CPUOffloadPolicy, DeepSpeed try.
set -u
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
R=$OUT/h2h; mkdir -p $R
log() { echo "$(date +%T) $*" | tee -a $R/driver.log; }
log start; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >> $R/driver.log 2>&1
timeout 200 python3 bench/hf_head_to_head/run.py --systems fsdp2 --batches 8,16 --ckpt both --timeout 60 --out $R/fsdp2 > $R/fsdp2.log 2>&1; log "fsdp2 rc=$?"
grep -E ': (ok|oom)' $R/fsdp2.log | tail -4
timeout 120 python3 bench/hf_head_to_head/run.py --systems fsdp2_offload --batches 8 --ckpt on --warmup 1 --steps 3 --timeout 110 --out $R/offload > $R/offload.log 2>&1; log "offload rc=$?"
grep -E ': (ok|oom)' $R/offload.log | tail -2
timeout 60 bash bench/hf_head_to_head/install_deepspeed.sh .carry/ds_wheels /tmp/ds_site > $R/ds_install.log 2>&1; log "ds install rc=$?"; tail -2 $R/ds_install.log
timeout 205 python3 bench/hf_head_to_head/run.py --systems deepspeed --batches 8 --ckpt on --warmup 1 --steps 3 --timeout 195 --ds-path /tmp/ds_site --out $R/deepspeed > $R/deepspeed.log 2>&1; log "deepspeed rc=$?"
tail -5 $R/deepspeed.log | cut -c1-300
cd $OUT && tar czf h2hA.tgz h2h && rm -rf h2h
