"""``mppca-denoise IN OUT [options]``: MP-PCA denoising of one 4D NIfTI series.

Every option and file is checked before any voxel is read (input header, mask shape, option values,
output destinations), so a mistake fails at once with one sentence. The outputs are written to temporary
files beside their destinations and renamed into place together at the end: a failure or an interrupt at any
step leaves no output behind.

``mppca-denoise --warm-up [T,...] [options]`` compiles the GPU engine's kernels for series of T volumes
(``warm_up``), so that an image build or a node's first job pays for the compilation once.
"""

from __future__ import annotations

import argparse
from collections import Counter
import dataclasses
import math
import os
from pathlib import Path
import time
import warnings

import numpy as np

from .. import io
from ..engine import (DEVICES, MIN_VOLUMES, MPPCAInputError, MPPCAWarning, check_device, choose_device, denoise,
                      resolve_noise, resolve_options)
from ..phases import Phases, process_age
from .common import (ArgumentParser, ProgressBar, add_denoising_options, add_gpu_memory_option, add_version_option,
                     leave_now_after_the_gpu, positive_int, say, user_errors, warnings_as_lines)

PROG = "mppca-denoise"

USAGE = """\
%(prog)s [options] IN OUT
       %(prog)s --warm-up [T,...] [options]"""

#: The numbers of volumes ``--warm-up`` compiles for when none are given: a DWI of 48 volumes (the tridiagonal
#: eigen step), one of 65 (64 directions and a b = 0: XsyevBatched) and a BOLD series of 300 (gathered
#: patches, the float64 refinement). Each T compiles kernels of its own (docs/gpu.md, "Warming up").
WARM_UP_VOLUMES = (48, 65, 300)

DESCRIPTION = """\
Denoise a 4D diffusion or functional MRI series by Marchenko-Pastur PCA
(MP-PCA; Veraart et al. 2016, Cordero-Grande et al. 2019). Each patch of voxels
is split into signal and noise components by the Marchenko-Pastur law and
projected onto its signal components; overlapping patches are combined.
IN and OUT are NIfTI files (.nii or .nii.gz); OUT is float32 with IN's affine
and header."""

EPILOG = """\
MRtrix3 dwidenoise's mode is --extent auto
--stride 1 --aggregation center --demean none
(with --estimator exp2, its default, or exp1). The defaults here (extent wide,
stride 3, weighted aggregation, volume demeaning, exp2) were chosen by
measurement (docs/benchmarks.md).

exit status: 0 done; 1 the input cannot be denoised or an output cannot be
written; 2 the command line is wrong; 130 interrupted (Ctrl-C); 143 terminated
(SIGTERM). On any failure no output file is left behind."""


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog=PROG, usage=USAGE, description=DESCRIPTION, epilog=EPILOG,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("input", nargs="?", metavar="IN",
                        help="the noisy 4D series (X, Y, Z, T), .nii or .nii.gz")
    parser.add_argument("output", nargs="?", metavar="OUT", help="the denoised series to write, .nii or .nii.gz")
    parser.add_argument("--mask", metavar="M",
                        help="3D NIfTI on IN's voxel grid: denoise only its non-zero voxels (outputs are 0 "
                             "outside; patches may still read voxels outside it)")
    parser.add_argument("--noise", metavar="FILE",
                        help="also write the 3D map of the noise level (standard deviation): estimated, or the "
                             "one given by --noise-in")
    parser.add_argument("--rank", metavar="FILE",
                        help="also write the 3D map of the number of signal components kept")
    add_denoising_options(parser)
    parser.add_argument("--noise-in", type=noise_level, metavar="FILE|NUMBER",
                        help="a given noise level (standard deviation) instead of each patch's estimate: one "
                             "positive number, or a 3D NIfTI map on IN's voxel grid (positive inside the "
                             "mask); a patch keeps the components above the Marchenko-Pastur edge "
                             "sigma^2 (1 + sqrt(gamma))^2 (docs/options.md)")
    parser.add_argument("--device", choices=DEVICES, default="auto",
                        help="auto: a CUDA GPU where the GPU engine is installed and usable and would "
                             "finish first, its start included, else the CPU (where the GPU may win and be "
                             "present, asking CUDA imports torch: 2-3 s); cpu: no GPU probe "
                             "(default: %(default)s)")
    parser.add_argument("--nprocs", type=positive_int, metavar="N",
                        help="CPU worker processes (default: the CPUs this process may use, at most "
                             "SLURM_CPUS_PER_TASK under SLURM)")
    add_gpu_memory_option(parser)
    parser.add_argument("--quiet", action="store_true",
                        help="no progress bar and no summary; warnings and errors are still printed")
    parser.add_argument("--timings", action="store_true",
                        help="print where the time went: start-up (the interpreter and the imports), checks, "
                             "read (with decompression), denoise (its input check, plan, backend and output "
                             "assembly), write (with compression)")
    parser.add_argument("--warm-up", nargs="?", const=WARM_UP_VOLUMES, type=volume_counts, metavar="T,...",
                        help="instead of denoising a file, compile the GPU engine's kernels for series of T "
                             "volumes in the mode the options describe and in dwidenoise's (default: "
                             f"{','.join(map(str, WARM_UP_VOLUMES))}); they are kept for later runs "
                             "(docs/gpu.md, \"Warming up\"); says so and exits 0 where no GPU can be used")
    add_version_option(parser)
    return parser


