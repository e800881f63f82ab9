"""Does a batch fit? An estimate of the activation memory one training step of a decoder-only HF
model needs on the compute device, checked before the step begins (before hostd is told), so a
batch that cannot fit fails with what would fit instead of an out-of-memory error mid-step.

What is already allocated when the first forward runs -- the GPU window, the gradient staging
buffers, resident layers with their FP32 master and moments -- is not estimated: it is out of the
free memory the check compares with. What the step adds, per token:
  * each recomputed decoder layer keeps its input: 2 h bytes (BF16);
  * each other decoder layer keeps what autograd saves for backward. For a Llama/Qwen layer with
    SDPA attention: 2 (10 h + 4 q + 4 kv + 4 f) bytes, h hidden, q = heads x head_dim,
    kv = kv_heads x head_dim, f = intermediate (norm inputs and outputs, the projections'
    inputs, q/k/v after rotary, attention output, the MLP's gate/up/act/product);
  * on top of what is kept, the larger of: the logits (BF16 logits, their FP32 copy for the loss,
    its FP32 and BF16 gradients: 12 V bytes, V the vocabulary), alive from the loss into the
    head's backward; and one layer's backward (its activations and their gradients, 2x the
    above; a recomputed layer's are rebuilt for it).
Calibrated on the H200 with Qwen3-4B shape, seq 1024 (bench/results/python_client_h200_2026-11-29b):
full recompute, 1.94 GiB per sample measured (peak allocated, batch 8 -> 16), 1.91 estimated;
half the layers recomputed, 160 KB per token and kept layer measured, 170 KB estimated.
"""

from ._lib import SlideDPError

GiB = float(1 << 30)


def layer_activation_bytes_per_token(config):
    h = int(config.hidden_size)
    heads = int(config.num_attention_heads)
    hd = int(getattr(config, "head_dim", None) or h // heads)
    kv = int(getattr(config, "num_key_value_heads", None) or heads) * hd
    f = int(config.intermediate_size)
    return 2 * (10 * h + 4 * heads * hd + 4 * kv + 4 * f)


def step_activation_bytes(config, batch, seq, recomputed, kept, offloaded=0):
    """Peak bytes a training step adds for `batch` x `seq` tokens with `recomputed` decoder layers
    checkpointed and `kept` keeping their activations, `offloaded` of which keep them in host
    memory instead."""
    tokens = int(batch) * int(seq)
    full = layer_activation_bytes_per_token(config)
    per_token = (recomputed * 2 * int(config.hidden_size) + (kept - offloaded) * full
                 + max(12 * int(config.vocab_size), 2 * full))
    return tokens * per_token


def check_batch_fits(config, batch, seq, recomputed, kept, available, device="cuda",
                     offloaded=0):
    """Raises SlideDPError(RESOURCE_EXHAUSTED) naming the batch, the estimate, what is free and
    the largest batch that fits (with this checkpointing and with full recompute)."""
    need = step_activation_bytes(config, batch, seq, recomputed, kept, offloaded)
    if need <= available:
        return need
    per_sample = step_activation_bytes(config, 1, seq, recomputed, kept, offloaded)
    fits = int(available // per_sample)
    layers = recomputed + kept
    full_sample = step_activation_bytes(config, 1, seq, layers, 0)
    fits_full = int(available // full_sample)
    hint = f"batch <= {fits} fits" if fits >= 1 else "not even batch 1 fits"
    if kept > 0:
        hint += (f"; with checkpointing='full' batch <= {fits_full} fits" if fits_full >= 1 else
                 "; not even with checkpointing='full'")
    raise SlideDPError(8, (
        f"batch: {batch} x seq {seq} needs about {need / GiB:.1f} GiB of activations on {device} "
        f"({recomputed} decoder layers recomputed, {kept} keeping their activations"
        f"{f' ({offloaded} offloaded to the host)' if offloaded else ''}, logits over a vocab of "
        f"{config.vocab_size}), but {available / GiB:.1f} GiB is free after the GPU window and "
        f"resident layers; {hint} (seq {seq}). Nothing was sent to hostd."))


def free_device_bytes(device):
    """Free memory for the step on `device`: the driver's free memory plus what torch's caching
    allocator holds unused; None on the CPU."""
    import torch
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return free + max(0, cached)
