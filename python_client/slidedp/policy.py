"""Per-layer activation policy (elastic checkpointing): what each decoder layer saves for backward.

A layout lists the decoder layers in forward order as space-separated groups
`<count><kind>[-r<ratio>]`, e.g. "6R 24F-r0 6N" (slidedpctl plan reads the same grammar):
  F     full-layer recompute: the layer saves its input; backward replays the whole layer.
  Seg   two segments, attention block and MLP block, each recomputed from its own input (the layer
        input and the attention block's output): the same replay as F, a transient of one segment.
  SAC   selective checkpointing (torch's create_selective_checkpoint_contexts): the outputs of the
        matmuls and of attention (with its log-sum-exp) are cached in forward; backward replays
        only the cheap ops (norms, rotary, activation function, residual adds).
  N     no checkpoint: ordinary autograd, everything saved, no replay.
  R     a resident decoder layer: its weights stay on the device and are updated there (device
        AdamW, like attach(resident_layers=...)); its activations are kept like N. `R` may name
        another activation kind for the resident layer: "RF", "RSeg-r0.5". R groups come first.
  -r<ratio>  the fraction in [0, 1] of the layer's saved bytes moved to pinned host memory in
        forward and back before its backward (tensor granularity, slidedp/offload.py); default 0.
        For F/Seg/SAC what autograd saves through its hooks is the (segment) input; SAC's cached
        operator outputs stay on the device.
Every kind changes only what is saved and recomputed, never the arithmetic: on the CPU the
gradients are bit-identical to F's (tests/python_client_test.py, tests/policy_test.py).
"""
import re
from typing import NamedTuple

from ._lib import SlideDPError

ACTIVATION_KINDS = ("F", "Seg", "SAC", "N")
_GROUP = re.compile(r"^(\d+)(R)?(F|Seg|SAC|N)?(?:-r(.*))?$")


class LayerPolicy(NamedTuple):
    kind: str  # one of ACTIVATION_KINDS
    ratio: float = 0.0  # offloaded fraction of the saved bytes
    resident: bool = False

    def token(self):
        kind = ("R" + ("" if self.kind == "N" else self.kind)) if self.resident else self.kind
        shown = self.ratio or (self.kind != "N" and not self.resident)
        return kind + (f"-r{self.ratio:g}" if shown else "")


def parse_layout(text, layers):
    """Parses a layout string for a model of `layers` decoder layers into one LayerPolicy per
    layer (forward order). Raises SlideDPError(INVALID_ARGUMENT) naming the group at fault."""
    if not isinstance(text, str) or not text.strip():
        raise SlideDPError(3, f"policy: {text!r}, expected a layout such as '{layers}F-r0' "
                              "(groups <count><kind>[-r<ratio>], kinds R, F, Seg, SAC, N)")
    out = []
    for group in text.split():
        m = _GROUP.match(group)
        if m is None:
            raise SlideDPError(3, f"policy: group {group!r}: expected <count><kind>[-r<ratio>] "
                                  f"with kind one of R, {', '.join(ACTIVATION_KINDS)} "
                                  "(e.g. '24F-r0', '6N', '4R')")
        count, resident, kind, ratio = m.groups()
        if not resident and not kind:
            raise SlideDPError(3, f"policy: group {group!r}: no kind; expected one of R, "
                                  f"{', '.join(ACTIVATION_KINDS)}")
        if int(count) < 1:
            raise SlideDPError(3, f"policy: group {group!r}: count {count}, expected >= 1")
        r = 0.0
        if ratio is not None:
            try:
                r = float(ratio)
            except ValueError:
                r = -1.0
            if not 0.0 <= r <= 1.0:
                raise SlideDPError(3, f"policy: group {group!r}: ratio {ratio!r}, expected a "
                                      "number in [0, 1] (the fraction of saved bytes offloaded)")
        if resident and out and not out[-1].resident:
            raise SlideDPError(3, f"policy: group {group!r}: resident groups (R) come first, "
                                  "before every streamed layer")
        out += [LayerPolicy(kind or "N", r, bool(resident))] * int(count)
    if len(out) != layers:
        raise SlideDPError(3, f"policy: {text!r} lists {len(out)} decoder layers, the model has "
                              f"{layers}")
    return out


def format_layout(policies):
    """The canonical layout string: consecutive equal policies as one group."""
    groups = []
    for p in policies:
        if groups and groups[-1][1] == p:
            groups[-1][0] += 1
        else:
            groups.append([1, p])
    return " ".join(f"{n}{p.token()}" for n, p in groups)


def spread(fraction, pos):
    """Whether decoder layer `pos` (forward order) is among a fraction f of them spread evenly:
    all for "full", none for "none", else layer pos when floor((pos+1)f) > floor(pos f) (f=0.5:
    layers 1, 3, 5, ...; f=0.25: 3, 7, ...). attach's checkpointing and offload_ratio choose
    layers so."""
    import math
    if fraction in ("full", "none"):
        return fraction == "full"
    return math.floor((pos + 1) * fraction + 1e-9) > math.floor(pos * fraction + 1e-9)


