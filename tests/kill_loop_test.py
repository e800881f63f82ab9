#!/usr/bin/env python3
"""Crash recovery through a real hostd: kill -9 loops with checkpoints, bit-exactness after
adoption and after a checkpoint restore, refuse/fresh.

Usage: kill_loop_test.py HOSTD SLIDEDPCTL NATIVE_TRAINER NATIVE_REFERENCE [LOOPS]

- test_kill_loop: two native_trainer ranks (--reattach-ms) train a tiny MLP through hostd, which
  writes a checkpoint every CKPT_EVERY steps into a directory of the test's temp dir (keep_last
  CKPT_KEEP). LOOPS times (default 100): after the ranks made progress, wait a random 0-40 ms
  (mid-update included), then kill -9 hostd (half the loops) or one rank, restart what was
  killed, and let the ranks re-attach. Definitions, checked per kill:
    observed  = the highest step whose completion (WaitStep OK) a rank printed before the kill
                (read after the victim died, so nothing it saw is missed);
    newest    = the newest committed checkpoint in the checkpoint directory when hostd is
                restarted (read while no hostd runs): the highest step-<t> directory holding the
                commit marker COMMITTED ("slidedp-checkpoint <format> step <t> meta_xxh64 <hex>")
                and a meta.json of step t whose layer files are all there with their sizes;
    hostd kill, state re-adopted at step T ("re-adopted job default at step T" in the new hostd's
                log): lost = max(0, observed - T); the ranks must go on at T + 1;
    hostd kill, state not adoptable (a layer mid-update, layers at different versions), restored
                from checkpoint C ("resumed from checkpoint DIR/step-<C> (step C, ..."): C must
                be `newest` (an older one loses newest - C committed steps, counted as lost);
                the ranks must go on at C + 1; observed - C steps are rolled back by design
                (checkpoint_rolled_back_steps), not lost;
    hostd kill, state not adoptable, "starting job default fresh": allowed only while no
                committed checkpoint exists yet (else newest steps are lost); a rollback of
                `observed` steps; the ranks must go on at step 1;
    rank kill:  the restarted rank attaches at step N; lost = max(0, observed - (N - 1)).
  Committed steps lost must be 0. At the end /dev/shm holds no file of the instance, the sizes of
  its segments during training were the same at the first and last loop, the open fds of this
  process and of hostd (first vs last incarnation, both with two ranks training, sampled while
  no checkpoint file is open) are unchanged, and keep_last bounds the checkpoint directory:
  after the stop (the last hostd committed checkpoints, pruning after each) it holds keep_last
  committed checkpoints and no interrupted write older than the newest. During the loop it may
  hold more (figures checkpoints_on_disk_max, checkpoint_partial_dirs_max, checkpoint_dir_bytes_*,
  sampled at each kill): a commit prunes the committed checkpoints beyond keep_last and the
  interrupted writes older than itself, so a kill between a commit and its pruning leaves an
  extra committed one, and each hostd killed before its first commit leaves its write in
  progress, until the next commit. One JSON line with the figures goes to stdout.
- test_adoption_is_bit_exact: train 4 steps, kill -9 hostd between steps, restart it, train to
  step 8: every layer's checksum equals native_reference's after 8 uninterrupted steps.
- test_checkpoint_restore_is_bit_exact: train 4 steps with a checkpoint every 2, kill -9 hostd,
  leave a layer mid-update in the control segment, restart hostd: it restores step 4's
  checkpoint (the ranks attach at 5); train to step 8: every layer's checksum equals
  native_reference's after 8 uninterrupted steps.
- test_inconsistent_state_refused_then_fresh: a layer left mid-update (pending != committed,
  written into the control segment of a killed hostd) makes hostd refuse the job with
  recovery_on_inconsistent refuse (naming the layer and versions), and start fresh with fresh.
"""
import json
import mmap
import os
import random
import re
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import HostdProcess, ctl_json  # noqa: E402

