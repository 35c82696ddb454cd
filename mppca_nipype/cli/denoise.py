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
from ..engine import (DEFAULTS, DEVICES, MIN_VOLUMES, NOISE_STRIDE, MPPCAInputError, MPPCAWarning, check_device,
                      choose_device, default_filter, denoise, resolve_noise, resolve_options)
from ..engine.complex_data import denoise_complex
from ..engine.groups import GROUP_DEMEANING, check_groups, plan_groups
from ..phases import Phases, process_age
from . import noise as noise_only
from .common import (ArgumentParser, ProgressBar, add_denoising_options, add_gpu_memory_option,
                     add_filter_option, add_map_options, add_noise_floor_options, add_phase_options,
                     add_run_options, add_version_option, check_destinations, inside_voxels,
                     leave_now_after_the_gpu, maps_asked, maps_problem, noise_floor_options, noise_floor_problem,
                     open_input, phase_problem, say, user_errors, warnings_as_lines, where_it_ran, write_images)

PROG = "mppca-denoise"

USAGE = """\
%(prog)s [options] IN OUT
       %(prog)s [options] IN OUT --echo IN2 OUT2 [--echo IN3 OUT3 ...]
       %(prog)s --noise-only --noise SIGMA [options] IN
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
and header. A complex IN (complex64/complex128) is denoised as complex data, as
a magnitude with --phase is, and OUT is then complex64."""

EPILOG = """\
MRtrix3 dwidenoise's mode is --extent auto
--stride 1 --aggregation center --demean none --estimator exp2 --filter hard
(or --estimator exp1, its other estimator). The defaults here (extent wide,
stride 3, volume demeaning, the olesen2023 estimator, optimal shrinkage,
gaussian aggregation) were chosen by measurement (docs/benchmarks.md).

--noise-only is mppca-noise IN SIGMA: the noise map alone, without denoising,
on a coarser grid (stride 7 unless --stride is given).

exit status: 0 done; 1 the input cannot be denoised or an output cannot be
written; 2 the command line is wrong; 130 interrupted (Ctrl-C); 143 terminated
(SIGTERM). On any failure no output file is left behind."""


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog=PROG, usage=USAGE, description=DESCRIPTION, epilog=EPILOG,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("input", nargs="?", metavar="IN",
                        help="the noisy 4D series (X, Y, Z, T), .nii or .nii.gz: real, or complex (complex64, "
                             "complex128: denoised as complex data, its phase as --phase gives a magnitude's)")
    parser.add_argument("output", nargs="?", metavar="OUT", help="the denoised series to write, .nii or .nii.gz")
    parser.add_argument("--mask", metavar="M",
                        help="3D NIfTI on IN's voxel grid: denoise only its non-zero voxels (outputs are 0 "
                             "outside; patches may still read voxels outside it)")
    parser.add_argument("--noise", metavar="FILE",
                        help="also write the 3D map of the noise level (standard deviation): estimated, or the "
                             "one given by --noise-in")
    parser.add_argument("--rank", metavar="FILE",
                        help="also write the 3D map of the number of signal components kept")
    add_map_options(parser, files=True)
    parser.add_argument("--noise-only", action="store_true",
                        help="write only the noise map (--noise), without denoising: mppca-noise IN SIGMA, the "
                             f"same run; without OUT; the default stride is then {NOISE_STRIDE}")
    add_denoising_options(parser, stride_unset=True, groups=True)
    parser.add_argument("--bval", metavar="FILE",
                        help="with --demean shells: the b-values of IN's volumes (FSL's .bval; default: the "
                             ".bval beside IN, IN's name with .bval for .nii[.gz])")
    parser.add_argument("--echo", nargs=2, action="append", metavar=("IN_E", "OUT_E"),
                        help="one more echo of a multi-echo series and its output, on IN's grid with IN's "
                             "volumes (repeat for each echo; IN OUT is the first): the echoes are denoised "
                             "jointly, each patch holding every echo's volumes, each voxel's mean per echo "
                             "removed; --noise and --rank are shared (docs/options.md)")
    parser.add_argument("--noise-in", type=noise_level, metavar="FILE|NUMBER",
                        help="a given noise level (standard deviation) instead of each patch's estimate: one "
                             "positive number, or a 3D NIfTI map on IN's voxel grid (positive inside the "
                             "mask); a patch keeps the components above the Marchenko-Pastur edge "
                             "sigma^2 (1 + sqrt(gamma))^2 (docs/options.md); with --noise-floor, the "
                             "channels' sigma of the magnitude data")
    add_filter_option(parser)
    add_noise_floor_options(parser)
    add_phase_options(parser)
    parser.add_argument("--device", choices=DEVICES, default="auto",
                        help="auto: a CUDA GPU where the GPU engine is installed and usable and would "
                             "finish first, its start included, else the CPU (where the GPU may win and be "
                             "present, asking CUDA imports torch: 2-3 s); cpu: no GPU probe "
                             "(default: %(default)s)")
    add_run_options(parser, work="denoise")
    add_gpu_memory_option(parser)
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
    if args.noise_only:
        given = [name for name, value in (("OUT", args.output), ("--noise-in", args.noise_in),
                                          ("--warm-up", args.warm_up), ("--coils", args.coils),
                                          ("--echo", args.echo), ("--bval", args.bval)) if value is not None]
        given += ["--noise-floor"] if args.noise_floor != "none" else []
        given += [name for name, value in (("--phase", args.phase), ("--phase-out", args.phase_out),
                                           ("--lambda-plus", args.lambda_plus),
                                           ("--variance-removed", args.variance_removed)) if value]
        if given:
            parser.error(f"--noise-only writes the noise map alone (--noise SIGMA) and takes no {', '.join(given)}")
        if args.input is None or args.noise is None:
            parser.error("--noise-only needs IN and --noise SIGMA, the noise map to write")
        if args.device == "cuda":
            parser.error("--noise-only runs on the CPU; leave out --device cuda")
        args.output = args.noise  # (a stride not given: ``engine.noise_stride``)
        with warnings_as_lines(PROG), user_errors(PROG):
            noise_only.run(args, parser, prog=PROG)
        return
    if args.stride is None:
        args.stride = DEFAULTS["stride"]
    if args.warm_up is not None:
        given = [name for name, value in (("IN", args.input), ("OUT", args.output), ("--mask", args.mask),
                                          ("--noise", args.noise), ("--rank", args.rank),
                                          ("--noise-in", args.noise_in), ("--phase", args.phase),
                                          ("--phase-out", args.phase_out), ("--echo", args.echo),
                                          ("--bval", args.bval), ("--lambda-plus", args.lambda_plus),
                                          ("--variance-removed", args.variance_removed)) if value is not None]
        given += ["--noise-floor"] if args.noise_floor != "none" else []
        if given:
            parser.error(f"--warm-up denoises generated series and takes no files ({', '.join(given)})")
    elif args.input is None or args.output is None:
        parser.error("the following arguments are required: IN, OUT")
    for problem in (noise_floor_problem(args), phase_problem(args), groups_problem(args), maps_problem(args)):
        if problem:
            parser.error(problem)
    with warnings_as_lines(PROG), user_errors(PROG):
        if args.warm_up is not None:
            warm_up(args, parser)
        else:
            run(args, parser)


