"""SlideDPOptimizer: the optimizer object attach() returns; it marks step boundaries (hostd
runs AdamW)."""
import torch

from ._lib import SlideDPError


class SlideDPOptimizer:
    """The step boundary of an attached model. hostd runs AdamW; this object only marks steps.
    `step()` returns the step's figures (a dict; also logged on logger 'slidedp')."""

    def __init__(self, runtime):
        self._rt = runtime
        self.param_groups = [{"params": [], "lr": None}]
        self.state = {}

    def step(self, closure=None):
        """Ends the training step. Raises SlideDPError when rank 0's upload of the resident
        layers that a hostd checkpoint asked for failed (hostd's checkpoint then lacks them and
        fails): the step itself has completed, and training may go on."""
        if closure is not None:
            with torch.enable_grad():
                closure()
        return self._rt.end_step()

    def zero_grad(self, set_to_none=True):
        pass  # gradients never stay in .grad: they are pushed to hostd during backward

    def state_dict(self):
        raise SlideDPError(12, "the optimizer state lives in hostd; checkpoint it with hostd "
                               "(slidedpctl), not through the client")

    def load_state_dict(self, state):
        self.state_dict()

    def close(self):
        """Detaches from hostd. Rank 0 first uploads the resident layers' final state
        (nondecoder="resident", resident_layers) so that hostd's final checkpoint, ExportHF and
        a resume include it; when that upload (or a checkpoint's that was not raised yet) fails,
        close() raises SlideDPError after detaching: hostd's copy of those layers is older than
        the training, so its final checkpoint is not written and ExportHF refuses."""
        self._rt.close()
