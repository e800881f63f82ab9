#!/usr/bin/env python3
"""Rank faults through a real hostd: SIGKILL a rank mid-push and mid-fetch, SIGSTOP a rank.

Usage: fault_test.py HOSTD SLIDEDPCTL NATIVE_TRAINER NATIVE_REFERENCE

Each case runs two native_trainer ranks; rank 1 hits a failure point (SLIDEDP_FAILPOINT, see
rankclient/rank_client.h) in step FAIL_STEP. Then:
  - no deadlock: rank 0 ends with ABORTED (exit code 3) within 2 s of rank 1's death (or, for
    SIGSTOP, within 2 s after rank 1's heartbeat deadline of 1 s), and hostd still answers;
  - no partial update: every layer's state is bit-identical to the single-process reference
    after FAIL_STEP - 1 steps (no layer of the failed step received a partial gradient), and
    every layer sits at version FAIL_STEP (sealed by the abort);
  - nothing leaks: the /dev/shm entries are the same before and after.
"""
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import HostdProcess  # noqa: E402

HOSTD = SLIDEDPCTL = TRAINER = REFERENCE = None
LAYERS, DIM, BATCH, CHUNK_BYTES, SEED = 4, 64, 16, 4096, 3
FAIL_STEP = 3
CHUNKS_PER_LAYER = -(-(DIM * DIM + DIM) * 4 // CHUNK_BYTES)  # FP32 gradients
CHUNKS_PER_STEP = LAYERS * CHUNKS_PER_LAYER


def common_flags():
    return ["--layers", str(LAYERS), "--dim", str(DIM), "--batch", str(BATCH), "--seed", str(SEED)]


def trainer_cmd(sock, rank, world, steps):
    return ([TRAINER, "--socket", sock, "--rank", str(rank), "--world-size", str(world),
             "--steps", str(steps), "--chunk-bytes", str(CHUNK_BYTES)] + common_flags() +
            (["--create-job"] if rank == 0 else []))


def reference_checksums(world, steps, out):
    subprocess.run([REFERENCE, "--world-size", str(world), "--steps", str(steps), "--out", out] +
                   common_flags(), check=True, capture_output=True, timeout=300)
    with open(out) as f:
        return {l["layer"]: l["checksum"] for l in json.load(f)["layers"]}


def process_state(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


class FaultTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="slidedp-fault-")
        self.instance = f"fault{os.getpid()}{self._testMethodName[-8:]}"
        self.shm_before = self.shm_entries()
        # Cleanups run last first: hostd stops (exit 0, none of its segments left), then the
        # rest of /dev/shm is compared.
        self.addCleanup(lambda: self.assertEqual(self.shm_entries(), self.shm_before,
                                                 "/dev/shm entries leaked"))
        self.hostd = self.enterContext(HostdProcess(
            HOSTD, "--model", "none", "--world_size", "2", "--mlock", "best_effort",
            "--update_threads", "1", "--heartbeat_interval_ms", "100",
            "--heartbeat_deadline_ms", "1000", tmp=self.tmp, instance=self.instance,
            slidedpctl=SLIDEDPCTL))
        self.sock = self.hostd.socket

    def shm_entries(self):
        # Other tests may run beside this one and own slidedp.* segments of their instances;
        # everything else in /dev/shm, and this instance's segments, must be unchanged.
        return sorted(n for n in os.listdir("/dev/shm")
                      if not n.startswith("slidedp.") or n.startswith(f"slidedp.{self.instance}."))

    def layers(self):
        return self.hostd.ctl_json("layers", "--checksums", timeout=30)

    def run_case(self, failpoint):
        env = dict(os.environ, SLIDEDP_FAILPOINT=failpoint)
        r0 = subprocess.Popen(trainer_cmd(self.sock, 0, 2, 10), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
        r1 = subprocess.Popen(trainer_cmd(self.sock, 1, 2, 10), env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if failpoint.startswith("push_stop"):
            deadline = time.time() + 60
            while process_state(r1.pid) != "T":
                self.assertLess(time.time(), deadline, "rank 1 never stopped")
                self.assertIsNone(r1.poll())
                time.sleep(0.005)
            t_stopped = time.time()
            t_fault = t_stopped + 1.0  # hostd may act only after the heartbeat deadline
        else:
            r1.wait(timeout=60)
            t_fault = t_stopped = time.time()
            self.assertEqual(r1.returncode, -signal.SIGKILL)
        _, err0 = r0.communicate(timeout=30)
        t_other = time.time()
        self.assertEqual(r0.returncode, 3, f"rank 0 should end ABORTED: {err0}")
        self.assertIn("ABORTED", err0)
        self.assertLessEqual(t_other - t_fault, 2.0, "rank 0 was not released within 2 s")
        if r1.poll() is None:
            os.kill(r1.pid, signal.SIGKILL)
        r1.communicate(timeout=30)
        print(f"{failpoint}: rank 0 released {t_other - t_stopped:.3f} s after rank 1 died or "
              f"stopped ({t_other - t_fault:.3f} s after hostd could know)", file=sys.stderr)
        # hostd answers, every layer sits at the failed step's version, and no layer of that
        # step was updated: the state is the reference's after FAIL_STEP - 1 steps.
        layers = self.layers()
        want = reference_checksums(2, FAIL_STEP - 1, os.path.join(self.tmp, "ref.json"))
        for l in layers:
            self.assertEqual(l["version"], FAIL_STEP, l)
            self.assertEqual(l["checksum"], want[l["layer"]], f"layer {l['layer']} changed")
        # The four segments (the instance lock file beside them is hostd's while it runs).
        self.assertEqual(len([n for n in os.listdir("/dev/shm")
                              if n.startswith(f"slidedp.{self.instance}.")
                              and not n.endswith(".lock")]), 4)

    def test_kill_mid_push(self):
        # Rank 1 dies after the second chunk of its first layer of FAIL_STEP.
        self.run_case(f"push_kill:{CHUNKS_PER_STEP * (FAIL_STEP - 1) + 2}")

    def test_kill_mid_fetch(self):
        # Rank 1 dies halfway through copying its second layer in FAIL_STEP's forward.
        self.run_case(f"fetch_kill:{LAYERS * (FAIL_STEP - 1) + 2}")

    def test_stop_before_push(self):
        self.run_case(f"push_stop:{CHUNKS_PER_STEP * (FAIL_STEP - 1) + 3}")


if __name__ == "__main__":
    HOSTD, SLIDEDPCTL, TRAINER, REFERENCE = sys.argv[1:5]
    unittest.main(argv=sys.argv[:1], verbosity=2)