def groups_problem(args) -> str | None:
    """The sentence that says why ``--demean shells|groups:FILE``, ``--bval`` and ``--echo`` do not go with
    the other options, or None."""
    mode = demean_of(args)
    if args.bval is not None and mode != "shells":
        return "--bval gives the b-values of --demean shells"
    grouped = mode in GROUP_DEMEANING or args.echo
    what = "--echo" if args.echo else f"--demean {mode}"
    if grouped and args.phase is not None:
        return f"--phase denoises one complex series and does not combine with {what}"
    if grouped and args.noise_floor != "none":
        return f"--noise-floor {args.noise_floor} does not combine with {what}"
    return None


def demean_of(args) -> str:
    """The demeaning mode of ``--demean`` (``groups`` for ``groups:FILE``)."""
    return args.demean.split(":", 1)[0]


def _volume_groups(args, n_volumes):
    """``denoise``'s ``demean``, ``groups`` and ``bvals`` from ``--demean`` and ``--bval``: the label or
    .bval file read (small), its count checked against IN's volumes."""
    mode = demean_of(args)
    if mode == "groups":
        path = args.demean.split(":", 1)[1]
        labels = check_groups(io.read_numbers(path, "group file"), n_volumes, f"the labels of the group file {path}")
        return dict(demean=mode, groups=labels)
    if mode == "shells":
        path = args.bval if args.bval is not None else io.beside(args.input, ".bval")
        if args.bval is None and not path.exists():
            raise MPPCAInputError(f"--demean shells needs the b-values: there is no {path} beside IN; give "
                                  "--bval FILE")
        bvals = io.read_numbers(path, ".bval file")
        if bvals.size != n_volumes:
            raise MPPCAInputError(f"the .bval file {path} holds {bvals.size} b-values, but IN has {n_volumes} volumes")
        return dict(demean=mode, bvals=bvals)
    return dict(demean=mode)


def console():
    """The ``mppca-denoise`` command: ``main``, and after a run on the GPU the process ends at once, its
    outputs written (``common.leave_now_after_the_gpu``)."""
    main()
    leave_now_after_the_gpu()


