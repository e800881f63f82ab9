"""slidedp: attach PyTorch / Hugging Face training jobs to a SlideDP hostd.

    import slidedp
    model, opt = slidedp.attach(model, hostd="unix:///run/slidedp/hostd.sock")

See python_client/README.md."""
from ._lib import SlideDPError
from .hf import SUPPORTED_FAMILIES, SlideDPOptimizer, attach
from .rank import GpuPlane, RankHandle, manifest_hash

__version__ = "0.1.0"
__all__ = ["attach", "SlideDPError", "SlideDPOptimizer", "RankHandle", "GpuPlane",
           "manifest_hash", "SUPPORTED_FAMILIES", "__version__"]
