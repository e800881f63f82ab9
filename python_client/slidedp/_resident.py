"""The resident layers' update on the device (nondecoder="resident", resident_layers).

These layers stay on the device for the whole run and hostd does not update them
(client_updated_layers): at opt.step() every rank applies AdamW to them with hostd's settings and
LR, after the all-reduce of their gradients, with hostd's clip / skip rule (slidedp_clip_scale,
checked by tests/clip_rule_parity_test.py). Rank 0 uploads their FP32 master and moments to hostd
when a checkpoint asks for them and at close, on a background thread it owns and joins.

ResidentLayers is a mixin of StreamedRuntime (slidedp/_runtime.py): its methods use the
runtime's rank, layers, settings and step state.
"""
import logging
import math
import os
import threading
import time

import torch

from ._lib import SlideDPError

log = logging.getLogger("slidedp")


class ResidentLayers:
    """StreamedRuntime's resident-layer update and uploads (see the module's docstring)."""

    def make_resident(self, layer, fp32, compute_dtype, device, from_hostd=False):
        def read(part):
            buf = torch.empty(layer.numel, dtype=torch.float32)
            self.rank.read_client_layer(layer.index, part, 0, buf.data_ptr(), layer.numel)
            return buf.to(device)

        if from_hostd:
            # A resumed job: hostd's copy (master, m, v) is the job's state at this version.
            layer.master, layer.m, layer.v = (read(part) for part in range(3))
            layer.flat = layer.master.to(torch.bfloat16).to(compute_dtype)
            self._materialize(layer)
            return
        if fp32 is None:
            # A meta model: hostd's FP32 master, as its own layers start from. Not its BF16
            # copy: a master on the BF16 grid moves none of the BF16 weights until the updates
            # add up to half a BF16 step (several steps at small learning rates), where an
            # FP32 master's roundings flip from the first update (measured: Qwen3-4B at lr
            # 1e-5, 6 of 36 decoder layers started from BF16 ended 8 steps at loss 5.56 where
            # all from FP32 reached 5.03).
            fp32 = read(0)
        layer.master = fp32.to(device=device, dtype=torch.float32)
        layer.m = torch.zeros_like(layer.master)
        layer.v = torch.zeros_like(layer.master)
        # The compute copy holds the master rounded to BF16, as hostd's streamed layers do.
        layer.flat = layer.master.to(torch.bfloat16).to(compute_dtype)
        self._materialize(layer)

    def _resident_layers(self):
        return [l for l in self.layers.values() if l.resident]

    def _maybe_sync(self):
        """Rank 0 uploads the resident layers when hostd asks (a checkpoint) for the version
        they hold now."""
        if self.rank.rank != 0 or not self._resident_layers():
            return
        want = self.rank.client_sync_step()
        if want != 0 and want == self.resident_version and want != self.sync_started:
            self._start_upload(want)

    def _start_upload(self, version, wait=False):
        """Snapshots the resident layers (a device copy, ordered after their last update on
        the current stream) and uploads it to hostd on a background thread."""
        self._join_upload()
        res = self._resident_layers()
        t0 = time.perf_counter()
        dev = res[0].master.device
        try:
            snap = [(l.index, l.master.clone(), l.m.clone(), l.v.clone()) for l in res]
        except torch.OutOfMemoryError:
            # No room for a copy: upload from the live tensors before the next update.
            log.warning("no device memory for a snapshot of the resident layers; uploading "
                        "them before training goes on")
            snap, wait = [(l.index, l.master, l.m, l.v) for l in res], True
        event = None
        if dev.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        self.sync_started = version
        self.sync_thread = threading.Thread(target=self._upload, args=(version, snap, event),
                                            name="slidedp-upload", daemon=True)
        self.sync_thread.start()
        if wait:
            self._join_upload()
        self.snapshot_s += time.perf_counter() - t0

    def _upload(self, version, snap, event):
        try:
            # Background work: on a host whose cores the optimizer threads fill, the training
            # thread (and hostd's update threads) go first. Linux: a thread id sets one thread.
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
            except (AttributeError, OSError):
                pass
            t0 = time.perf_counter()
            nbytes = 0
            if event is not None:
                event.synchronize()
            cuda = snap[0][1].device.type == "cuda"
            piece = 1 << 22  # elements per device-to-host copy (one hostd message)
            if cuda:
                staging = torch.empty(piece, dtype=torch.float32, pin_memory=True)
                stream = torch.cuda.Stream(snap[0][1].device)
            for idx, *parts in snap:
                for part, t in enumerate(parts):
                    t = t.reshape(-1)
                    n = t.numel()
                    for off in range(0, n, piece):
                        c = min(piece, n - off)
                        if cuda:
                            with torch.cuda.stream(stream):
                                staging[:c].copy_(t[off:off + c], non_blocking=True)
                            stream.synchronize()
                            ptr = staging.data_ptr()
                        else:
                            ptr = t.data_ptr() + off * 4
                        self.rank.upload_client_layer(version, idx, part, off, ptr, c)
                        nbytes += c * 4
            del snap
            self.sync_done = version
            log.info("rank 0 uploaded its resident layers at version %d to hostd: %.2f GB in "
                     "%.2f s", version, nbytes / 1e9, time.perf_counter() - t0)
        except Exception as e:  # noqa: BLE001 - raised on the training thread (_upload_error)
            if isinstance(e, SlideDPError) and e.code == 6:  # ALREADY_EXISTS: hostd has it
                self.sync_done = version
                return
            if self.sync_error is None:
                self.sync_error = (version, e)
            log.error("uploading the resident layers at version %d failed: %s", version, e)

    def _upload_error(self, what):
        """The failure of a finished upload, as the SlideDPError to raise (once), else None."""
        if self.sync_thread is not None and not self.sync_thread.is_alive():
            self._join_upload()
        if self.sync_error is None:
            return None
        version, e = self.sync_error
        self.sync_error = None
        code = e.code if isinstance(e, SlideDPError) else 13
        detail = e.message if isinstance(e, SlideDPError) else f"{type(e).__name__}: {e}"
        return SlideDPError(code, f"rank 0's upload of the resident layers (client_updated_layers)"
                                  f" at version {version} to hostd failed, {what}: {detail}")

    def _upload_final(self):
        """Rank 0 leaves its resident layers' final state in hostd, so that hostd's final
        checkpoint (a clean stop), ExportHF and a later resume include them. Returns the
        SlideDPError of an upload that failed (this one, or a checkpoint's not raised yet)."""
        if self.rank.rank != 0 or not self._resident_layers():
            return None
        self._join_upload()
        earlier = self._upload_error("so hostd's checkpoint of that version lacks them")
        if self.resident_version != self.sync_done:
            self._start_upload(self.resident_version, wait=True)
        final = self._upload_error(
            "so hostd's copy of them stays at an older version: its final checkpoint (a clean "
            "stop) is not written and ExportHF refuses; hostd --resume from an earlier checkpoint "
            "goes back to it")
        return final or earlier

    def _join_upload(self):
        if self.sync_thread is not None:
            self.sync_thread.join()
            self.sync_thread = None

    def _resident_update(self):
        """AdamW of the resident layers on the device, with hostd's settings for this step."""
        res = [l for l in self.layers.values() if l.resident]
        if not res:
            return 0.0
        t0 = time.perf_counter()
        o = self.rank.optimizer(self.step)
        if o["clip"] == "global":
            raise SlideDPError(9, "resident layers (nondecoder='resident', resident_layers) "
                                  "cannot follow hostd's global gradient clipping (the norm "
                                  "spans hostd's layers); use clip per_layer or none, or "
                                  "nondecoder='host' and resident_layers=0")
        world = self.rank.world_size
        nd = set(o["no_decay_tensors"]) if o["no_decay_norms_and_biases"] else set()
        lr, b1, b2, eps, t = o["lr"], o["beta1"], o["beta2"], o["eps"], self.step
        for l in res:
            if world > 1:
                torch.distributed.all_reduce(l.acc, group=self.s["process_group"])
                if o["scale_by_world_size"]:
                    l.acc.mul_(1.0 / world)
        # One device-to-host sync for every layer's norm.
        norms = torch.stack([l.acc.norm() for l in res]).tolist()
        for l, norm in zip(res, norms):
            g = l.acc
            if not math.isfinite(norm):
                self.resident_skipped += 1  # as hostd: a non-finite gradient skips the update
                continue
            if o["clip"] == "per_layer" and o["max_grad_norm"] > 0:
                coef = min(1.0, o["max_grad_norm"] / (norm + 1e-6))
                if coef < 1.0:
                    g.mul_(coef)
            for _, ti in l.params:
                wd = 0.0 if ti.name in nd else o["weight_decay"]
                if wd:
                    l.master[ti.offset: ti.offset + ti.numel].mul_(1.0 - lr * wd)
            l.m.mul_(b1).add_(g, alpha=1.0 - b1)
            l.v.mul_(b2).addcmul_(g, g, value=1.0 - b2)
            denom = (l.v.sqrt() / math.sqrt(1.0 - b2 ** t)).add_(eps)
            l.master.addcdiv_(l.m, denom, value=-lr / (1.0 - b1 ** t))
            l.flat.copy_(l.master if l.flat.dtype == torch.bfloat16
                         else l.master.to(torch.bfloat16))
        return time.perf_counter() - t0
