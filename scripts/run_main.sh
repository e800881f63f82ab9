#!/usr/bin/env bash
# The main job on a fresh machine: installs dependencies (Debian packages, the .venv with torch
# and transformers), builds, starts hostd and fine-tunes a built-in small model through it.
#
# With torch + transformers (the default after bootstrap): examples/train_hf.py, a full
# fine-tune of a Qwen3-shaped causal LM with the slidedp Python client under torchrun.
#   CPU:  qwen3-small (5M parameters, random init written as safetensors that hostd imports),
#         2 rank processes, on a text corpus made of this repository's READMEs.
#   GPU:  qwen3-0.6b shape (hostd's random init), one rank per GPU, layers streamed through the
#         GPU window (GPU-reduction route with one GPU, reduce-scatter with several).
# Otherwise (or SLIDEDP_NATIVE=1): the native MLP trainer (examples/native_trainer), 2 ranks.
# Either way: per-step loss and throughput on screen, slidedpctl status halfway, layer checksums
# and update stats after, then hostd stopped cleanly and its leftover segments counted (0).
# STEPS, LR, HF_BATCH and MODEL (train_hf shapes) or BATCH, LAYERS, DIM (native) change the run;
# SLIDEDP_CPU=1
# forces the CPU. On a machine without build tools (the GPU machine), BUILD_DIR may name a
# prebuilt tree or a bundle (deploy/bundle) and SKIP_SETUP=1 skips bootstrap and build.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${SKIP_SETUP:-0}" != 1 ]; then
  scripts/bootstrap.sh
  scripts/bootstrap_python.sh
  scripts/build.sh
fi
PY=${SLIDEDP_PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
HF=0
if [ "${SLIDEDP_NATIVE:-0}" != 1 ] && "$PY" -c "import torch, transformers" 2>/dev/null; then
  HF=1
fi
B=${BUILD_DIR:-build}
# bin NAME PATH-IN-BUILD: the program in a build tree, or in a bundle's bin/.
bin() { if [ -x "$B/bin/$1" ]; then echo "$B/bin/$1"; else echo "$B/$2"; fi; }
HOSTD_BIN=$(bin hostd hostd/hostd)
CTL_BIN=$(bin slidedpctl slidedpctl/slidedpctl)
CPU_TRAINER=$(bin native_trainer examples/native_trainer/native_trainer)
GPU_TRAINER=$(bin native_gpu_trainer examples/native_trainer/native_gpu_trainer)
R=2
GPUS=0
if [ "${SLIDEDP_CPU:-0}" != 1 ] && [ -x "$GPU_TRAINER" ] &&
  command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
  GPUS=$(nvidia-smi -L | grep -c "^GPU")
fi
TRAINER=$CPU_TRAINER
ROUTE=()
if ((GPUS > 1)); then
  R=$GPUS
  TRAINER=$GPU_TRAINER
  ROUTE=(--grad-route reduce_scatter --param-route replicated)
elif ((GPUS == 1)); then
  TRAINER=$GPU_TRAINER
  ROUTE=(--grad-route cpu_reduction)
fi
STEPS=${STEPS:-30}
LAYERS=${LAYERS:-8}
DIM=${DIM:-384}
BATCH=${BATCH:-256}
LR=${LR:-2e-3}
RUN=$(mktemp -d)
SOCK="$RUN/hostd.sock"
INSTANCE="main$$"
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
  rm -rf "$RUN"
}
trap cleanup EXIT
ctl() { "$CTL_BIN" --socket "$SOCK" "$@"; }
# follow PID PATTERN: prints rank 0's log as it grows until PID exits; slidedpctl status once,
# when a line matches PATTERN (halfway).
follow() {
  local shown=0 asked=0 running lines
  while :; do
    running=0
    kill -0 "$1" 2>/dev/null && running=1
    lines=$(wc -l <"$RUN/rank0.log")
    if ((lines > shown)); then
      sed -n "$((shown + 1)),${lines}p" "$RUN/rank0.log" | grep -v "Warning\|warnings.warn\|^ *$" || true
      shown=$lines
    fi
    if ((asked == 0 && running == 1)) && grep -q "$2" "$RUN/rank0.log"; then
      asked=1
      echo "-- slidedpctl status while training:"
      ctl status || true
      echo "--"
    fi
    ((running)) || break
    sleep 0.2
  done
}
# finish STATUS: hostd's view after training, a clean stop, leftover segments; exits STATUS.
finish() {
  echo "== after training (slidedpctl layers --checksums, stats):"
  ctl layers --checksums
  ctl stats
  kill -TERM "$HOSTD"
  wait "$HOSTD"
  PIDS=()
  echo "== hostd log:"
  cat "$RUN/hostd.log"
  echo "hostd stopped cleanly; leftover segments: $(ls /dev/shm | grep -c "slidedp.$INSTANCE" || true)"
  exit "$1"
}

