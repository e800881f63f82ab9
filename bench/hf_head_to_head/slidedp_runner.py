"""SlideDP entry of the HF head-to-head benchmark (bench/hf_head_to_head/run.py).

run.py imports `run_slidedp` in its own child process (one per (system, ckpt, batch)) and records
what it returns ({"status": "error", "why": ...} when it raises).

run_slidedp(cfg, batch, seq, steps, warmup, ckpt, **opts) -> dict
  Starts hostd (a child of this process, so the harness samples its RSS/PSS with ours) on cfg
  (config.json only: hostd initializes the weights from its seed), builds the model on the meta
  device, attaches it with slidedp (one rank on opts["device"]), trains warmup + steps steps on
  opts["input_ids"] and returns the measured steps' wall times, the last loss, the per-step
  breakdown slidedp reports (parameter waits, step-boundary wait, push wait, bytes moved),
  hostd's update counters (slidedpctl stats) and the GPU memory in use.
  opts: device, dry_run, seed, input_ids, lr, weight_decay, betas, eps, mark_phase, repo_root
  (from the harness) and, from --slidedp-opt KEY=VALUE: bundle (a deploy/bundle directory; default
  $SLIDEDP_BUNDLE, else REPO/.carry/bundle, else REPO/build), window_slots, prefetch,
  offload_ratio, offload_min_bytes (activation offload, slidedp.attach), resident_layers (the
  first N decoder layers updated on the device, slidedp.attach),
  update_threads (default: cores - 4), chunk_bytes, h2d_chunk_bytes, hostd_args (list of extra
  hostd flags; default ["--grad_route", "gpu_reduction"]), policy (a layout for
  slidedp.attach).
  defaults=1: what a user who follows the README gets: hostd with only --model, --socket (and
  --instance, the run's hyperparameters), no tuning flag; slidedp.attach(model, hostd=...,
  device=...) with no tuning argument, so policy="auto" chooses at the first step. The run
  records the chosen layout, its predicted step time and the selection's seconds.
"""
import json
import os
import subprocess
import sys
import tempfile
import time


def _paths(repo, bundle):
    cands = [bundle, os.environ.get("SLIDEDP_BUNDLE"), os.path.join(repo, ".carry", "bundle")]
    for b in cands:
        if b and os.path.exists(os.path.join(b, "bin", "hostd")):
            return (os.path.join(b, "bin", "hostd"), os.path.join(b, "bin", "slidedpctl"),
                    os.path.join(b, "lib", "libslidedp_rank.so"))
    build = os.path.join(repo, "build")
    return (os.path.join(build, "hostd", "hostd"), os.path.join(build, "slidedpctl", "slidedpctl"),
            os.path.join(build, "rankclient", "libslidedp_rank.so"))


