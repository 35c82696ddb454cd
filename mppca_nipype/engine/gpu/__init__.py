"""The GPU engine: Triton kernels and cuSOLVER's batched eigensolver, run slab by slab and batch by batch
to fit the device's memory. ``pipeline.denoise_gpu`` is the backend; its docstring says which module holds
each step (docs/gpu.md says how they work).

``usable()`` says, cheaply and without raising, whether this engine can run here. Importing this package
points Triton's kernel cache at a folder that outlives the process and can be written
(``use_kernel_cache``), before any of its modules imports Triton.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
import stat
import sys
import tempfile
import threading

__all__ = ["usable", "absent_reason", "visible_devices", "use_kernel_cache", "kernel_cache_dir"]

#: The kernel cache's folder inside the user's cache folder, and inside a temporary folder of the user's own.
KERNEL_CACHE = Path("mppca-nipype", "triton")


def kernel_cache_dir(environ=os.environ) -> str:
    """Where Triton should keep the compiled kernels when ``TRITON_CACHE_DIR`` is not set.

    Triton's own default, ``~/.triton/cache``, cannot be written where home is read-only (containers, the
    compute nodes of some clusters), and every kernel would then fail to compile. In order:
    the user's cache folder, ``$XDG_CACHE_HOME`` (when absolute) or ``~/.cache``, under
    ``mppca-nipype/triton``, when it can be written; else ``mppca-nipype-<uid>/triton`` in the temporary
    folder (``tempfile.gettempdir()``: ``$TMPDIR``, else ``/tmp``...), the ``mppca-nipype-<uid>`` folder
    created with mode 700 and used only if it belongs to this user and no one else may write it (the cache
    holds shared libraries that Triton loads); else a new private temporary folder, for this process alone.
    """
    xdg = environ.get("XDG_CACHE_HOME", "")
    user_cache = Path(xdg) if os.path.isabs(xdg) else Path(environ.get("HOME") or Path.home()) / ".cache"
    if _writable_folder(user_cache / KERNEL_CACHE):
        return str(user_cache / KERNEL_CACHE)
    own = Path(tempfile.gettempdir(), f"mppca-nipype-{_user_id()}")
    if _private_folder(own) and _writable_folder(own / KERNEL_CACHE.name):
        return str(own / KERNEL_CACHE.name)
    return tempfile.mkdtemp(prefix="mppca-nipype-triton-")


def use_kernel_cache(environ=os.environ) -> str:
    """Set ``TRITON_CACHE_DIR`` to ``kernel_cache_dir()`` unless it (or ``TRITON_HOME``, which moves Triton's
    default) is set already; return the folder Triton will use. Must run before Triton compiles anything;
    the setting is the process's (and its children's), so other Triton code in this process shares it."""
    if environ.get("TRITON_CACHE_DIR"):
        return environ["TRITON_CACHE_DIR"]
    if environ.get("TRITON_HOME"):
        return os.path.join(environ["TRITON_HOME"], ".triton", "cache")
    environ["TRITON_CACHE_DIR"] = kernel_cache_dir(environ)
    return environ["TRITON_CACHE_DIR"]


def _writable_folder(folder: Path) -> bool:
    """Whether ``folder`` exists or can be made, and a file can be created in it (one is created and removed:
    the permission bits do not tell a read-only file system, nor anything to root)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            return True
    except OSError:
        return False


def _private_folder(folder: Path) -> bool:
    """Create ``folder`` with mode 700 if it is missing; whether it is a folder (not a link) of this user's
    that no one else may write."""
    try:
        folder.mkdir(mode=0o700)
    except FileExistsError:
        pass
    except OSError:
        return False
    try:
        status = folder.lstat()
    except OSError:
        return False
    return (stat.S_ISDIR(status.st_mode) and status.st_uid == _user_id()
            and not status.st_mode & (stat.S_IWGRP | stat.S_IWOTH))


def _user_id() -> int:
    return os.getuid() if hasattr(os, "getuid") else 0


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
    _hash_triton_in_the_background()
    return None


_triton_hashing = None


def _hash_triton_in_the_background() -> None:
    """Start computing, on a thread, the part of every Triton cache key that hashes Triton's own files
    (``triton.runtime.cache.triton_key``: SHA-256 over its ~400 MB compiler library, 0.3-0.4 s on the H200
    machine, once per process, at the first kernel launch): it then runs beside torch's start, the read and
    the plan, and the hashing releases the GIL. Should the first launch come first, it hashes beside the
    thread (the function caches its result; the two are the same) and waits no longer than without it."""
    global _triton_hashing
    if _triton_hashing is not None:
        return
    try:
        from triton.runtime.cache import triton_key
    except ImportError:  # (a Triton that keys its cache otherwise)
        return
    def hash_quietly():
        try:
            triton_key()
        except Exception:  # noqa: BLE001 - the first launch calls it again and reports what went wrong
            pass

    _triton_hashing = threading.Thread(target=hash_quietly, name="mppca-triton-key", daemon=True)
    _triton_hashing.start()


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


use_kernel_cache()
