#!/usr/bin/env python3
"""tests/harness.py: HostdProcess and ctl() against a real hostd and stand-in daemons.

Usage: harness_test.py HOSTD SLIDEDPCTL
Python standard library only.
"""
import os
import signal
import stat
import sys
import tempfile
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
from harness import HostdProcess, ctl, ctl_json, shm_names  # noqa: E402

HOSTD = SLIDEDPCTL = None
TINY = ("--model", "tiny", "--update_threads", "0", "--mlock", "best_effort")


def fake_daemon(tmp, name, body):
    """A shell script that stands in for hostd: $2 is the socket path, $4 the instance."""
    path = os.path.join(tmp, name)
    with open(path, "w") as f:
        f.write("#!/bin/sh\n" + body + "\n")
    os.chmod(path, stat.S_IRWXU)
    return path


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


class HarnessTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="slidedp-harness-")

    def test_clean_run_stops_hostd_and_leaves_nothing(self):
        with HostdProcess(HOSTD, *TINY, tag="hc", slidedpctl=SLIDEDPCTL) as h:
            self.assertTrue(os.path.exists(h.socket))
            self.assertTrue(h.instance.startswith(f"hc{os.getpid()}"))
            self.assertIsNone(h.poll())
            self.assertTrue(h.shm_names(), "a running hostd has segments")
            layers = h.ctl_json("layers", "--checksums")
            self.assertEqual(len(layers), 7)
            self.assertEqual(ctl_json(SLIDEDPCTL, "status", socket=h.socket)["layers"],
                             h.ctl_json("status")["layers"])
            own_tmp = h.tmp
        self.assertEqual(h.returncode, 0)
        self.assertEqual(shm_names(h.instance), [])
        self.assertFalse(os.path.exists(own_tmp), "its own temporary directory is removed")
        self.assertIn("serving slidedp.v1.Control on unix:" + h.socket, h.output())

    def test_two_instances_side_by_side(self):
        with HostdProcess(HOSTD, *TINY, tmp=self.tmp, slidedpctl=SLIDEDPCTL) as a, \
                HostdProcess(HOSTD, *TINY, tmp=self.tmp, slidedpctl=SLIDEDPCTL) as b:
            self.assertNotEqual(a.instance, b.instance)
            self.assertNotEqual(a.socket, b.socket)
            self.assertEqual(os.path.dirname(a.socket), self.tmp)
            self.assertEqual(len(a.ctl_json("layers")), len(b.ctl_json("layers")))
        self.assertTrue(os.path.exists(a.log_path), "a given tmp is kept")

    def test_exception_kills_hostd_and_removes_its_segments(self):
        h = HostdProcess(HOSTD, *TINY, tmp=self.tmp)
        with self.assertRaisesRegex(RuntimeError, "boom"):
            with h:
                pid = h.pid
                self.assertTrue(h.shm_names())
                raise RuntimeError("boom")
        self.assertEqual(h.returncode, -signal.SIGKILL)
        self.assertFalse(alive(pid))
        self.assertEqual(shm_names(h.instance), [])

    def test_unexpected_exit_code_fails(self):
        with self.assertRaisesRegex(AssertionError, "exited 0, expected 3"):
            with HostdProcess(HOSTD, *TINY, tmp=self.tmp, expect_rc=3):
                pass

    def test_killed_by_the_test_with_expect_rc_none(self):
        with HostdProcess(HOSTD, *TINY, tmp=self.tmp, expect_rc=None) as h:
            self.assertEqual(h.kill(), -signal.SIGKILL)
            self.assertTrue(h.shm_names(), "SIGKILL leaves the segments")
        self.assertEqual(shm_names(h.instance), [], "the harness removes what was left")

    def test_restart_of_an_instance_reuses_socket(self):
        first = HostdProcess(HOSTD, *TINY, tmp=self.tmp, expect_rc=None, check_shm=False)
        with first:
            first.kill()
        self.assertTrue(os.path.exists(first.socket), "a killed hostd leaves its socket")
        with HostdProcess(HOSTD, *TINY, tmp=self.tmp, instance=first.instance,
                          socket=first.socket, slidedpctl=SLIDEDPCTL) as second:
            self.assertEqual(len(second.ctl_json("layers")), 7)

    def test_start_failure_carries_the_log(self):
        h = HostdProcess(HOSTD, "--model", os.path.join(self.tmp, "missing"), tmp=self.tmp)
        with self.assertRaisesRegex(AssertionError, r"exited \d+ before its socket") as cm:
            with h:
                self.fail("the body must not run")
        self.assertIn("missing", str(cm.exception))
        self.assertNotEqual(h.returncode, 0)
        self.assertEqual(shm_names(h.instance), [])

    def test_start_timeout_kills_the_daemon(self):
        slow = fake_daemon(self.tmp, "slow", "echo waiting forever; exec sleep 600")
        h = HostdProcess(slow, tmp=self.tmp, start_timeout_s=0.5)
        t0 = time.time()
        with self.assertRaisesRegex(AssertionError, "did not create .* within 0.5 s") as cm:
            with h:
                pass
        self.assertLess(time.time() - t0, 30)
        self.assertIn("waiting forever", str(cm.exception))
        self.assertEqual(h.returncode, -signal.SIGKILL)

    def test_arguments_and_wait_ready_false(self):
        echo = fake_daemon(self.tmp, "echo", 'echo "$@"; : > "$2"; exec sleep 600')
        with HostdProcess(echo, "--model", "x", tmp=self.tmp, wait_ready=False,
                          expect_rc=-signal.SIGTERM, check_shm=False) as h:
            h.wait_socket(timeout_s=30)
            time.sleep(0.1)
            self.assertEqual(h.output().split(),
                             ["--socket", h.socket, "--instance", h.instance, "--model", "x"])

    def test_ctl_checks_the_exit_code(self):
        missing = os.path.join(self.tmp, "nobody.sock")
        with self.assertRaisesRegex(AssertionError, r"slidedpctl --socket .* status: exit \d+, "
                                                    r"expected 0"):
            ctl(SLIDEDPCTL, "status", socket=missing, timeout=60)
        r = ctl(SLIDEDPCTL, "status", socket=missing, expect=None)
        self.assertNotEqual(r.returncode, 0)
        r = ctl(SLIDEDPCTL, "status", socket=missing, expect=r.returncode)
        self.assertTrue(r.stderr)
        # Without a socket: a command that needs no hostd.
        est = ctl_json(SLIDEDPCTL, "estimate", "--model", "tiny", "--gpus", "1", "--batch", "1",
                       "--seq", "64")
        self.assertIsInstance(est, dict)

    def test_use_python_client_imports_the_abi_without_torch(self):
        harness.use_python_client()
        from slidedp import _lib
        self.assertEqual(_lib.RankOptions._fields_[0][0], "abi_version")
        self.assertNotIn("transformers", sys.modules)
        self.assertNotIn("torch", sys.modules)


if __name__ == "__main__":
    HOSTD, SLIDEDPCTL = sys.argv[1:3]
    unittest.main(argv=sys.argv[:1], verbosity=2)
