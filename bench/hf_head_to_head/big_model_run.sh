#!/bin/bash
# A large-model feasibility run on one GPU: hostd (random init from a train_hf shape) + one GPU
# rank, full recompute, a few steps; the peak host PSS of hostd + the rank is sampled.
#   bench/hf_head_to_head/big_model_run.sh BUNDLE OUT [MODEL qwen3-8b] [BATCH 8] [STEPS 4]
# Writes OUT/steps.jsonl (slidedp's per-step figures), OUT/stats.json (hostd's update counters),
# OUT/pss_peak_kib.txt, logs. Used for the Qwen3-8B run in bench/results/python_client_h200_*.
set -u
B=${1:?bundle}; OUT=${2:?out}; MODEL=${3:-qwen3-8b}; BATCH=${4:-8}; STEPS=${5:-4}
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
W=$(mktemp -d); mkdir -p "$OUT"
python3 examples/train_hf.py prepare "$W" --model "$MODEL" --config-only >/dev/null
free -g >"$OUT/free_before.txt"
"$B/bin/hostd" --model "$W" --socket "$W/h.sock" --instance "big$$" --mlock best_effort \
  --update_threads $(( $(nproc) - 4 )) --grad_route gpu_reduction >"$OUT/hostd.log" 2>&1 &
HP=$!
( peak=0; while kill -0 $HP 2>/dev/null; do s=0
    for p in $HP $(pgrep -f "train_hf.py train"); do
      v=$(awk '/^Pss:/{print $2}' /proc/$p/smaps_rollup 2>/dev/null); s=$((s + ${v:-0})); done
    if [ $s -gt $peak ]; then peak=$s; echo $peak >"$OUT/pss_peak_kib.txt"; fi; sleep 0.5; done ) &
t0=$(date +%s)
while [ ! -S "$W/h.sock" ]; do
  sleep 0.5; kill -0 $HP 2>/dev/null || { echo "hostd exited"; tail -5 "$OUT/hostd.log"; exit 1; }
done
echo "hostd up after $(( $(date +%s) - t0 )) s"
SLIDEDP_RANK_LIB=$B/lib/libslidedp_rank.so python3 examples/train_hf.py train --hostd "$W/h.sock" \
  --model "$W" --meta --batch "$BATCH" --seq 1024 --steps "$STEPS" --device cuda --no-progress \
  --loss-log "$OUT/steps.jsonl" >"$OUT/train.log" 2>&1
rc=$?
echo "train rc=$rc"; tail -6 "$OUT/train.log"
"$B/bin/slidedpctl" --socket "$W/h.sock" stats --json >"$OUT/stats.json"
kill $HP; wait $HP
echo "host PSS peak KiB: $(cat "$OUT/pss_peak_kib.txt")"
exit $rc
