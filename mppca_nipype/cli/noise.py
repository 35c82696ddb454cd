"""``mppca-noise IN SIGMA [options]``: the MP-PCA noise map of one 4D NIfTI series, without denoising it.

Each patch's Gram matrix is decomposed for its eigenvalues only and thresholded by the Marchenko-Pastur law,
as ``mppca-denoise`` does (``engine.estimate_noise``); the patches sit on a coarser grid by default
(``NOISE_STRIDE``), so that estimating the noise is a fast step of its own, whose map a later
``mppca-denoise --noise-in SIGMA`` (or ``mppca-nipype --noise-in DIR``) can take. ``mppca-denoise --noise-only
--noise SIGMA IN`` is the same command.

Every option and file is checked before any voxel is read; the outputs are written beside their
destinations and renamed into place together at the end.
"""

from __future__ import annotations

import argparse
import time
import warnings

import numpy as np

from .. import io
from ..engine import NOISE_STRIDE, MPPCAInputError, MPPCAWarning, estimate_noise, noise_stride, resolve_options
from ..phases import Phases, process_age
from .common import (ArgumentParser, ProgressBar, add_denoising_options, add_run_options, add_version_option,
                     check_destinations, inside_voxels, open_input, say, user_errors, warnings_as_lines,
                     where_it_ran, write_images)

PROG = "mppca-noise"

DESCRIPTION = """\
Estimate the noise level (standard deviation) of a 4D diffusion or functional
MRI series by Marchenko-Pastur PCA (MP-PCA; Veraart et al. 2016,
Cordero-Grande et al. 2019), without denoising it. Each patch's eigenvalues
are split into signal and noise as mppca-denoise splits them, and the patches'
noise levels are combined per voxel as mppca-denoise combines them; only the
eigenvalues are computed, on a coarser grid of patches. IN is a NIfTI series
(.nii or .nii.gz); SIGMA is a 3D float32 NIfTI on IN's grid."""

EPILOG = f"""\
With the options of an mppca-denoise run, stride included, the map is that
run's noise map, bit for bit. The default stride here is {NOISE_STRIDE} (capped at the
extent: patches side by side; for spheres at the largest stride whose spheres
cover the image), chosen by measurement (docs/benchmarks.md,
"The noise map alone"). The map can be given to a later run:
mppca-denoise IN OUT --noise-in SIGMA.

exit status: 0 done; 1 the input cannot be read or an output cannot be
written; 2 the command line is wrong; 130 interrupted (Ctrl-C); 143 terminated
(SIGTERM). On any failure no output file is left behind."""


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog=PROG, description=DESCRIPTION, epilog=EPILOG,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("input", metavar="IN", help="the noisy 4D series (X, Y, Z, T), .nii or .nii.gz")
    parser.add_argument("output", metavar="SIGMA",
                        help="the 3D map of the noise standard deviation to write, .nii or .nii.gz")
    parser.add_argument("--mask", metavar="M",
                        help="3D NIfTI on IN's voxel grid: estimate only in its non-zero voxels (the map is 0 "
                             "outside; patches may still read voxels outside it)")
    parser.add_argument("--rank", metavar="FILE",
                        help="also write the 3D map of the number of signal components found")
    add_denoising_options(parser, stride=NOISE_STRIDE, stride_unset=True)
    add_run_options(parser, work="estimate")
    add_version_option(parser)
    return parser


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    with warnings_as_lines(PROG), user_errors(PROG):
        run(args, parser)


def run(args, parser, prog: str = PROG) -> None:
    """Check everything, estimate the noise, write the map(s) together, print the summary (and the timings).

    ``args`` as this module's parser gives them (``mppca-denoise --noise-only`` hands its own over, with
    ``output`` the noise map, and its name as ``prog``)."""
    started = time.perf_counter()
    phases = Phases(start_up=process_age())
    with phases("checks"):
        image, shape, mask = open_input(args)  # shapes only: no voxel of the series is read yet
        stride = noise_stride(shape, extent=args.extent, shape=args.shape) if args.stride is None else args.stride
        options = dict(extent=args.extent, stride=stride, shape=args.shape, estimator=args.estimator,
                       aggregation=args.aggregation, demean=args.demean)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", MPPCAWarning)  # estimate_noise() gives the same warnings, once
                resolve_options(shape, **options)
        except MPPCAInputError as err:
            parser.error(str(err))
        outputs = check_destinations(parser, [(args.output, "noise map"), (args.rank, "rank map")],
                                     (args.input, args.mask))

    with io.staged_files(outputs, what=outputs) as staged:
        with phases("read"):
            data = io.read_data(image, args.input)
        with phases("estimate"), ProgressBar(prog, "estimating the noise", quiet=args.quiet) as progress:
            result = estimate_noise(data, mask, **options, nprocs=args.nprocs, progress=progress)
        phases.parts_of("estimate", result.info["seconds"])
        with phases("write"):
            write_images({args.output: result.sigma, args.rank: result.rank}, image, staged, outputs)

    if not args.quiet:
        say(summary(result, data, mask, time.perf_counter() - started, prog))
    if args.timings:
        say(f"{prog}: timings: {phases.line()}")


def summary(result, data, mask, seconds: float, prog: str = PROG) -> str:
    """One line: size, time, where it ran, the grid, and the median noise over the voxels estimated."""
    inside = inside_voxels(data.shape, mask, data, result.info)
    count = int(np.count_nonzero(inside))
    medians = (f"median noise {np.median(result.sigma[inside]):.4g} in {count} voxels" if count
               else "no voxel was estimated")
    return (f"{prog}: estimated the noise of {'x'.join(map(str, data.shape))} in {seconds:.1f} s ({where_it_ran(result.info)}; "
            f"{result.info['n_windows']} patches, stride {result.info['stride']}); {medians}")


if __name__ == "__main__":
    main()
