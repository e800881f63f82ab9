#!/usr/bin/env bash
# Issue #17 point 12 on a GPU: a service takes any number of attach / detach cycles. Three
# examples/train_hf.py processes in turn against one hostd (the qwen3-0.6b shape built on the
# meta device, GPU-reduction route, resident embeddings/norm/lm_head): each creates its GPU data
# plane (NCCL communicators from hostd's id rendezvous, generations 1 and 2 again), trains
# STEPS steps from where the last one stopped, uploads its resident layers and detaches. The
# second process failed before: "creating the GPU data plane on cuda:0: PublishCommId:
# generation: expected >= 2, got 1".
#   tests/attach_cycles_gpu_test.sh BUNDLE OUT        (a bundle of deploy/bundle, or a build tree)
# Exit 0 when all three trained and hostd stopped cleanly; logs in OUT. Needs a GPU and torch.
set -euo pipefail
cd "$(dirname "$0")/.."
B=${1:?usage: attach_cycles_gpu_test.sh BUNDLE OUT}
OUT=${2:?usage: attach_cycles_gpu_test.sh BUNDLE OUT}
PY=${SLIDEDP_PYTHON:-python3}
STEPS=${STEPS:-4}
mkdir -p "$OUT"
bin() { if [ -x "$B/bin/$1" ]; then echo "$B/bin/$1"; else echo "$B/$2"; fi; }
HOSTD=$(bin hostd hostd/hostd)
CTL=$(bin slidedpctl slidedpctl/slidedpctl)
LIB=$B/lib/libslidedp_rank.so
[ -f "$LIB" ] || LIB=$B/rankclient/libslidedp_rank.so
RUN=$(mktemp -d)
SOCK=$RUN/hostd.sock
HOSTD_PID=
cleanup() {
  [ -n "$HOSTD_PID" ] && kill "$HOSTD_PID" 2>/dev/null || true
  rm -rf "$RUN"
}
trap cleanup EXIT
"$PY" examples/train_hf.py prepare "$RUN/model" --model qwen3-0.6b --config-only >"$OUT/prepare.log"
cat README.md python_client/README.md >"$RUN/corpus.txt"
"$HOSTD" --model "$RUN/model" --socket "$SOCK" --instance "cycles$$" --mlock best_effort \
  --grad_route gpu_reduction --lr 1e-4 >"$OUT/hostd.log" 2>&1 &
HOSTD_PID=$!
for _ in $(seq 600); do [ -S "$SOCK" ] && break; sleep 0.1; done
[ -S "$SOCK" ] || { echo "hostd did not start"; tail "$OUT/hostd.log"; exit 1; }
for run in 1 2 3; do
  SLIDEDP_RANK_LIB=$LIB NCCL_NVLS_ENABLE=0 "$PY" -m torch.distributed.run --nproc-per-node 1 \
    --master-addr 127.0.0.1 --master-port $((21000 + run)) examples/train_hf.py train \
    --hostd "$SOCK" --model "$RUN/model" --data "$RUN/corpus.txt" --device cuda --meta \
    --batch 4 --seq 256 --steps "$STEPS" --no-progress --loss-log "$OUT/loss_run$run.jsonl" \
    >"$OUT/run$run.log" 2>&1 || {
    echo "run $run FAILED:"
    tail -n 15 "$OUT/run$run.log"
    exit 1
  }
  step=$("$CTL" --socket "$SOCK" status --json | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["job"]["step"])')
  echo "run $run: ok, hostd's job at step $step"
  [ "$step" = $((run * STEPS)) ] || { echo "expected step $((run * STEPS))"; exit 1; }
done
kill -TERM "$HOSTD_PID"
rc=0
wait "$HOSTD_PID" || rc=$?
HOSTD_PID=
echo "hostd exit $rc"
exit "$rc"
