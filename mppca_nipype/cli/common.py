"""What every command of the package shares: one-line errors and warnings, a progress bar, staged outputs.

MRtrix3's manners: every problem is one sentence on stderr (``<prog>: error: ...``, ``<prog>: warning:
...``), long work shows a progress bar on stderr, ``--quiet`` silences everything but warnings and errors.
Exit status: 0 done, 1 the input or the environment is wrong, 2 the command line is wrong, 130 interrupted
(Ctrl-C), 143 terminated (SIGTERM, e.g. a batch job's time limit).
"""

from __future__ import annotations

import argparse
from contextlib import contextmanager
import os
import signal
import sys
import threading
import time
import warnings

from ..engine.errors import MPPCAInputError, MPPCAWarning
from ..engine.patches import EXTENT_RULES

#: Whether the last thing written to stderr was a progress bar left without its newline.
_bar_on_line = False


def say(line: str) -> None:
    """Write one line to stderr, first ending a progress bar drawn on the same line."""
    global _bar_on_line
    if _bar_on_line:
        sys.stderr.write("\n")
        _bar_on_line = False
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def one_line(message) -> str:
    """``message`` with its whitespace (newlines included) collapsed: one line, whatever it holds."""
    return " ".join(str(message).split())


def fail(prog: str, message, status: int = 1):
    """Print ``<prog>: error: <message>`` on stderr and exit with ``status`` (never returns)."""
    say(f"{prog}: error: {one_line(message)}")
    sys.exit(status)


def exit_interrupted(prog: str):
    """Ctrl-C: print ``<prog>: error: interrupted`` and exit 130 at once (cleanup must have run already).

    At once, because an interrupt that lands while a C extension runs Python code of its own (importing torch
    does) is marked "unhandled" inside CPython, which then kills itself with SIGINT at shutdown and reports
    -2 instead of 130, although the interrupt was handled here.
    """
    say(f"{prog}: error: interrupted")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(130)


class ArgumentParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (``<prog>: error: ... (see <prog> --help)``), exit 2."""

    def error(self, message):
        fail(self.prog, f"{message} (see {self.prog} --help)", 2)


class _Terminated(BaseException):
    """SIGTERM, raised in the main thread so that cleanup (``finally``) runs as for Ctrl-C."""


def _raise_terminated(signum, frame):
    raise _Terminated()


@contextmanager
def user_errors(prog: str):
    """Turn what the user must fix, or did on purpose, into one line on stderr and an exit status.

    ``MPPCAInputError`` -> its sentence, exit 1 (``MemoryError`` too); Ctrl-C -> "interrupted", exit 130;
    SIGTERM -> "terminated", exit 143. Anything else is a bug and keeps its traceback.
    """
    in_main_thread = threading.current_thread() is threading.main_thread()
    if in_main_thread:  # signal handlers can only be set there
        previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    except MPPCAInputError as err:
        fail(prog, err)
    except MemoryError:
        fail(prog, "not enough memory for this input on this machine")
    except KeyboardInterrupt:
        exit_interrupted(prog)
    except _Terminated:
        fail(prog, "terminated", 143)
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, previous)


def leave_now_after_the_gpu(status: int = 0) -> None:
    """End the process at once (``os._exit``) if it started CUDA, else return. For a command whose outputs are
    all written and renamed into place: Python's exit would then tear down the CUDA context and free torch's
    page-locked memory, 0.6-1.0 s more of the user's wait after a 96x96x60x300 run on the H200 machine,
    which the operating system does faster by ending the process. The standard streams are flushed first."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(status)


@contextmanager
def warnings_as_lines(prog: str):
    """Show each warning raised inside the block as one line, ``<prog>: warning: <message>``, once."""
    shown = set()

    def show(message, category, filename, lineno, file=None, line=None):
        text = one_line(message)
        if text not in shown:
            shown.add(text)
            say(f"{prog}: warning: {text}")

    with warnings.catch_warnings():
        warnings.simplefilter("always", MPPCAWarning)
        warnings.showwarning = show
        yield


