"""The small series a warm-up denoises so that a machine's first real runs find their kernels compiled.

Triton compiles a kernel once for each set of values of its compile-time constants (``tl.constexpr``) and
keeps it in its cache folder (``use_kernel_cache``). The GPU engine's constants follow from the patch and the
options:

- the patch's voxel count n and volume count T: the fused Gram and reconstruction kernels (``gram``,
  ``reconstruction``: n, T and their block sizes), the eigen step and the threshold (m = min(n, T):
  ``tridiagonal``, ``threshold``); n comes from the extent, which "wide" and "auto" derive from T;
- the demeaning (``DEMEAN``), the Gram precision (``FP64``: a float32 first pass, its float64 settling pass),
  a counted launch (``COUNTED``: the settling pass chosen on the device), the rank-one term of an undemeaned
  float32 run (``RANK_ONE``), the estimator (``ESTIMATOR``) and the settling test (``SETTLE``);
- the path, from T (in a float32 first pass): up to 64 the tridiagonal kernels, up to 128 the fused kernels
  with XsyevBatched (no Triton kernel in the eigen step), beyond gathered patches and cuBLAS;
- for the box sums (voxel demeaning on a full grid) also the image's y and z sizes, which a warm-up cannot
  know.

Triton also specialises integer arguments on divisibility by 16 (the rows and windows a launch covers) and
pointers on 16-byte alignment, so each (options, T) runs on two grids: one whose voxel and window counts
are multiples of 16, one whose are both odd. A warm-up therefore serves the runs whose options and T it
ran; ``warm_up_runs`` lists those runs: each T of ``volumes`` in the options' mode (the defaults unless
given) and in dwidenoise's mode.

A machine's first run needs no warm-up to compile in parallel: before a run whose kernels this machine has not
compiled for its options and T (``compile_ahead``), the backend runs on the small grids with every launch
turned into a compilation, queued on ``COMPILE_THREADS`` threads, so that the run's variants compile side by
side rather than one after the other as the run reaches them.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from contextvars import ContextVar
from dataclasses import dataclass, replace
from functools import lru_cache
import hashlib
import itertools
import math
import os
from pathlib import Path
import threading

import numpy as np

from ..patches import resolve_extent, window_positions

#: A grid larger than any patch: on it ``resolve_extent`` gives the extent a rule asks for, uncapped.
_UNCAPPED = (1001, 1001, 1001)

#: The sides a warm-up grid may take along an axis: the extent plus this many voxels, or more...
_MARGIN = 4
#: ...up to this many more.
_SIDES = 16


@dataclass(frozen=True)
class WarmUpRun:
    """One series of a warm-up: ``mode`` (what it is, for the report), the denoising ``options``, its grid
    ``shape`` and ``n_volumes``."""

    mode: str
    options: dict
    shape: tuple[int, int, int]
    n_volumes: int

    def series(self) -> np.ndarray:
        """The noisy series: a rank-5 signal on a baseline near 1000 plus noise (``phantoms``), so that
        some windows' ranks are near float32's limit and the settling pass runs too."""
        from ...phantoms import low_rank_phantom

        noisy, _ = low_rank_phantom(self.shape, self.n_volumes, seed=self.n_volumes)
        return noisy

    @property
    def label(self) -> str:
        return f"T={self.n_volumes}, {self.mode}, {'x'.join(map(str, self.shape))}"


def warm_up_grids(extent, stride) -> list[tuple[int, int, int]]:
    """The two smallest grids, with sides ``_MARGIN`` to ``_MARGIN + _SIDES - 1`` voxels beyond a patch of
    ``extent`` (three ints, so it is not capped), whose voxel count and count of windows at ``stride`` are
    multiples of 16 (the first) and both odd (the second)."""
    sides = [range(e + _MARGIN, e + _MARGIN + _SIDES) for e in extent]
    windows_along = [{side: len(window_positions(side, e, stride)) for side in axis}
                     for axis, e in zip(sides, extent)]

    def counts(shape):
        return math.prod(shape), math.prod(windows[side] for windows, side in zip(windows_along, shape))

    grids = []
    for wanted in (lambda voxels, windows: voxels % 16 == 0 and windows % 16 == 0,
                   lambda voxels, windows: voxels % 2 == 1 and windows % 2 == 1):
        grid = min((shape for shape in itertools.product(*sides) if wanted(*counts(shape))), key=math.prod,
                   default=None)
        if grid is not None:
            grids.append(tuple(int(side) for side in grid))
    return grids


def warm_up_runs(volumes, options=None) -> list[WarmUpRun]:
    """The series a warm-up denoises: for each T of ``volumes``, the options' mode (``options``: the keyword
    arguments of ``denoise``; the defaults when None) and dwidenoise's mode (with the estimator given, as
    dwidenoise's ``-estimator``), each on both ``warm_up_grids`` of the extent a full-size series of T takes."""
    from .. import DEFAULTS, DWIDENOISE_MODE

    given = options or {}
    options = dict(DEFAULTS, **given)
    dwidenoise = {**options, **DWIDENOISE_MODE, **{k: v for k, v in given.items() if k == "estimator"}}
    modes = [("the defaults" if options == DEFAULTS else "the options given", options)]
    if dwidenoise != options:
        modes.append(("dwidenoise's mode", dwidenoise))
    runs = []
    for n_volumes in volumes:
        for mode, mode_options in modes:
            extent = resolve_extent(mode_options["extent"], _UNCAPPED, n_volumes)
            runs += [WarmUpRun(mode, mode_options, shape, int(n_volumes))
                     for shape in warm_up_grids(extent, mode_options["stride"])]
    return runs


