"""What the multi-process tests share: a hostd process and slidedpctl calls (standard library only).

    from harness import HostdProcess, ctl_json

    with HostdProcess(HOSTD, "--model", "tiny", slidedpctl=SLIDEDPCTL) as h:
        layers = h.ctl_json("layers", "--checksums")
    # here hostd has exited 0 after SIGTERM and left no segment of its instance in /dev/shm

HostdProcess starts hostd on its own instance name and unix socket (in a temporary directory
unless given), with its output in a log file, and waits until the socket exists. Leaving the
`with` block normally (or finish()) stops hostd with SIGTERM and asserts the exit code
(`expect_rc`, 0 unless told; None: the test stopped or killed hostd itself) and, with
`check_shm`, that no segment of the instance is left. Leaving it with an exception (or abort())
kills hostd and removes its segments, so a failed test leaves no daemon or shared memory behind.
Failures are AssertionErrors that carry the tail of hostd's log.

`ctl` / `ctl_json` run slidedpctl (against a socket or, with socket=None, without one) and
check its exit code.
"""
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHON_CLIENT = os.path.join(REPO, "python_client")
LOG_TAIL_CHARS = 4000

_serial = itertools.count(1)


def use_python_client():
    """Puts python_client/ first on sys.path, so `from slidedp._lib import ...` finds this tree's
    package (importing slidedp._lib needs neither torch nor transformers)."""
    if PYTHON_CLIENT not in sys.path:
        sys.path.insert(0, PYTHON_CLIENT)


def shm_names(instance):
    """The /dev/shm entries of hostd instance `instance` (segments and the instance lock)."""
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"slidedp.{instance}."))


def remove_shm(instance):
    """Unlinks what a killed hostd of `instance` left in /dev/shm; returns the names removed."""
    names = shm_names(instance)
    for n in names:
        try:
            os.unlink(os.path.join("/dev/shm", n))
        except FileNotFoundError:
            pass
    return names


