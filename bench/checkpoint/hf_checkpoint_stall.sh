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
json.dump({"step_ends": ends, "checkpoints": cks, "host": host}, open(os.path.join(out, "watch.json"), "w"))
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
cks = w["checkpoints"]
rows = []
for s in steps:
    # The rank's own clock at the step's end (train_hf's end_unix); the watcher's stamp (when it
    # saw the line) where the log lacks it.
    e = s.get("end_unix", ends.get(s["step"]))
    b = e - s["step_time_s"] if e else None
    # The checkpoint in flight during any part of this step (index into cks; -1: none).
    infl = -1
    for i, ck in enumerate(cks):
        t_req, t_end = ck.get("requested"), ck.get("committed")
        if t_req and e and b is not None and t_end and b < t_end and e > t_req:
            infl = i
    rows.append({"step": s["step"], "step_time_s": s["step_time_s"], "in_flight": infl >= 0,
                 "checkpoint": infl, "resident_snapshot_s": s.get("resident_snapshot_s", 0.0)})
# hostd prepares the snapshot pool after the first step (checkpoint.prepare_snapshot_pool): its
# log line "checkpoint snapshot pool prepared: X GiB in S s" (local time) bounds that window. Steps
# overlapping it are a one-time cost of checkpointing: reported apart, in neither baseline.
import datetime, re
prep = None
for ln in open(os.path.join(out, "hostd.log")):
    m = re.match(r"(\S+) \S+ hostd: checkpoint snapshot pool prepared: .* in ([0-9.]+) s", ln)
    if m:
        t1 = datetime.datetime.strptime(m.group(1), "%Y-%m-%dT%H:%M:%S.%f").timestamp()
        prep = (t1 - float(m.group(2)), t1)
        break
removals = [ck["removal"] for ck in cks if ck.get("removal")]
for r, s in zip(rows, steps):
    e = s.get("end_unix", ends.get(s["step"]))
    r["preparing_pool"] = bool(prep and e and e - s["step_time_s"] < prep[1] and e > prep[0]
                               and not r["in_flight"])
    # The bench's removal of a committed checkpoint (the disk holds one): apart too.
    r["removing_previous"] = bool(e and not r["in_flight"] and not r["preparing_pool"] and any(
        e - s["step_time_s"] < b and e > a for a, b in removals))
warm = [r for r in rows if r["step"] > 2]
wi = [r["step_time_s"] for r in warm if r["in_flight"]]
wo = [r["step_time_s"] for r in warm
      if not r["in_flight"] and not r["preparing_pool"] and not r["removing_previous"]]
st = json.load(open(os.path.join(out, "stats.json")))
keys = [k for k in st if "checkpoint" in k]
def summary(xs):
    return {"steps": len(xs), "median_step_s": statistics.median(xs) if xs else None,
            "mean_step_s": statistics.mean(xs) if xs else None, "max_step_s": max(xs) if xs else None}
res = {"benchmark": "hf_checkpoint_stall", "command": "bench/checkpoint/hf_checkpoint_stall.sh " + cmd,
       "machine": platform.node(), "model": model, "batch": int(batch), "seq": int(os.environ.get("SEQ", "1024")),
       "steps_with_checkpoint": len(wi), "steps_without": len(wo),
       "median_step_s_with": statistics.median(wi) if wi else None,
       "median_step_s_without": statistics.median(wo) if wo else None,
       "mean_step_s_with": statistics.mean(wi) if wi else None,
       "mean_step_s_without": statistics.mean(wo) if wo else None,
       "pool_preparation": {"window_unix": prep,
                            **summary([r["step_time_s"] for r in warm if r["preparing_pool"]])},
       "removing_previous_checkpoint": {
           "windows_unix": removals, **summary([r["step_time_s"] for r in warm if r["removing_previous"]])},
       "checkpoints": [], "hostd": {k: st[k] for k in keys}, "steps": rows}
for i, ck in enumerate(cks):
    xs = [r["step_time_s"] for r in warm if r["checkpoint"] == i]
    c = {"at_step": ck["at_step"], "rc": ck.get("rc"), "output": ck.get("output"),
         "seconds": ck["committed"] - ck["requested"] if ck.get("committed") else None, **summary(xs)}
    if xs and wo:
        c["mean_ratio"] = c["mean_step_s"] / statistics.mean(wo)
        c["median_ratio"] = c["median_step_s"] / statistics.median(wo)
        # Step time the checkpoint added, against the run's steps without one.
        c["excess_s"] = sum(xs) - len(xs) * statistics.mean(wo)
        # The same against the steps without a checkpoint just around it (as many as it
        # overlapped, before and after): the step time drifts over a run.
        idx = [j for j, r in enumerate(warm) if r["checkpoint"] == i]
        free = [j for j, r in enumerate(warm)
                if not r["in_flight"] and not r["preparing_pool"] and not r["removing_previous"]]
        before = [warm[j]["step_time_s"] for j in free if j < idx[0]][-len(xs):]
        after = [warm[j]["step_time_s"] for j in free if j > idx[-1]][:len(xs)]
        if before + after:
            c["adjacent_steps"] = len(before + after)
            c["mean_ratio_adjacent"] = c["mean_step_s"] / statistics.mean(before + after)
    res["checkpoints"].append(c)
# Host counters between samples, as rates, split by whether a checkpoint was in flight.
hz = os.sysconf("SC_CLK_TCK")
_e = [s.get("end_unix", ends.get(s["step"])) for s in steps[2:]]  # warm steps: training runs
train_span = (min(e for e in _e if e), max(e for e in _e if e)) if any(_e) else (0, 0)
def rates(in_flight):
    n, acc = 0, {}
    hs = w.get("host", [])
    for a, b in zip(hs, hs[1:]):
        dt = b["t"] - a["t"]
        mid = (a["t"] + b["t"]) / 2
        infl = any(ck.get("requested") and ck.get("committed") and ck["requested"] <= mid <= ck["committed"]
                   for ck in cks)
        if dt <= 0 or infl != in_flight or not train_span[0] <= mid <= train_span[1]:
            continue
        n += 1
        for key, src, scale in (("cpus_busy", "busy_jiffies", 1 / hz), ("cpus_stolen", "steal_jiffies", 1 / hz),
                                ("cpus_iowait", "iowait_jiffies", 1 / hz), ("runq_wait_s_per_s", "runq_wait_ns", 1e-9),
                                ("pgscan_per_s", "pgscan", 1)):
            if src in a and src in b:
                acc[key] = acc.get(key, 0.0) + (b[src] - a[src]) * scale / dt
        if "dirty_kb" in b:
            acc["dirty_mb"] = acc.get("dirty_mb", 0.0) + b["dirty_kb"] / 1024
    return {"samples": n, **{k: v / n for k, v in acc.items()}}
res["host"] = {"cpus": os.cpu_count(), "with_checkpoint": rates(True), "without": rates(False)}
if wi and wo:
    res["median_ratio"] = res["median_step_s_with"] / res["median_step_s_without"]
    res["mean_ratio"] = res["mean_step_s_with"] / res["mean_step_s_without"]
json.dump(res, open(os.path.join(out, "stall.json"), "w"), indent=1)
print(json.dumps({k: v for k, v in res.items() if k != "steps"}))
PY
exit $rc