class ProgressBar:
    """A progress bar on stderr; an instance is the engine's ``progress(done, total)`` callback.

    On a terminal it is redrawn in place (at most ten times a second) and ends as one clean line; in a log
    (stderr not a terminal) it says nothing for the first ``delay`` seconds, so short runs stay silent,
    then writes a line at each further tenth of the work. ``quiet=True`` draws nothing. Use it as a
    context manager so that the bar's line is ended whatever happens.
    """

    def __init__(self, prog: str, label: str = "denoising", *, quiet: bool = False, delay: float = 2.0):
        self.prog, self.label, self.quiet, self.delay = prog, label, quiet, delay
        self.started = time.monotonic()
        self.tty = sys.stderr.isatty()
        self.last_drawn = 0.0
        self.last_tenth = -1
        self.drawn = False

    def __call__(self, done: int, total: int) -> None:
        if self.quiet or total <= 0:
            return
        now = time.monotonic()
        elapsed = now - self.started
        fraction = min(done / total, 1.0)
        if self.tty:
            if done < total and now - self.last_drawn < 0.1:
                return
            self._draw(fraction, elapsed)
            self.last_drawn = now
        elif elapsed >= self.delay:
            tenth = int(fraction * 10)
            if tenth > self.last_tenth:
                self.last_tenth = tenth
                say(f"{self.prog}: {self.label} {fraction:4.0%} ({elapsed:.0f} s)")

    def _draw(self, fraction: float, elapsed: float) -> None:
        global _bar_on_line
        width = 30
        filled = int(round(fraction * width))
        left = ""
        if 0.02 < fraction < 1:
            left = f", {elapsed * (1 - fraction) / fraction:.0f} s left"
        sys.stderr.write(f"\r{self.prog}: {self.label} [{'#' * filled}{'.' * (width - filled)}] "
                         f"{fraction:4.0%} ({elapsed:.0f} s{left})\033[K")
        sys.stderr.flush()
        self.drawn = True
        _bar_on_line = True

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        global _bar_on_line
        if _bar_on_line:
            sys.stderr.write("\n")
            sys.stderr.flush()
            _bar_on_line = False
        return False


class _VersionAction(argparse.Action):
    """``--version``: print ``<prog> <version>`` and exit 0, the version looked up only then (importlib.metadata
    costs 10-25 ms that every other run would pay)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        from .. import __version__

        sys.stdout.write(f"{parser.prog} {__version__}\n")
        parser.exit()


def add_version_option(parser) -> None:
    """``--version`` (on ``parser`` or an argument group of it)."""
    parser.add_argument("--version", action=_VersionAction, help="show the version and exit")


# -- option types shared by the commands -------------------------------------------------------------

def parse_extent(text: str):
    """A rule name (``auto``, ``wide``), ``N`` or ``X,Y,Z`` (odd positive integers) -> the name, an int, or a
    tuple of three ints."""
    if text in EXTENT_RULES:
        return text
    problem = (f"must be {', '.join(map(repr, EXTENT_RULES))}, an odd number N or three odd numbers X,Y,Z, "
               f"not {text!r}")
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(problem) from None
    if len(values) not in (1, 3) or any(v < 1 or v % 2 == 0 for v in values):
        raise argparse.ArgumentTypeError(problem)
    return values[0] if len(values) == 1 else values


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, not {text!r}")
    return value


def gpu_memory(text: str):
    """``--gpu-memory``: GiB or a share of the GPU's memory (``engine.resolve_gpu_memory``)."""
    from ..engine import resolve_gpu_memory

    try:
        return resolve_gpu_memory(text)
    except MPPCAInputError:
        raise argparse.ArgumentTypeError(f"must be a positive number of GiB (8, 8GiB) or a share of the GPU's "
                                         f"memory (50%), not {text!r}") from None


def add_gpu_memory_option(parser) -> None:
    """``--gpu-memory`` of every command that may run on a GPU."""
    parser.add_argument("--gpu-memory", type=gpu_memory, metavar="GIB|N%",
                        help="the most GPU memory a run may take: GiB, or a share of the GPU's memory (two "
                             "jobs sharing a GPU: 50%%); the series is cut into slabs and batches within it, "
                             "with the same results (default: $MPPCA_GPU_MEMORY, else all the GPU can give "
                             "this process)")


def demean_mode(text: str) -> str:
    """``--demean`` of ``mppca-denoise``: a mode of the engine's ``DEMEANING``, ``shells``, or ``groups:FILE``
    (the text as given; the file is read in the command's checks)."""
    from ..engine.estimators import DEMEANING

    if text in DEMEANING or text == "shells" or (text.startswith("groups:") and len(text) > len("groups:")):
        return text
    raise argparse.ArgumentTypeError(f"must be one of {', '.join(DEMEANING)}, shells or groups:FILE, not {text!r}")


