"""Files in and out: NIfTI with nibabel, input validation, atomic writes of images, text and JSON, and
file locks for writers that share a folder.

Knows nothing of the math, of Nipype or of BIDS. A file that cannot be read or written raises
``MPPCAInputError`` with one sentence for the user.
"""

from __future__ import annotations

from contextlib import contextmanager
import importlib
import json
import os
from pathlib import Path, PurePath
import re
import signal
import tempfile
from io import SEEK_SET, IOBase, UnsupportedOperation

import nibabel as nib
import numpy as np

from .engine.backend import available_cpus
from .engine.errors import MPPCAInputError

NIFTI_SUFFIXES = (".nii", ".nii.gz")
#: Compression level of the .nii.gz files written, in ISA-L's scale (0-3). On float32 MRI series level 1 gives
#: the size of zlib's levels 1 and 6 at ~10x zlib's speed; level 3 is slower for no smaller file, level 0
#: 30% larger (docs/benchmarks.md, "Compressed NIfTI").
GZIP_LEVEL = 1
#: Threads that compress a .nii.gz file, at most (and no more than the CPUs this process may use).
GZIP_THREADS = 8
#: Bytes decompressed per read into an array (``_decompressed``): a single read of a whole series is slower.
READ_BYTES = 64 << 20


def _is_nifti(path) -> bool:
    return str(path).endswith(NIFTI_SUFFIXES)


def load_image(path, what="input"):
    """Open a NIfTI image (header only; data are read on demand). Raise MPPCAInputError if unreadable."""
    path = Path(path)
    if not path.exists():
        raise MPPCAInputError(f"the {what} file {path} does not exist")
    if not _is_nifti(path):
        raise MPPCAInputError(f"the {what} file {path} is not NIfTI (.nii or .nii.gz)")
    try:
        return nib.load(str(path))
    except Exception as err:  # nibabel raises many types for corrupt files
        raise MPPCAInputError(f"the {what} file {path} cannot be read as NIfTI ({err})") from None


def is_complex(image) -> bool:
    """Whether the image stores complex numbers (NIfTI's complex64/complex128), from its header."""
    return image.get_data_dtype().kind == "c"


def read_data(image, path, what="input", dtype=np.float32):
    """The image's values with its scaling applied (scl_slope/scl_inter), as ``dtype``, in NIfTI's order
    (volume after volume: Fortran order, which the engine takes as it is): real numbers, or complex ones for a
    complex ``dtype`` (``is_complex`` says which the file holds; complex values asked for as real ones fail with
    one sentence). A .nii.gz file is decompressed by ISA-L (``isal``) where it is installed: twice as fast as
    zlib; stored as ``dtype`` with no scaling, it is decompressed straight into the array (``_decompressed``)."""
    if is_complex(image) and np.dtype(dtype).kind != "c":
        raise MPPCAInputError(f"the {what} file {path} holds complex numbers ({image.get_data_dtype()}), not "
                              "real ones")
    try:
        igzip = _isal("igzip")
        if igzip is None or not str(path).endswith(".gz"):
            return _values(image, dtype)
        with igzip.open(path, "rb") as stream:
            direct = _decompressed(image, stream, dtype)
            if direct is not None:
                return direct
            streamed = type(image).from_file_map(type(image).make_file_map({"image": stream, "header": stream}))
            return _values(streamed, dtype)
    except Exception as err:
        raise MPPCAInputError(f"the {what} file {path} is corrupt or truncated ({err})") from None


def _values(image, dtype):
    """The image's scaled values as ``dtype``: ``get_fdata`` for a real dtype; its data object for a complex one
    (``get_fdata`` gives real numbers only)."""
    if np.dtype(dtype).kind == "c":
        return np.asarray(image.dataobj).astype(dtype, copy=False)
    return np.asarray(image.get_fdata(dtype=dtype))


