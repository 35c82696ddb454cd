"""The GPU engine: Triton kernels and cuSOLVER's batched eigensolver, run slab by slab and batch by batch
to fit the device's memory. ``pipeline.denoise_gpu`` is the backend; its docstring says which module holds
each step (docs/gpu.md says how they work).

``usable()`` says, cheaply and without raising, whether this engine can run here.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
import sys

__all__ = ["usable", "absent_reason", "visible_devices"]


def usable() -> str | None:
    """None when torch and triton import and a CUDA device is usable; else one sentence saying why not.

    nvmath-python is not required here: without it the eigensolver falls back to torch.linalg.eigh, with a
    warning, when the pipeline starts. Where no GPU can be present, it answers without importing torch
    (which costs seconds, more than a small CPU run).
    """
    reason = absent_reason()
    if reason:
        return reason
    try:
        import torch
    except ImportError:
        return "torch is not installed (pip install 'mppca-nipype[gpu]')"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed (pip install 'mppca-nipype[gpu]')"
    try:
        if not torch.cuda.is_available() or torch.cuda.device_count() < 1:
            return "no CUDA device is visible to torch"
        major, _ = torch.cuda.get_device_capability()
    except Exception as err:  # a driver too old for this torch, a device in a bad state
        return f"the CUDA device cannot be used ({type(err).__name__}: {err})"
    if major < 7:
        return f"the CUDA device has compute capability {major}.x; the Triton kernels need 7.0 or newer"
    return None


def _driver_devices() -> int:
    """NVIDIA devices the driver shows on this machine (Linux), counted without initialising CUDA."""
    gpus = Path("/proc/driver/nvidia/gpus")
    return len(list(gpus.iterdir())) if gpus.is_dir() else len(list(Path("/dev").glob("nvidia[0-9]*")))


def visible_devices() -> list[str]:
    """The CUDA devices this process may use, by the names CUDA knows them (indices or UUIDs), without
    initialising CUDA: ``CUDA_VISIBLE_DEVICES`` when set (SLURM sets it for ``--gres=gpu:N``), else every
    NVIDIA device of the machine."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [name.strip() for name in listed.split(",") if name.strip() and name.strip() != "-1"]
    return [str(i) for i in range(_driver_devices())]


def absent_reason() -> str | None:
    """A reason there can be no usable GPU, found without importing torch; None when there may be one."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", "unset").strip() in ("", "-1"):
        return "CUDA_VISIBLE_DEVICES hides every device"
    for package in ("torch", "triton"):
        if importlib.util.find_spec(package) is None:
            return f"{package} is not installed (pip install 'mppca-nipype[gpu]')"
    if sys.platform.startswith("linux") and not (_driver_devices() or Path("/dev/dxg").exists()):  # dxg: WSL
        return "no NVIDIA GPU is present (no NVIDIA driver device found)"
    return None
