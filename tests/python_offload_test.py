#!/usr/bin/env python3
"""slidedp.offload.ActivationOffload on a plain HF model (no hostd): the saved-tensor hooks and
per-layer wiring that slidedp.attach installs (python_client/slidedp/hf.py), on a Qwen3-shaped
model with its own parameters.

Usage: python_offload_test.py [--device cpu|cuda]   (cuda: exits 77 without a GPU)

Checks, for checkpointing none / full / half and offload ratios 0.5 and 1: the losses and every
parameter gradient of two training iterations equal, bit for bit, those of the same model
without offload (the offloaded tensors come back with the same values and strides, so the same
kernels run on them; eager attention on the GPU, whose kernels are deterministic); every offloaded
tensor came back through the prefetch (no misses); the host buffers of the first iteration are
reused by the next ones. On CUDA also: pinned host buffers, and the memory allocated at the end
of forward and the peak of the iteration are lower with offload (figures printed).
"""
import contextlib
import os
import sys
import time
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python_client"))
DEVICE = "cpu"


def make_model(device, layers=4, hidden=64, inter=128, seed=0):
    import torch
    import transformers
    cfg = transformers.Qwen3Config(hidden_size=hidden, intermediate_size=inter,
                                   num_hidden_layers=layers, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=hidden // 4, vocab_size=512,
                                   max_position_embeddings=4096)
    cfg._attn_implementation = "eager" if device == "cuda" else "sdpa"
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        cfg, dtype=torch.bfloat16 if device == "cuda" else torch.float32).to(device)
    model.config.use_cache = False
    model.train()
    return model


def wire(model, offload, checkpointing):
    """What StreamedRuntime does for activation offload: each decoder layer's forward runs
    between begin_layer/end_layer (checkpointed through torch.utils.checkpoint when chosen), its
    output is watched, the logits are watched, and the model's forward runs under the saved-tensor
    hooks. Returns a context manager for a forward."""
    import torch
    import torch.utils.checkpoint
    from slidedp.offload import OffloadedTensor, spread
    layers = model.model.layers
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    for pos, layer in enumerate(layers):
        orig = layer.forward
        ckpt = spread(checkpointing, pos)

        def forward(*args, orig=orig, ckpt=ckpt, pos=pos, **kwargs):
            prev = offload.begin_layer(pos)
            try:
                if ckpt:
                    out = torch.utils.checkpoint.checkpoint(orig, *args, use_reentrant=False,
                                                            **kwargs)
                else:
                    out = orig(*args, **kwargs)
            finally:
                offload.end_layer(prev)
            offload.watch(out, pos)
            return out
        layer.forward = forward

    def pack(t):
        return offload.pack(t, params) if offload.cur is not None else t

    def unpack(x):
        return offload.unpack(x) if isinstance(x, OffloadedTensor) else x

    @contextlib.contextmanager
    def step():
        offload.begin_forward()
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield
    return step


def train(device, checkpointing, ratio, iters=2, batch=4, seq=32, min_bytes=0, shape=None):
    import torch
    from slidedp.offload import ActivationOffload, spread
    model = make_model(device, **(shape or {}))
    n = len(model.model.layers)
    off = ActivationOffload(device, [p for p in range(n) if spread(ratio, p)] if ratio else [],
                            min_bytes=min_bytes)
    step = wire(model, off, checkpointing)
    g = torch.Generator().manual_seed(1)
    losses, grads, stats, peaks = [], [], [], []
    for _ in range(iters):
        x = torch.randint(0, model.config.vocab_size, (batch, seq), generator=g).to(device)
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            t0 = time.perf_counter()
        with step():
            out = model(input_ids=x, labels=x)
        if device == "cuda":
            after_forward = torch.cuda.memory_allocated() - base
        off.watch(out.logits, n)
        out.loss.backward()
        if device == "cuda":
            torch.cuda.synchronize()
            # (peak during the iteration, allocated at the end of forward, seconds), over the
            # weights; the gradients accumulate in .grad, so the peak is often backward's end.
            peaks.append((torch.cuda.max_memory_allocated() - base, after_forward,
                          time.perf_counter() - t0))
        losses.append(out.loss.item())
        grads.append({k: p.grad.clone() for k, p in model.named_parameters()})
        model.zero_grad(set_to_none=True)
        stats.append(off.step_stats())
    return losses, grads, stats, peaks, off


