#!/usr/bin/env python3
"""deploy/bundle: the bundle is self-contained, relocatable, and its manifest is true.

Usage: bundle_test.py BUNDLE_SCRIPT BUILD_DIR   (CTest passes deploy/bundle and the build folder)
Builds one stripped bundle, copies it to another folder and removes the original, then checks it
from there: ldd resolves every library inside the bundle or in the system list below; the bundled
hostd and slidedpctl run with an empty LD_LIBRARY_PATH and every library hostd maps comes from the
bundle or that list; MANIFEST.json's sizes and sha256 match the files. Python standard library only.
"""
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import HostdProcess, ctl_json  # noqa: E402

BUNDLE = BUILD = None

# Libraries the bundle may take from the target, written out here independently of the policy in
# deploy/bundle: glibc, the GCC runtime, the NVIDIA driver, and the CUDA runtime when the manifest
# says it was left out.
SYSTEM = re.compile(
    r"^(ld-linux-x86-64\.so\.2|linux-vdso\.so\.1|libc\.so\.6|libm\.so\.6|libdl\.so\.2|"
    r"libpthread\.so\.0|librt\.so\.1|libresolv\.so\.2|libutil\.so\.1|libanl\.so\.1|"
    r"libmvec\.so\.1|libnss_\w+\.so\.2|libstdc\+\+\.so\.6|libgcc_s\.so\.1)$")
DRIVER_OR_CUDA = re.compile(r"^lib(cuda|nvidia-|cudart|nccl|cublas|cublasLt)")
# Bundled libraries hostd must load from the bundle (the ones the GPU machine lacks).
MUST_BE_BUNDLED = ["libgrpc++.so", "libprotobuf.so", "libabsl_", "libspdlog.so", "libhwloc.so"]


def is_elf(path):
    with open(path, "rb") as f:
        return f.read(4) == b"\x7fELF"