HOSTD = SLIDEDPCTL = TRAINER = REFERENCE = None
LOOPS = 100
LAYERS, DIM, BATCH, CHUNK_BYTES, SEED = 4, 64, 16, 4096, 3
# proto/shm_abi.h: kLayerControlOffset = kHeaderBytes + sizeof(ControlBlock) + 64 * sizeof(RankSlot)
LAYER_CONTROL_OFFSET = 4096 + 128 + 64 * 64
LAYER_CONTROL_BYTES = 128

STEP_RE = re.compile(r"^rank (\d+) step +(\d+) ", re.M)
ATTACH_RE = re.compile(r"^rank (\d+)(?:/\d+)?: (?:re-)?attached at step (\d+)", re.M)
ADOPT_RE = re.compile(r"re-adopted job default at step (\d+)")
FRESH_RE = re.compile(r"starting job default fresh at step 0")
# hostd/engine.cc, after a restore (the recovery of an inconsistent state, or --resume).
RESTORE_RE = re.compile(r"resumed from checkpoint (\S+) \(step (\d+),")
# model/checkpoint_format.h: <dir>/step-<t zero-padded to 12>.<instance>.<job>[.tmp]/ (formats
# 1 and 2: step-<t>[.tmp]/), the commit marker COMMITTED written last, holding
# "slidedp-checkpoint <format> step <t> meta_xxh64 <hex>".
CKPT_DIR_RE = re.compile(r"^step-(\d+)(?:\.[A-Za-z0-9_~-]+\.[A-Za-z0-9_~-]+)?(\.tmp)?$")
CKPT_MARKER = "COMMITTED"
# Formats 1 to 3 (hostd writes 3 since checkpoints name their instance and job).
CKPT_MARKER_RE = re.compile(r"^slidedp-checkpoint [123] step (\d+) meta_xxh64 [0-9a-f]{1,16}\n$")
CKPT_EVERY, CKPT_KEEP = 5, 2


def common_flags():
    return ["--layers", str(LAYERS), "--dim", str(DIM), "--batch", str(BATCH), "--seed", str(SEED)]


def fd_count(pid="self"):
    return len(os.listdir(f"/proc/{pid}/fd"))


def read(path):
    try:
        with open(path) as f:
            return f.read()
    except FileNotFoundError:
        return ""


def dir_bytes(path):
    total = 0
    for root, _, files in os.walk(path):
        for n in files:
            try:
                total += os.stat(os.path.join(root, n)).st_size
            except FileNotFoundError:
                pass
    return total


def committed_checkpoint(path, step):
    """True when the step directory `path` of step `step` is a committed checkpoint, checked
    independently of hostd's reader: the marker names step `step`, meta.json is of step `step`,
    and every layer file it lists exists with its size (the XXH3 checksums are not checked)."""
    try:
        m = CKPT_MARKER_RE.match(read(os.path.join(path, CKPT_MARKER)))
        if not m or int(m.group(1)) != step:
            return False
        meta = json.loads(read(os.path.join(path, "meta.json")))
        if meta.get("step") != step or not meta.get("files"):
            return False
        return all(os.stat(os.path.join(path, f["name"])).st_size == f["size_bytes"]
                   for f in meta["files"])
    except (FileNotFoundError, ValueError):  # pruned while being read, or a partial meta.json
        return False


def scan_checkpoints(ckpt_dir):
    """{"committed": {step: bytes}, "other": {name: bytes}} for the step directories of
    ckpt_dir: committed checkpoints, and the rest (step-<t>.tmp, step-<t> without its marker)."""
    out = {"committed": {}, "other": {}}
    try:
        names = os.listdir(ckpt_dir)
    except FileNotFoundError:
        return out
    for n in names:
        m = CKPT_DIR_RE.match(n)
        path = os.path.join(ckpt_dir, n)
        if not m or not os.path.isdir(path):
            continue
        if not m.group(2) and committed_checkpoint(path, int(m.group(1))):
            out["committed"][int(m.group(1))] = dir_bytes(path)
        else:
            out["other"][n] = dir_bytes(path)
    return out