def run_slidedp(cfg, batch, seq, steps, warmup, ckpt, **opts):
    import torch
    import transformers
    repo = opts["repo_root"]
    hostd_bin, ctl_bin, lib = _paths(repo, opts.get("bundle"))
    os.environ["SLIDEDP_RANK_LIB"] = lib
    os.environ.setdefault("SLIDEDP_CTL", ctl_bin)  # policy="auto" ranks layouts with `slidedpctl plan`
    sys.path.insert(0, os.path.join(repo, "python_client"))
    import slidedp

    work = tempfile.mkdtemp(prefix="slidedp-h2h-")
    cfg.save_pretrained(work)
    sock = os.path.join(work, "hostd.sock")
    betas = opts.get("betas", (0.9, 0.999))
    cmd = [hostd_bin, "--model", work, "--socket", sock, "--instance", f"h2h{os.getpid()}",
           "--mlock", "best_effort", "--seed", str(opts.get("seed", 0)),
           "--lr", str(opts.get("lr", 1e-5)), "--weight_decay", str(opts.get("weight_decay", 0.01)),
           "--beta1", str(betas[0]), "--beta2", str(betas[1]), "--eps", str(opts.get("eps", 1e-8))]
    # Defaults measured on the H200 (bench/results/python_client_h200_2026-11-29): with one rank
    # the GPU-reduction route lets hostd apply AdamW chunk by chunk as the D2H lands (3.9-4.2
    # Gparam/s with 12 threads), where the CPU-reduction route's whole-layer updates with every
    # core reached 1.4 Gparam/s next to the rank's own threads.
    defaults = bool(int(opts.get("defaults", 0) or 0))
    if defaults:
        cmd.remove("--mlock")
        cmd.remove("best_effort")
    else:
        threads = opts.get("update_threads") or max(1, (os.cpu_count() or 4) - 4)
        cmd += ["--update_threads", str(threads)]
    if "hostd_args" not in opts and not defaults:
        cmd += ["--grad_route", "gpu_reduction"]
    if opts.get("chunk_bytes"):
        cmd += ["--chunk_bytes", str(opts["chunk_bytes"])]
    cmd += list(opts.get("hostd_args", []))
    log = open(os.path.join(work, "hostd.log"), "w+")
    t0 = time.perf_counter()
    hostd = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    opt = None
    try:
        while not os.path.exists(sock):
            if hostd.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"hostd exited {hostd.returncode}: {log.read()[-3000:]}")
            time.sleep(0.1)
        hostd_start_s = time.perf_counter() - t0
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(cfg)
        model.train()
        dev = opts.get("device", "cuda")
        kw = {k: opts[k] for k in ("window_slots", "prefetch", "h2d_chunk_bytes", "nondecoder",
                                   "max_pending_grads", "offload_ratio", "offload_min_bytes",
                                   "resident_layers")
              if k in opts}
        if defaults:
            model, opt = slidedp.attach(model, hostd=sock, device=dev, verify_init=False)
        elif "policy" in opts:
            model, opt = slidedp.attach(model, hostd=sock, device=dev, policy=opts["policy"],
                                        verify_init=False, **kw)
        else:
            model, opt = slidedp.attach(model, hostd=sock, device=dev,
                                        checkpointing=opts.get("checkpointing", "full" if ckpt else "none"),
                                        verify_init=False, **kw)
        x = opts["input_ids"].to(dev)
        cuda = dev != "cpu" and torch.cuda.is_available()
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        times, per_step, loss, losses = [], [], None, []
        mark = opts.get("mark_phase")
        all_steps = []  # every step's figures, warmup included (AutoPolicy validates on them)
        step_starts = []  # time.monotonic() at each step's start: hostd's update spans use it
        for i in range(warmup + steps):
            if i == 0 and mark:
                mark("train")
            step_starts.append(time.monotonic())
            t = time.perf_counter()
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
            losses.append(loss.detach())
            st = opt.step()
            all_steps.append(st)
            if cuda:
                torch.cuda.synchronize()
            dt = time.perf_counter() - t
            if i >= warmup:
                times.append(dt)
                per_step.append(st)
        if mark:  # the harness's PSS sample of hostd + this rank, while both still hold their memory
            mark("measured")
        # Every step's loss, warmup included: the first is the initial weights' (equal for every
        # setting of one hostd seed), the later ones show whether the settings train alike.
        out = {"step_times": times, "loss": float(loss), "losses": [float(v) for v in losses],
               "hostd_start_s": round(hostd_start_s, 2),
               "hostd_cmd": " ".join(cmd)}
        keys = ["param_fetch_wait_s", "param_slot_wait_s", "step_begin_wait_s", "push_wait_s",
                "resident_update_s", "h2d_bytes", "d2h_bytes", "activation_offload_bytes",
                "activation_prefetch_wait_s"]
        out["breakdown_median"] = {k: sorted(s[k] for s in per_step)[len(per_step) // 2]
                                   for k in keys}
        # Where the version gate held the last step's forward: (layer, seconds, ms into step).
        out["last_step_fetch_waits"] = per_step[-1].get("param_fetch_waits", [])
        rt = model.slidedp
        out["policy"] = per_step[-1].get("policy")
        out["predicted_step_s"] = per_step[-1].get("policy_predicted_step_s")
        auto = getattr(rt, "auto", None)
        if auto is not None:
            i = auto.sel.info
            out["autopolicy"] = {
                "layout": auto.sel.layout, "selection_s": i.get("selection_s"),
                "profile_s": i.get("profile_s"), "attach_s": i.get("attach_s"),
                "cache": i.get("cache"), "resolves": auto.sel.resolves,
                "history": auto.history, "mem_scale": auto.sel.mem_scale,
                "plan": i.get("plan"), "plan_fixed": i.get("plan_fixed"),
                "activation_budget": i.get("activation_budget"),
                "validation": [{k: s_.get(k) for k in (
                    "policy", "policy_activation_peak_bytes", "policy_activation_predicted_bytes",
                    "policy_peak_reserved_bytes")} for s_ in all_steps[:4]]}
        if cuda:
            free, total = torch.cuda.mem_get_info()
            window = rt.backend.plane.window_slots * rt.backend.plane.slot_elems * 2
            out["peak_gpu_reserved_GiB"] = round(
                (torch.cuda.max_memory_reserved() + window) / 2**30, 2)
            out["peak_gpu_allocated_GiB"] = round(
                (torch.cuda.max_memory_allocated() + window) / 2**30, 2)
            out["gpu_window_GiB"] = round(window / 2**30, 2)
            out["gpu_used_GiB_at_end"] = round((total - free) / 2**30, 2)
            out["window_slots"] = rt.backend.plane.window_slots
        r = subprocess.run([ctl_bin, "--socket", sock, "stats", "--json"], capture_output=True,
                           text=True, timeout=30)
        if r.returncode == 0:
            stats = json.loads(r.stdout)
            spans = stats.pop("last_step_layers", [])
            out["hostd_stats"] = stats
            # hostd's update pipeline of the last step it completed (its updates overlap the next
            # step's forward), on this process's clock: ms from that step's start, with the next
            # step's start for reference. [layer, start, end, busy ms, idle ms before/within]
            done = int(stats.get("steps_completed", 0))
            if spans and 1 <= done <= len(step_starts):
                t0 = step_starts[done - 1]
                out["update_trace"] = {
                    "step": done,
                    "next_step_start_ms": (round((step_starts[done] - t0) * 1e3, 1)
                                           if done < len(step_starts) else None),
                    "span_s": stats.get("last_step_span_seconds"),
                    "idle_s": stats.get("last_step_idle_seconds"),
                    "layers": [[s_.get("layer", 0), round((s_["start_s"] - t0) * 1e3, 1),
                                round((s_["end_s"] - t0) * 1e3, 1),
                                round(s_.get("busy_seconds", 0) * 1e3, 1),
                                round(s_.get("idle_before_seconds", 0) * 1e3, 1)]
                               for s_ in spans]}
        return out
    finally:
        if opt is not None:
            try:
                opt.close()
            except Exception as e:  # noqa: BLE001 - the measurement is already taken
                print(f"close: {e}", file=sys.stderr)
        hostd.terminate()
        try:
            hostd.wait(60)
        except subprocess.TimeoutExpired:
            hostd.kill()
