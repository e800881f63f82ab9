#!/usr/bin/env python3
"""hostd's Prometheus endpoint and `slidedpctl watch` against a real hostd (issue #6, item 5).

Usage: metrics_test.py HOSTD SLIDEDPCTL LIBSLIDEDP_RANK.so

hostd serves the tiny Qwen3 shape with metrics.listen on a free loopback port; one rank
(python_client, in this process, on the CPU, FP32 gradients) trains 3 steps while
`slidedpctl watch --steps 3 --json` runs. Scrapes (urllib) before and after must agree with what
ran: steps_completed_total 0 -> 3, the step_seconds histogram counts 3 steps (its +Inf bucket
too) with a positive sum, every slidedp_layer_version is 3 (min = max = 3),
param_bytes_published_total = 3 steps x 2 bytes x every parameter, grad_bytes_received_total =
3 x 4 bytes x every parameter (one rank, FP32 gradients), update_seconds_total grows, one rank
attached, checkpoint_last_step NaN (no checkpoint yet), build_info carries the version. watch
prints lines whose new_steps add up to 3, ending at step 3, and exits 0; without --steps it ends
with exit 0 on SIGINT. Configuration: [metrics] in a TOML file, the dotted flag and
SLIDEDP_METRICS_LISTEN all set the key; a non-loopback address is refused naming
metrics.listen unless metrics.allow_remote. Takes about 30 s on 2 cores.
"""
import json
import math
import os
import signal
import socket as socketlib
import subprocess
import sys
import tempfile
import time
import unittest
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python_client"))
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from harness import HostdProcess  # noqa: E402

HOSTD = CTL = LIB = None