def legacy_layout(checkpointing, offload_ratio, resident_layers, layers):
    """The layout attach's older arguments describe: the first `resident_layers` resident, a
    fraction `checkpointing` recomputed (F, else N) and a fraction `offload_ratio` of the layers
    offloading all their saved tensors, each spread evenly."""
    return [LayerPolicy("F" if spread(checkpointing, pos) else "N",
                        1.0 if offload_ratio > 0 and spread(offload_ratio, pos) else 0.0,
                        pos < resident_layers) for pos in range(layers)]


# ---- SAC: what the selective checkpoint caches ----
def _sac_saved_ops():
    import torch
    aten = torch.ops.aten
    names = ["mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
             "_scaled_dot_product_flash_attention_for_cpu", "_flash_attention_forward",
             "_efficient_attention_forward"]
    return frozenset(getattr(aten, n).default for n in names if hasattr(aten, n))


_SAC_SAVED = None


def _sac_policy(ctx, func, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy
    return CheckpointPolicy.MUST_SAVE if func in _SAC_SAVED else CheckpointPolicy.PREFER_RECOMPUTE


def sac_context():
    """The context_fn of a SAC layer's checkpoint: matmul and attention outputs (with the
    log-sum-exp attention returns) are cached in forward, everything else is replayed."""
    global _SAC_SAVED
    from torch.utils.checkpoint import create_selective_checkpoint_contexts
    if _SAC_SAVED is None:
        _SAC_SAVED = _sac_saved_ops()
    return create_selective_checkpoint_contexts(_sac_policy)


def _sac_checkpoint_kwargs():
    # torch >= 2.15 asks whether SAC's cached tensors go through the saved-tensor hooks in scope
    # (the window's tokens, activation offload); torch 2.11 never sends them. Both versions keep
    # them on the device, so a layout means the same memory on either.
    import inspect
    import torch.utils.checkpoint as ck
    try:
        params = inspect.signature(ck.checkpoint).parameters
    except (TypeError, ValueError):
        return {}
    return {"respect_saved_tensors_hooks": False} if "respect_saved_tensors_hooks" in params \
        else {}


SAC_CHECKPOINT_KWARGS = _sac_checkpoint_kwargs()


def check_segmentable(module, pos):
    """Seg rewrites a decoder layer's forward as residual + self_attn(input_layernorm(x)), then
    residual + mlp(post_attention_layernorm(x)) -- the forward of the Llama, Qwen2 and Qwen3
    layers of transformers 5 (which return the hidden states as a tensor). Raises SlideDPError
    when the layer does not have that shape."""
    import inspect
    import torch
    missing = [n for n in ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
               if not isinstance(getattr(module, n, None), torch.nn.Module)]
    if missing:
        raise SlideDPError(3, f"policy: Seg for decoder layer {pos} ({type(module).__name__}): "
                              f"it has no {', '.join(missing)}; expected a Llama/Qwen decoder "
                              "layer. Use F, SAC or N for it")
    ann = inspect.signature(type(module).forward).return_annotation
    if ann is not inspect.Signature.empty and "Tensor" not in str(ann):
        raise SlideDPError(3, f"policy: Seg for decoder layer {pos} ({type(module).__name__}): "
                              f"its forward returns {ann}, expected the hidden states "
                              "(transformers >= 5). Use F, SAC or N for it")


def run_layer(kind, module, forward, pre, post, pos, args, kwargs):
    """Runs decoder layer `module` (its original `forward`) under activation kind `kind`, in
    training mode with gradients enabled (otherwise plainly, like HF's own checkpointing).
    pre(args) runs before the layer's computation (or each segment's), post(args, out,
    recompute) after it and returns the output: the runtime's window hooks, or nothing for the
    AutoPolicy profile (autopolicy.py), which times exactly this code."""
    import torch
    ckpt = torch.utils.checkpoint.checkpoint

    def run(recompute, *a, **kw):
        pre(a)
        return post(a, forward(*a, **kw), recompute)

    if kind == "N" or not (module.training and torch.is_grad_enabled()):
        return run(False, *args, **kwargs)
    if kind == "Seg":
        # The decoder layer's own forward in two checkpointed segments: residual + attention,
        # residual + MLP, the same operations in the same order (check_segmentable).
        if len(args) != 1:
            raise SlideDPError(9, f"policy Seg: decoder layer {pos} called with {len(args)} "
                                  "positional arguments, expected the hidden states only")

        def attention_block(h, **kw):
            pre((h,))
            a, _ = module.self_attn(hidden_states=module.input_layernorm(h), **kw)
            return h + a

        def mlp_block(h):
            pre((h,))
            return h + module.mlp(module.post_attention_layernorm(h))

        a = ckpt(attention_block, args[0], use_reentrant=False, **kwargs)
        out = ckpt(mlp_block, a, use_reentrant=False)
        return post(args, out, True)
    if kind == "SAC":
        return ckpt(run, True, *args, use_reentrant=False, context_fn=sac_context,
                    **SAC_CHECKPOINT_KWARGS, **kwargs)
    return ckpt(run, True, *args, use_reentrant=False, **kwargs)
