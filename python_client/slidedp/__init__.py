"""slidedp: attach PyTorch / Hugging Face training jobs to a SlideDP hostd.

    import slidedp
    model, opt = slidedp.attach(model, hostd="unix:///run/slidedp/hostd.sock")

See python_client/README.md. `import slidedp` loads neither torch nor transformers: attach,
SlideDPOptimizer and SUPPORTED_FAMILIES come from slidedp.hf (which needs torch) at first use, so
the C ABI bindings (slidedp._lib, slidedp.rank) work with the standard library alone."""
from ._lib import SlideDPError
from .rank import GpuPlane, RankHandle, manifest_hash

__version__ = "0.1.0"
__all__ = ["attach", "SlideDPError", "SlideDPOptimizer", "RankHandle", "GpuPlane",
           "manifest_hash", "SUPPORTED_FAMILIES", "__version__"]

_FROM_HF = ("attach", "SlideDPOptimizer", "SUPPORTED_FAMILIES")


def __getattr__(name):
    if name in _FROM_HF:
        from . import hf
        return getattr(hf, name)
    raise AttributeError(f"module 'slidedp' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_FROM_HF))