def _decompressed(image, stream, dtype):
    """The voxels of a compressed NIfTI ``image`` read from the decompressing ``stream`` (at its start) straight
    into a Fortran-order array, when they are stored as ``dtype`` (either byte order) with no scaling: one
    copy, where nibabel makes three (the file's bytes, the array, ``get_fdata``'s cast). Else None (nothing
    read)."""
    layout = _direct_layout(image, dtype)
    if layout is None:
        return None
    offset, stored = layout
    values = np.empty(image.shape, dtype=stored, order="F")
    _read_voxels(stream, offset, values)
    return values if stored.isnative else values.astype(dtype, order="F")


def _direct_layout(image, dtype):
    """(the voxels' offset in the file, their stored dtype) where ``_decompressed`` reads them straight into
    the array (stored as ``dtype``, either byte order, with no scaling); else None."""
    # the scaling nibabel applies is its proxy's (the header's get_slope_inter can say None where it scales)
    proxy = image.dataobj
    offset, slope, inter = (getattr(proxy, name, None) for name in ("offset", "slope", "inter"))
    stored = image.header.get_data_dtype()
    if offset is None or stored.newbyteorder("=") != np.dtype(dtype) or slope != 1 or inter != 0:
        return None
    return int(offset), stored


def _read_voxels(stream, offset, values, going_on=None):
    """Fill the Fortran-order array ``values`` from the decompressing ``stream`` (at its start), from the
    file's byte ``offset`` on, READ_BYTES at a time; ``going_on()`` (if given) is asked before each read, and
    False stops the reading (returns False)."""
    stream.seek(offset)  # (forward: the header and extensions are read past)
    view, filled = memoryview(values.reshape(-1, order="F")).cast("B"), 0
    while filled < len(view):
        if going_on is not None and not going_on():
            return False
        count = stream.readinto(view[filled:filled + READ_BYTES])
        if not count:
            raise EOFError(f"the file ends after {filled} of its {len(view)} bytes of voxels")
        filled += count
    return True


