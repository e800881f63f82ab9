#!/usr/bin/env python3
"""R rank processes of the native trainer through hostd, bit-exact with the one-process reference.

Issue #3, acceptance 1 and 2: for R in {1, 2, 4}, hostd (--model none) and R native_trainer
processes train the MLP for 20 steps with 4 KiB gradient chunks (each layer spans several chunks
and the 4-slot rings wrap many times per step); then every layer's checksum of master, m, v and
params (slidedpctl layers --checksums) must equal native_reference's for the same settings, every
layer must be at version 20, and every parameter fetch of step t must have returned version t-1.
hostd stops on SIGTERM and leaves no segment in /dev/shm.

Usage: native_trainer_test.py HOSTD SLIDEDPCTL NATIVE_TRAINER NATIVE_REFERENCE
Python standard library only.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import HostdProcess  # noqa: E402

HOSTD = SLIDEDPCTL = TRAINER = REFERENCE = None

STEPS = 20
LAYERS = 4  # the trainer's default model: 4 layers of width 64, global batch 32
CHUNK_BYTES = 4096
PROC_TIMEOUT_S = 60


class NativeTrainerTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="slidedp-native-")
        self.procs = []
        self.files = []

    def tearDown(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in self.files:
            f.close()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def hostd(self, world_size, threads=1):
        """hostd for one job; its `with` block ends with SIGTERM, exit 0 and no segment left."""
        return HostdProcess(
            HOSTD, "--model", "none", "--world_size", str(world_size), "--mlock", "best_effort",
            "--update_threads", str(threads), "--heartbeat_deadline_ms", "5000", tmp=self.tmp,
            instance=f"nt{os.getpid()}r{world_size}t{threads}", slidedpctl=SLIDEDPCTL)

    def reference(self, world_size, model=()):
        out = os.path.join(self.tmp, f"reference{world_size}.json")
        r = subprocess.run([REFERENCE, "--world-size", str(world_size), "--steps", str(STEPS),
                            "--out", out, *model], capture_output=True, text=True, timeout=120)
        self.assertEqual(r.returncode, 0, r.stderr)
        with open(out) as f:
            return json.load(f)

    def run_job(self, world_size, model=(), chunk_bytes=CHUNK_BYTES, threads=1):
        with self.hostd(world_size, threads) as hostd:
            socket = hostd.socket
            trainers = []
            for rank in range(world_size):
                stamps = os.path.join(self.tmp, f"stamps{world_size}.{rank}.jsonl")
                cmd = [TRAINER, "--socket", socket, "--rank", str(rank), "--world-size",
                       str(world_size), "--steps", str(STEPS), "--chunk-bytes", str(chunk_bytes),
                       "--timeout-ms", "30000", "--stamps", stamps, *model]
                if rank == 0:
                    cmd.append("--create-job")
                out = open(os.path.join(self.tmp, f"trainer{world_size}.{rank}.log"), "w+")
                self.files.append(out)
                p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True)
                self.procs.append(p)
                trainers.append((p, out, stamps))
            deadline = time.time() + PROC_TIMEOUT_S
            for p, _, _ in trainers:
                try:
                    p.wait(timeout=max(1, deadline - time.time()))
                except subprocess.TimeoutExpired:
                    pass
            logs = []
            for rank, (p, out, _) in enumerate(trainers):
                out.seek(0)
                logs.append(out.read())
            for rank, (p, _, _) in enumerate(trainers):
                if p.poll() is None or p.returncode != 0:
                    what = "did not finish" if p.poll() is None else f"exited {p.returncode}"
                    self.fail(f"R={world_size}: rank {rank} {what}\n{logs[rank]}\n"
                              f"hostd:\n{hostd.output()}")
            layers = hostd.ctl_json("layers", "--checksums")
        return layers, logs, [s for _, _, s in trainers]

    def check_stamps(self, world_size, stamp_files):
        for rank, path in enumerate(stamp_files):
            with open(path) as f:
                stamps = [json.loads(line) for line in f if line.strip()]
            self.assertEqual(len(stamps), STEPS * LAYERS, f"R={world_size} rank {rank}")
            seen = set()
            for s in stamps:
                self.assertEqual(s["rank"], rank)
                self.assertEqual(s["phase"], "fwd")
                # Acceptance 2: a rank computes step t only with version t-1 of every layer.
                self.assertEqual(s["version"], s["step"] - 1,
                                 f"R={world_size} rank {rank} computed with {s}")
                seen.add((s["step"], s["layer"]))
            self.assertEqual(seen, {(t, l) for t in range(1, STEPS + 1) for l in range(LAYERS)})

    def check_losses(self, world_size, logs, reference_loss):
        # The shards' losses summed over ranks are the global-batch loss of the reference.
        per_step = {}
        for log in logs:
            for m in re.finditer(r"^rank \d+ step +(\d+) +shard_loss (\S+)", log, re.M):
                per_step[int(m.group(1))] = per_step.get(int(m.group(1)), 0.0) + float(m.group(2))
        self.assertEqual(sorted(per_step), list(range(1, STEPS + 1)))
        for t in range(1, STEPS + 1):
            self.assertAlmostEqual(per_step[t], reference_loss[t - 1],
                                   delta=1e-5 * abs(reference_loss[t - 1]) + 1e-9)
        self.assertLess(reference_loss[-1], reference_loss[0], "the model does not learn")

    def test_bit_exact_with_reference(self):
        for world_size in (1, 2, 4):
            with self.subTest(world_size=world_size):
                t0 = time.time()
                layers, logs, stamp_files = self.run_job(world_size)
                ref = self.reference(world_size)
                self.assertEqual(len(layers), LAYERS)
                self.assertEqual(len(ref["layers"]), LAYERS)
                for got, want in zip(layers, ref["layers"]):
                    self.assertEqual(int(got["layer"]), want["layer"])
                    self.assertEqual(int(got["version"]), STEPS, got)
                    print(f"R={world_size} layer {want['layer']} ({got['name']}): "
                          f"hostd {got['checksum']} reference {want['checksum']} "
                          f"{'==' if got['checksum'] == want['checksum'] else '!='}",
                          flush=True)
                    self.assertEqual(got["checksum"], want["checksum"],
                                     f"R={world_size} layer {want['layer']} differs")
                self.check_stamps(world_size, stamp_files)
                self.check_losses(world_size, logs, ref["loss"])
                print(f"R={world_size}: {STEPS} steps bit-exact, loss {ref['loss'][0]:.4f} -> "
                      f"{ref['loss'][-1]:.4f}, {time.time() - t0:.1f} s", flush=True)

    def test_large_chunks_reduced_in_parallel(self):
        # 256-wide layers (65,792 parameters) in one 1 MiB chunk: hostd splits each chunk's
        # rank sum across its update threads; the result must not change.
        model = ("--dim", "256")
        layers, _, stamp_files = self.run_job(2, model, chunk_bytes=1 << 20, threads=2)
        ref = self.reference(2, model)
        for got, want in zip(layers, ref["layers"]):
            self.assertEqual(got["checksum"], want["checksum"], f"layer {want['layer']} differs")
        self.check_stamps(2, stamp_files)


if __name__ == "__main__":
    if len(sys.argv) < 5:
        sys.exit("usage: native_trainer_test.py HOSTD SLIDEDPCTL NATIVE_TRAINER NATIVE_REFERENCE")
    HOSTD, SLIDEDPCTL, TRAINER, REFERENCE = sys.argv[1:5]
    unittest.main(argv=sys.argv[:1] + sys.argv[5:], verbosity=2)
