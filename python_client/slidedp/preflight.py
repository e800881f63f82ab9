"""Does a batch fit? An estimate of the activation memory one training step of a decoder-only HF
model needs on the compute device, checked before the step begins (before hostd is told), so a
batch that cannot fit fails with what would fit instead of an out-of-memory error mid-step.

What is already allocated when the first forward runs -- the GPU window, the gradient staging
buffers, resident layers with their FP32 master and moments -- is not estimated: it is out of the
free memory the check compares with. What the step adds, per token:
  * each recomputed decoder layer (F) keeps its input: 2 h bytes (BF16); a segmented one (Seg)
    its input and its attention block's output, 4 h; a selectively checkpointed one (SAC) its
    input and its cached matmul and attention outputs; an offload ratio r removes r of what goes
    through autograd's hooks (see saved_bytes_per_token);
  * each other decoder layer (N) keeps what autograd saves for backward. For a Llama/Qwen layer with
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


def saved_bytes_per_token(config, kind):
    """(bytes kept on the device per token by one decoder layer of this activation kind
    (slidedp/policy.py), of which the part an offload ratio applies to)."""
    h = int(config.hidden_size)
    heads = int(config.num_attention_heads)
    hd = int(getattr(config, "head_dim", None) or h // heads)
    q = heads * hd
    kv = int(getattr(config, "num_key_value_heads", None) or heads) * hd
    f = int(config.intermediate_size)
    if kind == "F":
        return 2 * h, 2 * h  # the layer input
    if kind == "Seg":
        return 4 * h, 4 * h  # the layer input and the attention block's output
    if kind == "SAC":
        # The input (through autograd's hooks) and the cached matmul and attention outputs
        # (q, k, v, attention, o_proj, gate, up, down), which stay on the device.
        return 2 * h + 2 * (2 * q + 2 * kv + 2 * h + 2 * f), 2 * h
    full = layer_activation_bytes_per_token(config)
    return full, full


def layout_activation_bytes(config, batch, seq, policies):
    """Peak bytes a training step adds for `batch` x `seq` tokens with one (kind, ratio) per
    decoder layer: what each keeps less what it offloads, plus the larger of the logits and one
    layer's backward."""
    tokens = int(batch) * int(seq)
    full = layer_activation_bytes_per_token(config)
    per_token = max(12 * int(config.vocab_size), 2 * full)
    for kind, ratio in policies:
        kept, movable = saved_bytes_per_token(config, kind)
        per_token += kept - ratio * movable
    return int(tokens * per_token)


def check_batch_fits(config, batch, seq, policies, available, device="cuda"):
    """Raises SlideDPError(RESOURCE_EXHAUSTED) naming the batch, the estimate, what is free and
    the largest batch that fits (with this layout and with full recompute). policies: one
    (kind, ratio) per decoder layer."""
    need = layout_activation_bytes(config, batch, seq, policies)
    if need <= available:
        return need
    per_sample = layout_activation_bytes(config, 1, seq, policies)
    fits = int(available // per_sample)
    full_sample = layout_activation_bytes(config, 1, seq, [("F", 0.0)] * len(policies))
    fits_full = int(available // full_sample)
    hint = f"batch <= {fits} fits" if fits >= 1 else "not even batch 1 fits"
    if any(k != "F" or r for k, r in policies):
        hint += (f"; with every layer recomputed (F) batch <= {fits_full} fits"
                 if fits_full >= 1 else "; not even with every layer recomputed (F)")
    counts = {}
    for k, r in policies:
        key = k + (f"-r{r:g}" if r else "")
        counts[key] = counts.get(key, 0) + 1
    layout = ", ".join(f"{n} {k}" for k, n in counts.items())
    raise SlideDPError(8, (
        f"batch: {batch} x seq {seq} needs about {need / GiB:.1f} GiB of activations on {device} "
        f"(decoder layers: {layout}; logits over a vocab of {config.vocab_size}), but "
        f"{available / GiB:.1f} GiB is free after the GPU window and resident layers; {hint} "
        f"(seq {seq}). Nothing was sent to hostd."))


def free_device_bytes(device):
    """Free memory for the step on `device`: the driver's free memory plus what torch's caching
    allocator holds unused; None on the CPU."""
    import torch
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return free + max(0, cached)