def noise_level(text: str):
    """``--noise-in``: a positive number (float), or else the name of a file (str), checked in ``_checked``."""
    try:
        value = float(text)
    except ValueError:
        return text
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number or a 3D NIfTI file, not {text!r}")
    return value


def volume_counts(text: str) -> tuple[int, ...]:
    """``T[,T...]``: numbers of volumes, each at least ``MIN_VOLUMES``."""
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        counts = ()
    if not counts or min(counts) < MIN_VOLUMES:
        raise argparse.ArgumentTypeError(f"must be numbers of volumes (at least {MIN_VOLUMES}) separated by "
                                         f"commas, not {text!r}")
    return counts


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.warm_up is not None:
        given = [name for name, value in (("IN", args.input), ("OUT", args.output), ("--mask", args.mask),
                                          ("--noise", args.noise), ("--rank", args.rank),
                                          ("--noise-in", args.noise_in)) if value is not None]
        if given:
            parser.error(f"--warm-up denoises generated series and takes no files ({', '.join(given)})")
    elif args.input is None or args.output is None:
        parser.error("the following arguments are required: IN, OUT")
    with warnings_as_lines(PROG), user_errors(PROG):
        if args.warm_up is not None:
            warm_up(args, parser)
        else:
            run(args, parser)


def console():
    """The ``mppca-denoise`` command: ``main``, and after a run on the GPU the process ends at once, its
    outputs written (``common.leave_now_after_the_gpu``)."""
    main()
    leave_now_after_the_gpu()


def run(args, parser) -> None:
    """Check everything, denoise, write the outputs together, print the summary (and the timings)."""
    started = time.perf_counter()
    phases = Phases(start_up=process_age())
    with phases("checks"):
        image, mask, options, outputs = _checked(args, parser)

    with io.staged_files(outputs, what=outputs) as staged:
        with phases("read"):
            data = io.read_data(image, args.input)
        with phases("denoise"), ProgressBar(PROG, quiet=args.quiet) as progress:
            result = denoise(data, mask, **options, device=args.device, nprocs=args.nprocs,
                             gpu_memory=args.gpu_memory, progress=progress)
        phases.parts_of("denoise", result.info["seconds"])
        maps = {args.output: result.denoised, args.noise: result.sigma, args.rank: result.rank}
        with phases("write"):
            for path in outputs:
                try:
                    io.save_like(maps[path], image, staged[path], atomic=False)
                except OSError as err:
                    raise MPPCAInputError(f"cannot write the {outputs[path]} {path}: "
                                          f"{err.strerror or err}") from None

    if not args.quiet:
        say(summary(result, data, mask, time.perf_counter() - started))
    if args.timings:
        say(f"{PROG}: timings: {phases.line()}")


def _checked(args, parser):
    """Every check before a voxel is read: the input's header, the mask, the options, the device, the
    destinations (distinct, not an input, writable). Returns (image, mask, options, {output: label})."""
    # the input's header and the mask: shapes only, no voxel of the series is read yet
    image = io.open_series(args.input)
    shape = tuple(image.shape)
    mask = io.load_mask(args.mask, shape[:3]) if args.mask else None
    options = dict(extent=args.extent, stride=args.stride, estimator=args.estimator,
                   aggregation=args.aggregation, demean=args.demean)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", MPPCAWarning)  # denoise() gives the same warnings, once
            resolved = resolve_options(shape, **options)
    except MPPCAInputError as err:
        parser.error(str(err))
    # raises MPPCAInputError, with the reason, when 'cuda' cannot be used; 'auto' probes the GPU only where
    # it would finish first (a small series never waits for torch to be imported)
    if args.noise_in is not None:  # a map is small: read now, so that its values are checked before the series'
        options["noise"], variance = _given_noise(args.noise_in, shape, mask)
        resolved = dataclasses.replace(resolved, noise_variance=variance)
    choose_device(args.device, shape, resolved, args.nprocs)

    # the destinations: distinct, not an input, writable (proved by creating their temporary files)
    outputs = {args.output: "output"}
    for path, what in ((args.noise, "noise map"), (args.rank, "rank map")):
        if path is not None:
            if _same_file(path, *outputs):
                parser.error(f"the {what} {path} is also given as another output")
            outputs[path] = what
    for path, what in outputs.items():
        for source in (args.input, args.mask, args.noise_in if isinstance(args.noise_in, str) else None):
            if source is not None and _same_file(path, source):
                parser.error(f"the {what} {path} would overwrite the input {source}")
        io.check_writable(path, what)
    return image, mask, options, outputs