class ReadAhead:
    """A compressed series decompressed by a forked child process into memory both processes share, while
    this one goes on: ISA-L inflates on one thread (~3 s for a 663 MB series on the H200 machine), and a
    GPU run's start (torch's import, CUDA's) takes 1.5-2 s that the read used to follow. A thread would
    not do: the imports hold the GIL. ``read_ahead`` starts it; ``result`` waits for the child and returns
    the array, or None where it failed (the caller then reads the file itself, and says what is wrong);
    ``cancel`` stops it. The child stops by itself when this process ends."""

    def __init__(self, values, child):
        self.values, self.child = values, child

    def result(self):
        if self.child is None:
            return self.values
        _, status = os.waitpid(self.child, 0)
        self.child = None
        if os.waitstatus_to_exitcode(status) != 0:
            self.values = None
        return self.values

    def cancel(self):
        if self.child is not None:
            try:
                os.kill(self.child, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.waitpid(self.child, 0)
            self.child, self.values = None, None


def read_ahead(path, dtype=np.float32) -> ReadAhead | None:
    """Start reading the voxels of the .nii.gz series ``path`` in a forked child process (``ReadAhead``), as
    ``read_data`` reads them where they are stored as ``dtype`` with no scaling. None, with nothing started,
    where it cannot: not a .nii.gz file, no ISA-L, not Linux (fork), a header it cannot read or values it
    would have to convert (the caller reads the file itself then, and reports what is wrong)."""
    import mmap
    import sys

    igzip = _isal("igzip")
    if igzip is None or not str(path).endswith(".gz") or not sys.platform.startswith("linux"):
        return None
    try:
        image = nib.load(str(path))
        layout = _direct_layout(image, dtype)
    except Exception:  # noqa: BLE001 - the checks that follow say what is wrong with the file
        return None
    if layout is None or not layout[1].isnative:
        return None
    offset, stored = layout
    size = int(np.prod(image.shape)) * stored.itemsize
    if size == 0:
        return None
    parent = os.getpid()
    try:
        values = np.ndarray(image.shape, stored, buffer=mmap.mmap(-1, size), order="F")  # shared with the child
        child = os.fork()
    except OSError:  # no memory for it, or no process: read where the run reads
        return None
    if child == 0:  # the child: fill the shared array, then leave without running this process's exit handlers
        code = 1
        try:
            with igzip.open(str(path), "rb") as stream:
                code = 0 if _read_voxels(stream, offset, values, lambda: os.getppid() == parent) else 1
        except BaseException:  # noqa: BLE001 - the parent reads the file again and reports it
            pass
        finally:
            os._exit(code)
    return ReadAhead(values, child)


def open_series(path):
    """Open a 4D series and check its header (4D, enough volumes) without reading the voxels."""
    from .engine import MIN_VOLUMES

    image = load_image(path)
    shape = tuple(image.shape)
    if len(shape) != 4:
        raise MPPCAInputError(f"the input {path} must be a 4D series, but it is {len(shape)}D {shape}")
    if shape[3] < MIN_VOLUMES:
        raise MPPCAInputError(f"the input {path} has {shape[3]} volumes; MP-PCA needs at least {MIN_VOLUMES}")
    return image


def load_series(path):
    """Read a 4D series: returns (float32 array, nibabel image). Scaled integer data are read scaled."""
    image = open_series(path)
    return read_data(image, path), image


def load_mask(path, spatial_shape):
    """Read a mask (non-zero = inside) of the given spatial shape; a trailing axis of length 1 is allowed."""
    image = load_image(path, "mask")
    data = read_data(image, path, "mask")
    if data.ndim == 4 and data.shape[3] == 1:
        data = data[..., 0]
    if data.shape != tuple(spatial_shape):
        raise MPPCAInputError(f"the mask {path} has shape {data.shape}, but the input's voxel grid is "
                              f"{tuple(spatial_shape)}")
    return data != 0


def load_noise_map(path, spatial_shape):
    """Read a map of the noise level (sigma) on the input's voxel grid, float64; a trailing axis of length 1 is
    allowed. Its shape is checked from the header, before its values are read."""
    image = load_image(path, "noise level")
    shape = tuple(image.shape)
    if len(shape) == 4 and shape[3] == 1:
        shape = shape[:3]
    if shape != tuple(spatial_shape):
        raise MPPCAInputError(f"the noise level file {path} has shape {tuple(image.shape)}, but the input's "
                              f"voxel grid is {tuple(spatial_shape)}")
    return read_data(image, path, "noise level", dtype=np.float64).reshape(shape)


def beside(path, suffix: str) -> Path:
    """The file next to a NIfTI ``path`` with its NIfTI suffix replaced by ``suffix`` (dwi.nii.gz -> dwi.bval)."""
    name = str(path)
    for nifti in sorted(NIFTI_SUFFIXES, key=len, reverse=True):
        if name.endswith(nifti):
            return Path(name[:-len(nifti)] + suffix)
    return Path(name + suffix)


def read_numbers(path, what) -> np.ndarray:
    """The numbers of a text file separated by spaces, tabs or newlines (a .bval file, a column of labels),
    float64; one sentence when the file is missing or holds something else."""
    path = Path(path)
    try:
        words = path.read_text().split()
    except (OSError, UnicodeDecodeError) as err:
        raise MPPCAInputError(f"cannot read the {what} {path}: {getattr(err, 'strerror', None) or err}") from None
    numbers = []
    for word in words:
        try:
            numbers.append(float(word))
        except ValueError:
            raise MPPCAInputError(f"the {what} {path} must hold numbers only, not {word!r}") from None
    return np.array(numbers, dtype=np.float64)


def check_writable(path, what="output"):
    """Fail now, with one sentence, if ``path`` cannot be written (before any long computation)."""
    path = Path(path)
    if not _is_nifti(path):
        raise MPPCAInputError(f"the {what} file {path} must end in .nii or .nii.gz")
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        raise MPPCAInputError(f"cannot write the {what} {path}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise MPPCAInputError(f"cannot write the {what} {path}: the folder {folder} is not writable")
    if path.is_dir():
        raise MPPCAInputError(f"cannot write the {what} {path}: it is a folder")


@contextmanager
def staged_files(destinations, *, what=None, commit=None, clear_stale=False, make_folders=False):
    """Reserve a temporary file beside each destination for the block to write; when the block succeeds,
    rename them all into place.

    Yields ``{destination as given: temporary Path}`` (same folder and suffix, hidden name
    ``.<name>.<random><suffix>``). Creating the temporary files first proves that every destination can be
    written before any work is done (else ``MPPCAInputError`` naming ``what[destination]``, a mapping, or
    "output"); renaming only at the end means that a failure or an interrupt at any step leaves no output
    at all: the temporary files are removed, and outputs already renamed are taken back (a file that was
    there before, e.g. from an earlier run, is put back as it was: it is kept as a hard link, or renamed
    aside where the file system has none, until every rename succeeded). The renames run
    inside ``commit()`` when given (e.g. with SIGTERM held off). The outputs get the usual permissions
    (0666 less the umask), not the temporary files' private ones. ``clear_stale``: first remove the
    temporaries a killed writer left beside each destination (only under the lock that guards them);
    ``make_folders``: create missing folders.
    """
    staged = {}
    try:
        for given in destinations:
            path = Path(given)
            if make_folders:
                path.parent.mkdir(parents=True, exist_ok=True)
            if clear_stale:
                remove_stale_temporaries(path)
            suffix = ".nii.gz" if path.name.endswith(".nii.gz") else path.suffix
            try:
                fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix, dir=path.parent)
            except OSError as err:
                label = what.get(given, "output") if what else "output"
                raise MPPCAInputError(f"cannot write the {label} {path}: {err.strerror}") from None
            os.close(fd)
            staged[given] = Path(tmp)
        yield staged
        umask = os.umask(0o022)
        os.umask(umask)
        renamed = []  # (destination, the earlier file kept aside or None)
        try:
            with commit() if commit else _nothing():
                for given, tmp in staged.items():
                    os.chmod(tmp, 0o666 & ~umask)  # temporary files are private; outputs follow the umask
                    earlier = _keep_aside(Path(given), tmp)
                    renamed.append((Path(given), earlier))
                    os.replace(tmp, given)
        except BaseException:
            for path, earlier in reversed(renamed):
                try:  # one that cannot be put back must not keep the others from it, nor hide the error
                    if earlier is not None:
                        os.replace(earlier, path)
                    else:
                        path.unlink(missing_ok=True)
                except OSError:
                    pass
            raise
        for _, earlier in renamed:
            if earlier is not None:
                earlier.unlink(missing_ok=True)
    finally:
        for tmp in staged.values():
            tmp.unlink(missing_ok=True)


def _keep_aside(path: Path, tmp: Path):
    """Keep the file at ``path`` (if any) under a temporary name beside it before it is replaced; returns
    that name, or None when there is nothing to keep. A hard link keeps ``path`` in place meanwhile;
    without hard links the file is renamed aside (``path`` then briefly does not exist)."""
    if not path.exists():
        return None
    aside = tmp.with_name(tmp.name + ".earlier")
    try:
        os.link(path, aside)
    except OSError:
        os.replace(path, aside)
    return aside


@contextmanager
def _nothing():
    yield


@contextmanager
def atomic_destination(path):
    """``staged_files`` for one file: a temporary path (str) beside ``path`` for the block to write, renamed
    over ``path`` when the block succeeds, removed when it fails."""
    with staged_files([path]) as staged:
        yield str(staged[path])


@contextmanager
def commit_together():
    """A block of renames that SIGTERM cannot split (a ``commit`` for ``staged_files``): the signal waits
    until the block ends. SIGKILL cannot be held off; a rerun completes what it split."""
    blocked = hasattr(signal, "pthread_sigmask")
    if blocked:
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    try:
        yield
    finally:
        if blocked:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def write_text_atomic(path, text: str):
    """Write ``text`` to ``path`` through a temporary file in the same folder and a rename."""
    with atomic_destination(path) as tmp:
        Path(tmp).write_text(text)
    return Path(path)


def _jsonable(value):
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, PurePath):
        return str(value)
    if isinstance(value, (set, tuple)):
        return list(value)
    return str(value)


