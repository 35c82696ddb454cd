"""The GPU engine: Triton kernels and cuSOLVER's batched eigensolver, run slab by slab and batch by batch
to fit the device's memory. ``pipeline.denoise_gpu`` is the backend; its docstring says which module holds
each step (docs/gpu.md says how they work).

``usable()`` says, cheaply and without raising, whether this engine can run here. Importing this package
points Triton's kernel cache at a folder that outlives the process and can be written
(``use_kernel_cache``), before any of its modules imports Triton.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
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
    _start_cuda_beside_torchs_import()
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
    _settle_triton_key()
    return None


#: The thread starting CUDA beside torch's import (``_start_cuda_beside_torchs_import``), once a process.
_cuda_start = None


def _start_cuda_beside_torchs_import() -> None:
    """Start CUDA's driver and the device's primary context (the one torch's runtime uses) on a thread, through
    the driver's own library, while this thread imports torch: on the H200 machine the two take ~0.2 s and
    ~0.2-0.3 s that would otherwise follow the import (1.5-2 s), at the check and at the first allocation.

    Only where torch is not imported yet (else there is nothing to overlap) and exactly one device is visible:
    it is the one any run uses (with several, a run may be given another, ``interfaces.gpu_slot``, and a context
    on the first would only hold its memory). Anything that fails here is left for torch to meet and report."""
    global _cuda_start
    if _cuda_start is not None or "torch" in sys.modules or not sys.platform.startswith("linux") \
            or len(visible_devices()) != 1:
        return

    def start():
        try:
            driver = ctypes.CDLL("libcuda.so.1")
        except OSError:
            return
        device, context = ctypes.c_int(), ctypes.c_void_p()
        if driver.cuInit(0) == 0 and driver.cuDeviceGet(ctypes.byref(device), 0) == 0:
            driver.cuDevicePrimaryCtxRetain(ctypes.byref(context), device)  # (kept until the process ends)

    _cuda_start = threading.Thread(target=start, name="mppca-cuda-start", daemon=True)
    _cuda_start.start()


#: The thread hashing Triton's files for this process (``_settle_triton_key``), where their hash was
#: not remembered; True once the hash was read from where it is remembered.
_triton_hashing = None

#: The file that remembers Triton's hash for one installation of Triton: in the kernel cache's folder, named by
#: ``_triton_files_fingerprint``.
TRITON_KEY_FILE = Path("mppca-nipype-triton-key", "{fingerprint}")


def _settle_triton_key() -> None:
    """Give this process the part of every Triton cache key that hashes Triton's own files
    (``triton.runtime.cache.triton_key``: SHA-256 over its ~400-500 MB compiler library, 0.5-0.8 s of a warm
    GPU run on the H200 machine, once per process, at the first kernel launch) without hashing them.

    The hash is remembered in the kernel cache's folder (``TRITON_KEY_FILE``) under a fingerprint of the files
    it covers: their paths, sizes, inodes and modification and change times (``_triton_files_fingerprint``,
    a few hundred files stat-ed in milliseconds). A reinstalled or edited Triton has another fingerprint, and
    its hash is computed anew. Where the file is there, ``triton_key`` returns its text (as Triton's own
    compile workers are given the parent's key); where it is not, the hash is computed on a thread (hashing
    releases the GIL: it runs beside torch's start, the read and the plan; a first launch that comes first
    hashes beside it and waits no longer than without it) and written there."""
    global _triton_hashing
    if _triton_hashing is not None:
        return
    try:
        from triton.runtime import cache
        triton_key = cache.triton_key
    except (ImportError, AttributeError):  # (a Triton that keys its cache otherwise)
        return
    remembered = _remembered_triton_key_file(Path(cache.__file__).resolve().parents[1])
    try:
        key = remembered.read_text() if remembered is not None else ""
    except OSError:
        key = ""
    if key:
        cache.triton_key = lambda: key
        _triton_hashing = True
        return

    def hash_and_remember():
        try:
            key = triton_key()
        except Exception:  # noqa: BLE001 - the first launch calls it again and reports what went wrong
            return
        if remembered is not None:
            _write_whole(remembered, key)

    _triton_hashing = threading.Thread(target=hash_and_remember, name="mppca-triton-key", daemon=True)
    _triton_hashing.start()


def _remembered_triton_key_file(triton_dir: Path) -> Path | None:
    """Where the hash of the Triton in ``triton_dir`` is remembered (``TRITON_KEY_FILE``); None where its files
    cannot be listed."""
    try:
        fingerprint = _triton_files_fingerprint(triton_dir)
    except OSError:
        return None
    return Path(use_kernel_cache()) / str(TRITON_KEY_FILE).format(fingerprint=fingerprint)


def _triton_files_fingerprint(triton_dir: Path) -> str:
    """A digest of the identity of every file ``triton_key`` hashes under ``triton_dir`` (the modules of its
    compiler, backends and language, Python or compiled, its cache module and ``_C/libtriton*``): path, size,
    inode, and modification and change times in nanoseconds. Rewriting a file changes its change time at
    least, which no one can set back."""
    files = [triton_dir / "runtime" / "cache.py", *sorted((triton_dir / "_C").glob("libtriton*"))]
    for package in ("compiler", "backends", "language"):
        files += sorted(path for suffix in ("*.py", "*.so") for path in (triton_dir / package).rglob(suffix))
    digest = hashlib.sha256(str(triton_dir).encode())
    for file in files:
        status = file.stat()
        digest.update(repr((str(file.relative_to(triton_dir)), status.st_size, status.st_ino, status.st_mtime_ns,
                            status.st_ctime_ns)).encode())
    return digest.hexdigest()[:32]


def _write_whole(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in its folder renamed onto it, so that a reader finds
    the whole text or no file; quietly nothing where the folder cannot be written."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    except OSError:
        return
    try:
        with os.fdopen(descriptor, "w") as file:
            file.write(text)
        os.replace(temporary, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(temporary)


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