class OffloadTest(unittest.TestCase):
    def test_bit_exact_with_prefetch(self):
        # Recomputing a layer runs the same kernels on the same inputs: one baseline serves
        # every checkpointing setting.
        bl, bg, bs, _, _ = train(DEVICE, "none", 0.0)
        self.assertEqual(bs[0]["activation_offload_bytes"], 0)
        for ckpt, ratio in [("none", 0.5), ("full", 1.0), (0.5, 1.0)]:
            with self.subTest(checkpointing=ckpt, offload_ratio=ratio):
                losses, grads, stats, _, off = train(DEVICE, ckpt, ratio)
                self.assertEqual(losses, bl)
                for k, b in enumerate(bg):
                    for name, t in b.items():
                        self.assertTrue(torch_equal(grads[k][name], t), f"iteration {k}: {name}")
                for s in stats:
                    self.assertGreater(s["activation_offload_bytes"], 0)
                    self.assertEqual(s["activation_prefetch_bytes"], s["activation_offload_bytes"])
                    self.assertEqual(s["activation_prefetch_misses"], 0)
                    self.assertEqual(s["activation_offload_pool_bytes"],
                                     stats[0]["activation_offload_pool_bytes"])
                if DEVICE == "cuda":
                    bufs = [b for free in off.pool.values() for b in free]
                    self.assertTrue(bufs and all(b.is_pinned() for b in bufs))
                print(f"checkpointing {ckpt}, offload_ratio {ratio}: "
                      f"{stats[-1]['activation_offload_bytes']} bytes offloaded per iteration, "
                      f"prefetch wait {stats[-1]['activation_prefetch_wait_s']:.4f} s", flush=True)

    def test_threshold_and_layers(self):
        """Tensors under offload_min_bytes stay; only the chosen layers' tensors move (r=0.25 of
        4 layers: layer 3 alone)."""
        from slidedp.offload import spread
        self.assertEqual([p for p in range(4) if spread(0.25, p)], [3])
        self.assertEqual([p for p in range(4) if spread(0.5, p)], [1, 3])
        _, _, all_small, _, _ = train(DEVICE, "none", 0.25, iters=1, min_bytes=0)
        _, _, big_only, _, _ = train(DEVICE, "none", 0.25, iters=1, min_bytes=32 << 10)
        _, _, every, _, _ = train(DEVICE, "none", 1.0, iters=1, min_bytes=0)
        a = all_small[0]["activation_offload_bytes"]
        self.assertGreater(a, big_only[0]["activation_offload_bytes"])
        self.assertGreater(big_only[0]["activation_offload_bytes"], 0)
        # The four layers have the same shapes: one of them offloads a quarter of the bytes.
        self.assertEqual(4 * a, every[0]["activation_offload_bytes"])

    def test_peak_memory_cuda(self):
        if DEVICE != "cuda":
            self.skipTest("GPU memory: --device cuda")
        shape = dict(layers=8, hidden=1024, inter=3072)
        peak, fwd = {}, {}
        for ckpt, ratio in [("none", 0.0), ("none", 0.5), ("none", 1.0), ("full", 0.0),
                            ("full", 1.0)]:
            _, _, stats, peaks, _ = train("cuda", ckpt, ratio, iters=3, batch=8, seq=1024,
                                          min_bytes=64 << 10, shape=shape)
            peak[(ckpt, ratio)], fwd[(ckpt, ratio)], dt = peaks[-1]
            st = stats[-1]
            print(f"8 layers x hidden 1024, batch 8 x seq 1024 (eager attention), checkpointing "
                  f"{ckpt}, offload_ratio {ratio}: peak {peak[(ckpt, ratio)] / 2**20:.0f} MiB "
                  f"over the weights, {fwd[(ckpt, ratio)] / 2**20:.0f} MiB at the end of "
                  f"forward, {st['activation_offload_bytes'] / 2**20:.0f} MiB offloaded, "
                  f"prefetch wait {st['activation_prefetch_wait_s'] * 1e3:.2f} ms, "
                  f"{dt * 1e3:.1f} ms/iteration (third)", flush=True)
        self.assertLess(peak[("none", 1.0)], peak[("none", 0.5)])
        self.assertLess(peak[("none", 0.5)], peak[("none", 0.0)])
        self.assertLess(fwd[("none", 1.0)], fwd[("none", 0.5)])
        self.assertLess(fwd[("full", 1.0)], fwd[("full", 0.0)])


def torch_equal(a, b):
    import torch
    return torch.equal(a, b)


def main():
    global DEVICE
    args = sys.argv[1:]
    if "--device" in args:
        i = args.index("--device")
        DEVICE = args[i + 1]
        del args[i:i + 2]
    if DEVICE not in ("cpu", "cuda"):
        print(__doc__)
        sys.exit(2)
    if DEVICE == "cuda":
        import torch
        if not torch.cuda.is_available():
            print("skipped: no CUDA device")
            sys.exit(77)
    unittest.main(argv=[sys.argv[0]] + args, verbosity=2)


if __name__ == "__main__":
    main()