LIB=$B/lib/libslidedp_rank.so
[ -f "$LIB" ] || LIB=$B/rankclient/libslidedp_rank.so
if ((HF)); then
  R=2
  HOSTD_ARGS=(--lr "${LR:-1e-3}")
  TRAIN_ARGS=(--device cpu --threads 1 --batch "${HF_BATCH:-16}" --seq 128 --steps "$STEPS")
  MODEL=${MODEL:-qwen3-small}
  : >"$RUN/prep.log"
  if ((GPUS)); then
    R=$GPUS
    MODEL=${MODEL_GPU:-qwen3-0.6b}
    route=gpu_reduction
    ((GPUS > 1)) && route=reduce_scatter
    HOSTD_ARGS=(--lr "${LR:-1e-4}" --grad_route "$route")
    TRAIN_ARGS=(--device cuda --meta --batch "${HF_BATCH:-8}" --seq 512 --steps "$STEPS")
    # hostd initializes the weights itself; the ranks build the model on the meta device.
    "$PY" examples/train_hf.py prepare "$RUN/model" --model "$MODEL" --config-only \
      >"$RUN/prep.log" 2>&1
  else
    "$PY" examples/train_hf.py prepare "$RUN/model" --model "$MODEL" >"$RUN/prep.log" 2>&1
  fi
  cat README.md python_client/README.md examples/README.md >"$RUN/corpus.txt"
  "$HOSTD_BIN" --model "$RUN/model" --world_size "$R" --socket "$SOCK" --instance "$INSTANCE" \
    --mlock best_effort "${HOSTD_ARGS[@]}" >"$RUN/hostd.log" 2>&1 &
else
  "$HOSTD_BIN" --model none --world_size "$R" --socket "$SOCK" --instance "$INSTANCE" \
    --mlock best_effort >"$RUN/hostd.log" 2>&1 &
fi
HOSTD=$!
PIDS+=("$HOSTD")
for _ in $(seq 100); do [ -S "$SOCK" ] && break; sleep 0.1; done
ctl version

if ((HF)); then
  echo "== fine-tuning $MODEL through hostd with the slidedp client: $R ranks ($( ((GPUS)) && echo "on $GPUS GPU(s)" || echo "on the CPU")), $STEPS steps"
  : >"$RUN/rank0.log"
  SLIDEDP_RANK_LIB=$LIB OMP_NUM_THREADS=1 "$PY" -m torch.distributed.run --nproc-per-node "$R" \
    --master-addr 127.0.0.1 --master-port $((20000 + $$ % 20000)) \
    examples/train_hf.py train --hostd "$SOCK" --model "$RUN/model" --data "$RUN/corpus.txt" \
    --no-progress "${TRAIN_ARGS[@]}" --loss-log "$RUN/loss{rank}.jsonl" >"$RUN/rank0.log" 2>&1 &
  TRAINER_PID=$!
  PIDS+=("$TRAINER_PID")
  follow "$TRAINER_PID" "^step $((STEPS / 2))/"
  failed=0
  wait "$TRAINER_PID" || failed=1
  if ((failed)); then
    echo "training failed:"
    tail -n 20 "$RUN/rank0.log"
  else
    echo "== global loss per step (mean of the ranks' losses):"
    cat "$RUN"/loss*.jsonl | "$PY" -c '
import json, sys, collections
l = collections.defaultdict(list)
for line in sys.stdin:
    r = json.loads(line); l[r["step"]].append(r["loss"])
for i, t in enumerate(sorted(l)):
    print(f"step {t:3d}  loss {sum(l[t]) / len(l[t]):7.4f}", end="\n" if i % 5 == 4 else "   ")
print()'
  fi
  finish "$failed"
fi

echo "== training: $R ranks ($( ((GPUS)) && echo "on $GPUS GPU(s)" || echo "on the CPU")), $LAYERS layers x $DIM, global batch $BATCH, $STEPS steps, lr $LR"
TRAINERS=()
for rank in $(seq 0 $((R - 1))); do
  create=""
  [ "$rank" = 0 ] && create="--create-job"
  gpu=()
  ((GPUS)) && gpu=(--gpu $((rank % GPUS)) "${ROUTE[@]}")
  # Created here: the background job opens its redirection asynchronously, and the loop below
  # reads the file at once.
  : >"$RUN/rank$rank.log"
  "$TRAINER" --socket "$SOCK" --rank "$rank" --world-size "$R" \
    --layers "$LAYERS" --dim "$DIM" --batch "$BATCH" --lr "$LR" --steps "$STEPS" $create \
    "${gpu[@]}" >"$RUN/rank$rank.log" 2>&1 &
  TRAINERS+=($!)
  PIDS+=($!)
done

# Rank 0's lines as they come; hostd's view (status with its layer table) once, halfway.
follow "${TRAINERS[0]}" "^rank 0 step *$((STEPS / 2)) "
failed=0
for rank in $(seq 0 $((R - 1))); do
  rc=0
  wait "${TRAINERS[$rank]}" || rc=$?
  if ((rc != 0)); then
    failed=1
    echo "rank $rank exited with $rc:"
    tail -n 5 "$RUN/rank$rank.log"
  fi
done
for rank in $(seq 1 $((R - 1))); do grep -h "summary" "$RUN/rank$rank.log" || true; done
if ((failed == 0)); then
  echo "== global loss per step (sum of the ranks' shard losses):"
  awk '/^rank [0-9]+ step /{l[$4] += $6; if ($4 > n) n = $4}
       END {for (t = 1; t <= n; t++) printf "step %3d  loss %7.4f%s", t, l[t], (t % 5 ? "   " : "\n");
            if (n % 5) printf "\n"}' "$RUN"/rank*.log
fi

finish "$failed"
