"""mppca-nipype: fast Marchenko-Pastur PCA denoising of diffusion and functional MRI.

Python users call :func:`denoise` on arrays; Nipype users add :class:`mppca_nipype.interfaces.MPPCADenoise`
to a workflow; the command line has ``mppca-denoise`` (one file) and ``mppca-nipype`` (a BIDS app).
"""

from importlib.metadata import PackageNotFoundError, version as _version

from .engine import DenoiseResult, MPPCAInputError, MPPCAWarning, denoise

try:
    __version__ = _version("mppca-nipype")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0+unknown"

__all__ = ["denoise", "DenoiseResult", "MPPCAInputError", "MPPCAWarning", "__version__"]