#: Threads that compile a first run's kernels side by side (``compile_ahead``). On the H200 machine's 16 cores
#: the seed's problem's first run, a whole process, took 10.9, 11.2, 8.9 and 9.4 s with 2, 3, 4 and 6
#: threads, ~15 s with 8 or 16, and 24-30 s compiling in the run (Triton's front end holds the GIL: more
#: threads wait on it and on the run's own thread).
COMPILE_THREADS = 4

#: Set while ``compile_ahead`` runs the backend: every Triton launch in this context only compiles its kernel.
_compile_only = ContextVar("mppca_compile_only", default=False)
_setting_up = threading.Lock()
_pool = None
_compiled = set()  # the markers this process found or wrote
_queued = set()  # the compilations this process queued that have not ended


class KernelsAhead:
    """What ``compile_ahead`` queued for a run: its ``queued`` compilations, and the file that records the set
    compiled, written once the run succeeded (``run_succeeded``) and every queued compilation has ended (a
    process that ends first leaves it to a later run)."""

    def __init__(self, marker: str, futures):
        self.marker, self.futures = marker, list(futures)
        self._lock, self._succeeded, self._left = threading.Lock(), False, len(self.futures)
        for future in self.futures:
            future.add_done_callback(self._one_done)

    @property
    def queued(self) -> int:
        return len(self.futures)

    def _one_done(self, _future):
        with self._lock:
            self._left -= 1
            ready = self._succeeded and self._left == 0
        if ready:
            _write_marker(self.marker)

    def run_succeeded(self) -> None:
        with self._lock:
            self._succeeded = True
            ready = self._left == 0
        if ready:
            _write_marker(self.marker)


def compile_ahead(n_volumes, options, backend, cache_dir) -> KernelsAhead | None:
    """Queue the compilation of the kernels a GPU run of ``options`` (``DenoiseOptions``) over T =
    ``n_volumes`` launches, on ``COMPILE_THREADS`` threads, and return at once (``KernelsAhead``).

    Nothing is queued (None) where the file that records them compiled is in ``cache_dir`` (Triton's cache
    folder: ``use_kernel_cache``), under the interpreter, or where this Triton lacks the asynchronous
    compilation this needs (``triton.runtime._async_compile``). ``backend`` (``denoise_gpu``) runs on
    ``warm_up_grids``, with a noise map of the same kind, each launch a compilation only
    (``triton.JITFunction.run``'s ``warmup``). What it reads back from the device is meaningless (the windows
    its settling passes choose on the device are none, ``settling.choose_windows``), and any error it meets
    ends it: the kernels queued so far still compile, and the run compiles any other itself. The run waits
    for a kernel still compiling where Triton keeps the queued compilation in its cache (Triton 3.9 does);
    where it does not (3.6), each one that ends is put there, and a run that needs one still under way
    compiles it itself (the same kernel). A run over a masked or partly non-finite image may take the fused
    kernels where these grids take the box sums: those it compiles itself.
    """
    if os.environ.get("TRITON_INTERPRET") == "1" or compiling_only():
        return None
    marker = _compiled_marker(Path(cache_dir), n_volumes, options)
    if str(marker) in _compiled or marker.exists():
        _compiled.add(str(marker))
        return None
    try:
        from triton.runtime import _async_compile
    except ImportError:
        return None
    _let_launches_only_compile()
    mode = _async_compile.AsyncCompileMode(_compile_pool())
    only, asynchronous = _compile_only.set(True), _async_compile.active_mode.set(mode)
    try:
        for grid in warm_up_grids(options.extent, options.stride):
            _compiling_run(backend, grid, n_volumes, options)
    except Exception:  # noqa: BLE001 - a dry run over uninitialised results may fail anywhere; see above
        pass
    finally:
        _async_compile.active_mode.reset(asynchronous)
        _compile_only.reset(only)
    in_kernel_cache = "__getattr__" in vars(_async_compile.FutureKernel)  # (Triton 3.6: it is not)
    for future in mode.raw_futures:
        if not in_kernel_cache:  # put there as it ends
            future.add_done_callback(lambda done, queued=mode.future_kernels[future._key]: queued.result(True))
        _queued.add(future)
        future.add_done_callback(_queued.discard)
    return KernelsAhead(str(marker), mode.raw_futures)