def run(args, parser) -> None:
    """Check everything, denoise, write the outputs together, print the summary (and the timings)."""
    started = time.perf_counter()
    phases = Phases(start_up=process_age())
    ahead = _read_ahead(args)
    try:
        _run_checked(args, parser, started, phases, ahead)
    finally:
        if ahead is not None:
            ahead.cancel()


def _read_ahead(args):
    """IN decompressed by a child process beside the checks (``io.read_ahead``) where it is a .nii.gz and the
    checks may start the GPU (torch's import and CUDA's: on the H200 machine 1.5-2 s that the read
    followed); else None."""
    if args.device == "cpu" or not str(args.input).endswith(".gz"):
        return None
    from ..engine.gpu import absent_reason

    return io.read_ahead(args.input) if absent_reason() is None else None


def _run_checked(args, parser, started, phases, ahead) -> None:
    with phases("checks"):
        image, mask, options, outputs = _checked(args, parser)

    complex_input = io.is_complex(image)
    with io.staged_files(outputs, what=outputs) as staged:
        with phases("read"):
            data = None if ahead is None else ahead.result()
            if data is None:
                data = io.read_data(image, args.input, dtype=np.complex64 if complex_input else np.float32)
            echoes = [io.read_data(io.load_image(path), path) for path, _ in args.echo or ()]
            phase = None if args.phase is None else io.read_data(io.load_image(args.phase, "phase"), args.phase,
                                                                 "phase")
        with phases("denoise"), ProgressBar(PROG, quiet=args.quiet) as progress:
            run_options = dict(device=args.device, nprocs=args.nprocs, gpu_memory=args.gpu_memory,
                               progress=progress)
            if echoes:
                result = denoise([data, *echoes], mask, **options, **noise_floor_options(args), **run_options,
                                 maps=maps_asked(args))
            elif phase is None and not complex_input:
                result = denoise(data, mask, **options, **noise_floor_options(args), **run_options,
                                 maps=maps_asked(args))
            else:  # a magnitude and its phase, or the complex series itself (phase None)
                result = denoise_complex(data, phase, mask, **options, phase_method=args.phase_method,
                                         **run_options)
        phases.parts_of("denoise", result.info["seconds"])
        per_echo = {}
        if echoes:  # each echo written like its own input
            per_echo = {out: (result.denoised[:, :, :, e + 1], path) for e, (path, out) in enumerate(args.echo)}
            result.denoised = result.denoised[:, :, :, 0]
        images = {args.output: result.denoised_complex if complex_input else result.denoised,
                  args.noise: result.sigma, args.rank: result.rank, args.phase_out: getattr(result, "phase", None),
                  # (complex data has no extra maps: refused with --phase or a complex input)
                  args.lambda_plus: getattr(result, "lambda_plus", None),
                  args.variance_removed: getattr(result, "variance_removed", None)}
        with phases("write"):
            write_images(images, image, staged, {path: what for path, what in outputs.items() if path in images})
            for out, (denoised, path) in per_echo.items():
                write_images({out: denoised}, io.load_image(path), staged, {out: outputs[out]})

    if not args.quiet:
        say(summary(result, data, mask, time.perf_counter() - started))
    if args.timings:
        say(f"{PROG}: timings: {phases.line()}")