def add_denoising_options(parser, *, stride=None, stride_unset=False, groups=False) -> None:
    """The denoising options of every command (``mppca-denoise``, ``mppca-noise``, ``mppca-nipype``): same
    names, defaults from the engine. ``stride``: the command's default grid step (the engine's by default);
    ``stride_unset``: leave ``args.stride`` None when not given, for a command whose default depends on other
    options (``mppca-denoise --noise-only``); ``groups``: ``--demean`` also takes ``shells`` and
    ``groups:FILE`` (``demean_mode``)."""
    from ..engine import DEFAULTS, PATCH_SHAPES
    from ..engine.estimators import AGGREGATIONS, DEMEANING, ESTIMATORS

    stride = DEFAULTS["stride"] if stride is None else stride
    parser.add_argument("--extent", type=parse_extent, default=DEFAULTS["extent"], metavar="auto|wide|N|X,Y,Z",
                        help="patch size in voxels, odd; 'auto' is the smallest odd e with e^3 >= T, capped "
                             "at the image size (dwidenoise's rule); 'wide' is the same but at least 7 "
                             "(default: %(default)s)")
    parser.add_argument("--stride", type=positive_int, default=None if stride_unset else stride, metavar="S",
                        help="1: every voxel is the centre of its own patch (dwidenoise); S > 1: patches "
                             "on a grid of step S (at most the extent) plus one flush against each far edge, "
                             f"fewer patches and faster (default: {stride})")
    parser.add_argument("--shape", choices=PATCH_SHAPES, default=DEFAULTS["shape"],
                        help="the patch: cuboid, the whole extent; sphere, the voxels within distance r of the "
                             "centre, r the smallest radius holding as many voxels as the extent's cuboid, "
                             "centred on the stride's grid over the whole image and clipped at its edges; its "
                             "bounding cube of side 2r+1 must fit the image (docs/options.md) "
                             "(default: %(default)s)")
    parser.add_argument("--estimator", choices=ESTIMATORS, default=DEFAULTS["estimator"],
                        help="Marchenko-Pastur noise estimator: exp2 (Cordero-Grande 2019, dwidenoise's "
                             "default), exp1 (Veraart 2016), med (the median noise eigenvalue, Gavish & Donoho "
                             "2014) or olesen2023 (Olesen et al. 2023) (docs/options.md) (default: %(default)s)")
    parser.add_argument("--aggregation", choices=AGGREGATIONS, default=DEFAULTS["aggregation"],
                        help="how overlapping patches combine: center takes each voxel from its own patch "
                             "(needs --stride 1; dwidenoise), weighted averages the covering patches with "
                             "weight 1/(1 + rank + 1 if demeaned), uniform averages them equally, gaussian "
                             "weights as weighted times a Gaussian of the distance from the patch's centre "
                             "(default: %(default)s)")
    if groups:
        parser.add_argument("--demean", type=demean_mode, default=DEFAULTS["demean"],
                            metavar="volume|voxel|none|shells|groups:FILE",
                            help="the mean removed inside a patch before PCA (and added back after): volume, "
                                 "the patch's mean time course (DIPY's centring); voxel, each voxel's temporal "
                                 "mean; none, nothing (dwidenoise); shells, each voxel's mean over each b-value "
                                 "shell (the .bval beside IN, or --bval; shells clustered as MRtrix3 does); "
                                 "groups:FILE, each voxel's mean over each group of volumes, FILE a text file of "
                                 "one integer label per volume (default: %(default)s)")
        return
    parser.add_argument("--demean", choices=DEMEANING, default=DEFAULTS["demean"],
                        help="the mean removed inside a patch before PCA (and added back after): volume, "
                             "the patch's mean time course (DIPY's centring); voxel, each voxel's temporal "
                             "mean; none, nothing (dwidenoise) (default: %(default)s)")


def add_filter_option(parser) -> None:
    """``--filter`` of the commands that denoise (``mppca-denoise``, ``mppca-nipype``)."""
    from ..engine import COMPLEX_FILTER, DEFAULTS
    from ..engine.estimators import FILTERS

    parser.add_argument("--filter", choices=FILTERS,
                        help="what each patch keeps of its components, the noise level taken as known: hard, "
                             "its P leading components whole (MP-PCA, dwidenoise); optshrink, Gavish & "
                             "Donoho's optimal shrinkage of the singular values (Frobenius loss, 2017); "
                             "optthresh, their optimal hard threshold (2014) (docs/options.md) "
                             f"(default: {DEFAULTS['filter']}; for complex data, a magnitude with its phase, "
                             f"{COMPLEX_FILTER}, which leaves them the least bias)")


