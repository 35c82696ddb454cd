"""mppca-nipype: fast Marchenko-Pastur PCA denoising of diffusion and functional MRI.

Python users call :func:`denoise` on arrays (:func:`denoise_complex` on a magnitude and its phase, and
:func:`estimate_noise` for the noise map alone); Nipype users add :class:`mppca_nipype.interfaces.MPPCADenoise`
to a workflow; the command line has ``mppca-denoise`` (one
file), ``mppca-noise`` (its noise map alone) and ``mppca-nipype`` (a BIDS app).
"""

from .engine import DenoiseResult, MPPCAInputError, MPPCAWarning, NoiseResult, denoise, estimate_noise
from .engine.complex_data import ComplexDenoiseResult, denoise_complex

__all__ = ["denoise", "DenoiseResult", "denoise_complex", "ComplexDenoiseResult", "estimate_noise", "NoiseResult", "MPPCAInputError", "MPPCAWarning",
           "__version__"]


def __getattr__(name):
    # ``__version__`` is looked up when asked for: importing importlib.metadata and reading the installed
    # packages' metadata costs 10-25 ms, which every ``import mppca_nipype`` would pay
    if name == "__version__":
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version("mppca-nipype")
        except PackageNotFoundError:  # running from a source tree that was not installed
            return "0+unknown"
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