def ctl(slidedpctl, *args, socket=None, expect=0, timeout=60, env=None, cwd=None):
    """Runs `slidedpctl [--socket SOCKET] ARGS...`; returns the CompletedProcess (text). Raises
    AssertionError unless it exits `expect` (None: any exit code)."""
    cmd = [slidedpctl] + (["--socket", socket] if socket else []) + [str(a) for a in args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
    if expect is not None and r.returncode != expect:
        raise AssertionError(f"slidedpctl {' '.join(cmd[1:])}: exit {r.returncode}, expected "
                             f"{expect}\nstdout: {r.stdout[-LOG_TAIL_CHARS:]}\n"
                             f"stderr: {r.stderr[-LOG_TAIL_CHARS:]}")
    return r


def ctl_json(slidedpctl, *args, socket=None, **kw):
    """ctl with --json (added unless ARGS has it); returns the parsed output."""
    args = [str(a) for a in args]
    if "--json" not in args:
        args.append("--json")
    r = ctl(slidedpctl, *args, socket=socket, **kw)
    try:
        return json.loads(r.stdout)
    except ValueError as e:
        raise AssertionError(f"slidedpctl {' '.join(args)}: not JSON ({e}): {r.stdout!r}") from e


class HostdProcess:
    """One hostd process. Attributes: socket, instance, tmp (its directory), log_path, proc.

    hostd: the binary. args: its flags besides --socket and --instance (which this class adds).
    tmp: the directory for the socket and the log (default: a new temporary directory, removed
    after a clean exit; output() still answers). instance / socket: given to restart an
    instance (a stale socket file is removed first), else derived from `tag`, the pid and a
    counter. slidedpctl: the binary that
    ctl() / ctl_json() use. env, cwd: hostd's environment and directory. wait_ready: False
    returns from start() at once (the test decides when hostd is ready). start_timeout_s: how
    long start() waits for the socket. expect_rc: the exit code a clean `with` exit asserts after
    SIGTERM (None: not checked, hostd is killed if still running). check_shm: a clean exit also
    asserts that no /dev/shm entry of the instance is left.
    """

    def __init__(self, hostd, *args, tmp=None, tag="h", instance=None, socket=None,
                 slidedpctl=None, env=None, cwd=None, wait_ready=True, start_timeout_s=60,
                 stop_timeout_s=60, expect_rc=0, check_shm=True, log_name=None):
        self.hostd = hostd
        self.args = [str(a) for a in args]
        self._own_tmp = tmp is None
        self.tmp = tmp if tmp is not None else tempfile.mkdtemp(prefix=f"slidedp-{tag}-")
        self.instance = instance or f"{tag}{os.getpid()}n{next(_serial)}"
        self.socket = socket or os.path.join(self.tmp, f"{self.instance}.sock")
        self.log_path = os.path.join(self.tmp, log_name or f"{self.instance}.log")
        self.slidedpctl = slidedpctl
        self.env, self.cwd = env, cwd
        self.wait_ready = wait_ready
        self.start_timeout_s, self.stop_timeout_s = start_timeout_s, stop_timeout_s
        self.expect_rc, self.check_shm = expect_rc, check_shm
        self.proc = None
        self._saved_output = None  # the log's text once a temporary directory of ours is gone

    # --- lifecycle ---------------------------------------------------------------------------
    def command(self):
        """hostd's argv (for a test that runs it itself, e.g. to see it refuse to start)."""
        return [self.hostd, "--socket", self.socket, "--instance", self.instance, *self.args]

    def start(self):
        """Starts hostd and (with wait_ready) waits for its socket; returns self. Raises
        AssertionError with the log's tail if hostd exits or times out first (it is killed)."""
        if os.path.exists(self.socket):
            os.unlink(self.socket)  # left by a killed hostd of this instance
        # hostd holds the log's only descriptor: the test's own fds stay as they were.
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                         env=self.env, cwd=self.cwd)
        if self.wait_ready:
            self.wait_socket()
        return self

    def wait_socket(self, timeout_s=None):
        """Waits until the control socket exists."""
        deadline = time.time() + (timeout_s or self.start_timeout_s)
        while not os.path.exists(self.socket):
            if self.proc.poll() is not None:
                raise AssertionError(f"hostd exited {self.proc.returncode} before its socket "
                                     f"existed:\n{self.output_tail()}")
            if time.time() > deadline:
                self.kill()
                raise AssertionError(f"hostd did not create {self.socket} within "
                                     f"{timeout_s or self.start_timeout_s} s:\n"
                                     f"{self.output_tail()}")
            time.sleep(0.02)

    def stop(self, sig=signal.SIGTERM, timeout_s=None):
        """Sends `sig` (if hostd still runs) and waits; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=timeout_s or self.stop_timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"hostd did not exit within {timeout_s or self.stop_timeout_s}"
                                 f" s of signal {sig}:\n{self.output_tail()}") from None

    def kill(self):
        """SIGKILL and wait; returns the exit code."""
        if self.proc.poll() is None:
            self.proc.kill()
        return self.proc.wait()

    def poll(self):
        return self.proc.poll()

    def send_signal(self, sig):
        self.proc.send_signal(sig)

    def wait(self, timeout=None):
        """Waits for hostd to exit (subprocess.Popen.wait); returns the exit code."""
        return self.proc.wait(timeout=timeout)

    @property
    def pid(self):
        return self.proc.pid

    @property
    def returncode(self):
        return self.proc.returncode

    def close(self):
        """Kills hostd if it still runs."""
        if self.proc is not None and self.proc.poll() is None:
            self.kill()

    def finish(self):
        """The clean end: SIGTERM, the exit code asserted (expect_rc), no /dev/shm entry of the
        instance left (check_shm). Returns hostd's output."""
        try:
            if self.expect_rc is not None:
                rc = self.stop()
                if rc != self.expect_rc:
                    raise AssertionError(f"hostd exited {rc}, expected {self.expect_rc}:\n"
                                         f"{self.output_tail()}")
            self.close()
            if self.check_shm and self.expect_rc is not None:
                left = remove_shm(self.instance)
                if left:
                    raise AssertionError(f"hostd left {left} in /dev/shm")
        finally:
            self.abort()
        text = self.output()
        if self._own_tmp:
            self._saved_output = text
            shutil.rmtree(self.tmp, ignore_errors=True)
        return text

    def abort(self):
        """The end after an error: hostd killed if it still runs, its segments removed."""
        self.close()
        remove_shm(self.instance)

    def __enter__(self):
        try:
            return self.start()
        except BaseException:
            self.abort()
            raise

    def __exit__(self, exc_type, exc, tb):
        if exc_type is not None:
            self.abort()
        else:
            self.finish()
        return False

    # --- what it said ------------------------------------------------------------------------
    def output(self):
        """Everything hostd wrote to stdout and stderr so far."""
        if self._saved_output is not None:
            return self._saved_output
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except FileNotFoundError:  # the test removed the directory
            return f"({self.log_path} is gone)"

    def output_tail(self, chars=LOG_TAIL_CHARS):
        return self.output()[-chars:]

    def shm_names(self):
        return shm_names(self.instance)

    # --- slidedpctl --------------------------------------------------------------------------
    def ctl(self, *args, **kw):
        """slidedpctl --socket SOCKET ARGS... (see ctl())."""
        assert self.slidedpctl, "HostdProcess(slidedpctl=...) is needed for ctl()"
        return ctl(self.slidedpctl, *args, socket=self.socket, **kw)

    def ctl_json(self, *args, **kw):
        assert self.slidedpctl, "HostdProcess(slidedpctl=...) is needed for ctl_json()"
        return ctl_json(self.slidedpctl, *args, socket=self.socket, **kw)
