#!/usr/bin/env bash
# The main job on a fresh machine: installs dependencies, builds, starts hostd with no model and
# trains the native MLP (examples/native_trainer) with 2 rank processes through it: rank 0's loss
# and samples/s per step on screen, slidedpctl status/layers while it trains and after, the global
# loss per step, then hostd stopped cleanly and its leftover segments counted (0 expected).
# The model: LAYERS x DIM, global batch BATCH, STEPS steps at LR (environment overrides).
# With a GPU (nvidia-smi lists one and the build has the CUDA targets) the ranks are
# native_gpu_trainer processes: layers computed on the GPU, parameters streamed through the GPU
# window, gradients D2H; one rank per GPU on the reduce-scatter route, or 2 ranks sharing a single
# GPU on the CPU-reduction route. SLIDEDP_CPU=1 forces the CPU trainer.
# On a machine without the build tools (the GPU machine), BUILD_DIR may name a prebuilt tree or a
# bundle (deploy/bundle) and SKIP_SETUP=1 skips bootstrap and build.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${SKIP_SETUP:-0}" != 1 ]; then
  scripts/bootstrap.sh
  scripts/build.sh
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

"$HOSTD_BIN" --model none --world_size "$R" --socket "$SOCK" --instance "$INSTANCE" \
  --mlock best_effort >"$RUN/hostd.log" 2>&1 &
HOSTD=$!
PIDS+=("$HOSTD")
for _ in $(seq 100); do [ -S "$SOCK" ] && break; sleep 0.1; done
ctl version

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
shown=0
asked=0
while :; do
  running=0
  kill -0 "${TRAINERS[0]}" 2>/dev/null && running=1
  lines=$(wc -l <"$RUN/rank0.log")
  if ((lines > shown)); then
    sed -n "$((shown + 1)),${lines}p" "$RUN/rank0.log"
    shown=$lines
  fi
  if ((asked == 0 && running == 1)) &&
    grep -q "^rank 0 step *$((STEPS / 2)) " "$RUN/rank0.log"; then
    asked=1
    echo "-- slidedpctl status while training:"
    ctl status || true
    echo "--"
  fi
  ((running)) || break
  sleep 0.2
done
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

echo "== after training (slidedpctl layers --checksums, stats):"
ctl layers --checksums
ctl stats
kill -TERM "$HOSTD"
wait "$HOSTD"
PIDS=()
echo "== hostd log:"
cat "$RUN/hostd.log"
echo "hostd stopped cleanly; leftover segments: $(ls /dev/shm | grep -c "slidedp.$INSTANCE" || true)"
exit "$failed"
