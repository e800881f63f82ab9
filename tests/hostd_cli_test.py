#!/usr/bin/env python3
"""hostd + slidedpctl as a user runs them: real processes, a real unix socket, real segments.

Usage: hostd_cli_test.py HOSTD SLIDEDPCTL   (CTest passes the built binaries)
Python standard library only.
"""
import json
import os
import re
import subprocess
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import HostdProcess, shm_names  # noqa: E402

HOSTD = SLIDEDPCTL = None

QWEN3_0_6B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024,
    "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
    "tie_word_embeddings": True, "rms_norm_eps": 1e-6, "max_position_embeddings": 40960,
    "rope_theta": 1000000, "torch_dtype": "bfloat16", "initializer_range": 0.02,
}


class HostdCliTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="slidedp-cli-")
        self.daemons = []

    def tearDown(self):
        for d in self.daemons:
            d.abort()  # killed if still running, its segments removed

    def start(self, model, tag, *extra):
        """hostd on instance cli<pid><tag>; the test stops it (d.stop()) and checks the code."""
        d = HostdProcess(HOSTD, "--model", model, "--update_threads", "0", *extra, tmp=self.tmp,
                         instance=f"cli{os.getpid()}{tag}", slidedpctl=SLIDEDPCTL,
                         start_timeout_s=240)
        self.daemons.append(d)
        return d.start()

    def test_tcp_listener_needs_the_service_token(self):
        """Issue #17 point 11: the loopback TCP listener is open to every local user, so hostd
        serves it only with an auth_token_file nobody else can read, and every call over it
        carries the token (they needed none)."""
        import socket as pysocket
        with pysocket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        token_file = os.path.join(self.tmp, "token")
        with open(token_file, "w") as f:
            f.write("t" * 40 + "\n")
        os.chmod(token_file, 0o644)
        tag = f"cli{os.getpid()}tcp"
        sock = os.path.join(self.tmp, "tcp.sock")
        base = [HOSTD, "--model", "tiny", "--socket", sock, "--instance", tag,
                "--listen_tcp", f"127.0.0.1:{port}"]
        r = subprocess.run(base, capture_output=True, text=True, timeout=60)
        self.assertEqual(r.returncode, 2, r.stderr)  # no auth_token_file: refused by the config
        self.assertIn("needs auth_token_file", r.stderr)
        r = subprocess.run(base + ["--auth_token_file", token_file], capture_output=True,
                           text=True, timeout=60)
        self.assertEqual(r.returncode, 1, r.stdout + r.stderr)  # readable by others
        self.assertIn("mode 0644", r.stdout + r.stderr)
        os.chmod(token_file, 0o640)
        d = self.start("tiny", "tcp", "--listen_tcp", f"127.0.0.1:{port}", "--auth_token_file",
                       token_file)
        env = {k: v for k, v in os.environ.items() if k != "SLIDEDP_TOKEN_FILE"}
        tcp = [SLIDEDPCTL, "--tcp", f"127.0.0.1:{port}"]
        r = subprocess.run(tcp + ["status", "--json"], capture_output=True, text=True,
                           timeout=60, env=env)
        self.assertEqual(r.returncode, 4, r.stdout + r.stderr)
        self.assertIn("UNAUTHENTICATED", r.stderr)
        r = subprocess.run(tcp + ["--token-file", token_file, "status", "--json"],
                           capture_output=True, text=True, timeout=60, env=env)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(json.loads(r.stdout)["job"]["job_id"], "default")
        r = subprocess.run(tcp + ["status"], capture_output=True, text=True, timeout=60,
                           env=dict(env, SLIDEDP_TOKEN_FILE=token_file))
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(d.stop(), 0)

    def check_status_json(self, d, expected_layers):
        st = json.loads(d.ctl("status", "--json").stdout)
        layers = st["layers"]
        self.assertEqual([l["name"] for l in layers], expected_layers)
        for i, l in enumerate(layers):
            self.assertEqual(l["layer"], i)
            self.assertEqual(l["version"], 0)
            self.assertIsInstance(l["bytes"], int)
            self.assertGreaterEqual(l["bytes"], 14 * l["numel"])
            self.assertIsInstance(l["numa_node"], int)
            self.assertGreaterEqual(l["numa_node"], 0)
        return st

    def check_layers_table(self, d, n_layers):
        out = d.ctl("layers").stdout.rstrip("\n").split("\n")
        header = out[0]
        self.assertTrue(header.startswith("LAYER"), header)
        rows = out[1:]
        self.assertEqual(len(rows), n_layers, out)
        # Aligned: under every header word, each row's cell either starts where the word starts
        # (left-aligned text) or ends where it ends (right-aligned numbers).
        cols = [(m.start(), m.end()) for m in re.finditer(r"\S+", header)]
        for r in rows:
            r = r.ljust(len(header))
            for s, e in cols:
                starts_here = r[s] != " " and (s == 0 or r[s - 1] == " ")
                ends_here = r[e - 1] != " " and (e >= len(r) or r[e] == " ")
                self.assertTrue(starts_here or ends_here,
                                f"row {r!r} is not aligned under {header[s:e]!r} of {header!r}")

    def test_qwen3_0_6b_config_json(self):
        mdir = os.path.join(self.tmp, "qwen3-0.6b")
        os.makedirs(mdir)
        with open(os.path.join(mdir, "config.json"), "w") as f:
            json.dump(QWEN3_0_6B, f)
        d = self.start(mdir, "q06")
        names = (["model.embed_tokens"] + [f"model.layers.{i}" for i in range(28)] +
                 ["model.norm"])
        st = self.check_status_json(d, names)
        self.assertEqual(st["job"]["total_params"], 596049920)
        self.assertEqual(st["job"]["family"], "qwen3")
        self.check_layers_table(d, 30)
        # The four segments and, while hostd runs, its instance lock file.
        self.assertEqual(sorted(n.rsplit(".", 1)[1] for n in shm_names(d.instance)),
                         ["control", "grads", "lock", "params", "state"])
        self.assertEqual(d.stop(), 0, d.output())
        self.assertEqual(shm_names(d.instance), [], "clean stop must remove the segments")

    def test_tiny_and_config_file_path(self):
        d = self.start("tiny", "tiny")
        tiny = (["model.embed_tokens"] + [f"model.layers.{i}" for i in range(4)] +
                ["model.norm", "lm_head"])
        self.check_status_json(d, tiny)
        self.check_layers_table(d, 7)
        v = json.loads(d.ctl("version", "--json").stdout)
        self.assertEqual(v["client"]["version"], v["daemon"]["version"])
        cfg = d.ctl("config", "show", "--json").stdout
        self.assertIn('"flag"', cfg)
        self.assertEqual(d.stop(), 0)

        path = os.path.join(self.tmp, "cfg.json")
        with open(path, "w") as f:
            json.dump(dict(QWEN3_0_6B, hidden_size=64, intermediate_size=128,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=16, vocab_size=256), f)
        d2 = self.start(path, "file")
        self.check_status_json(d2, ["model.embed_tokens", "model.layers.0", "model.layers.1",
                                    "model.norm"])
        self.assertEqual(d2.stop(), 0)

    def test_ranks_and_checkpoint_dirs(self):
        """Issue #17: no phantom row for a slot no rank holds; a checkpoint --dir is sent
        absolute (relative to slidedpctl's working directory) and must lie under checkpoint.dir
        or output_roots."""
        ckpt = os.path.join(self.tmp, "ckpt")
        root = os.path.join(self.tmp, "root")
        os.makedirs(root)
        d = self.start("tiny", "dirs", "--checkpoint.dir", ckpt, "--output_roots", root,
                       "--checkpoint.prepare_snapshot_pool", "false")
        r = d.ctl("ranks")
        self.assertEqual(r.stdout, "no rank attached (world size 1)\n")
        self.assertEqual(json.loads(d.ctl("ranks", "--json").stdout), [])

        ctl = [SLIDEDPCTL, "--socket", d.socket, "checkpoint", "--json"]
        r = subprocess.run(ctl + ["--dir", "rel"], cwd=root, capture_output=True, text=True,
                           timeout=120)
        self.assertEqual(r.returncode, 0, r.stderr)
        # A checkpoint's directory names its step, instance and job (format 3).
        step0 = os.path.join(root, "rel", f"step-000000000000.cli{os.getpid()}dirs.default")
        self.assertEqual(json.loads(r.stdout)["path"], step0)
        self.assertTrue(os.path.exists(os.path.join(step0, "COMMITTED")))
        outside = os.path.join(self.tmp, "outside")
        for bad in (outside, os.path.join(root, "..", "outside"), os.path.join(ckpt, "..", "x")):
            r = subprocess.run(ctl + ["--dir", bad], capture_output=True, text=True, timeout=60)
            self.assertEqual(r.returncode, 4, r.stderr)
            self.assertIn("PERMISSION_DENIED", r.stderr)
            self.assertIn(f"output_roots ({root})", r.stderr)
        self.assertFalse(os.path.exists(outside))
        self.assertEqual(d.stop(), 0, d.output())

    def test_second_daemon_same_instance_is_refused_and_state_kept(self):
        d = self.start("tiny", "dup")
        before = json.loads(d.ctl("status", "--json").stdout)
        other = subprocess.run([HOSTD, "--model", "tiny", "--instance", d.instance, "--socket",
                                os.path.join(self.tmp, "other.sock")],
                               capture_output=True, text=True, timeout=60)
        self.assertEqual(other.returncode, 1)
        self.assertIn("in use by hostd pid", other.stdout + other.stderr)
        after = json.loads(d.ctl("status", "--json").stdout)
        self.assertEqual(before["layers"], after["layers"])
        self.assertEqual(d.stop(), 0)

    def test_unreachable_and_rejected_exit_codes(self):
        r = subprocess.run([SLIDEDPCTL, "--socket", os.path.join(self.tmp, "none.sock"),
                            "status"], capture_output=True, text=True, timeout=60)
        self.assertEqual(r.returncode, 3, r.stderr)
        self.assertIn("cannot reach hostd", r.stderr)

    def test_help_and_bad_config(self):
        h = subprocess.run([HOSTD, "--help"], capture_output=True, text=True, timeout=60)
        self.assertEqual(h.returncode, 0)
        for key in ("--model", "--socket", "--lr", "--clip", "SLIDEDP_LR"):
            self.assertIn(key, h.stdout)
        bad = subprocess.run([HOSTD, "--clip", "sometimes"], capture_output=True, text=True,
                             timeout=60)
        self.assertEqual(bad.returncode, 2)
        self.assertIn("clip", bad.stderr)
        missing = subprocess.run([HOSTD, "--model", os.path.join(self.tmp, "absent"), "--socket",
                                  os.path.join(self.tmp, "x.sock"), "--instance", "absent"],
                                 capture_output=True, text=True, timeout=60)
        self.assertEqual(missing.returncode, 1)
        self.assertIn("absent", missing.stdout + missing.stderr)


if __name__ == "__main__":
    HOSTD, SLIDEDPCTL = sys.argv[1], sys.argv[2]
    unittest.main(argv=sys.argv[:1], verbosity=2)