class Harness:
    def __init__(self, tmp, instance, policy="checkpoint", ckpt_every=0, ckpt_keep=CKPT_KEEP):
        self.tmp, self.instance, self.policy = tmp, instance, policy
        self.ckpt_dir = os.path.join(tmp, "ckpt")
        self.ckpt_every, self.ckpt_keep = ckpt_every, ckpt_keep
        self.sock = os.path.join(tmp, "hostd.sock")
        self.hostd = None
        self.hostd_logs = []
        self.ranks = {}
        self.rank_logs = {0: [], 1: []}

    def start_hostd(self):
        """hostd on the one instance and socket, not waited for (the ranks re-attach); what a
        killed one left in /dev/shm stays for it to adopt."""
        name = f"hostd-{len(self.hostd_logs)}.log"
        self.hostd_logs.append(os.path.join(self.tmp, name))
        self.hostd = HostdProcess(
            HOSTD, "--model", "none", "--world_size", "2", "--mlock", "best_effort",
            "--update_threads", "1", "--heartbeat_interval_ms", "100",
            "--heartbeat_deadline_ms", "1000", "--recovery_on_inconsistent", self.policy,
            *(["--checkpoint.dir", self.ckpt_dir, "--checkpoint.every_steps",
               str(self.ckpt_every), "--checkpoint.keep_last", str(self.ckpt_keep)]
              if self.ckpt_every else []),
            tmp=self.tmp, instance=self.instance, socket=self.sock, log_name=name,
            wait_ready=False).start()

    def hostd_log(self):
        return read(self.hostd_logs[-1])

    def start_rank(self, r, steps, reattach=True):
        path = os.path.join(self.tmp, f"rank{r}-{len(self.rank_logs[r])}.log")
        self.rank_logs[r].append(path)
        cmd = ([TRAINER, "--socket", self.sock, "--rank", str(r), "--world-size", "2",
                "--steps", str(steps), "--chunk-bytes", str(CHUNK_BYTES), "--create-job",
                "--timeout-ms", "20000"] + common_flags() +
               (["--reattach-ms", "60000"] if reattach else []))
        with open(path, "w") as log:
            self.ranks[r] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)

    def rank_text(self, r, last_only=False):
        logs = self.rank_logs[r][-1:] if last_only else self.rank_logs[r]
        return "".join(read(p) for p in logs)

    def observed_by(self, r):
        """The last step rank r saw complete since its last (re-)attach (attach step - 1 when it
        completed none yet), from its newest log that says; 0 before any attach."""
        for path in reversed(self.rank_logs[r]):
            text = read(path)
            attaches = list(ATTACH_RE.finditer(text))
            if not attaches:
                continue
            last = attaches[-1]
            steps = [int(m.group(2)) for m in STEP_RE.finditer(text, last.end())]
            return steps[-1] if steps else int(last.group(2)) - 1
        return 0

    def observed(self):
        """The highest step a rank saw complete in the current run of steps (after a fresh
        restart the old, rolled-back steps no longer count)."""
        return max(self.observed_by(r) for r in (0, 1))

    def attach_steps(self, r):
        return [int(m.group(2)) for m in ATTACH_RE.finditer(self.rank_text(r, last_only=True))]

    def wait_for(self, what, pred, timeout=60):
        deadline = time.time() + timeout
        while True:
            got = pred()
            if got:
                return got
            for r, p in self.ranks.items():
                if p.poll() is not None and p.returncode not in (0, -signal.SIGKILL):
                    raise AssertionError(f"rank {r} exited {p.returncode}:\n"
                                         f"{self.rank_text(r, last_only=True)[-3000:]}")
            if self.hostd.poll() is not None and self.hostd.returncode != -signal.SIGKILL:
                raise AssertionError(f"hostd exited {self.hostd.returncode}:\n"
                                     f"{self.hostd_log()[-3000:]}")
            if time.time() > deadline:
                raise AssertionError(f"timed out waiting for {what}; hostd log:\n"
                                     f"{self.hostd_log()[-2000:]}\nrank logs:\n" +
                                     "\n".join(self.rank_text(r, True)[-1500:] for r in (0, 1)))
            time.sleep(0.01)

    def hostd_fds(self):
        """hostd's open fds, counted while none is in the checkpoint directory (a checkpoint in
        flight holds a file or directory there for a few ms); after 3 s of trying, the count
        with them (an fd leaked there then shows as a difference)."""
        deadline = time.time() + 3
        while True:
            fd_dir = f"/proc/{self.hostd.pid}/fd"
            targets = []
            for n in os.listdir(fd_dir):
                try:
                    targets.append(os.readlink(os.path.join(fd_dir, n)))
                except FileNotFoundError:
                    pass
            if not any(t.startswith(self.ckpt_dir) for t in targets) or time.time() > deadline:
                return len(targets)
            time.sleep(0.002)

    def instance_files(self):
        out = {}
        for n in os.listdir("/dev/shm"):
            if n.startswith(f"slidedp.{self.instance}."):
                try:
                    out[n] = os.stat(os.path.join("/dev/shm", n)).st_size
                except FileNotFoundError:
                    pass
        return out

    def stop(self):
        for p in self.ranks.values():
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)
        if self.hostd is not None and self.hostd.poll() is None:
            self.hostd.send_signal(signal.SIGTERM)
            return self.hostd.wait(timeout=60)
        return None

    def layers(self):
        return ctl_json(SLIDEDPCTL, "layers", "--checksums", socket=self.sock, timeout=30)


