#!/usr/bin/env python3
"""The analysis of bench/checkpoint/hf_checkpoint_stall.sh, also run on a result directory
afterwards:  python3 bench/checkpoint/stall_analysis.py OUT MODEL BATCH "ARGS OF THE RUN"
Reads OUT/{watch.json,steps.jsonl,stats.json,hostd.log}; writes OUT/stall.json and prints it
without the per-step rows.

A step is "with" a checkpoint when one was in flight (request to commit) during any part of it.
Steps while hostd prepared the snapshot pool and while the bench removed the previous checkpoint
are reported apart and in no baseline. Host samples (the watcher's, once a second) give CPU
busy, steal and iowait; a step overlapping a second of more than 0.3 CPUs stolen by the
hypervisor is "under steal", and each checkpoint also gets its ratio over steps free of steal
against the steps free of steal without a checkpoint.
"""
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
res["host"] = {"cpus": w.get("cpus", os.cpu_count()), "with_checkpoint": rates(True),
               "without": rates(False)}
# Hypervisor steal per step (CPUs, averaged over the step) from the host samples: on a VM the
# host's own work (e.g. writing back the guest's disk writes) takes CPU time from the guest, and
# every step then slows, checkpoint or not.
hs = w.get("host", [])
def stolen(s):
    e = s.get("end_unix", ends.get(s["step"]))
    if not e:
        return None
    b, tot, span = e - s["step_time_s"], 0.0, 0.0
    for a, c in zip(hs, hs[1:]):
        if "steal_jiffies" not in a or "steal_jiffies" not in c or c["t"] <= a["t"]:
            continue
        lo, hi = max(a["t"], b), min(c["t"], e)
        if hi > lo:
            tot += (c["steal_jiffies"] - a["steal_jiffies"]) / hz / (c["t"] - a["t"]) * (hi - lo)
            span += hi - lo
    return tot / span if span else None
for r, s in zip(rows, steps):
    r["steal_cpus"] = stolen(s)
STEAL = 0.3  # CPUs
def calm(r):
    return r["steal_cpus"] is not None and r["steal_cpus"] <= STEAL
if any(r["steal_cpus"] is not None for r in warm):
    base = [r["step_time_s"] for r in warm if calm(r) and not r["in_flight"]
            and not r["preparing_pool"] and not r["removing_previous"]]
    under = [r for r in warm if r["steal_cpus"] is not None and not calm(r)]
    res["steal"] = {"threshold_cpus": STEAL, "under_steal": summary([r["step_time_s"] for r in under]),
                    "under_steal_without_checkpoint": summary(
                        [r["step_time_s"] for r in under if not r["in_flight"]]),
                    "baseline_free_of_steal": summary(base)}
    for i, c in enumerate(res["checkpoints"]):
        xs = [r["step_time_s"] for r in warm if r["checkpoint"] == i and calm(r)]
        c["steps_under_steal"] = sum(1 for r in under if r["checkpoint"] == i)
        c["steal_free"] = summary(xs)
        if xs and base:
            c["steal_free"]["mean_ratio"] = statistics.mean(xs) / statistics.mean(base)
            c["steal_free"]["median_ratio"] = statistics.median(xs) / statistics.median(base)
if wi and wo:
    res["median_ratio"] = res["median_step_s_with"] / res["median_step_s_without"]
    res["mean_ratio"] = res["mean_step_s_with"] / res["mean_step_s_without"]
json.dump(res, open(os.path.join(out, "stall.json"), "w"), indent=1)
print(json.dumps({k: v for k, v in res.items() if k != "steps"}))
