#!/bin/bash
# The H200 measurements that #5 (head-to-head) and #6 (checkpoint stall) accept on, each sized for
# one device call (< 600 s). Run from the repository root on the GPU machine with a bundle
# (python3 deploy/bundle --build build --out .carry/bundle --strip --with-bench --with-gpu-tests):
#   bench/hf_head_to_head/acceptance_run.sh h2h   BUNDLE OUT   # one run.py invocation: every ratio side by side
#   bench/hf_head_to_head/acceptance_run.sh stall BUNDLE OUT   # a 4B python_client job checkpointed twice while it trains
#   bench/hf_head_to_head/acceptance_run.sh baselines BUNDLE OUT  # anchor + FSDP2 offload + slidedp + DeepSpeed, batch 8
#   bench/hf_head_to_head/acceptance_run.sh auto BUNDLE OUT    # #19 item 1 at seq 1024: defaults vs hand-tuned, b8/b16
#   bench/hf_head_to_head/acceptance_run.sh auto_long BUNDLE OUT  # FSDP2 best, warm cache b16, b32, b1 at 8K
# auto (#19 items 1, 2, 5): slidedp with a user's defaults (defaults=1: hostd with only --model and
# --socket, attach with no tuning argument, so policy="auto") next to the hand-tuned
# configurations of the h2h plan, in one run.py invocation; auto_long's defaults run at b16 finds
# AutoPolicy's cache warm when XDG_CACHE_HOME is auto's (its selection seconds: the item-5 figure).
# h2h plan (in this order, so a budget cut drops the least needed runs): FSDP2 full recompute at
# batch 16 and FSDP2's best (no recompute, batch 8); slidedp full recompute at batch 16 (window 40
# slots, the first 6 decoder layers updated on the GPU: their host update was the exposed tail of
# the step boundary) and its best (a quarter of the layers recomputed, batch 16, 4 resident
# layers: less GPU memory is free there); slidedp batch 8 (the host-floor ratio: every decoder
# layer host-updated) and FSDP2 + CPUOffloadPolicy batch 8.
# baselines (#19 item 5): the harness's FSDP2 + CPUOffloadPolicy must reproduce anchor_baselines.py
# offload 8 (copied to .carry/anchor_baselines.py) within 10% in the same run.py invocation, so the
# ratios against it (and DeepSpeed ZeRO-Offload's, installed offline from .carry/ds_wheels) hold.
# Order: anchor and fsdp2_offload adjacent (same machine state), slidedp with a user's defaults,
# DeepSpeed last (its cpu_adam JIT build, 1-2 min the first time, makes it the least certain fit).
# About 70-90 s each for the first three (CPU init of the 4B model ~20-30 s), DeepSpeed ~3-4 min.
set -u
WHAT=${1:?h2h, stall or baselines}; B=${2:?bundle}; OUT=${3:?out}
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
mkdir -p "$OUT"
case "$WHAT" in
  h2h)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$OUT/nvidia-smi.txt" 2>&1
    timeout 585 python3 bench/hf_head_to_head/run.py --timeout 170 --budget-s 570 \
      --slidedp-opt bundle="$B" --slidedp-opt update_threads=12 --slidedp-opt max_pending_grads=16 \
      --run fsdp2:on:16 --run fsdp2:off:8 \
      --run slidedp:on:16:window_slots=40,resident_layers=6 \
      --run slidedp:off:16:checkpointing=0.25,resident_layers=4 \
      --run slidedp:on:8:window_slots=40 --run fsdp2_offload:on:8 \
      --out "$OUT/h2h" >"$OUT/h2h.log" 2>&1
    echo "rc=$?" >>"$OUT/h2h.log"
    tail -12 "$OUT/h2h.log"
    ;;
  stall)
    { cat /sys/kernel/mm/transparent_hugepage/enabled /sys/kernel/mm/transparent_hugepage/defrag; grep -E "MemTotal|MemAvailable" /proc/meminfo; } \
      >"$OUT/host.txt" 2>&1
    # 310 steps of ~1.1 s, a checkpoint after step 20 and another after step 170 (each 48 GB,
    # written at checkpoint.max_write_mb_per_s 400: ~125 s): the first finds the snapshot pool
    # hostd prepared after step 1, the second the buffers the first kept (a service's every
    # later checkpoint).
    MAX_WRITE_MB=${MAX_WRITE_MB:-400} timeout 560 bash bench/checkpoint/hf_checkpoint_stall.sh \
      "$B" "$OUT/stall" qwen3-4b 8 310 20,170 >"$OUT/stall.log" 2>&1
    echo "rc=$?" >>"$OUT/stall.log"
    tail -3 "$OUT/stall.log" | cut -c1-2500
    ;;
  baselines)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$OUT/nvidia-smi.txt" 2>&1
    { env | grep -E "^(OMP|MKL|CUDA|NCCL|TORCH|PYTORCH)_" | sort; nproc; } >"$OUT/env.txt" 2>&1
    if [ -d .carry/ds_wheels ]; then
      timeout 90 bench/hf_head_to_head/install_deepspeed.sh .carry/ds_wheels >"$OUT/install_deepspeed.log" 2>&1
      echo "install_deepspeed rc=$?" >>"$OUT/install_deepspeed.log"
    fi
    left=$((580 - SECONDS))  # one device call < 600 s, whatever the install took
    timeout $left python3 bench/hf_head_to_head/run.py --timeout 270 --budget-s $((left - 15)) \
      --anchor-script .carry/anchor_baselines.py --slidedp-opt bundle="$B" \
      --run anchor:on:8 --run fsdp2_offload:on:8 --run slidedp:on:8 --run deepspeed:on:8 \
      --out "$OUT/baselines" >"$OUT/baselines.log" 2>&1
    echo "rc=$?" >>"$OUT/baselines.log"
    grep -E "^\[hh2h\].*: (ok|error|oom|timeout|crash|unavailable)|^AGREEMENT|^RATIO|^rc=" "$OUT/baselines.log" | cut -c1-400
    tail -8 "$OUT/baselines.log" | cut -c1-400
    ;;
  auto)
    # b16 and b8 at seq 1024: defaults next to the hand-tuned configurations (AUTO_BUDGET_S, default
    # 570, bounds the whole invocation).
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$OUT/nvidia-smi.txt" 2>&1
    export XDG_CACHE_HOME=${XDG_CACHE_HOME:-$OUT/cache}
    T=${AUTO_BUDGET_S:-570}
    timeout $((T + 10)) python3 bench/hf_head_to_head/run.py --timeout 170 --budget-s "$T" \
      --slidedp-opt bundle="$B" \
      --run slidedp:on:16:defaults=1 \
      --run slidedp:on:16:window_slots=40,resident_layers=6,update_threads=12,max_pending_grads=16 \
      --run slidedp:on:8:defaults=1 \
      --run slidedp:on:8:window_slots=40,update_threads=12,max_pending_grads=16 \
      --run slidedp:off:16:checkpointing=0.25,resident_layers=4,update_threads=12,max_pending_grads=16 \
      --out "$OUT/auto" >"$OUT/auto.log" 2>&1
    echo "rc=$?" >>"$OUT/auto.log"
    grep -E "^\[hh2h\].*: (ok|error|oom|timeout|crash|unavailable)|^rc=" "$OUT/auto.log" | cut -c1-400
    ;;
  auto_long)
    # FSDP2's best, the warm-cache start at b16, b32 at seq 1024, b1 at 8K: defaults next to
    # hand-tuned.
    export XDG_CACHE_HOME=${XDG_CACHE_HOME:-$OUT/cache}
    T=${AUTO_BUDGET_S:-570}
    timeout $((T + 10)) python3 bench/hf_head_to_head/run.py --timeout 170 --budget-s "$T" \
      --slidedp-opt bundle="$B" \
      --run fsdp2:off:8 --run slidedp:on:16:defaults=1 \
      --run slidedp:on:32:defaults=1 \
      --run slidedp:on:32:window_slots=40,resident_layers=4,update_threads=12,max_pending_grads=16 \
      --out "$OUT/long" >"$OUT/long.log" 2>&1
    echo "rc=$?" >>"$OUT/long.log"
    left=$((T - SECONDS))
    if ((left > 150)); then
      timeout $((left + 5)) python3 bench/hf_head_to_head/run.py --seq 8192 --timeout 140 \
        --budget-s "$left" --slidedp-opt bundle="$B" \
        --run slidedp:on:1:defaults=1 \
        --run slidedp:on:1:window_slots=40,resident_layers=6,update_threads=12,max_pending_grads=16 \
        --out "$OUT/s8k" >"$OUT/s8k.log" 2>&1
      echo "rc=$?" >>"$OUT/s8k.log"
    fi
    grep -hE "^\[hh2h\].*: (ok|error|oom|timeout|crash|unavailable)|^rc=" "$OUT"/long.log "$OUT"/s8k.log | cut -c1-400
    ;;
  *) echo "unknown measurement $WHAT (h2h, stall or baselines)" >&2; exit 2 ;;
esac
