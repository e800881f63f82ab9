#!/bin/bash
# Checkpoint stall of a python_client job on a GPU (issue #6): hostd (random init from a
# train_hf shape, --checkpoint.dir) and one GPU rank (examples/train_hf.py, resident embeddings:
# the checkpoint asks rank 0 for them) train STEPS steps; after step AT a checkpoint is requested
# (`slidedpctl checkpoint`, waiting for the commit in the background) while training goes on;
# AT may list several steps (20,120): one checkpoint after another.
# Every step's end is the rank's end_unix in its loss log; a step is "with" when a checkpoint was
# in flight (from the request to the commit) during any part of it.
#   [DEVICE=cpu] bench/checkpoint/hf_checkpoint_stall.sh BUNDLE OUT [MODEL qwen3-4b] [BATCH 8] [STEPS 24] [AT 6] [CKDIR]
# MAX_WRITE_MB=N passes --checkpoint.max_write_mb_per_s N to hostd (default 0: no limit),
# DIRECT_IO=false --checkpoint.direct_io false.
# The watcher also samples the host once a second (/proc/stat CPU busy, /proc/schedstat run-queue
# wait summed over CPUs, /proc/vmstat reclaim scans, /proc/meminfo Dirty/Writeback): stall.json's
# "host" gives their rates with and without a checkpoint in flight.
# Writes OUT/stall.json (per-step times, medians and means with/without a checkpoint in flight
# and their ratios, overall and per checkpoint, hostd's checkpoint counters, the rank's resident
# snapshot time), logs.
set -u
B=${1:?bundle}; OUT=${2:?out}; MODEL=${3:-qwen3-4b}; BATCH=${4:-8}; STEPS=${5:-24}; AT=${6:-6}
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
W=$(mktemp -d); CK=${7:-$W/ck}; mkdir -p "$OUT" "$CK"
python3 examples/train_hf.py prepare "$W" --model "$MODEL" --config-only >/dev/null
"$B/bin/hostd" --model "$W" --socket "$W/h.sock" --instance "ckst$$" --mlock best_effort \
  --update_threads $(( $(nproc) > 5 ? $(nproc) - 4 : 1 )) --checkpoint.dir "$CK" --checkpoint.keep_last 1 \
  --checkpoint.on_stop false --checkpoint.max_write_mb_per_s "${MAX_WRITE_MB:-0}" \
  --checkpoint.direct_io "${DIRECT_IO:-true}" --grad_route "${ROUTE:-gpu_reduction}" >"$OUT/hostd.log" 2>&1 &
HP=$!
while [ ! -S "$W/h.sock" ]; do
  sleep 0.5; kill -0 $HP 2>/dev/null || { echo "hostd exited"; tail -5 "$OUT/hostd.log"; exit 1; }
done
CTL="$B/bin/slidedpctl --socket $W/h.sock"
: >"$OUT/steps.jsonl"
# Watcher: timestamps each new step line; after step AT (each of a comma-separated list, one at
# a time: the next is asked for after the previous committed) asks for a checkpoint and waits.
python3 - "$OUT" "$AT" "$CTL" <<'PY' &
import json, os, subprocess, sys, time
out, ats, ctl = sys.argv[1], [int(a) for a in sys.argv[2].split(",")], sys.argv[3].split()
seen, ends, cks, host = 0, [], [], []
path = os.path.join(out, "steps.jsonl")
def sample():
    # Each source on its own: a kernel without schedstats has no /proc/schedstat.
    h = {"t": time.time()}
    try:
        cpu = open("/proc/stat").readline().split()[1:]
        h["busy_jiffies"] = sum(int(x) for i, x in enumerate(cpu[:8]) if i not in (3, 4, 7))
        h["steal_jiffies"] = int(cpu[7]) if len(cpu) > 7 else 0
        h["iowait_jiffies"] = int(cpu[4])
    except (OSError, ValueError):
        pass
    try:
        h["runq_wait_ns"] = sum(int(ln.split()[8]) for ln in open("/proc/schedstat")
                                if ln.startswith("cpu"))
    except (OSError, ValueError, IndexError):
        pass
    try:
        vm = dict(ln.split() for ln in open("/proc/vmstat"))
        h["pgscan"] = sum(int(v) for k, v in vm.items() if k.startswith("pgscan_"))
    except (OSError, ValueError):
        pass
    try:
        mi = dict((ln.split(":")[0], int(ln.split()[1])) for ln in open("/proc/meminfo"))
        h["dirty_kb"] = mi.get("Dirty", 0) + mi.get("Writeback", 0)
    except (OSError, ValueError, IndexError):
        pass
    return h
last_sample = 0.0
while True:
    if time.time() - last_sample >= 1.0:
        last_sample = time.time()
        h = sample()
        if h: host.append(h)
    with open(path) as f:
        lines = f.read().splitlines()
    now = time.time()
    for ln in lines[seen:]:
        ends.append((json.loads(ln)["step"], now))
    seen = len(lines)
    busy = cks and "committed" not in cks[-1]
    if not busy and len(cks) < len(ats) and seen >= ats[len(cks)]:
        p = subprocess.Popen(ctl + ["checkpoint", "--wait-s", "900"], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
        cks.append({"at_step": seen, "requested": time.time(), "proc": p})
    for ck in cks:
        if "committed" not in ck and ck["proc"].poll() is not None:
            ck["committed"] = time.time(); ck["rc"] = ck["proc"].returncode
            ck["output"] = ck["proc"].stdout.read()
            if len(cks) < len(ats):
                # The disk may hold one checkpoint only (the H200 machine's 64 GiB, a 4B one is
                # 45 GiB): it is removed as soon as it commits when another one is to come; the
                # steps during the removal are reported apart.
                t_rm = time.time()
                for ln in ck["output"].splitlines():
                    if ln.startswith("path "):
                        subprocess.run(["rm", "-rf", ln.split(None, 1)[1]])
                ck["removal"] = [t_rm, time.time()]
    if os.path.exists(os.path.join(out, "train.done")) and all("committed" in c for c in cks):
        break
    time.sleep(0.05)
for ck in cks:
    ck.pop("proc", None)
json.dump({"step_ends": ends, "checkpoints": cks, "host": host, "cpus": os.cpu_count()}, open(os.path.join(out, "watch.json"), "w"))
PY
WP=$!
SLIDEDP_RANK_LIB=$B/lib/libslidedp_rank.so python3 examples/train_hf.py train --hostd "$W/h.sock" \
  --model "$W" --meta --batch "$BATCH" --seq ${SEQ:-1024} --steps "$STEPS" --device "${DEVICE:-cuda}" --no-progress \
  --loss-log "$OUT/steps.jsonl" >"$OUT/train.log" 2>&1
rc=$?; touch "$OUT/train.done"; wait $WP
$CTL stats --json >"$OUT/stats.json"
kill $HP; wait $HP
python3 "$(dirname "$0")/stall_analysis.py" "$OUT" "$MODEL" "$BATCH" "$*"
exit $rc
