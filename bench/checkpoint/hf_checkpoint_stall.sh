#!/bin/bash
# Checkpoint stall of a python_client job on a GPU (issue #6): hostd (random init from a
# train_hf shape, --checkpoint.dir) and one GPU rank (examples/train_hf.py, resident embeddings:
# the checkpoint asks rank 0 for them) train STEPS steps; after step AT a checkpoint is requested
# (`slidedpctl checkpoint`, waiting for the commit in the background) while training goes on.
# Every step's end is timestamped as it appears in the rank's loss log; a step is "with" when a
# checkpoint was in flight during any part of it.
#   [DEVICE=cpu] bench/checkpoint/hf_checkpoint_stall.sh BUNDLE OUT [MODEL qwen3-4b] [BATCH 8] [STEPS 24] [AT 6] [CKDIR]
# Writes OUT/stall.json (per-step times, medians with/without a checkpoint in flight, their
# ratio, hostd's checkpoint counters, the rank's resident snapshot time), logs.
set -u
B=${1:?bundle}; OUT=${2:?out}; MODEL=${3:-qwen3-4b}; BATCH=${4:-8}; STEPS=${5:-24}; AT=${6:-6}
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
W=$(mktemp -d); CK=${7:-$W/ck}; mkdir -p "$OUT" "$CK"
python3 examples/train_hf.py prepare "$W" --model "$MODEL" --config-only >/dev/null
"$B/bin/hostd" --model "$W" --socket "$W/h.sock" --instance "ckst$$" --mlock best_effort \
  --update_threads $(( $(nproc) > 5 ? $(nproc) - 4 : 1 )) --checkpoint.dir "$CK" --checkpoint.keep_last 1 \
  --checkpoint.on_stop false --grad_route "${ROUTE:-gpu_reduction}" >"$OUT/hostd.log" 2>&1 &
HP=$!
while [ ! -S "$W/h.sock" ]; do
  sleep 0.5; kill -0 $HP 2>/dev/null || { echo "hostd exited"; tail -5 "$OUT/hostd.log"; exit 1; }
done
CTL="$B/bin/slidedpctl --socket $W/h.sock"
: >"$OUT/steps.jsonl"
# Watcher: timestamps each new step line; after step AT asks for a checkpoint and waits for it.
python3 - "$OUT" "$AT" "$CTL" <<'PY' &
import json, os, subprocess, sys, time
out, at, ctl = sys.argv[1], int(sys.argv[2]), sys.argv[3].split()
seen, ends, ck = 0, [], None
path = os.path.join(out, "steps.jsonl")
while True:
    with open(path) as f:
        lines = f.read().splitlines()
    now = time.time()
    for ln in lines[seen:]:
        ends.append((json.loads(ln)["step"], now))
    seen = len(lines)
    if ck is None and seen >= at:
        t0 = time.time()
        p = subprocess.Popen(ctl + ["checkpoint", "--wait-s", "900"], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
        ck = {"requested": t0, "proc": p}
    if ck is not None and "committed" not in ck and ck["proc"].poll() is not None:
        ck["committed"] = time.time(); ck["rc"] = ck["proc"].returncode
        ck["output"] = ck["proc"].stdout.read()
    if os.path.exists(os.path.join(out, "train.done")) and (ck is None or "committed" in ck):
        break
    time.sleep(0.05)
ck.pop("proc", None) if ck else None
json.dump({"step_ends": ends, "checkpoint": ck}, open(os.path.join(out, "watch.json"), "w"))
PY
WP=$!
SLIDEDP_RANK_LIB=$B/lib/libslidedp_rank.so python3 examples/train_hf.py train --hostd "$W/h.sock" \
  --model "$W" --meta --batch "$BATCH" --seq ${SEQ:-1024} --steps "$STEPS" --device "${DEVICE:-cuda}" --no-progress \
  --loss-log "$OUT/steps.jsonl" >"$OUT/train.log" 2>&1
rc=$?; touch "$OUT/train.done"; wait $WP
$CTL stats --json >"$OUT/stats.json"
kill $HP; wait $HP
python3 - "$OUT" "$MODEL" "$BATCH" "$*" <<'PY'
import json, os, platform, statistics, sys
out, model, batch, cmd = sys.argv[1:5]
w = json.load(open(os.path.join(out, "watch.json")))
steps = [json.loads(l) for l in open(os.path.join(out, "steps.jsonl"))]
ends = dict((s, t) for s, t in w["step_ends"])
ck = w["checkpoint"] or {}
t_req, t_end = ck.get("requested"), ck.get("committed")
rows = []
for s in steps:
    e = ends.get(s["step"])
    b = e - s["step_time_s"] if e else None
    infl = bool(t_req and e and b is not None and b < t_end and e > t_req)
    rows.append({"step": s["step"], "step_time_s": s["step_time_s"], "in_flight": infl,
                 "resident_snapshot_s": s.get("resident_snapshot_s", 0.0)})
warm = [r for r in rows if r["step"] > 2]
wi = [r["step_time_s"] for r in warm if r["in_flight"]]
wo = [r["step_time_s"] for r in warm if not r["in_flight"]]
st = json.load(open(os.path.join(out, "stats.json")))
keys = [k for k in st if k.startswith("checkpoint") or "checkpoint" in k]
res = {"benchmark": "hf_checkpoint_stall", "command": "bench/checkpoint/hf_checkpoint_stall.sh " + cmd,
       "machine": platform.node(), "model": model, "batch": int(batch), "seq": int(os.environ.get("SEQ", "1024")),
       "checkpoint_seconds": (t_end - t_req) if t_end else None, "checkpoint_rc": ck.get("rc"),
       "checkpoint_output": ck.get("output"),
       "steps_with_checkpoint": len(wi), "steps_without": len(wo),
       "median_step_s_with": statistics.median(wi) if wi else None,
       "median_step_s_without": statistics.median(wo) if wo else None,
       "mean_step_s_with": statistics.mean(wi) if wi else None,
       "mean_step_s_without": statistics.mean(wo) if wo else None,
       "hostd": {k: st[k] for k in keys}, "steps": rows}
if wi and wo:
    res["median_ratio"] = res["median_step_s_with"] / res["median_step_s_without"]
    res["mean_ratio"] = res["mean_step_s_with"] / res["mean_step_s_without"]
json.dump(res, open(os.path.join(out, "stall.json"), "w"), indent=1)
print(json.dumps({k: v for k, v in res.items() if k not in ("steps", "checkpoint_output")}))
PY
exit $rc