def _checked(args, parser):
    """Every check before a voxel is read: the input's header, the mask, the options, the device, the
    destinations (distinct, not an input, writable). Returns (image, mask, options, {output: label})."""
    image, shape, mask = open_input(args)  # shapes only: no voxel of the series is read yet
    if io.is_complex(image):  # the phase is in the series, and the real part it gives has no floor
        if args.phase is not None:
            parser.error(f"IN {args.input} is a complex series, which carries its own phase; leave out --phase")
        if args.noise_floor != "none":
            parser.error(f"IN {args.input} is a complex series, denoised through its phase-demodulated real part "
                         f"with no magnitude floor; leave out --noise-floor {args.noise_floor}")
        if maps_asked(args):
            parser.error(f"IN {args.input} is a complex series; --lambda-plus and --variance-removed are not "
                         "available for complex data")
    if args.phase is not None:  # its header now; its values (units, finiteness) once read
        phase_shape = tuple(io.load_image(args.phase, "phase").shape)
        if phase_shape != shape:
            raise MPPCAInputError(f"the phase {args.phase} has shape {phase_shape}, but the magnitude's is {shape}")
    if args.filter is None:  # complex data (a magnitude with its phase, or a complex series) have their own
        args.filter = default_filter(io.is_complex(image) or args.phase is not None)
    for path, _ in args.echo or ():  # the other echoes' headers: IN's grid and volumes
        echo_shape = tuple(io.open_series(path).shape)
        if echo_shape != shape:
            raise MPPCAInputError(f"the echo {path} has shape {echo_shape}, but IN's is {shape}")
    groups = _volume_groups(args, shape[3])
    options = dict(extent=args.extent, stride=args.stride, shape=args.shape, estimator=args.estimator,
                   aggregation=args.aggregation, filter=args.filter, **groups)
    resolve_shape, resolve_demean, removed_means = shape, groups["demean"], 0
    if args.echo or groups["demean"] in GROUP_DEMEANING:  # the series denoise() runs: the group contrasts
        transform, resolve_demean = plan_groups(shape[3], len(args.echo) + 1 if args.echo else None,
                                                groups["demean"], groups.get("groups"), groups.get("bvals"))
        resolve_shape, removed_means = shape[:3] + (transform.n_contrasts,), transform.n_groups
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", MPPCAWarning)  # denoise() gives the same warnings, once
            resolved = resolve_options(resolve_shape, extent=args.extent, stride=args.stride, shape=args.shape,
                                       estimator=args.estimator, aggregation=args.aggregation,
                                       demean=resolve_demean, filter=args.filter, removed_means=removed_means)
    except MPPCAInputError as err:
        parser.error(str(err))
    # raises MPPCAInputError, with the reason, when 'cuda' cannot be used; 'auto' probes the GPU only where
    # it would finish first (a small series never waits for torch to be imported)
    if args.noise_in is not None:  # a map is small: read now, so that its values are checked before the series'
        options["noise"], variance = _given_noise(args.noise_in, shape, mask)
        resolved = dataclasses.replace(resolved, noise_variance=variance)
    choose_device(args.device, resolve_shape, resolved, args.nprocs)

    # the destinations: distinct, not an input, writable (proved by creating their temporary files)
    outputs = check_destinations(parser, [(args.output, "output"), (args.noise, "noise map"),
                                          (args.rank, "rank map"), (args.phase_out, "phase output"),
                                          (args.lambda_plus, "lambda_plus map"),
                                          (args.variance_removed, "variance-removed map"),
                                          *((out, f"output of the echo {path}") for path, out in args.echo or ())],
                                 (args.input, args.mask, args.noise_in if isinstance(args.noise_in, str) else None,
                                  args.phase, *(path for path, _ in args.echo or ())))
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
    options = warm_up_options(args)
    for n_volumes in args.warm_up:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", MPPCAWarning)
                resolve_options((1001, 1001, 1001, n_volumes), **{**DEFAULTS, **options})
        except MPPCAInputError as err:
            parser.error(str(err))
    from ..engine.gpu import usable, use_kernel_cache

    reason = usable()
    if reason is not None:
        check_device(args.device)  # 'cuda': MPPCAInputError with the reason
        say(f"{PROG}: nothing to warm up: {reason}")
        return
    from ..engine.gpu.warmup import wait_for_compilations, warm_up_runs

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
        wait_for_compilations()  # (what its first run queued beside it, the settling kernels among them)
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


def warm_up_options(args) -> dict:
    """The denoising options of ``--warm-up``: those of the command line that differ from the defaults. The
    parser gives every option a value, and ``warm_up_runs`` takes an estimator given into dwidenoise's mode
    too (as dwidenoise's ``-estimator``): the default's passed on would replace that mode's own."""
    options = dict(extent=args.extent, stride=args.stride, shape=args.shape, estimator=args.estimator,
                   aggregation=args.aggregation, demean=args.demean, filter=args.filter)
    return {name: value for name, value in options.items() if value not in (None, DEFAULTS[name])}


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
    denoised = inside_voxels(data.shape, mask, data, result.info)
    count = int(np.count_nonzero(denoised))
    if count:
        medians = (f"median noise {np.median(result.sigma[denoised]):.4g}, "
                   f"median rank {np.median(result.rank[denoised]):.3g} in {count} voxels")
    else:
        medians = "no voxel was denoised"
    line = (f"{PROG}: denoised {'x'.join(map(str, data.shape))} in {seconds:.1f} s ({where_it_ran(result.info)}); "
            f"{medians}")
    if "n_groups" in result.info:  # demeaned by groups of volumes (shells, labels, echoes)
        line += (f"; {result.info['n_groups']} groups of volumes ({result.info['usable_volumes']} usable)"
                 + (f", {result.info['echoes']} echoes denoised jointly" if "echoes" in result.info else ""))
    if "phase_method" in result.info:  # complex data: how the phase was read and whether demodulation held
        ratio = result.info["imaginary_sd_ratio"]
        units = result.info["phase_units"]
        line += (f"; {'complex input' if units == 'complex' else f'phase in {units}'}, background by "
                 f"{result.info['phase_method']}, rms of the imaginary part / noise "
                 f"{'n/a' if ratio is None else format(ratio, '.3f')}")
    return line


if __name__ == "__main__":
    console()