def add_noise_floor_options(parser) -> None:
    """``--noise-floor`` and ``--coils`` of the commands that denoise (``mppca-denoise``, ``mppca-nipype``);
    ``noise_floor_problem`` checks them together."""
    from ..engine import NOISE_FLOORS

    parser.add_argument("--noise-floor", choices=NOISE_FLOORS, default="none",
                        help="the magnitude noise floor to remove: none takes the data as signal plus Gaussian "
                             "noise (dwidenoise); rician (magnitude of one complex channel) and ncchi (root "
                             "sum of squares of --coils channels) denoise a variance-stabilised transform and "
                             "map it back without the floor's bias; two passes unless --noise-in gives the "
                             "channels' sigma (docs/options.md) (default: %(default)s)")
    parser.add_argument("--coils", type=positive_int, metavar="N",
                        help="the number of receive channels combined by root sum of squares, for "
                             "--noise-floor ncchi (rician is N = 1)")


def noise_floor_problem(args) -> str | None:
    """The sentence that says why ``--noise-floor`` and ``--coils`` do not go together, or None."""
    if args.coils is not None and args.noise_floor != "ncchi":
        return f"--coils describes a non-central chi floor and needs --noise-floor ncchi (not {args.noise_floor})"
    if args.noise_floor == "ncchi" and args.coils is None:
        return "--noise-floor ncchi needs --coils N, the number of channels combined (rician is N = 1)"
    return None


def noise_floor_options(args) -> dict:
    """``denoise``'s ``noise_floor`` and ``coils`` from the checked arguments."""
    return dict(noise_floor=args.noise_floor, coils=args.coils or 1)


def add_map_options(parser, *, files: bool) -> None:
    """``--lambda-plus`` and ``--variance-removed`` of the commands that denoise: the extra maps' files
    (``mppca-denoise``, ``files``) or flags that write them under the derivatives' names (``mppca-nipype``);
    ``maps_asked`` reads them and ``maps_problem`` checks them against the other options."""
    how = dict(metavar="FILE") if files else dict(action="store_true")
    what = "the 3D map" if files else "each run's map"
    parser.add_argument("--lambda-plus", **how,
                        help=f"also write {what} of the patches' Marchenko-Pastur upper edge "
                             "sigma^2 (1 + sqrt(gamma))^2, in the data's variance units, aggregated as the noise "
                             "map (docs/options.md, \"Extra maps\")")
    parser.add_argument("--variance-removed", **how,
                        help=f"also write {what} of the variance removed from each voxel: the mean over "
                             "volumes of (input - denoised)^2")


def maps_asked(args) -> tuple:
    """The extra maps ``denoise`` is to compute (``engine.MAPS``) for the options given (``add_map_options``)."""
    from ..engine.maps import MAPS

    return tuple(name for name in MAPS if getattr(args, name))


def maps_problem(args) -> str | None:
    """The sentence that says why the extra maps asked for cannot be had with the other options, or None."""
    if getattr(args, "phase", None) is not None and maps_asked(args):
        return "--lambda-plus and --variance-removed are not available with --phase"
    if args.lambda_plus and args.noise_floor != "none":
        return ("--lambda-plus is not available with --noise-floor: the patches' Marchenko-Pastur edges are those "
                "of the variance-stabilised data")
    return None


def add_phase_method_option(parser, *, what="the complex series") -> None:
    """``--phase-method`` of the commands that denoise complex data (``mppca-denoise``, ``mppca-nipype``);
    ``what`` names the data it applies to in the help."""
    from ..engine.complex_data import PHASE_METHODS

    parser.add_argument("--phase-method", choices=PHASE_METHODS, default=PHASE_METHODS[0],
                        help=f"how the background phase of {what} is estimated: hann, a 2D Hann low-pass of each "
                             "slice in k-space; mppca, the same of the complex series first denoised by MP-PCA (a "
                             "second pass, over 2T volumes; less noise in the phase) (default: %(default)s)")


