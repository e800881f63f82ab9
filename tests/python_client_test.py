#!/usr/bin/env python3
"""python_client against a real hostd on the CPU, compared with one process training the whole
global batch with torch.optim.AdamW (issue #5, acceptance 1).

Usage: python_client_test.py HOSTD LIBSLIDEDP_RANK.so [--device cpu|cuda]

With --device cuda (CTest python_client_gpu_test, label gpu; exits 77 without CUDA) the ranks
compute in BF16 on the GPU through the GPU data plane (2 ranks share the one GPU on the
CPU-reduction route) and push BF16 gradients; the reference computes in BF16 on the GPU with FP32
master weights.

Each case writes a tiny Qwen3-shaped model (examples/train_hf.py prepare: config.json +
model.safetensors), starts hostd on that directory (hostd imports the weights), runs the ranks
with torchrun (examples/train_hf.py train, 2 processes), and compares
  - every step's global loss (mean of the ranks' losses: equal row counts, no padding) with the
    reference's loss on the whole global batch, and
  - hostd's final BF16 parameters (fetched by rank 0) with the reference's FP32 master rounded
    to BF16.
The reference: one process, the same init and data order, FP32 master weights in
torch.optim.AdamW (same lr, betas, eps, weight decay; no decay for norm weights and biases, as
hostd), each step's forward/backward with the master weights rounded to BF16 (what hostd
streams), the gradient in FP32 (the job's grad dtype).

Stated tolerance, CPU (FP32 compute, FP32 gradients; the differences left are the order of the
cross-rank gradient sum and AdamW's rounding, which can flip a BF16 rounding): every step's
|loss - reference| <= 1e-4 * reference loss; final parameters: relative L2 distance <= 2e-3 and
>= 90% of the BF16 values identical (measured: 1.1e-6 / 1.4e-6, 8e-5 / 2.4e-4, 98.9% / 94.6%;
accumulating micro-batches sums in another order, so more BF16 roundings flip). GPU (BF16 compute and gradients; two half batches are not
one whole batch in BF16, so BF16 gradients and then BF16 roundings of the parameters differ):
every step's |loss - reference| <= 2e-3 * reference loss; final parameters: relative L2 <= 1e-2,
>= 50% of the BF16 values identical (H200, tied/no recompute/2 micro-batches: 5.3e-5, 1.05e-3,
66%).
"""
import json
import os
import socket as socketlib
import subprocess
import sys
import tempfile
import time
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python_client"))
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, os.path.join(ROOT, "tests"))
from harness import HostdProcess, remove_shm  # noqa: E402

HOSTD = LIB = None
DEVICE = "cpu"
LR, WD, BETAS, EPS = 1e-3, 0.01, (0.9, 0.999), 1e-8
STEPS, BATCH, SEQ = 20, 8, 32
# (loss rtol, final params rel L2, fraction of BF16 parameters bit-identical to the one-process
# reference). The last is a summation-order figure, not a correctness bound: ranks accumulating
# micro-batches add in another order than one process on the global batch. torch 2.15's CPU
# kernels give 88.9% on the tied no-recompute accumulation case, the same with the
# python client of 3dedfe9, so the bound is 0.85; rel L2 (4.6e-4 there) is the accuracy check.
TOL = {"cpu": (1e-4, 2e-3, 0.85), "cuda": (2e-3, 1e-2, 0.50)}
SENTENCES = ["the quick brown fox jumps over the lazy dog. ", "a stitch in time saves nine. ",
             "all that glitters is not gold. ", "to be or not to be, that is the question. ",
             "slidedp streams layers through a small gpu window. "]


def write_text(path, seed=3):
    import random
    rng = random.Random(seed)
    with open(path, "w") as f:
        f.write("".join(rng.choice(SENTENCES) for _ in range(400)))
    return path


def free_port():
    with socketlib.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def reference(model_dir, steps, batch, seq, data, device="cpu"):
    """One process on the whole global batch; FP32 master weights in torch.optim.AdamW; compute
    with the master rounded to BF16 (in FP32 on the CPU, in BF16 on the GPU)."""
    import torch
    import transformers
    import train_hf
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.config._attn_implementation = "sdpa"
    compute = torch.float32 if device == "cpu" else torch.bfloat16
    # Parameters in the compute dtype, buffers (rotary inv_freq) left in FP32, as mixed-precision
    # training does (and as slidedp, which streams only the parameters).
    model.to(device=device)
    for p in model.parameters():
        p.data = p.data.to(compute)
    model.train()
    named = list(model.named_parameters())
    init = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    init_named = dict(init.named_parameters())
    masters = [init_named[n].detach().clone().to(device) for n, _ in named]
    del init
    decay = [m for (n, _), m in zip(named, masters) if not ("norm" in n or n.endswith(".bias"))]
    no_decay = [m for (n, _), m in zip(named, masters) if "norm" in n or n.endswith(".bias")]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WD},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=LR, betas=BETAS, eps=EPS, foreach=False)
    tokens = train_hf.load_tokens(data, model.config.vocab_size, 1, (steps + 1) * batch * seq)
    losses = []
    for k in range(steps):
        with torch.no_grad():
            for (_, p), m in zip(named, masters):
                p.copy_(m.to(torch.bfloat16).to(compute))
        x = torch.from_numpy(train_hf.batch_rows(tokens, k, batch, seq).copy()).to(device)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        for (_, p), m in zip(named, masters):
            m.grad = p.grad.detach().float()
            p.grad = None
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    final = {n: m.to(torch.bfloat16).cpu() for (n, _), m in zip(named, masters)}
    return losses, final


class PythonClientTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp(prefix="slidedp-pyclient-")
        self.procs = []
        self.hostds = []
        self.refs = {}
        self.data = write_text(os.path.join(self.tmp, "data.txt"))

    def tearDown(self):
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
        for h in self.hostds:
            try:
                h.stop(timeout_s=10)
            except AssertionError:
                pass  # killed
            h.close()

    def prepare(self, name, shape, seed=0):
        d = os.path.join(self.tmp, name)
        r = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "train_hf.py"),
                            "prepare", d, "--model", shape, "--seed", str(seed)],
                           capture_output=True, text=True, timeout=300)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        return d

    def start_hostd(self, model_dir, world, tag, extra=()):
        """hostd on instance py<pid><tag>; returns (socket, its HostdProcess)."""
        h = HostdProcess(HOSTD, "--model", model_dir, "--world_size", str(world),
                         "--mlock", "best_effort", "--update_threads", "1",
                         "--lr", str(LR), "--weight_decay", str(WD),
                         "--beta1", str(BETAS[0]), "--beta2", str(BETAS[1]), "--eps",
                         str(EPS), "--grad_dtype", "fp32" if DEVICE == "cpu" else "bf16",
                         *extra, tmp=self.tmp, instance=f"py{os.getpid()}{tag}",
                         socket=os.path.join(self.tmp, f"{tag}.sock"),
                         log_name=f"hostd-{tag}.log")
        self.hostds.append(h)
        return h.start().socket, h

    def run_ranks(self, sock, model_dir, world, tag, extra=(), steps=STEPS):
        env = dict(os.environ, SLIDEDP_RANK_LIB=LIB, OMP_NUM_THREADS="1")
        logs = [os.path.join(self.tmp, f"{tag}-loss{r}.jsonl") for r in range(world)]
        dump = os.path.join(self.tmp, f"{tag}-params.pt")
        # One rank runs without the launcher (train_hf.py defaults to rank 0 of 1).
        launch = [sys.executable] if world == 1 else [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
            "--master-addr", "127.0.0.1", "--master-port", str(free_port())]
        cmd = [*launch, os.path.join(ROOT, "examples", "train_hf.py"), "train", "--hostd", sock,
               "--model", model_dir, "--batch", str(BATCH), "--seq", str(SEQ), "--steps",
               str(steps), "--device", DEVICE, "--threads", "1", "--no-progress",
               "--data", self.data,
               "--loss-log", os.path.join(self.tmp, f"{tag}-loss{{rank}}.jsonl"),
               "--dump-params", dump, *extra]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
        self.assertEqual(r.returncode, 0, r.stdout[-4000:] + r.stderr[-8000:])
        per_rank = []
        for path in logs:
            with open(path) as f:
                per_rank.append([json.loads(line) for line in f])
        return per_rank, dump

    def check_against_reference(self, model_dir, per_rank, dump, label):
        import torch
        loss_rtol, param_rl2, param_same = TOL[DEVICE]
        if model_dir not in self.refs:  # one reference per model for the cases of a test
            self.refs[model_dir] = reference(model_dir, STEPS, BATCH, SEQ, self.data, DEVICE)
        ref_losses, ref_final = self.refs[model_dir]
        self.assertEqual(len(per_rank[0]), STEPS)
        worst = 0.0
        for k in range(STEPS):
            got = sum(r[k]["loss"] for r in per_rank) / len(per_rank)
            rel = abs(got - ref_losses[k]) / ref_losses[k]
            worst = max(worst, rel)
            self.assertLessEqual(rel, loss_rtol, f"{label}: step {k + 1}: loss {got} vs "
                                                 f"reference {ref_losses[k]}")
        self.assertLess(ref_losses[-1], ref_losses[0] - 0.5, "the reference must train")
        got = torch.load(dump)
        self.assertEqual(set(got), set(n for n in ref_final if n != "lm_head.weight" or
                                       n in got))
        num = den = 0.0
        same = total = 0
        for n, t in got.items():
            r = ref_final[n]
            d = t.float() - r.float()
            num += float(d.square().sum())
            den += float(r.float().square().sum())
            same += int((t.view(torch.int16) == r.view(torch.int16)).sum())
            total += t.numel()
        rl2 = (num / den) ** 0.5
        print(f"{label}: worst step |dloss|/loss {worst:.2e}, final params rel L2 {rl2:.2e}, "
              f"{100.0 * same / total:.2f}% identical", flush=True)
        self.assertLessEqual(rl2, param_rl2, label)
        self.assertGreaterEqual(same / total, param_same, label)
        # The parameters moved: training through hostd is not a no-op.
        import safetensors.torch
        init = safetensors.torch.load_file(os.path.join(model_dir, "model.safetensors"))
        moved = sum(int((got[n] != init[n].to(torch.bfloat16)).sum()) for n in got)
        self.assertGreater(moved, total // 2, label)

    def test_two_ranks_full_recompute_untied(self):
        d = self.prepare("untied", "qwen3-tiny")
        sock, _ = self.start_hostd(d, 2, "a")
        per_rank, dump = self.run_ranks(sock, d, 2, "a", ["--checkpointing", "full"])
        self.check_against_reference(d, per_rank, dump, "2 ranks, full recompute, untied")

    def test_two_ranks_no_recompute_tied_accumulation(self):
        d = self.prepare("tied", "qwen3-tiny-tied")
        sock, _ = self.start_hostd(d, 2, "b")
        per_rank, dump = self.run_ranks(sock, d, 2, "b", ["--checkpointing", "none",
                                                         "--accum", "2"])
        self.check_against_reference(d, per_rank, dump,
                                     "2 ranks, no recompute, tied, 2 micro-batches")

    def test_two_ranks_resident_nondecoder(self):
        """nondecoder="resident" and resident_layers=1: embeddings, the first decoder layer, the
        final norm and lm_head stay on the device and are updated there (their gradients
        all-reduced over the process group); hostd updates only the other decoder layers and
        completes each step without them."""
        d = self.prepare("resident", "qwen3-tiny")
        sock, _ = self.start_hostd(d, 2, "r")
        # gloo: it all-reduces CUDA tensors too, and NCCL refuses two ranks on one GPU.
        per_rank, dump = self.run_ranks(sock, d, 2, "r", ["--checkpointing", "full",
                                                         "--nondecoder", "resident",
                                                         "--resident-layers", "1",
                                                         "--dist-backend", "gloo"])
        self.check_against_reference(d, per_rank, dump,
                                     "2 ranks, resident non-decoder layers and first layer")
        # hostd ran every step without those layers' gradients (embedding 0, decoder layer 1,
        # norm 5, lm_head 6 of the 4-layer model) and says so.
        ctl = os.path.join(os.path.dirname(HOSTD), "slidedpctl")  # a bundle's bin/
        if not os.path.exists(ctl):  # the build tree
            ctl = os.path.join(os.path.dirname(os.path.dirname(HOSTD)), "slidedpctl", "slidedpctl")
        out = subprocess.run([ctl, "--socket", sock, "status", "--json"], capture_output=True,
                             text=True, check=True).stdout
        job = json.loads(out)["job"]
        self.assertEqual(job["client_updated_layers"], [0, 1, 5, 6], out)
        self.assertEqual(int(job["step"]), STEPS, out)

    def test_resident_layers_checkpoint_and_resume(self):
        """nondecoder="resident" with hostd's checkpoints: a checkpoint of step 3 (every_steps 3)
        asks rank 0 for the resident layers (embedding, norm, lm_head) and waits for its upload;
        the close uploads step 5's, which the final checkpoint of a clean stop holds. A hostd
        resumed from either checkpoint gives the resident layers back to the rank (master, m,
        v), and training goes on bit-identical to an uninterrupted run."""
        if DEVICE != "cpu":
            self.skipTest("bit-exact resume runs in the CPU variant (python_client_test)")
        import torch
        d = self.prepare("ckres", "qwen3-tiny")
        res = ["--checkpointing", "full", "--nondecoder", "resident"]
        # Tags unique in this file: an instance name of another test would re-adopt its state.
        sock, _ = self.start_hostd(d, 1, "ru")
        full, full_dump = self.run_ranks(sock, d, 1, "ru", res, steps=6)
        ck = os.path.join(self.tmp, "ck")
        sock, hostd = self.start_hostd(d, 1, "rc", ["--checkpoint.dir", ck,
                                                   "--checkpoint.every_steps", "3",
                                                   "--checkpoint.keep_last", "5"])
        part, _ = self.run_ranks(sock, d, 1, "rc", res, steps=5)
        text = hostd.finish()  # SIGTERM, exit 0, no segment left
        self.assertIn("asking rank 0 for its state of layers [0, 5, 6] at version 3", text)
        self.assertIn("checkpoint of step 3 committed", text)
        self.assertIn("at version 5 (uploaded by rank 0)", text)
        self.assertIn("checkpoint of step 5 committed", text)
        for k in range(5):  # the same job so far
            self.assertEqual(part[0][k]["loss"], full[0][k]["loss"], f"step {k + 1}")
        full_final = torch.load(full_dump)
        step3 = os.path.join(ck, f"step-000000000003.py{os.getpid()}rc.default")  # instance, job
        for step_dir, tag, steps in ((step3, "r3", 3),
                                     (ck, "r5", 1)):  # the directory: its newest, step 5
            sock, _ = self.start_hostd(d, 1, tag, ["--checkpoint.resume", step_dir])
            got, dump = self.run_ranks(sock, d, 1, tag, res, steps=steps)
            first = 6 - steps
            for k in range(steps):
                self.assertEqual(got[0][k]["step"], first + k + 1)
                self.assertEqual(got[0][k]["loss"], full[0][first + k]["loss"],
                                 f"{tag}: step {first + k + 1}")
            final = torch.load(dump)
            for n, t in full_final.items():
                self.assertTrue(torch.equal(final[n], t), f"{tag}: {n}")
        # Without the upload hostd's copy is stale: a resident attach to the job is refused.
        sock, hostd = self.start_hostd(d, 1, "rs")
        env = dict(os.environ, SLIDEDP_RANK_LIB=LIB, OMP_NUM_THREADS="1",
                   PYTHONPATH=os.path.join(ROOT, "python_client"))
        code = ("import sys, torch, slidedp; sys.path.insert(0, %r); import train_hf\n"
                "cfg = train_hf.make_config(%r); m = train_hf.build_model(cfg, 0)\n"
                "m, opt = slidedp.attach(m, hostd=%r, device='cpu', nondecoder='resident', "
                "verify_init=False)\n"
                "x = torch.zeros(1, 8, dtype=torch.long); m(input_ids=x, labels=x).loss.backward()\n"
                "opt.step(); m.slidedp.rank.wait_step(1); import os; os._exit(0)\n"
                % (os.path.join(ROOT, "examples"), d, sock))
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=300, env=env)
        self.assertEqual(r.returncode, 0, r.stderr[-3000:])
        code2 = code.replace("opt.step(); m.slidedp.rank.wait_step(1); import os; os._exit(0)",
                             "pass")
        r = subprocess.run([sys.executable, "-c", code2], capture_output=True, text=True,
                           timeout=300, env=env)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("copy of the resident layers", r.stderr[-3000:])
        self.assertIn("--resume", r.stderr[-3000:])

    def test_activation_offload(self):
        """offload_ratio: the saved activations of a fraction of the decoder layers go to host
        memory in forward and come back (prefetched one layer ahead) for backward. One rank, 2
        micro-batches, every saved tensor but the parameters offloaded (offload_min_bytes 0).
        r=0.5 without recompute (decoder layers 1 and 3: all their saved tensors) and r=1.0 with
        full recompute (every layer's saved input) must equal the r=0 run bit for bit on the CPU
        (same values, same strides: the same kernels run on them); each run, r=0 too, is
        checked against the single-process AdamW reference; every offloaded tensor must come
        back through the prefetch (no misses), from host buffers reused across steps."""
        import torch
        d = self.prepare("offload", "qwen3-tiny-tied")
        # nondecoder "host": the configuration whose GPU tolerance was measured (with resident
        # layers the r=0 run itself had 46.5% identical BF16 values on the H200, under the 50%).
        common = ["--accum", "2", "--offload-min-bytes", "0", "--nondecoder", "host"]
        runs = {}
        for tag, ckpt, ratio in [("o0", "none", "0"), ("o1", "none", "0.5"),
                                 ("o2", "full", "1.0")]:
            sock, p = self.start_hostd(d, 1, tag)
            runs[tag] = self.run_ranks(sock, d, 1, tag, ["--checkpointing", ckpt,
                                                         "--offload-ratio", ratio, *common])
            p.stop()
            label = f"1 rank, checkpointing {ckpt}, offload_ratio {ratio}, 2 micro-batches"
            self.check_against_reference(d, *runs[tag], label)
            log = runs[tag][0][0]
            if ratio == "0":
                self.assertTrue(all(r["activation_offload_bytes"] == 0 for r in log), label)
                continue
            for r in log:
                self.assertGreater(r["activation_offload_bytes"], 0, label)
                self.assertEqual(r["activation_prefetch_bytes"], r["activation_offload_bytes"],
                                 label)
                self.assertEqual(r["activation_prefetch_misses"], 0, label)
                self.assertGreaterEqual(r["activation_prefetch_wait_s"], 0.0, label)
            # The first step allocates the host buffers; later steps reuse them.
            self.assertEqual({r["activation_offload_pool_bytes"] for r in log},
                             {log[0]["activation_offload_pool_bytes"]}, label)
        # Full recompute offloads only each layer's input: less than r=0.5 without recompute.
        self.assertLess(runs["o2"][0][0][0]["activation_offload_bytes"],
                        runs["o1"][0][0][0]["activation_offload_bytes"])
        if DEVICE != "cpu":
            return
        base_log, base_dump = runs["o0"]
        base = torch.load(base_dump)
        for tag in ("o1", "o2"):
            log, dump = runs[tag]
            self.assertEqual([r["loss"] for r in log[0]], [r["loss"] for r in base_log[0]], tag)
            got = torch.load(dump)
            for n, t in base.items():
                self.assertTrue(torch.equal(got[n], t), f"{tag}: {n}")

    def test_window_schedule_on_cpu(self):
        """The GPU backend's window discipline (fixed slots, prefetch, saved views of a slot
        turned into tokens and fetched again in backward) run on the host with BF16 compute:
        losses and final parameters must equal, bit for bit, plain BF16 CPU training with every
        layer's host copy kept, for recompute and no recompute and a window that forces every
        slot to be reused."""
        import torch
        import transformers
        import slidedp
        import train_hf
        if DEVICE != "cpu":
            self.skipTest("runs in the CPU variant (python_client_test)")
        os.environ["SLIDEDP_RANK_LIB"] = LIB
        d = self.prepare("window", "qwen3-tiny-tied")

        def train(tag, **kw):
            sock, p = self.start_hostd(d, 1, tag)
            model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16)
            model.train()  # checkpointing recomputes in training mode only
            model, opt = slidedp.attach(model, hostd=sock, device="cpu", **kw)
            tokens = train_hf.load_tokens(self.data, model.config.vocab_size, 1, 6 * 4 * 32)
            losses = []
            for k in range(5):
                x = torch.from_numpy(train_hf.batch_rows(tokens, k, 4, 32).copy())
                loss = model(input_ids=x, labels=x).loss
                loss.backward()
                opt.step()
                losses.append(float(loss))
            final = model.slidedp.fetch_state_dict()
            opt.close()
            p.stop()
            return losses, final

        base_losses, base_final = train("w0", checkpointing="none")
        self.assertLess(base_losses[-1], base_losses[0])
        for tag, kw in [("w1", dict(cpu_window=True, checkpointing="full")),
                        ("w2", dict(cpu_window=True, checkpointing="none")),
                        ("w3", dict(cpu_window=True, checkpointing="none", window_slots=5,
                                    prefetch=1)),
                        ("w4", dict(cpu_window=True, checkpointing="full", window_slots=5,
                                    prefetch=1)),
                        # Activation offload next to the window's tokens (saved views of a slot
                        # are tokens, never offloaded).
                        ("w6", dict(cpu_window=True, checkpointing="none", window_slots=5,
                                    prefetch=1, offload_ratio=1.0, offload_min_bytes=0)),
                        ("w7", dict(cpu_window=True, checkpointing=0.5, offload_ratio=0.5,
                                    offload_min_bytes=0))]:
            with self.subTest(tag, **kw):
                losses, final = train(tag, **kw)
                self.assertEqual(losses, base_losses)
                for n, t in base_final.items():
                    self.assertTrue(torch.equal(final[n], t), n)
        with self.assertRaises(slidedp.SlideDPError) as cm:
            train("w5", cpu_window=True, window_slots=4)
        self.assertIn("window_slots: 4, expected >= 6", str(cm.exception))

    def test_layout_candidates_bit_exact(self):
        """Every activation candidate of a layout (F, Seg, SAC, N, each with offload ratios 0,
        0.5 and 1; slidedp/policy.py) changes only what is saved: losses and hostd's final
        parameters equal those of every layer recomputed (F) bit for bit, through the window's
        schedule (BF16 compute) and the plain host copies, for the three families; a resident
        layer (R) sees the same first loss. A layout's preflight estimate follows its kinds."""
        import torch
        import slidedp
        import train_hf
        from slidedp import preflight
        if DEVICE != "cpu":
            self.skipTest("runs in the CPU variant (python_client_test)")
        os.environ["SLIDEDP_RANK_LIB"] = LIB

        def train(d, tag, **kw):
            sock, p = self.start_hostd(d, 1, tag)
            model = train_hf.build_model(train_hf.make_config(shapes[d]), 0).to(torch.bfloat16)
            model.train()
            model, opt = slidedp.attach(model, hostd=sock, device="cpu", offload_min_bytes=0,
                                        verify_init=False, **kw)
            for layer in model.model.layers:
                layer.mlp.down_proj.register_forward_pre_hook(count_replay)
            tokens = train_hf.load_tokens(self.data, model.config.vocab_size, 1, 4 * 4 * 32)
            losses, moved = [], 0
            for k in range(3):
                x = torch.from_numpy(train_hf.batch_rows(tokens, k, 4, 32).copy())
                loss = model(input_ids=x, labels=x).loss
                counts["backward"] = True
                loss.backward()
                counts["backward"] = False
                stats = opt.step()
                moved += stats["activation_offload_bytes"]
                losses.append(float(loss))
            final = model.slidedp.fetch_state_dict()
            opt.close()
            p.stop()
            return losses, final, moved

        # What backward replays: each decoder layer's down_proj forward starts again in backward
        # (a pre-hook: checkpoint stops the replay once the last saved tensor is back)
        # for F, Seg and SAC and not for N; SAC caches the matmul and attention outputs of its
        # forward (the policy answers MUST_SAVE for them) for the replay.
        from slidedp import policy as policy_mod
        counts = {"backward": False, "replayed": 0, "cached": 0}
        sac_policy = policy_mod._sac_policy

        def counting_policy(ctx, func, *args, **kwargs):
            verdict = sac_policy(ctx, func, *args, **kwargs)
            if not ctx.is_recompute and func in policy_mod._SAC_SAVED:
                counts["cached"] += 1
            return verdict

        def count_replay(module, args):
            if counts["backward"]:
                counts["replayed"] += 1

        policy_mod._sac_policy = counting_policy
        self.addCleanup(setattr, policy_mod, "_sac_policy", sac_policy)
        shapes = {}
        for shape in ("qwen3-tiny-tied", "llama-tiny", "qwen2-tiny"):
            shapes[self.prepare("layout-" + shape, shape)] = shape
        dirs = list(shapes)
        base = {d: train(d, f"l{i}F", cpu_window=True, policy="4F-r0")
                for i, d in enumerate(dirs)}
        self.assertLess(base[dirs[0]][0][-1], base[dirs[0]][0][0])
        self.assertEqual(base[dirs[0]][2], 0)
        # Over the 3 steps: layers replayed in backward (F, Seg, SAC) and outputs SAC cached.
        for i, (layout, replayed, sac) in enumerate((
                ("4F-r0", 4, 0), ("4N-r0", 0, 0), ("4SAC-r0", 4, 4), ("4Seg-r0", 4, 0),
                ("1F 1SAC 1N 1Seg", 3, 1))):
            with self.subTest("what backward replays", policy=layout):
                counts.update(replayed=0, cached=0)
                train(dirs[0], f"m{i}", cpu_window=True, policy=layout)
                self.assertEqual(counts["replayed"], 3 * replayed)
                if sac:
                    self.assertEqual(counts["cached"] % (3 * sac), 0)
                    self.assertGreaterEqual(counts["cached"], 3 * sac * 7)
                else:
                    self.assertEqual(counts["cached"], 0)
        cases = [
            (0, "1Seg-r0 1SAC-r0 1N-r0 1F-r1", dict(cpu_window=True)),
            (0, "1Seg-r0.5 1SAC-r0.5 1N-r0.5 1F-r0.5", dict(cpu_window=True)),
            (0, "1N-r1 1Seg-r1 1SAC-r1 1F-r0", dict(cpu_window=True, window_slots=5,
                                                    prefetch=1)),
            (0, "1SAC-r1 1Seg-r0.5 1N-r0.5 1F-r1", dict(cpu_window=False)),
            (1, "1Seg-r0 1SAC-r0.5 1N-r1 1F-r0", dict(cpu_window=True)),
            (2, "1N-r0 1SAC-r1 1Seg-r0.5 1F-r0", dict(cpu_window=True)),
        ]
        for i, (di, layout, kw) in enumerate(cases):
            with self.subTest(shapes[dirs[di]], policy=layout, **kw):
                losses, final, moved = train(dirs[di], f"l{i}", policy=layout, **kw)
                self.assertEqual(losses, base[dirs[di]][0])
                for n, t in base[dirs[di]][1].items():
                    self.assertTrue(torch.equal(final[n], t), n)
                if "-r0.5" in layout or "-r1" in layout:
                    self.assertGreater(moved, 0)
        # r=0.5 moves about half of what r=1 moves, r=0 nothing (N layers, many saved tensors).
        moved = {r: train(dirs[0], f"lr{i}", cpu_window=True, policy=f"4N-r{r}")[2]
                 for i, r in enumerate((0, 0.5, 1))}
        self.assertEqual(moved[0], 0)
        self.assertGreater(moved[0.5], 0.3 * moved[1])
        self.assertLess(moved[0.5], 0.7 * moved[1])
        losses, _, _ = train(dirs[0], "lR", cpu_window=True, policy="1R 1RSeg 2F-r0")
        self.assertEqual(losses[0], base[dirs[0]][0][0])
        self.assertLess(losses[-1], losses[0])
        cfg = train_hf.make_config("qwen3-4b")
        est = {k: preflight.layout_activation_bytes(cfg, 1, 1024, [(k, 0.0)] * 36)
               for k in ("F", "Seg", "SAC", "N")}
        self.assertLess(est["F"], est["Seg"])
        self.assertLess(est["Seg"], est["SAC"])
        self.assertLess(est["SAC"], est["N"])
        self.assertLess(preflight.layout_activation_bytes(cfg, 1, 1024, [("N", 1.0)] * 36),
                        est["F"])

    def test_meta_model_resident_layers_start_from_hostds_fp32_master(self):
        """A meta model (hostd initializes the weights): the resident layers start from hostd's
        FP32 master, like hostd's own layers, not from its BF16 copy (a master on the BF16 grid
        leaves the BF16 weights unchanged until the updates add up to half a BF16 step: on the
        H200 at lr 1e-5, 6 such layers of 36 ended 8 steps at loss 5.56 instead of 5.03)."""
        if DEVICE != "cpu":
            self.skipTest("runs in the CPU variant (python_client_test)")
        import torch
        import transformers
        import slidedp
        import train_hf
        d = os.path.join(self.tmp, "meta")
        train_hf.make_config("qwen3-tiny").save_pretrained(d)  # config only: hostd's init
        sock, _ = self.start_hostd(d, 1, "m")
        os.environ["SLIDEDP_RANK_LIB"] = LIB
        cfg = transformers.AutoConfig.from_pretrained(d)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(cfg)
        model, opt = slidedp.attach(model, hostd=sock, device="cpu", cpu_window=True,
                                    nondecoder="resident", resident_layers=2,
                                    verify_init=False)
        rt = model.slidedp
        resident = sorted(i for i, l in rt.layers.items() if l.resident)
        self.assertEqual(resident, [0, 1, 2, 5, 6])  # embedding, decoders 1-2, norm, lm_head
        for i in resident:
            layer = rt.layers[i]
            want = torch.empty(layer.numel, dtype=torch.float32)
            rt.rank.read_client_layer(i, 0, 0, want.data_ptr(), layer.numel)
            if layer.kind != "norm":  # a norm starts at ones
                off_grid = want != want.bfloat16().float()
                self.assertTrue(bool(off_grid.any()), f"layer {i}: hostd's init is on the grid")
            self.assertTrue(torch.equal(layer.master, want), f"layer {i}: not hostd's master")
            self.assertTrue(torch.equal(layer.flat, want.bfloat16()), f"layer {i}")
        opt.close()

    def test_refused_uploads_of_resident_layers_raise(self):
        """Rank 0's uploads of the resident layers (nondecoder="resident") that hostd refuses
        reach the caller: the one a checkpoint asked for from opt.step() once it has finished
        (the step itself completes and training goes on), the final one from opt.close() after
        the detach. The old client only logged both: every opt.step() returned its figures and
        close() returned None, while hostd's copy of the layers stayed older than the training
        (its checkpoint of that version and its final one lack them)."""
        if DEVICE != "cpu":
            self.skipTest("runs in the CPU variant (python_client_test)")
        import torch
        import transformers
        import slidedp
        d = self.prepare("upl", "qwen3-tiny")
        sock, _ = self.start_hostd(d, 1, "up")
        os.environ["SLIDEDP_RANK_LIB"] = LIB
        model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
        model.train()
        model, opt = slidedp.attach(model, hostd=sock, device="cpu", nondecoder="resident")
        rt = model.slidedp
        x = torch.randint(0, model.config.vocab_size, (2, 16))

        def train_step():
            model(input_ids=x, labels=x).loss.backward()
            return opt.step()

        self.assertEqual(train_step()["step"], 1)
        # hostd asks rank 0 (ControlBlock::client_sync_step) for version 1 once, as a checkpoint
        # of it would, but by the time the upload arrives step 2 runs or has completed: hostd
        # refuses it (FAILED_PRECONDITION, "only between steps, of the last completed step").
        asked = iter([rt.resident_version])
        rt.rank.client_sync_step = lambda: next(asked, 0)
        raised = []
        for _ in range(2):  # the upload runs in the background: its failure comes with the
            try:            # step that finds it finished (step 2, else step 3)
                train_step()
            except slidedp.SlideDPError as e:
                raised.append(e)
            if rt.sync_thread is not None:
                rt.sync_thread.join()
        del rt.rank.client_sync_step
        self.assertEqual(len(raised), 1, raised)
        self.assertEqual(raised[0].code, 9, str(raised[0]))
        self.assertIn("upload of the resident layers (client_updated_layers) at version 1 to "
                      "hostd failed, so hostd's checkpoint of that version lacks them",
                      str(raised[0]))
        self.assertIn("only between steps", str(raised[0]))
        self.assertIsNone(rt.step)  # the step completed
        self.assertEqual(train_step()["step"], 4)  # and training goes on
        # The final upload at close, for a version hostd has not reached: refused, raised.
        rt.resident_version += 5
        with self.assertRaises(slidedp.SlideDPError) as cm:
            opt.close()
        self.assertEqual(cm.exception.code, 9, str(cm.exception))
        self.assertIn("at version 9 to hostd failed, so hostd's copy of them stays at an older "
                      "version", str(cm.exception))
        self.assertIn("got version 9", str(cm.exception))
        # Detached all the same, and hostd still serves the job, at step 4.
        ctl = os.path.join(os.path.dirname(HOSTD), "slidedpctl")  # a bundle's bin/
        if not os.path.exists(ctl):  # the build tree
            ctl = os.path.join(os.path.dirname(os.path.dirname(HOSTD)), "slidedpctl", "slidedpctl")
        out = subprocess.run([ctl, "--socket", sock, "status", "--json"], capture_output=True,
                             text=True, check=True).stdout
        status = json.loads(out)
        self.assertEqual(int(status["job"]["step"]), 4, out)
        self.assertFalse([r for r in status.get("ranks", []) if r.get("attached")], out)

    def test_bad_input(self):
        """Each bad input fails in attach with a message naming what is wrong, and hostd's
        weights are untouched (a correct rank attaches afterwards and verifies them)."""
        if DEVICE != "cpu":
            self.skipTest("bad input runs in the CPU variant (python_client_test)")
        import torch
        import transformers
        import slidedp
        import train_hf
        d = self.prepare("bad", "qwen3-tiny")
        sock, _ = self.start_hostd(d, 1, "c")
        os.environ["SLIDEDP_RANK_LIB"] = LIB

        def model_of(shape):
            return train_hf.build_model(train_hf.make_config(shape), 0)

        cases = [
            ("unsupported family", lambda: transformers.AutoModelForCausalLM.from_config(
                transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64)),
             {}, "model_type: 'gpt2' is not supported"),
            ("manifest mismatch", lambda: model_of("llama-tiny"), {},
             "does not match hostd's job"),
            ("world size mismatch", lambda: model_of("qwen3-tiny"), {"world_size": 3},
             "hostd's job expects 1"),
            ("offload ratio out of range", lambda: model_of("qwen3-tiny"),
             {"offload_ratio": 1.5}, "offload_ratio: 1.5, expected a number in [0, 1]"),
            ("negative offload ratio", lambda: model_of("qwen3-tiny"),
             {"offload_ratio": -0.1}, "offload_ratio: -0.1, expected a number in [0, 1]"),
            ("offload ratio not a number", lambda: model_of("qwen3-tiny"),
             {"offload_ratio": "half"}, "offload_ratio: 'half', expected a number in [0, 1]"),
            ("negative offload threshold", lambda: model_of("qwen3-tiny"),
             {"offload_ratio": 0.5, "offload_min_bytes": -1},
             "offload_min_bytes: -1, expected an integer >= 0"),
            ("bad checkpointing", lambda: model_of("qwen3-tiny"), {"checkpointing": "some"},
             "checkpointing: 'some'"),
            ("accumulation 0", lambda: model_of("qwen3-tiny"), {"accumulation_steps": 0},
             "accumulation_steps: 0"),
            ("recompute fraction out of range", lambda: model_of("qwen3-tiny"),
             {"checkpointing": 1.5}, "checkpointing: 1.5"),
            ("unknown nondecoder policy", lambda: model_of("qwen3-tiny"),
             {"nondecoder": "gpu"}, "nondecoder: 'gpu', expected 'auto', 'resident' or 'host'"),
            ("more resident decoder layers than the model has", lambda: model_of("qwen3-tiny"),
             {"resident_layers": 5}, "resident_layers: 5, expected an integer in [0, 4]"),
            ("every layer resident", lambda: model_of("qwen3-tiny"),
             {"resident_layers": 4, "nondecoder": "resident"},
             "leaves hostd no layer to update; expected at most 3"),
            ("layout of an unknown kind", lambda: model_of("qwen3-tiny"),
             {"policy": "2F 2X"}, "policy: group '2X': expected <count><kind>[-r<ratio>]"),
            ("layout of the wrong layer count", lambda: model_of("qwen3-tiny"),
             {"policy": "3F-r0"}, "policy: '3F-r0' lists 3 decoder layers, the model has 4"),
            ("layout offload ratio out of range", lambda: model_of("qwen3-tiny"),
             {"policy": "2F-r1.5 2N"}, "policy: group '2F-r1.5': ratio '1.5', expected"),
            ("resident group after a streamed one", lambda: model_of("qwen3-tiny"),
             {"policy": "2F 2R"}, "policy: group '2R': resident groups (R) come first"),
            ("layout next to checkpointing", lambda: model_of("qwen3-tiny"),
             {"policy": "4N", "checkpointing": "none"},
             "policy: '4N' with checkpointing='none': the layout says"),
            ("memory budget not positive", lambda: model_of("qwen3-tiny"),
             {"memory_budget": -1}, "memory_budget: -1, expected a number of bytes > 0"),
            ("weights differ from hostd's", lambda: train_hf.build_model(
                train_hf.make_config("qwen3-tiny"), 7), {}, "hostd's weights differ"),
        ]
        for name, make, kw, expect in cases:
            with self.subTest(name):
                m = make()
                with self.assertRaises(slidedp.SlideDPError) as cm:
                    slidedp.attach(m, hostd=sock, device="cpu", **kw)
                self.assertIn(expect, str(cm.exception))
        # A batch whose activations exceed the memory budget: refused at its first forward,
        # naming the batch that fits, before hostd hears of the step.
        from slidedp import preflight
        model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
        layers = model.config.num_hidden_layers
        per_sample = preflight.layout_activation_bytes(model.config, 1, 16, [("F", 0.0)] * layers)
        model.train()
        model, opt = slidedp.attach(model, hostd=sock, device="cpu", policy=f"{layers}F-r0",
                                    memory_budget=int(per_sample * 3.5))
        x = torch.randint(0, model.config.vocab_size, (4, 16))
        with self.assertRaises(slidedp.SlideDPError) as cm:
            model(input_ids=x, labels=x)
        self.assertEqual(cm.exception.code, 8, str(cm.exception))
        self.assertIn("batch: 4 x seq 16 needs about", str(cm.exception))
        self.assertIn("batch <= 3 fits", str(cm.exception))
        self.assertIsNone(model.slidedp.step)
        opt.close()
        # hostd still serves its untouched job: a correct rank verifies the weights and trains.
        model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
        model, opt = slidedp.attach(model, hostd=sock, device="cpu")
        x = torch.randint(0, model.config.vocab_size, (2, 16))
        model(input_ids=x, labels=x).loss.backward()
        with self.assertRaises(slidedp.SlideDPError) as cm:  # a forward after the step
            opt.step()
            opt.step()
        self.assertIn("opt.step() after 0 complete backward passes", str(cm.exception))
        # A dead hostd: the next step fails with UNAVAILABLE naming what it was doing, no hang.
        self.hostds[-1].kill()
        t0 = time.time()
        with self.assertRaises(slidedp.SlideDPError) as cm:
            model(input_ids=x, labels=x).loss.backward()
        self.assertEqual(cm.exception.code, 14, str(cm.exception))
        self.assertIn("beginning step 2", str(cm.exception))
        self.assertLess(time.time() - t0, 30)
        self.assertIsNone(model.slidedp.step)  # nothing half-begun on the client side
        try:
            opt.close()  # detaching from a dead hostd may report UNAVAILABLE; it must not hang
        except slidedp.SlideDPError as e:
            self.assertEqual(e.code, 14, str(e))
        # The killed hostd left its shared state for re-adoption (as it should); nobody will
        # adopt it: remove it, or every run of this test leaves ~70 MB in /dev/shm.
        self.assertTrue(remove_shm(self.hostds[-1].instance),
                        "a killed hostd leaves its segments for re-adoption")


def main():
    global HOSTD, LIB, DEVICE
    args = sys.argv[1:]
    if "--device" in args:
        i = args.index("--device")
        DEVICE = args[i + 1]
        del args[i:i + 2]
    if len(args) < 2 or DEVICE not in ("cpu", "cuda"):
        print(__doc__)
        sys.exit(2)
    HOSTD, LIB = os.path.abspath(args[0]), os.path.abspath(args[1])
    if DEVICE == "cuda":
        try:
            import torch
            if not torch.cuda.is_available():
                raise ImportError("no CUDA device")
        except ImportError as e:
            print(f"skipped: {e}")
            sys.exit(77)
    unittest.main(argv=[sys.argv[0]] + args[2:], verbosity=2)


if __name__ == "__main__":
    main()
