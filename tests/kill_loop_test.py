#!/usr/bin/env python3
"""Crash re-adoption through a real hostd: kill -9 loops, bit-exactness after adoption, refuse/fresh.

Usage: kill_loop_test.py HOSTD SLIDEDPCTL NATIVE_TRAINER NATIVE_REFERENCE [LOOPS]

- test_kill_loop: two native_trainer ranks (--reattach-ms) train a tiny MLP through hostd. LOOPS
  times (default 100): after the ranks made progress, wait a random 0-40 ms (mid-update included),
  then kill -9 hostd (half the loops) or one rank, restart what was killed, and let the ranks
  re-attach. Definitions, checked per kill:
    observed  = the highest step whose completion (WaitStep OK) a rank printed before the kill
                (read after the victim died, so nothing it saw is missed);
    hostd kill, state re-adopted at step T ("re-adopted job default at step T" in the new hostd's
                log): lost = max(0, observed - T); the ranks must go on at T + 1;
    hostd kill, state not adoptable (a layer mid-update, layers at different versions): hostd
                logs "starting job default fresh" (recovery_on_inconsistent checkpoint, and there
                is no checkpoint yet); that is counted as a rollback of `observed` steps, not as a
                loss, and the ranks must go on at step 1;
    rank kill:  the restarted rank attaches at step N; lost = max(0, observed - (N - 1)).
  Committed steps lost must be 0. At the end /dev/shm holds no file of the instance, the sizes of
  its segments during training were the same at the first and last loop, and the open fds of this
  process and of hostd (first vs last incarnation, both with two ranks training) are unchanged.
  One JSON line with the figures goes to stdout.
- test_adoption_is_bit_exact: train 4 steps, kill -9 hostd between steps, restart it, train to
  step 8: every layer's checksum equals native_reference's after 8 uninterrupted steps.
- test_inconsistent_state_refused_then_fresh: a layer left mid-update (pending != committed,
  written into the control segment of a killed hostd) makes hostd refuse the job with
  recovery_on_inconsistent refuse (naming the layer and versions), and start fresh with fresh.
"""
import json
import mmap
import os
import random
import re
import signal
import struct
import subprocess
import sys
import tempfile
import time
import unittest

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


class Harness:
    def __init__(self, tmp, instance, policy="checkpoint"):
        self.tmp, self.instance, self.policy = tmp, instance, policy
        self.sock = os.path.join(tmp, "hostd.sock")
        self.hostd = None
        self.hostd_logs = []
        self.ranks = {}
        self.rank_logs = {0: [], 1: []}

    def start_hostd(self):
        path = os.path.join(self.tmp, f"hostd-{len(self.hostd_logs)}.log")
        self.hostd_logs.append(path)
        with open(path, "w") as log:
            self.hostd = subprocess.Popen(
                [HOSTD, "--model", "none", "--world_size", "2", "--socket", self.sock,
                 "--instance", self.instance, "--mlock", "best_effort", "--update_threads", "1",
                 "--heartbeat_interval_ms", "100", "--heartbeat_deadline_ms", "1000",
                 "--recovery_on_inconsistent", self.policy],
                stdout=log, stderr=subprocess.STDOUT)

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
        r = subprocess.run([SLIDEDPCTL, "--socket", self.sock, "layers", "--json", "--checksums"],
                           capture_output=True, text=True, timeout=30)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)


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
        h = self.h = Harness(self.tmp, self.instance)
        h.start_hostd()
        for r in (0, 1):
            h.start_rank(r, 10**9)
        h.wait_for("first steps", lambda: h.observed() >= 3)
        segments = lambda: {n: b for n, b in h.instance_files().items()
                            if not n.endswith(".lock")}
        seg_first = segments()
        hostd_fds_first = fd_count(h.hostd.pid)
        stats = {"loops": 0, "hostd_kills": 0, "rank_kills": 0, "adoptions": 0,
                 "fresh_restarts": 0, "rolled_back_steps": 0, "committed_steps_lost": 0}
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
                h.start_hostd()
                m = h.wait_for("hostd's recovery decision",
                               lambda: ADOPT_RE.search(h.hostd_log()) or
                               FRESH_RE.search(h.hostd_log()))
                if m.re is ADOPT_RE:
                    stats["adoptions"] += 1
                    t = int(m.group(1))
                    stats["committed_steps_lost"] += max(0, observed - t)
                    resume = t + 1
                else:
                    stats["fresh_restarts"] += 1
                    stats["rolled_back_steps"] += observed
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
                h.start_rank(r, 10**9)
                n = h.wait_for(f"rank {r} attached", lambda: h.attach_steps(r))[0]
                stats["committed_steps_lost"] += max(0, observed - (n - 1))
            stats["loops"] += 1
        last_from = h.observed()
        h.wait_for("progress after the last loop", lambda: h.observed() > last_from + 1)
        seg_last = segments()
        hostd_fds_last = fd_count(h.hostd.pid)
        self.assertEqual(h.stop(), 0, h.hostd_log()[-2000:])
        self.h = None
        left = Harness(self.tmp, self.instance).instance_files()
        test_fds_after = fd_count()
        shm_total_after = sum(os.stat(os.path.join("/dev/shm", n)).st_size
                              for n in os.listdir("/dev/shm")
                              if os.path.isfile(os.path.join("/dev/shm", n)))
        stats.update({
            "seconds": round(time.time() - t0, 1),
            "instance_shm_bytes_first_loop": sum(seg_first.values()),
            "instance_shm_bytes_last_loop": sum(seg_last.values()),
            "instance_shm_files_after_stop": len(left),
            "dev_shm_total_bytes_before": shm_total_before,
            "dev_shm_total_bytes_after": shm_total_after,
            "test_fds_before": test_fds_before, "test_fds_after": test_fds_after,
            "hostd_fds_first": hostd_fds_first, "hostd_fds_last": hostd_fds_last,
        })
        print(json.dumps(stats), flush=True)
        self.assertEqual(stats["committed_steps_lost"], 0, stats)
        self.assertEqual(stats["loops"], LOOPS)
        self.assertEqual(seg_first, seg_last)
        self.assertEqual(left, {}, "files of the instance left in /dev/shm")
        self.assertEqual(test_fds_before, test_fds_after)
        self.assertEqual(hostd_fds_first, hostd_fds_last)

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
        with open(f"/dev/shm/slidedp.{self.instance}.control", "r+b") as f:
            mm = mmap.mmap(f.fileno(), 0)
            off = LAYER_CONTROL_OFFSET + 1 * LAYER_CONTROL_BYTES
            committed, pending = struct.unpack_from("<QQ", mm, off)
            self.assertEqual((committed, pending), (3, 3))
            struct.pack_into("<Q", mm, off + 8, 4)
            mm.close()
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