def add_phase_options(parser) -> None:
    """``--phase``, ``--phase-out`` and ``--phase-method`` of ``mppca-denoise``; ``phase_problem`` checks them."""
    parser.add_argument("--phase", metavar="FILE",
                        help="the phase of IN (IN is then the magnitude of a complex series), 4D on IN's grid, in "
                             "radians or the scanner's whole-number units ([-4096, 4095] or [0, 4095], detected): "
                             "the smooth background phase is removed and the real part denoised, with Gaussian "
                             "noise and no magnitude floor (docs/options.md)")
    parser.add_argument("--phase-out", metavar="FILE",
                        help="with --phase: also write the phase of the denoised complex series, in radians")
    add_phase_method_option(parser, what="the complex series (--phase, or a complex IN)")


def phase_problem(args) -> str | None:
    """The sentence that says why the phase options do not go with the others, or None."""
    if args.phase_out is not None and args.phase is None:
        return "--phase-out writes the denoised phase and needs --phase, the input's phase"
    if args.phase is not None and args.noise_floor != "none":
        return ("--phase removes the magnitude floor by denoising the demodulated real part; leave out "
                f"--noise-floor {args.noise_floor}")
    return None


def add_run_options(parser, *, work: str) -> None:
    """``--nprocs``, ``--quiet`` and ``--timings`` of the one-file commands; ``work`` names the computing
    phase in the timings (``denoise``, ``estimate``)."""
    parser.add_argument("--nprocs", type=positive_int, metavar="N",
                        help="CPU worker processes (default: the CPUs this process may use, at most "
                             "SLURM_CPUS_PER_TASK under SLURM)")
    parser.add_argument("--quiet", action="store_true",
                        help="no progress bar and no summary; warnings and errors are still printed")
    parser.add_argument("--timings", action="store_true",
                        help="print where the time went: start-up (the interpreter and the imports), checks, "
                             f"read (with decompression), {work} (its input check, plan, backend and output "
                             "assembly), write (with compression)")


# -- the files of the one-file commands ----------------------------------------------------------------

def open_input(args):
    """The input's header and the mask (``args.input``, ``args.mask``): (image, shape, mask or None). No voxel
    of the series is read."""
    from .. import io

    image = io.open_series(args.input)
    shape = tuple(image.shape)
    mask = io.load_mask(args.mask, shape[:3]) if args.mask else None
    return image, shape, mask


def same_file(path, *others) -> bool:
    """Whether ``path`` names the same file as any of ``others`` (after links and relative parts)."""
    real = os.path.realpath(path)
    return any(real == os.path.realpath(other) for other in others)


def check_destinations(parser, outputs, sources) -> dict:
    """The outputs (pairs (path, what), None paths left out) are distinct, none is one of the input files
    ``sources`` (None entries ignored), and each can be written (``io.check_writable``); a clash is a usage
    error. Returns {path: what} of the outputs given, in order."""
    from .. import io

    checked = {}
    for path, what in outputs:
        if path is None:
            continue
        if same_file(path, *checked):
            parser.error(f"the {what} {path} is also given as another output")
        checked[path] = what
    for path, what in checked.items():
        for source in sources:
            if source is not None and same_file(path, source):
                parser.error(f"the {what} {path} would overwrite the input {source}")
        io.check_writable(path, what)
    return checked


def write_images(images: dict, reference, staged: dict, outputs: dict) -> None:
    """Save each array of ``images`` ({path: array}) like ``reference`` into its staged file; a failure is one
    sentence naming the output (``outputs``: {path: what})."""
    from .. import io

    for path in outputs:
        try:
            io.save_like(images[path], reference, staged[path], atomic=False)
        except OSError as err:
            raise MPPCAInputError(f"cannot write the {outputs[path]} {path}: {err.strerror or err}") from None


def inside_voxels(shape, mask, data, info):
    """The voxels a run computed: the mask (all without one) less those whose series is not finite."""
    import numpy as np

    inside = np.ones(shape[:3], bool) if mask is None else mask.copy()
    if info.get("n_nonfinite_voxels"):  # (else every voxel in the mask was: no pass over the series)
        inside &= np.isfinite(data).all(axis=3)
    return inside


def where_it_ran(info) -> str:
    """'cpu, 2 processes' or 'cuda on NVIDIA H200' from a result's ``info``."""
    where = info.get("backend", "?")
    if info.get("device") not in (None, where):
        where += f" on {info['device']}"
    if info.get("backend") == "cpu" and "nprocs" in info:
        where += f", {info['nprocs']} process{'es' if info['nprocs'] != 1 else ''}"
    return where
