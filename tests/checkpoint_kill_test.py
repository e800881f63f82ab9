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
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import HostdProcess, ctl_json, shm_names  # noqa: E402

HOSTD = SLIDEDPCTL = TRAINER = None
KILLS = int(os.environ.get("SLIDEDP_CKPT_KILLS", "24"))
MODEL = ["--layers", "6", "--dim", "1024", "--batch", "8"]


class CheckpointKillTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="slidedp-ckill-")
        self.dir = os.path.join(self.tmp, "ckpt")
        self.instance = f"ckill{os.getpid()}"
        self.socket = os.path.join(self.tmp, "h.sock")
        self.procs = []
        self.hostds = []

    def tearDown(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for h in self.hostds:
            h.abort()  # killed if still running; the instance's segments removed
        shutil.rmtree(self.tmp, ignore_errors=True)

    def listing(self):
        return ctl_json(SLIDEDPCTL, "checkpoints", "--dir", self.dir, "--verify", timeout=120)

    def start_hostd(self, resume, k):
        """Round k's hostd on the one instance and socket (a killed one's socket is replaced);
        the segments a SIGKILL leaves stay for the next round."""
        args = ["--model", "none", "--world_size", "1", "--mlock", "best_effort",
                "--update_threads", "1", "--checkpoint.dir", self.dir,
                "--checkpoint.every_steps", "1", "--checkpoint.keep_last", "2",
                "--checkpoint.on_stop", "false"]
        if resume:
            args += ["--resume", self.dir]
        h = HostdProcess(HOSTD, *args, tmp=self.tmp, instance=self.instance, socket=self.socket,
                         slidedpctl=SLIDEDPCTL, log_name=f"hostd{k}.log")
        self.hostds.append(h)
        return h.start()

    def status_step(self):
        job = ctl_json(SLIDEDPCTL, "status", socket=self.socket).get("job") or {}
        return int(job.get("step", 0)), job

    def test_kill_during_checkpoint_writes(self):
        rng = random.Random(int(os.environ.get("SLIDEDP_CKPT_SEED", "1234")))
        t0 = time.time()
        hits = 0
        expected_step = None
        for k in range(KILLS + 1):
            hostd = self.start_hostd(resume=k > 0, k=k)
            if expected_step is not None:
                # Loads: the resumed job is at the newest valid checkpoint's step.
                step, job = self.status_step()
                self.assertEqual(step, expected_step, job)
            if k == KILLS:
                hostd.stop()
                hostd.close()
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
            hostd.kill()
            hostd.close()
            trainer.kill()
            trainer.wait()
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