def free_port():
    with socketlib.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port):
    """{(name, frozenset(labels)): value} of the text exposition."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, value = line.rsplit(" ", 1)
        labels = frozenset()
        if "{" in head:
            name, rest = head.split("{", 1)
            pairs = [p for p in rest.rstrip("}").split('",') if p]
            labels = frozenset(tuple(p.rstrip('"').split('="', 1)) for p in pairs)
        else:
            name = head
        out[(name, labels)] = float(value)
    return out


def one(metrics, name, **labels):
    return metrics[(name, frozenset(labels.items()))]


class MetricsTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="slidedp-metrics-")
        self.procs = []
        os.environ["SLIDEDP_RANK_LIB"] = LIB
        # Cleanups run last first: a test's hostd stops before its directory goes.
        self.addCleanup(subprocess.run, ["rm", "-rf", self.tmp])

    def tearDown(self):
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()

    def test_metrics_follow_training_and_watch_prints_each_step(self):
        import torch
        import transformers
        import slidedp
        import train_hf
        d = os.path.join(self.tmp, "model")
        r = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "train_hf.py"),
                            "prepare", d, "--model", "qwen3-tiny"], capture_output=True,
                           text=True, timeout=300)
        self.assertEqual(r.returncode, 0, r.stderr)
        port = free_port()
        # The [metrics] table of a config file.
        cfg = os.path.join(self.tmp, "hostd.toml")
        with open(cfg, "w") as f:
            f.write(f'[metrics]\nlisten = "127.0.0.1:{port}"\n')
        # Stopped by the harness after the test's cleanups: SIGTERM, exit 0, no segment left.
        hostd = self.enterContext(HostdProcess(
            HOSTD, "--config", cfg, "--model", d, "--mlock", "best_effort", "--update_threads",
            "1", "--grad_dtype", "fp32", tmp=self.tmp, instance=f"met{os.getpid()}",
            socket=os.path.join(self.tmp, "h.sock"), log_name="hostd.log"))
        sock = hostd.socket

        before = scrape(port)
        build = [k for k in before if k[0] == "slidedp_build_info"]
        self.assertEqual(len(build), 1)
        self.assertTrue(dict(build[0][1])["version"])
        self.assertEqual(one(before, "slidedp_steps_completed_total"), 0)
        self.assertEqual(one(before, "slidedp_step_seconds_count"), 0)
        self.assertEqual(one(before, "slidedp_ranks_attached"), 0)
        self.assertTrue(math.isnan(one(before, "slidedp_checkpoint_last_step")))
        self.assertGreater(one(before, "slidedp_shm_bytes"), 0)
        self.assertGreater(one(before, "slidedp_locked_bytes"), 0)
        versions = {dict(k[1])["layer"]: v for k, v in before.items()
                    if k[0] == "slidedp_layer_version"}
        self.assertEqual(len(versions), 7)  # embedding, 4 decoder layers, norm, lm_head
        self.assertEqual(set(versions.values()), {0.0})

        watch = subprocess.Popen([CTL, "--socket", sock, "watch", "--steps", "3", "--interval",
                                  "0.05", "--json"], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
        self.procs.append(watch)
        time.sleep(0.5)  # its first poll sees step 0
        model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
        model, opt = slidedp.attach(model, hostd=sock, device="cpu")
        tokens = train_hf.load_tokens(None, model.config.vocab_size, 1, 4 * 4 * 32)
        for k in range(3):
            x = torch.from_numpy(train_hf.batch_rows(tokens, k, 4, 32).copy())
            model(input_ids=x, labels=x).loss.backward()
            opt.step()
        model.slidedp.fetch_state_dict()  # waits for step 3's updates
        out, err = watch.communicate(timeout=60)
        self.assertEqual(watch.returncode, 0, err)
        lines = [json.loads(l) for l in out.splitlines()]
        self.assertGreaterEqual(len(lines), 1, out)
        self.assertEqual(sum(l["new_steps"] for l in lines), 3, out)
        self.assertEqual(lines[-1]["step"], 3, out)
        self.assertGreater(lines[-1]["step_seconds"], 0, out)
        self.assertEqual(lines[-1]["ranks_attached"], 1, out)

        after = scrape(port)
        total = int(one(after, "slidedp_update_params_total")) // 3
        status = json.loads(subprocess.run([CTL, "--socket", sock, "status", "--json"],
                                           capture_output=True, text=True,
                                           check=True).stdout)
        self.assertEqual(total, int(status["job"]["total_params"]))
        self.assertEqual(one(after, "slidedp_steps_completed_total"), 3)
        self.assertEqual(one(after, "slidedp_last_step"), 3)
        self.assertEqual(one(after, "slidedp_step_seconds_count"), 3)
        self.assertEqual(one(after, "slidedp_step_seconds_bucket", le="+Inf"), 3)
        self.assertGreater(one(after, "slidedp_step_seconds_sum"), 0)
        self.assertGreater(one(after, "slidedp_update_seconds_total"),
                           one(before, "slidedp_update_seconds_total"))
        self.assertEqual(one(after, "slidedp_param_bytes_published_total"), 3 * 2 * total)
        self.assertEqual(one(after, "slidedp_grad_bytes_received_total"), 3 * 4 * total)
        self.assertEqual(one(after, "slidedp_ranks_attached"), 1)
        self.assertEqual(one(after, "slidedp_layer_version_min"), 3)
        self.assertEqual(one(after, "slidedp_layer_version_max"), 3)
        self.assertEqual({v for k, v in after.items() if k[0] == "slidedp_layer_version"}, {3.0})
        opt.close()

        # Without --steps, watch runs until Ctrl-C and then exits 0.
        w = subprocess.Popen([CTL, "--socket", sock, "watch", "--interval", "0.1"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.procs.append(w)
        time.sleep(0.5)
        self.assertIsNone(w.poll())
        w.send_signal(signal.SIGINT)
        out, err = w.communicate(timeout=10)
        self.assertEqual(w.returncode, 0, err)
        self.assertIn("STEP", out.splitlines()[0])

    def test_listen_configuration(self):
        def config(*args, env=None):
            return subprocess.run([HOSTD, "--print-config", *args], capture_output=True,
                                  text=True, env=dict(os.environ, **(env or {})))
        r = config("--metrics.listen", "127.0.0.1:9464")
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn('metrics.listen = "127.0.0.1:9464"', r.stdout)
        r = config(env={"SLIDEDP_METRICS_LISTEN": "[::1]:9500"})
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn('metrics.listen = "[::1]:9500"', r.stdout)
        self.assertIn("env", [l for l in r.stdout.splitlines() if "metrics.listen" in l][0])
        r = config("--metrics.listen", "0.0.0.0:9464")
        self.assertEqual(r.returncode, 2)
        self.assertIn("metrics.listen", r.stderr)
        self.assertIn("not a loopback address", r.stderr)
        self.assertIn("metrics.allow_remote", r.stderr)
        r = config("--metrics.listen", "0.0.0.0:9464", "--metrics.allow_remote", "true")
        self.assertEqual(r.returncode, 0, r.stderr)
        r = config("--metrics.listen", "127.0.0.1:99999")
        self.assertEqual(r.returncode, 2)
        self.assertIn("PORT 0..65535", r.stderr)
        # The printed config reads back (dotted keys are TOML tables).
        path = os.path.join(self.tmp, "back.toml")
        with open(path, "w") as f:
            f.write(config("--metrics.listen", "127.0.0.1:9464").stdout)
        r = config("--config", path)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn('metrics.listen = "127.0.0.1:9464"', r.stdout)
        with open(path, "w") as f:
            f.write('[metrics]\nlisten = "127.0.0.1:1"\nbogus = 1\n')
        r = config("--config", path)
        self.assertEqual(r.returncode, 2)
        self.assertIn("metrics.bogus", r.stderr)


def main():
    global HOSTD, CTL, LIB
    if len(sys.argv) < 4:
        print(__doc__)
        sys.exit(2)
    HOSTD, CTL, LIB = (os.path.abspath(a) for a in sys.argv[1:4])
    unittest.main(argv=[sys.argv[0]] + sys.argv[4:], verbosity=2)


if __name__ == "__main__":
    main()