def wait_for_compilations() -> None:
    """Wait until every compilation this process queued has ended (the warm-up: nothing left behind)."""
    for future in list(_queued):
        future.exception()


def compiling_only() -> bool:
    """Whether this is ``compile_ahead``'s run, whose launches only compile their kernels."""
    return _compile_only.get()


def _write_marker(marker: str) -> None:
    """Record (``KernelsAhead``'s file) that this machine has compiled a run's kernels."""
    if marker in _compiled:
        return
    _compiled.add(marker)
    try:
        Path(marker).parent.mkdir(parents=True, exist_ok=True)
        Path(marker).touch()
    except OSError:  # a read-only cache: the next run queues the compilations again, and finds them cached
        pass


def _compiling_run(backend, grid, n_volumes, options) -> None:
    from ..patches import plan_patches

    every_voxel = np.ones(grid, dtype=bool)
    noise = options.noise_variance
    if isinstance(noise, np.ndarray):  # a map of the run's grid: one of this grid's, of the same kind
        noise = np.full(math.prod(grid), float(np.median(noise)) or 1.0)
    plan = plan_patches(grid, options.extent, options.stride, every_voxel, every_voxel, options.shape)
    series = np.zeros((*grid, n_volumes), dtype=np.float32)
    backend(series, every_voxel, plan, replace(options, noise_variance=noise))


def _compiled_marker(cache_dir: Path, n_volumes, options) -> Path:
    """The file that records a run's kernels compiled: named by the engine's kernel sources, Triton's version,
    the device and what sets the kernels' compile-time constants (T and the options, the noise level's kind)."""
    import torch
    import triton

    noise = options.noise_variance
    kind = "estimated" if noise is None else "map" if isinstance(noise, np.ndarray) else "given"
    key = hashlib.sha256(repr((_kernel_sources(), triton.__version__, torch.version.cuda,
                               torch.cuda.get_device_capability(), n_volumes,
                               replace(options, noise_variance=None), kind)).encode()).hexdigest()
    return cache_dir / "mppca-nipype-compiled" / key[:32]


@lru_cache(maxsize=None)
def _kernel_sources() -> str:
    """A digest of this package's GPU engine sources (its kernels, and the code that chooses their variants)."""
    digest = hashlib.sha256()
    for source in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(source.read_bytes())
    return digest.hexdigest()


def _compile_pool() -> ThreadPoolExecutor:
    """The threads that compile. The interpreter's exit waits for what they have queued (a first run's
    variants its own run did not need: for the runs to come); ``os._exit`` (the command after a GPU run)
    does not, and a later run queues what is missing again."""
    global _pool
    with _setting_up:
        if _pool is None:
            from ..backend import available_cpus

            _pool = ThreadPoolExecutor(min(COMPILE_THREADS, available_cpus()), thread_name_prefix="mppca-compile")
        return _pool


def _let_launches_only_compile() -> None:
    """Make ``JITFunction.run`` compile without launching in a ``_compile_only`` context (once a process)."""
    from triton.runtime.jit import JITFunction

    with _setting_up:
        if getattr(JITFunction.run, "_mppca_compile_only", False):
            return
        launch = JITFunction.run

        def run(self, *args, grid, warmup, **kwargs):
            return launch(self, *args, grid=grid, warmup=warmup or _compile_only.get(), **kwargs)

        run._mppca_compile_only = True
        JITFunction.run = run