def json_text(obj) -> str:
    """``obj`` as indented JSON text ending in a newline (NumPy scalars and arrays, paths and sets are
    converted; anything else unknown becomes its ``str``)."""
    return json.dumps(obj, indent=2, default=_jsonable) + "\n"


def write_json_atomic(path, obj):
    """Write ``obj`` as indented JSON (``json_text``), atomically."""
    return write_text_atomic(path, json_text(obj))


@contextmanager
def file_lock(path, *, wait=True, on_wait=None):
    """Hold an exclusive lock on the file ``path`` (created) for the block.

    A POSIX (``fcntl``) lock: it works on NFS and goes with its holder, even one killed by SIGKILL, so a
    killed run never leaves a stale lock. With ``wait`` false, raises BlockingIOError when another process
    holds it; ``on_wait()`` is called once before waiting.
    """
    import fcntl

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        try:
            fcntl.lockf(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            if not wait:
                raise BlockingIOError(f"another process holds the lock {path}") from None
            if on_wait is not None:
                on_wait()
            fcntl.lockf(handle, fcntl.LOCK_EX)
        yield  # the lock goes with the file's closing


def remove_stale_temporaries(path):
    """Remove the temporary files a killed writer left beside ``path`` (``.<name>.<random>``).

    Only call it while holding the lock that guards ``path`` (another writer's live temporary would go)."""
    path = Path(path)
    for stale in path.parent.glob(f".{glob_escape(path.name)}.*"):
        stale.unlink(missing_ok=True)


def glob_escape(name: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", name)


def save_like(array, reference, path, dtype=None, *, atomic=True):
    """Write ``array`` with the reference image's affine and header, atomically: as ``dtype``, by default
    float32, or complex64 for a complex ``array``.

    The data are written to a temporary file in the destination folder, then renamed over ``path``: a
    reader never sees a half-written file, and an interrupted run leaves none behind. ``atomic=False``
    writes ``path`` itself (for a path that is already a ``staged_files`` temporary).
    """
    path = Path(path)
    if dtype is None:
        dtype = np.complex64 if np.iscomplexobj(array) else np.float32
    header = reference.header.copy()
    header.set_data_dtype(dtype)
    if array.ndim != len(header.get_data_shape()):
        header.set_data_shape(array.shape)
    image = type(reference)(np.asarray(array, dtype=dtype), reference.affine, header)
    image.header.set_slope_inter(1, 0)  # float output: no scaling
    if hasattr(image.header, "set_xyzt_units"):
        image.header.set_xyzt_units(*reference.header.get_xyzt_units())
    if not atomic:
        write_nifti(image, path)
        return path
    with atomic_destination(path) as tmp:
        write_nifti(image, tmp)
    return path


def write_nifti(image, path):
    """``nib.save(image, path)``, with a .nii.gz file compressed by ISA-L on threads where ``isal`` is
    installed (standard gzip: nibabel, MRtrix3 and FSL read it; ``GZIP_LEVEL``)."""
    igzip_threaded = _isal("igzip_threaded")
    if igzip_threaded is None or not str(path).endswith(".gz"):
        nib.save(image, path)
        return
    threads = min(GZIP_THREADS, available_cpus())
    with igzip_threaded.open(path, "wb", compresslevel=GZIP_LEVEL, threads=threads) as stream:
        forward = _ForwardOnly(stream)
        image.to_file_map(image.make_file_map({"image": forward, "header": forward}))


class _ForwardOnly(IOBase):
    """A stream that only moves forward (a compressor's), as nibabel writes into a file: ``tell``, and
    ``seek`` to where it is or further on (the gap written as zeros)."""

    def __init__(self, stream):
        super().__init__()
        self.stream, self.position = stream, 0

    def writable(self):
        return True

    def write(self, data):
        size = memoryview(data).nbytes
        self.stream.write(data)
        self.position += size
        return size

    def tell(self):
        return self.position

    def seek(self, position, whence=SEEK_SET):
        if whence != SEEK_SET or position < self.position:
            raise UnsupportedOperation("a compressed stream only moves forward")
        if position > self.position:
            self.write(bytes(position - self.position))
        return self.position


def _isal(module):
    """``isal.<module>`` (ISA-L's gzip), or None where python-isal is not installed."""
    try:
        return importlib.import_module(f"isal.{module}")
    except ImportError:
        return None
