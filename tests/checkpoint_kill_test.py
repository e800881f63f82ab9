#!/usr/bin/env python3
"""R4: kill -9 hostd at random moments while it writes checkpoints; the previous one still loads.

A chain of KILLS rounds on one instance and one checkpoint directory. Each round starts hostd
(--model none, --resume DIR from the second round on, checkpoint.every_steps 1, keep_last 2)
and one native_trainer rank on a 6 x 1024 MLP (75 MB per checkpoint), so hostd is writing a
checkpoint most of the time; after a random delay hostd gets SIGKILL (and the trainer too).
Then:
  - `slidedpctl checkpoints --dir DIR --verify` must show at least one valid checkpoint, and
    every committed one must verify (sizes and xxh64 of every file);
  - the next round's hostd must resume from the newest valid one (its status reports that step),
    which is the proof that it loads; the last round does the same with a plain start.
A round whose kill left a .tmp directory or an unmarked step directory hit a write in progress;
the test reports how many did and requires some.

Usage: checkpoint_kill_test.py HOSTD SLIDEDPCTL [NATIVE_TRAINER]
(NATIVE_TRAINER defaults to the native_trainer next to hostd's build tree.)
Python standard library only.
"""
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest

HOSTD = SLIDEDPCTL = TRAINER = None
KILLS = int(os.environ.get("SLIDEDP_CKPT_KILLS", "24"))
MODEL = ["--layers", "6", "--dim", "1024", "--batch", "8"]


def shm_names(instance):
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"slidedp.{instance}."))


class CheckpointKillTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="slidedp-ckill-")
        self.dir = os.path.join(self.tmp, "ckpt")
        self.instance = f"ckill{os.getpid()}"
        self.socket = os.path.join(self.tmp, "h.sock")
        self.procs = []

    def tearDown(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for n in shm_names(self.instance):
            os.unlink(os.path.join("/dev/shm", n))
        shutil.rmtree(self.tmp, ignore_errors=True)

    def listing(self):
        r = subprocess.run([SLIDEDPCTL, "checkpoints", "--dir", self.dir, "--verify", "--json"],
                           capture_output=True, text=True, timeout=120)
        self.assertEqual(r.returncode, 0, r.stderr)
        return json.loads(r.stdout)

    def start_hostd(self, resume, log):
        cmd = [HOSTD, "--model", "none", "--world_size", "1", "--socket", self.socket,
               "--instance", self.instance, "--mlock", "best_effort", "--update_threads", "1",
               "--checkpoint.dir", self.dir, "--checkpoint.every_steps", "1",
               "--checkpoint.keep_last", "2", "--checkpoint.on_stop", "false"]
        if resume:
            cmd += ["--resume", self.dir]
        if os.path.exists(self.socket):
            os.unlink(self.socket)  # left by the killed hostd; hostd would remove it too
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        self.procs.append(p)
        deadline = time.time() + 60
        while not os.path.exists(self.socket):
            if p.poll() is not None or time.time() > deadline:
                log.seek(0)
                self.fail(f"hostd did not start (rc {p.poll()}): {log.read()[-3000:]}")
            time.sleep(0.02)
        return p

    def status_step(self):
        r = subprocess.run([SLIDEDPCTL, "--socket", self.socket, "status", "--json"],
                           capture_output=True, text=True, timeout=60)
        self.assertEqual(r.returncode, 0, r.stderr)
        job = json.loads(r.stdout).get("job") or {}
        return int(job.get("step", 0)), job

    def test_kill_during_checkpoint_writes(self):
        rng = random.Random(int(os.environ.get("SLIDEDP_CKPT_SEED", "1234")))
        t0 = time.time()
        hits = 0
        expected_step = None
        for k in range(KILLS + 1):
            log = open(os.path.join(self.tmp, f"hostd{k}.log"), "w+")
            hostd = self.start_hostd(resume=k > 0, log=log)
            if expected_step is not None:
                # Loads: the resumed job is at the newest valid checkpoint's step.
                step, job = self.status_step()
                self.assertEqual(step, expected_step, job)
            if k == KILLS:
                hostd.send_signal(signal.SIGTERM)
                hostd.wait(timeout=60)
                log.close()
                break
            trainer = subprocess.Popen(
                [TRAINER, "--socket", self.socket, "--rank", "0", "--world-size", "1",
                 "--steps", "100000", "--create-job", "--timeout-ms", "20000", *MODEL],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            self.procs.append(trainer)
            if k == 0:  # the chain needs a first committed checkpoint to fall back on
                deadline = time.time() + 60
                while int(self.status_step()[1].get("last_checkpoint_step", 0)) == 0:
                    self.assertLess(time.time(), deadline, "no first checkpoint within 60 s")
                    time.sleep(0.05)
            time.sleep(rng.uniform(0.3, 1.5))
            hostd.send_signal(signal.SIGKILL)
            hostd.wait()
            trainer.kill()
            trainer.wait()
            log.close()
            entries = self.listing()
            valid = [e for e in entries if e["valid"]]
            self.assertTrue(valid, f"kill {k}: no valid checkpoint left: {entries}")
            for e in entries:
                if not e["temporary"] and "marker" not in e["reason"] and not e["valid"]:
                    self.fail(f"kill {k}: a committed checkpoint does not verify: {e}")
            if any(not e["valid"] for e in entries):
                hits += 1
            expected_step = max(int(e["step"]) for e in valid)
        self.assertEqual(shm_names(self.instance), [])
        print(f"{KILLS} kills in {time.time() - t0:.1f} s; {hits} left an interrupted write "
              f"behind; the newest valid checkpoint loaded every time (last: step "
              f"{expected_step})", flush=True)
        self.assertGreater(hits, 0, "no kill landed in a checkpoint write")


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit("usage: checkpoint_kill_test.py HOSTD SLIDEDPCTL [NATIVE_TRAINER]")
    HOSTD, SLIDEDPCTL = sys.argv[1:3]
    rest = sys.argv[3:]
    if rest and not rest[0].startswith("-"):
        TRAINER = rest.pop(0)
    else:
        TRAINER = os.path.join(os.path.dirname(os.path.dirname(HOSTD)), "examples",
                               "native_trainer", "native_trainer")
    unittest.main(argv=sys.argv[:1] + rest, verbosity=2)
