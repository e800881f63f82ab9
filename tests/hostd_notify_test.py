"""systemd's notify protocol without systemd, and deploy/install.sh into a staging root: a datagram socket stands in for the service manager
(NOTIFY_SOCKET) and asks for a watchdog (WATCHDOG_USEC). hostd must send STATUS while it creates
the job's state (with EXTEND_TIMEOUT_USEC), READY=1 once its socket listens, WATCHDOG=1 pings
with a status line naming the job -- also while a CreateJob creates a large job's state -- and
STOPPING=1 on SIGTERM, then exit 0.

    python3 tests/hostd_notify_test.py HOSTD
"""
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import unittest

import grpc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import HostdProcess  # noqa: E402
from pbwire import pb, varint  # noqa: E402

HOSTD = None


def start_notified(model, tag, recv_timeout, *extra):
    """hostd with a stand-in service manager: (its HostdProcess, its notify listener, its socket,
    the HostdProcess again for the log). Readiness is the test's: READY=1 on the listener."""
    tmp = tempfile.mkdtemp(prefix="slidedp-notify-")
    notify_path = os.path.join(tmp, "notify.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(notify_path)
    listener.settimeout(recv_timeout)
    env = dict(os.environ, NOTIFY_SOCKET=notify_path, WATCHDOG_USEC="400000")
    env.pop("WATCHDOG_PID", None)
    h = HostdProcess(HOSTD, "--model", model, "--mlock", "best_effort", "--update_threads", "1",
                     *extra, tmp=tmp, instance=f"{tag}{os.getpid()}",
                     socket=os.path.join(tmp, "hostd.sock"), log_name="hostd.log", env=env,
                     wait_ready=False).start()
    return h, listener, h.socket, h


class NotifyTest(unittest.TestCase):
    def test_ready_status_watchdog_stopping(self):
        p, listener, sock, log = start_notified("tiny", "nt", 0.5)
        messages = []

        def drain(until, stop=None):
            while time.time() < until:
                try:
                    messages.append(listener.recv(4096).decode())
                except socket.timeout:
                    continue
                if stop and stop(messages[-1]):
                    return True
            return False

        try:
            self.assertTrue(drain(time.time() + 60, lambda m: "READY=1" in m),
                            f"no READY=1: {messages}")
            self.assertTrue(os.path.exists(sock), "READY before the control socket listens")
            self.assertTrue(any(m.startswith("STATUS=creating the job's state") for m in
                                messages), messages)
            # The start timeout is extended while the state is created, and STATUS follows the
            # creation's phases (the tiny model's 7 layers).
            before_ready = messages[:messages.index(next(m for m in messages if "READY=1" in m))]
            self.assertTrue(any(m.startswith("EXTEND_TIMEOUT_USEC=") for m in before_ready),
                            before_ready)
            self.assertTrue(any("STATUS=creating job 'default': initializing weights 7/7 layers"
                                in m for m in before_ready), before_ready)
            ready = next(m for m in messages if "READY=1" in m)
            self.assertIn("STATUS=job ", ready)
            # Half the watchdog interval: at least 3 pings in 1.2 s, each with the job's status.
            n0 = len(messages)
            drain(time.time() + 1.2)
            pings = [m for m in messages[n0:] if "WATCHDOG=1" in m]
            self.assertGreaterEqual(len(pings), 3, messages[n0:])
            self.assertTrue(all("0 steps, idle, 0/1 ranks attached" in m for m in pings), pings)
            p.send_signal(signal.SIGTERM)
            self.assertTrue(drain(time.time() + 30, lambda m: "STOPPING=1" in m),
                            f"no STOPPING=1: {messages[-3:]}")
            self.assertEqual(p.wait(timeout=30), 0)
        finally:
            p.abort()  # killed if still running, its segments removed
            listener.close()
            sys.stdout.write(log.output()[-2000:] if p.returncode else "")

    def test_watchdog_pings_while_a_job_is_created(self):
        """The unit's configuration: model none, the job from a trainer's CreateJob. Creating a
        large job's state takes seconds to minutes; the watchdog's probe waited for the engine's
        lock, which CreateJob held all along, so no ping came and systemd restarted hostd. Now
        the pings go on, STATUS shows the creation's phase, and AttachRank is UNAVAILABLE until
        the job exists."""
        p, listener, sock, log = start_notified("none", "nc", 0.1,
                                                "--checkpoint.prepare_snapshot_pool", "false")
        messages = []
        try:
            deadline = time.time() + 60
            while not any("READY=1" in m for m in messages):
                self.assertLess(time.time(), deadline, messages)
                try:
                    messages.append(listener.recv(4096).decode())
                except socket.timeout:
                    pass
            channel = grpc.insecure_channel("unix:" + sock)
            # Four layers of 4000 x 4000 (64M parameters, ~0.9 GiB of shared memory): seconds to
            # initialize on one update thread.
            manifest = pb((1, "llama"), (2, "big"),
                          *[(3, pb((1, f"l{i}"), (2, 2), (3, pb((1, f"l{i}.w"),
                                                              (2, varint(4000) + varint(4000)),
                                                              (3, 2)))))
                            for i in range(4)])
            request = pb((1, pb((1, "big"), (2, manifest), (5, 1))))
            result = {}

            def create():
                try:
                    channel.unary_unary("/slidedp.v1.Control/CreateJob")(request, timeout=600)
                    result["ok"] = True
                except grpc.RpcError as e:
                    result["error"] = f"{e.code().name}: {e.details()}"

            t0 = time.time()
            creator = threading.Thread(target=create)
            creator.start()
            n0 = len(messages)
            attach_during = None
            while creator.is_alive():
                try:
                    messages.append(listener.recv(4096).decode())
                except socket.timeout:
                    pass
                if attach_during is None and any("STATUS=creating job 'big'" in m
                                                  for m in messages[n0:]):
                    try:
                        channel.unary_unary("/slidedp.v1.Control/AttachRank")(
                            pb((2, 0), (3, "0" * 16)), timeout=30)
                        attach_during = "OK"
                    except grpc.RpcError as e:
                        attach_during = f"{e.code().name}: {e.details()}"
            creation_s = time.time() - t0
            creator.join()
            self.assertTrue(result.get("ok"), result)
            during = messages[n0:]
            pings = [m for m in during if "WATCHDOG=1" in m]
            # A ping every 0.2 s; allow for a loaded machine, but a creation without pings (the
            # old probe) fails: at least one per 0.8 s of creation, and 3 at the least.
            self.assertGreaterEqual(creation_s, 1.0, "the job was created too fast to tell")
            self.assertGreaterEqual(len(pings), max(3, int(creation_s / 0.8)),
                                    f"{len(pings)} pings in {creation_s:.1f} s: {during[-5:]}")
            self.assertTrue(any("STATUS=creating job 'big':" in m for m in pings), during[:5])
            self.assertIsNotNone(attach_during, "no STATUS named the creation")
            self.assertTrue(attach_during.startswith("UNAVAILABLE: creating job 'big'"),
                            attach_during)
            channel.close()
            p.send_signal(signal.SIGTERM)
            self.assertEqual(p.wait(timeout=60), 0)
        finally:
            p.abort()  # killed if still running, its segments removed
            listener.close()
            sys.stdout.write(log.output()[-2000:] if p.returncode else "")

    def test_no_notify_socket_is_silent(self):
        """Without NOTIFY_SOCKET hostd runs as before (started by hand)."""
        env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC")}
        # Exit 0 after SIGTERM, asserted when the block ends.
        with HostdProcess(HOSTD, "--model", "tiny", "--mlock", "best_effort", "--update_threads",
                          "1", tag="nn", env=env, stop_timeout_s=30):
            pass

    def test_install_into_a_staging_root(self):
        """deploy/install.sh --root: the unit (Type=notify, watchdog, memlock, OOM score, user,
        runtime directory) points at the installed hostd, the example config parses with it, and
        a second install keeps an edited config."""
        import configparser
        import shutil
        root_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        tmp = tempfile.mkdtemp(prefix="slidedp-install-")
        bundle = os.path.join(tmp, "bundle")
        os.makedirs(os.path.join(bundle, "bin"))
        shutil.copy(HOSTD, os.path.join(bundle, "bin", "hostd"))
        stage = os.path.join(tmp, "root")
        cmd = [os.path.join(root_dir, "deploy", "install.sh"), "--bundle", bundle, "--root",
               stage, "--prefix", "/opt/sdp"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        unit = configparser.ConfigParser(strict=False, interpolation=None)
        unit.optionxform = str
        unit.read(os.path.join(stage, "etc/systemd/system/slidedp-hostd.service"))
        svc = unit["Service"]
        self.assertEqual(svc["Type"], "notify")
        self.assertEqual(svc["ExecStart"], "/opt/sdp/bin/hostd --config /etc/slidedp/hostd.toml")
        self.assertTrue(os.access(os.path.join(stage, "opt/sdp/bin/hostd"), os.X_OK))
        self.assertEqual(svc["User"], "slidedp")
        self.assertEqual(svc["RuntimeDirectory"], "slidedp")
        self.assertEqual(svc["LimitMEMLOCK"], "infinity")
        self.assertLess(int(svc["OOMScoreAdjust"]), 0)
        self.assertIn("WatchdogSec", svc)
        conf = os.path.join(stage, "etc/slidedp/hostd.toml")
        out = subprocess.run([HOSTD, "--config", conf, "--print-config"], capture_output=True,
                             text=True, check=True).stdout
        self.assertRegex(out, r'(?m)^socket = "/run/slidedp/hostd.sock" +# file$')
        with open(conf, "a") as f:
            f.write("seed = 7\n")
        r = subprocess.run(cmd, capture_output=True, text=True)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("kept the existing", r.stdout)
        self.assertIn("seed = 7", open(conf).read())
        # A bad config stops the install before anything is restarted.
        with open(conf, "a") as f:
            f.write("no_such_key = 1\n")
        r = subprocess.run(cmd, capture_output=True, text=True)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("no_such_key", r.stdout + r.stderr)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        print(__doc__)
        sys.exit(2)
    HOSTD = os.path.abspath(sys.argv.pop(1))
    unittest.main(verbosity=2)