def _given_noise(noise_in, shape, mask):
    """``--noise-in``'s number, or its map read from the file, and the noise variance it resolves to
    (``resolve_noise``, checked once here; one sentence when it cannot be used)."""
    if not isinstance(noise_in, str):
        return noise_in, resolve_noise(noise_in, shape[:3], mask)
    if not os.path.exists(noise_in):
        raise MPPCAInputError(f"--noise-in {noise_in} is neither a positive number nor an existing file (it "
                              "takes a number or a 3D NIfTI on IN's voxel grid)")
    sigma = io.load_noise_map(noise_in, shape[:3])
    try:
        return sigma, resolve_noise(sigma, shape[:3], mask)
    except MPPCAInputError as err:
        raise MPPCAInputError(f"--noise-in {noise_in}: {err}") from None


def warm_up(args, parser) -> None:
    """Denoise small generated series on the GPU (``engine.gpu.warmup.warm_up_runs``: each T of
    ``args.warm_up`` in the options' mode and dwidenoise's) so that Triton compiles the kernels runs of those T
    take and keeps them in its cache folder; say what each series compiled and how long it took. Where no
    GPU can be used: one sentence, and nothing else to do (``--device cuda``: that is an error)."""
    if args.device == "cpu":
        parser.error("--warm-up compiles the GPU engine's kernels and cannot run with --device cpu")
    options = dict(extent=args.extent, stride=args.stride, estimator=args.estimator,
                   aggregation=args.aggregation, demean=args.demean)
    for n_volumes in args.warm_up:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", MPPCAWarning)
                resolve_options((1001, 1001, 1001, n_volumes), **options)
        except MPPCAInputError as err:
            parser.error(str(err))
    from ..engine.gpu import usable, use_kernel_cache

    reason = usable()
    if reason is not None:
        check_device(args.device)  # 'cuda': MPPCAInputError with the reason
        say(f"{PROG}: nothing to warm up: {reason}")
        return
    from ..engine.gpu.warmup import warm_up_runs

    cache = Path(use_kernel_cache())
    runs = warm_up_runs(args.warm_up, options)
    if not args.quiet:
        say(f"{PROG}: warm-up: {len(runs)} series of T = {', '.join(map(str, args.warm_up))} "
            f"({', '.join(dict.fromkeys(run.mode for run in runs))}); kernels kept in {cache}")
    started = time.perf_counter()
    compiled = Counter()
    for run in runs:
        before = _compiled_kernels(cache)
        run_started = time.perf_counter()
        denoise(run.series(), device="cuda", **run.options)
        seconds = time.perf_counter() - run_started
        new = Counter(name for entry, name in _compiled_kernels(cache).items() if entry not in before)
        compiled += new
        if not args.quiet:
            say(f"{PROG}: warm-up: {run.label}: {seconds:.1f} s, {_kernel_counts(new)}")
    if not args.quiet:
        seconds = time.perf_counter() - started
        what = (f"{sum(compiled.values())} kernel variants compiled into {cache}" if compiled
                else f"every kernel was in {cache} already")
        say(f"{PROG}: warm-up: done in {seconds:.1f} s; {what}")


def _compiled_kernels(cache: Path) -> dict:
    """{entry: kernel name} of the compiled kernels in Triton's cache folder: each of its entries holds one
    specialisation of one kernel, named by its ``__grp__<kernel>.json``."""
    prefix, suffix = "__grp__", ".json"
    return {group.parent.name: group.name[len(prefix):-len(suffix)]
            for group in cache.glob(f"*/{prefix}*{suffix}")}


def _kernel_counts(counts: Counter) -> str:
    """'compiled _gram_kernel x2, _threshold_kernel' or 'nothing compiled'."""
    if not counts:
        return "nothing compiled"
    return "compiled " + ", ".join(name + (f" x{count}" if count > 1 else "")
                                   for name, count in sorted(counts.items()))


def summary(result, data, mask, seconds: float) -> str:
    """One line: size, time, where it ran, and the median noise and rank over the denoised voxels."""
    info = result.info
    where = info.get("backend", "?")
    if info.get("device") not in (None, where):
        where += f" on {info['device']}"
    if info.get("backend") == "cpu" and "nprocs" in info:
        where += f", {info['nprocs']} process{'es' if info['nprocs'] != 1 else ''}"
    denoised = np.ones(data.shape[:3], bool) if mask is None else mask.copy()
    if info.get("n_nonfinite_voxels"):  # (else every voxel in the mask was: no pass over the series)
        denoised &= np.isfinite(data).all(axis=3)
    count = int(np.count_nonzero(denoised))
    if count:
        medians = (f"median noise {np.median(result.sigma[denoised]):.4g}, "
                   f"median rank {np.median(result.rank[denoised]):.3g} in {count} voxels")
    else:
        medians = "no voxel was denoised"
    return (f"{PROG}: denoised {'x'.join(map(str, data.shape))} in {seconds:.1f} s ({where}); "
            f"{medians}")


def _same_file(path, *others) -> bool:
    """Whether ``path`` names the same file as any of ``others`` (after links and relative parts)."""
    real = os.path.realpath(path)
    return any(real == os.path.realpath(other) for other in others)


if __name__ == "__main__":
    console()