def sha256(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def soname(path):
    d = subprocess.run(["readelf", "-d", "--wide", path], capture_output=True, text=True).stdout
    m = re.search(r"\(SONAME\)\s+Library soname: \[([^\]]+)\]", d)
    return m.group(1) if m else os.path.basename(path)


def clean_env():
    env = {k: v for k, v in os.environ.items() if not k.startswith("LD_")}
    env["LD_LIBRARY_PATH"] = ""
    return env


class BundleTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.mkdtemp(prefix="slidedp-bundle-")
        first = os.path.join(cls.tmp, "made", "bundle")
        r = subprocess.run([sys.executable, BUNDLE, "--build", BUILD, "--out", first, "--strip",
                            "--with-bench"], capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            raise AssertionError(f"deploy/bundle -> {r.returncode}:\n{r.stdout}\n{r.stderr}")
        print(r.stdout, file=sys.stderr)
        # A copy in another folder, the original gone: nothing may point back at either the
        # first location or the build.
        cls.root = os.path.join(cls.tmp, "elsewhere", "moved-bundle")
        shutil.copytree(first, cls.root, symlinks=True)
        shutil.rmtree(os.path.join(cls.tmp, "made"))
        with open(os.path.join(cls.root, "MANIFEST.json")) as f:
            cls.manifest = json.load(f)
        cls.elves = []
        for d, _, files in os.walk(cls.root):
            cls.elves += [os.path.join(d, f) for f in files if is_elf(os.path.join(d, f))]

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def inside(self, path):
        return os.path.realpath(path).startswith(os.path.realpath(self.root) + os.sep)

    def external_ok(self, soname):
        # A CUDA or driver library is the target's, also one that only another CUDA library
        # needs (libcublasLt through libcublas), which the manifest does not list.
        return bool(DRIVER_OR_CUDA.match(soname))

    def test_contents(self):
        paths = {f["path"] for f in self.manifest["files"]}
        for p in ("bin/hostd", "bin/slidedpctl", "bin/native_trainer", "bin/slidedp-env",
                  "lib/libslidedp_rank.so"):
            self.assertIn(p, paths)
        benches = set()
        for d, dirs, files in os.walk(BUILD):
            dirs[:] = [x for x in dirs if x != "CMakeFiles"]
            benches |= {f"bin/{f}" for f in files if f.endswith("_bench")}
        self.assertIn("bin/adam_bench", benches)
        self.assertLessEqual(benches, paths, "--with-bench bundles every *_bench")
        for p in paths:
            name = os.path.basename(p)
            self.assertFalse(SYSTEM.match(name) or re.match(r"^lib(cuda|nvidia-)", name),
                             f"{p}: a system or driver library must not be bundled")

    def test_ldd_resolves_inside_bundle(self):
        self.assertGreater(len(self.elves), 10)
        kinds = {f["path"]: f["kind"] for f in self.manifest["files"]}
        for elf in self.elves:
            rel = os.path.relpath(elf, self.root)
            d = subprocess.run(["readelf", "-d", "--wide", elf], capture_output=True, text=True,
                               check=True).stdout
            rpath = re.findall(r"\((RPATH|RUNPATH)\)\s+Library \w+: \[([^\]]*)\]", d)
            if kinds[rel] == "cuda":  # copied verbatim: RUNPATH $ORIGIN or none
                self.assertIn(rpath, ([], [("RUNPATH", "$ORIGIN")], [("RPATH", "$ORIGIN")]), rel)
            else:
                self.assertEqual(len(rpath), 1, f"{rel}: {rpath}")
                self.assertEqual(rpath[0][0], "RPATH", rel)
                self.assertTrue(rpath[0][1].startswith("$ORIGIN"), f"{rel}: {rpath[0][1]}")
            r = subprocess.run(["ldd", elf], capture_output=True, text=True, env=clean_env())
            self.assertEqual(r.returncode, 0, f"ldd {rel}: {r.stderr}")
            self.assertNotIn("not found", r.stdout.replace("=> not found", "") + r.stderr)
            for soname, where in re.findall(r"^\s*(\S+)\s+=>\s+(not found|\S+)", r.stdout,
                                            re.M):
                if SYSTEM.match(soname) or self.external_ok(soname):
                    continue
                self.assertNotEqual(where, "not found", f"{rel}: {soname} not found")
                self.assertTrue(self.inside(where), f"{rel}: {soname} => {where}, outside")

    def test_relocated_hostd_and_slidedpctl(self):
        bindir = os.path.join(self.root, "bin")
        # SIGTERM at the end of the block: exit 0, no segment of the instance left.
        with HostdProcess(os.path.join(bindir, "hostd"), "--model", "tiny", "--update_threads",
                          "0", tmp=self.tmp, instance=f"bundle{os.getpid()}",
                          socket=os.path.join(self.tmp, "s.sock"), log_name="hostd.log",
                          env=clean_env(), cwd=self.tmp, start_timeout_s=240) as hostd:
            with open(f"/proc/{hostd.pid}/maps") as f:
                mapped = {line.split()[-1] for line in f
                          if re.search(r"\.so(\.[0-9.]+)?$", line.split()[-1])}
            for lib in mapped:
                name = soname(lib)
                self.assertTrue(self.inside(lib) or SYSTEM.match(name) or self.external_ok(name),
                                f"hostd mapped {lib}, neither the bundle's nor a system library")
            for prefix in MUST_BE_BUNDLED:
                hits = [l for l in mapped if os.path.basename(l).startswith(prefix)]
                self.assertTrue(hits, f"hostd has no {prefix}* mapped: {sorted(mapped)}")
                for h in hits:
                    self.assertTrue(self.inside(h), f"{h} is not the bundle's")
            layers = ctl_json(os.path.join(bindir, "slidedpctl"), "status", socket=hostd.socket,
                              env=clean_env())["layers"]
            self.assertEqual(len(layers), 7, layers)

    def test_manifest_matches_files(self):
        on_disk = set()
        for d, _, files in os.walk(self.root):
            on_disk |= {os.path.relpath(os.path.join(d, f), self.root) for f in files}
        on_disk.discard("MANIFEST.json")
        self.assertEqual({f["path"] for f in self.manifest["files"]}, on_disk)
        for f in self.manifest["files"]:
            p = os.path.join(self.root, f["path"])
            self.assertEqual(os.path.getsize(p), f["size_bytes"], f["path"])
            self.assertEqual(sha256(p), f["sha256"], f["path"])
        self.assertEqual(self.manifest["total_bytes"],
                         sum(f["size_bytes"] for f in self.manifest["files"]))
        self.assertRegex(self.manifest["git_revision"] or "", r"^[0-9a-f]{40}$")
        self.assertRegex(self.manifest["source_machine"]["glibc"], r"^2\.\d+$")
        # The newest GLIBC_ any bundled ELF needs, recomputed here with objdump -T.
        newest = (2, 0)
        for elf in self.elves:
            t = subprocess.run(["objdump", "-T", elf], capture_output=True, text=True).stdout
            for v in re.findall(r"\(GLIBC_(\d+\.\d+(?:\.\d+)?)\)", t):
                newest = max(newest, tuple(int(x) for x in v.split(".")))
        need = tuple(int(x) for x in self.manifest["requires"]["GLIBC"].split("."))
        self.assertEqual(need, newest)

    def test_size_of_the_core_bundle(self):
        # hostd + slidedpctl + native_trainer and every library: what goes to the GPU machine,
        # whose transfer limit is 64 MiB in all.
        skip = {"bench", "gpu_test"}
        core = sum(f["size_bytes"] for f in self.manifest["files"] if f["kind"] not in skip)
        self.assertLess(core, 40 << 20, f"{core / (1 << 20):.1f} MiB")

    def test_slidedp_env(self):
        env = os.path.join(self.root, "bin", "slidedp-env")
        r = subprocess.run([env, "--verify", "--json"], capture_output=True, text=True,
                           env=clean_env(), timeout=60)
        out = json.loads(r.stdout)
        glibc = [c for c in out["checks"] if c["check"] == "glibc"][0]
        self.assertTrue(glibc["ok"], glibc)
        sha = [c for c in out["checks"] if c["check"] == "sha256"][0]
        self.assertTrue(sha["ok"], sha)
        self.assertEqual(r.returncode, 0 if out["ok"] else 1)
        # A manifest asking for a glibc from the future: named, with the files that need it.
        m = dict(self.manifest)
        m["requires_versions"] = dict(m["requires_versions"])
        m["requires_versions"]["libc.so.6"] = m["requires_versions"]["libc.so.6"] + ["GLIBC_9.99"]
        m["files"] = [dict(f) for f in m["files"]]
        hostd = [f for f in m["files"] if f["path"] == "bin/hostd"][0]
        hostd["requires_versions"] = dict(hostd["requires_versions"])
        hostd["requires_versions"]["libc.so.6"] = hostd["requires_versions"]["libc.so.6"] + [
            "GLIBC_9.99"]
        fake = os.path.join(self.tmp, "fake")
        os.makedirs(os.path.join(fake, "bin"))
        shutil.copy(env, os.path.join(fake, "bin"))
        with open(os.path.join(fake, "MANIFEST.json"), "w") as f:
            json.dump(m, f)
        r = subprocess.run([os.path.join(fake, "bin", "slidedp-env")], capture_output=True,
                           text=True, timeout=60)
        self.assertEqual(r.returncode, 1, r.stdout)
        self.assertIn("GLIBC_9.99", r.stdout)
        self.assertRegex(r.stdout, r"GLIBC_9\.99 \(from libc\.so\.6\) needed by bin/hostd")

    def test_build_without_hostd_is_an_error(self):
        empty = tempfile.mkdtemp(dir=self.tmp)
        r = subprocess.run([sys.executable, BUNDLE, "--build", empty, "--out",
                            os.path.join(self.tmp, "never")], capture_output=True, text=True,
                           timeout=60)
        self.assertEqual(r.returncode, 1)
        self.assertIn("hostd not found", r.stderr)
        self.assertIn(os.path.join(empty, "hostd", "hostd"), r.stderr)
        self.assertFalse(os.path.exists(os.path.join(self.tmp, "never")))


if __name__ == "__main__":
    BUNDLE, BUILD = sys.argv[1], sys.argv[2]
    unittest.main(argv=sys.argv[:1], verbosity=2)