def reference_checksums(world, steps, out):
    subprocess.run([REFERENCE, "--world-size", str(world), "--steps", str(steps), "--out", out] +
                   common_flags(), check=True, capture_output=True, timeout=300)
    with open(out) as f:
        return {l["layer"]: l["checksum"] for l in json.load(f)["layers"]}


class KillLoopTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="slidedp-killloop-")
        self.instance = f"kl{os.getpid()}{self._testMethodName[-6:]}"
        self.h = None

    def tearDown(self):
        if self.h is not None:
            self.h.stop()
            self.h = None
        subprocess.run([SLIDEDPCTL, "cleanup", "--instance", self.instance],
                       capture_output=True, timeout=30)

    def test_kill_loop(self):
        rng = random.Random(int(os.environ.get("SLIDEDP_KILL_SEED", "20261129")))
        test_fds_before = fd_count()
        shm_total_before = sum(os.stat(os.path.join("/dev/shm", n)).st_size
                               for n in os.listdir("/dev/shm")
                               if os.path.isfile(os.path.join("/dev/shm", n)))
        self.assertEqual(Harness(self.tmp, self.instance).instance_files(), {})
        h = self.h = Harness(self.tmp, self.instance, ckpt_every=CKPT_EVERY)
        h.start_hostd()
        for r in (0, 1):
            h.start_rank(r, 10**9)
        # Steady state before the first loop: keep_last checkpoints committed.
        h.wait_for("first checkpoints",
                   lambda: len(scan_checkpoints(h.ckpt_dir)["committed"]) >= CKPT_KEEP)
        segments = lambda: {n: b for n, b in h.instance_files().items()
                            if not n.endswith(".lock")}
        seg_first = segments()
        hostd_fds_first = h.hostd_fds()
        stats = {"loops": 0, "hostd_kills": 0, "rank_kills": 0, "adoptions": 0,
                 "restores_from_checkpoint": 0, "fresh_restarts": 0,
                 "checkpoint_rolled_back_steps": 0, "checkpoint_rolled_back_steps_max": 0,
                 "fresh_rolled_back_steps": 0,
                 "committed_steps_lost": 0}
        problems = []  # wrong restore decisions, each with the hostd log lines that show it
        ckpt_samples = []  # scan_checkpoints() once per loop, at the kill
        t0 = time.time()
        for loop in range(LOOPS):
            progress_from = h.observed()
            h.wait_for(f"progress in loop {loop}", lambda: h.observed() > progress_from)
            time.sleep(rng.uniform(0, 0.04))
            victim = rng.choice(["hostd", "hostd", "rank0", "rank1"])
            if victim == "hostd":
                stats["hostd_kills"] += 1
                h.hostd.kill()
                h.hostd.wait()
                time.sleep(0.02)  # let ranks print what they saw complete
                observed = h.observed()
                # No hostd runs: the directory is what the new one will find.
                ckpts = scan_checkpoints(h.ckpt_dir)
                ckpt_samples.append(ckpts)
                newest = max(ckpts["committed"], default=None)
                h.start_hostd()
                m = h.wait_for("hostd's recovery decision",
                               lambda: ADOPT_RE.search(h.hostd_log()) or
                               RESTORE_RE.search(h.hostd_log()) or
                               FRESH_RE.search(h.hostd_log()))
                if m.re is ADOPT_RE:
                    stats["adoptions"] += 1
                    t = int(m.group(1))
                    stats["committed_steps_lost"] += max(0, observed - t)
                    resume = t + 1
                elif m.re is RESTORE_RE:
                    stats["restores_from_checkpoint"] += 1
                    c = int(m.group(2))
                    want_path = os.path.join(h.ckpt_dir, f"step-{c:012d}.{h.instance}.default")
                    if newest is None or c != newest or m.group(1) != want_path:
                        stats["committed_steps_lost"] += max(0, (newest or 0) - c)
                        problems.append(
                            f"loop {loop}: restored {m.group(1)} (step {c}), the newest "
                            f"committed checkpoint on disk was {newest}; on disk: {ckpts}; "
                            f"log: {m.group(0)}")
                    stats["checkpoint_rolled_back_steps"] += max(0, observed - c)
                    stats["checkpoint_rolled_back_steps_max"] = max(
                        stats["checkpoint_rolled_back_steps_max"], observed - c)
                    resume = c + 1
                else:
                    stats["fresh_restarts"] += 1
                    stats["fresh_rolled_back_steps"] += observed
                    if newest is not None:
                        stats["committed_steps_lost"] += newest
                        problems.append(
                            f"loop {loop}: started fresh although checkpoint {newest} was "
                            f"committed; on disk: {ckpts}; log: "
                            f"{[l for l in h.hostd_log().splitlines() if 'recovery' in l]}")
                    resume = 1
                for r in (0, 1):
                    h.wait_for(f"rank {r} re-attached",
                               lambda: any(s == resume for s in h.attach_steps(r)[-1:]) and
                               h.attach_steps(r))
            else:
                r = int(victim[-1])
                stats["rank_kills"] += 1
                h.ranks[r].kill()
                h.ranks[r].wait()
                observed = h.observed()
                ckpt_samples.append(scan_checkpoints(h.ckpt_dir))
                h.start_rank(r, 10**9)
                n = h.wait_for(f"rank {r} attached", lambda: h.attach_steps(r))[0]
                stats["committed_steps_lost"] += max(0, observed - (n - 1))
            stats["loops"] += 1
        # A checkpoint committed (and the older ones pruned) after the last loop.
        last_from = h.observed()
        h.wait_for("progress and a checkpoint after the last loop",
                   lambda: h.observed() > last_from + 1 and
                   max(scan_checkpoints(h.ckpt_dir)["committed"], default=0) > last_from)
        seg_last = segments()
        hostd_fds_last = h.hostd_fds()
        self.assertEqual(h.stop(), 0, h.hostd_log()[-2000:])
        self.h = None
        left = Harness(self.tmp, self.instance).instance_files()
        ckpt_after = scan_checkpoints(h.ckpt_dir)
        test_fds_after = fd_count()
        shm_total_after = sum(os.stat(os.path.join("/dev/shm", n)).st_size
                              for n in os.listdir("/dev/shm")
                              if os.path.isfile(os.path.join("/dev/shm", n)))
        ckpt_bytes = max(b for c in ckpt_samples + [ckpt_after] for b in c["committed"].values())
        total = lambda c: sum(c["committed"].values()) + sum(c["other"].values())
        newest_after = max(ckpt_after["committed"], default=0)
        stale_after = [n for n in ckpt_after["other"]
                       if int(CKPT_DIR_RE.match(n).group(1)) < newest_after]
        stats.update({
            "seconds": round(time.time() - t0, 1),
            "instance_shm_bytes_first_loop": sum(seg_first.values()),
            "instance_shm_bytes_last_loop": sum(seg_last.values()),
            "instance_shm_files_after_stop": len(left),
            "dev_shm_total_bytes_before": shm_total_before,
            "dev_shm_total_bytes_after": shm_total_after,
            "test_fds_before": test_fds_before, "test_fds_after": test_fds_after,
            "hostd_fds_first": hostd_fds_first, "hostd_fds_last": hostd_fds_last,
            "checkpoint_every_steps": CKPT_EVERY, "checkpoint_keep_last": CKPT_KEEP,
            "checkpoint_bytes": ckpt_bytes,
            "checkpoints_on_disk_max": max(len(c["committed"]) for c in ckpt_samples),
            "checkpoint_partial_dirs_max": max(len(c["other"]) for c in ckpt_samples),
            "checkpoint_dir_bytes_first_loop": total(ckpt_samples[0]),
            "checkpoint_dir_bytes_last_loop": total(ckpt_samples[-1]),
            "checkpoint_dir_bytes_max": max(total(c) for c in ckpt_samples),
            "checkpoint_dir_bytes_after_stop": total(ckpt_after),
            "checkpoints_after_stop": sorted(ckpt_after["committed"]),
            "checkpoint_partial_dirs_after_stop": sorted(ckpt_after["other"]),
        })
        print(json.dumps(stats), flush=True)
        self.assertEqual(problems, [])
        self.assertEqual(stats["committed_steps_lost"], 0, stats)
        self.assertEqual(stats["loops"], LOOPS)
        self.assertEqual(seg_first, seg_last)
        self.assertEqual(left, {}, "files of the instance left in /dev/shm")
        self.assertEqual(test_fds_before, test_fds_after)
        self.assertEqual(hostd_fds_first, hostd_fds_last)
        # keep_last bounds the directory: the last hostd committed checkpoints (and pruned after
        # each), so after the stop it holds keep_last committed checkpoints and no interrupted
        # write older than the newest, whatever the loops left there.
        self.assertEqual(len(ckpt_after["committed"]), CKPT_KEEP, ckpt_after)
        self.assertEqual(stale_after, [], ckpt_after)
        self.assertLessEqual(sum(ckpt_after["committed"].values()), CKPT_KEEP * ckpt_bytes)
        shutil.rmtree(h.ckpt_dir)  # kept when the test fails

    def test_adoption_is_bit_exact(self):
        h = self.h = Harness(self.tmp, self.instance)
        h.start_hostd()
        for r in (0, 1):
            h.start_rank(r, 4, reattach=False)
        for r in (0, 1):
            self.assertEqual(h.ranks[r].wait(timeout=120), 0, h.rank_text(r))
        h.hostd.kill()  # between steps: every layer at version 4
        h.hostd.wait()
        self.assertEqual(len([n for n in h.instance_files() if not n.endswith(".lock")]), 4)
        h.start_hostd()
        for r in (0, 1):
            h.start_rank(r, 8, reattach=False)
        for r in (0, 1):
            self.assertEqual(h.ranks[r].wait(timeout=120), 0, h.rank_text(r))
            self.assertEqual(h.attach_steps(r), [5])
        self.assertRegex(h.hostd_log(), "re-adopted job default at step 4")
        want = reference_checksums(2, 8, os.path.join(self.tmp, "ref.json"))
        for l in h.layers():
            self.assertEqual(l["version"], 8, l)
            self.assertEqual(l["checksum"], want[l["layer"]], f"layer {l['layer']} differs")
        self.assertEqual(h.stop(), 0)
        self.h = None
        self.assertEqual(Harness(self.tmp, self.instance).instance_files(), {})

    def test_checkpoint_restore_is_bit_exact(self):
        h = self.h = Harness(self.tmp, self.instance, ckpt_every=2)
        h.start_hostd()
        # Two steps, then two more: hostd skips a periodic checkpoint while the previous one is
        # being written, so step 2's must have committed before step 4 completes. Each commits
        # after its step completed (the ranks may have exited by then).
        for steps in (2, 4):
            for r in (0, 1):
                h.start_rank(r, steps, reattach=False)
            for r in (0, 1):
                self.assertEqual(h.ranks[r].wait(timeout=120), 0, h.rank_text(r, last_only=True))
            h.wait_for(f"the checkpoint of step {steps}",
                       lambda: steps in scan_checkpoints(h.ckpt_dir)["committed"])
        h.hostd.kill()
        h.hostd.wait()
        self.assertEqual(sorted(scan_checkpoints(h.ckpt_dir)["committed"]), [2, 4])
        # What a kill in the middle of layer 2's update of step 5 leaves: pending 5, committed
        # 4; not adoptable, so hostd restores the newest checkpoint (step 4).
        self.leave_mid_update(layer=2, committed=4)
        h.start_hostd()
        for r in (0, 1):
            h.start_rank(r, 8, reattach=False)
        for r in (0, 1):
            self.assertEqual(h.ranks[r].wait(timeout=120), 0, h.rank_text(r, last_only=True))
            self.assertEqual(h.attach_steps(r), [5])
        log = h.hostd_log()
        self.assertIn("restore_checkpoint: mid-update or torn: layer 2 (pending version 5, "
                      "committed 4)", log)
        self.assertEqual([(m.group(1), m.group(2)) for m in RESTORE_RE.finditer(log)],
                         [(os.path.join(h.ckpt_dir, f"step-000000000004.{h.instance}.default"),
                           "4")])
        self.assertNotRegex(log, ADOPT_RE)
        want = reference_checksums(2, 8, os.path.join(self.tmp, "ref.json"))
        for l in h.layers():
            self.assertEqual(l["version"], 8, l)
            self.assertEqual(l["checksum"], want[l["layer"]], f"layer {l['layer']} differs")
        self.assertEqual(h.stop(), 0)
        self.h = None
        self.assertEqual(Harness(self.tmp, self.instance).instance_files(), {})
        shutil.rmtree(h.ckpt_dir)  # kept when the test fails

    def leave_mid_update(self, layer, committed):
        """Writes into the control segment of a killed hostd what a kill in the middle of
        `layer`'s update of step committed + 1 leaves: pending committed + 1."""
        with open(f"/dev/shm/slidedp.{self.instance}.control", "r+b") as f:
            mm = mmap.mmap(f.fileno(), 0)
            off = LAYER_CONTROL_OFFSET + layer * LAYER_CONTROL_BYTES
            self.assertEqual(struct.unpack_from("<QQ", mm, off), (committed, committed))
            struct.pack_into("<Q", mm, off + 8, committed + 1)
            mm.close()

    def test_inconsistent_state_refused_then_fresh(self):
        h = self.h = Harness(self.tmp, self.instance, policy="refuse")
        h.start_hostd()
        for r in (0, 1):
            h.start_rank(r, 3, reattach=False)
        for r in (0, 1):
            self.assertEqual(h.ranks[r].wait(timeout=120), 0, h.rank_text(r))
        h.hostd.kill()
        h.hostd.wait()
        # What a kill in the middle of layer 1's update of step 4 leaves: pending 4, committed 3.
        self.leave_mid_update(layer=1, committed=3)
        h.start_hostd()
        h.start_rank(0, 3, reattach=False)
        self.assertNotEqual(h.ranks[0].wait(timeout=120), 0)
        out = h.rank_text(0, last_only=True)
        self.assertIn("FAILED_PRECONDITION", out)
        self.assertIn("layer 1 (pending version 4, committed 3)", out)
        self.assertTrue(h.instance_files(), "refuse must leave the state for inspection")
        self.assertEqual(h.stop(), 0)
        h.hostd = None
        h.policy = "fresh"
        h.start_hostd()
        for r in (0, 1):
            h.start_rank(r, 2, reattach=False)
        for r in (0, 1):
            self.assertEqual(h.ranks[r].wait(timeout=120), 0, h.rank_text(r, last_only=True))
            self.assertEqual(h.attach_steps(r), [1])
        self.assertRegex(h.hostd_log(), "starting job default fresh at step 0")
        self.assertEqual(h.stop(), 0)
        self.h = None
        self.assertEqual(Harness(self.tmp, self.instance).instance_files(), {})


if __name__ == "__main__":
    HOSTD, SLIDEDPCTL, TRAINER, REFERENCE = sys.argv[1:5]
    if len(sys.argv) > 5:
        LOOPS = int(sys.argv[5])
    del sys.argv[1:]
    unittest.main(verbosity=2)
