"""``mppca-nipype BIDS_DIR OUTPUT_DIR participant [options]``: MP-PCA denoising of a BIDS dataset.

A BIDS app (BIDS-Apps and BIDS execution-spec conventions): every DWI and BOLD run the labels and filters
select is denoised by a Nipype workflow and written as a BIDS derivative dataset with its provenance.
``mppca-nipype --demo OUTPUT_DIR`` writes a small generated dataset and runs the whole pipeline on it.

Everything is checked before any work starts; a problem is one sentence on stderr and an exit status
(``EXIT``). BIDS_DIR is only ever read.
"""

from __future__ import annotations

import argparse
from contextlib import ExitStack
import gc
import json
import math
import os
from pathlib import Path
import signal
import sys
import time
import warnings

from ..engine import DEVICES, MPPCAInputError, available_cpus
from .common import (add_denoising_options, add_filter_option, add_gpu_memory_option, add_map_options,
                     add_noise_floor_options, add_phase_method_option, add_version_option, exit_interrupted, fail,
                     maps_asked, maps_problem, noise_floor_options, noise_floor_problem, positive_int, say)

PROG = "mppca-nipype"

#: Exit statuses, as the BIDS execution spec recommends (sysexits.h).
EXIT = dict(ok=0, failure=1, invalid_bids=16, nothing_selected=18, usage=64, input_missing=66,
            cannot_create=73)

DESCRIPTION = """\
Denoise every DWI and BOLD run of a BIDS dataset by Marchenko-Pastur PCA (MP-PCA; Veraart et al. 2016,
Cordero-Grande et al. 2019) and write a BIDS derivative dataset: per run the denoised series
(*_desc-denoised_<dwi|bold>.nii.gz) with a JSON sidecar holding its provenance, .bval/.bvec for DWI, noise
and rank maps, and logs/CITATION.md. A magnitude/phase pair (part-mag and part-phase runs) is denoised as one
complex series and written as both parts. BIDS_DIR is never written to.

First time? Try:  mppca-nipype --demo ./mppca-demo"""

EPILOG = """\
exit status: 0 done; 1 a run failed (crash reports in OUTPUT_DIR/logs); 16 BIDS_DIR is not valid BIDS;
18 the labels and filters select no run; 64 the command line is wrong; 66 an input (BIDS_DIR, filter file)
is missing; 73 OUTPUT_DIR or the work directory cannot be created; 130 interrupted; 143 terminated
(SIGTERM: a job's time limit or preemption). A run stopped at any point leaves no partial derivative;
run the same command again to do what is missing. Runs sharing OUTPUT_DIR (an array job) are safe."""


class AppError(Exception):
    """A problem the user must fix: one sentence and the exit status."""

    def __init__(self, message, status):
        super().__init__(message)
        self.status = status


class Terminated(BaseException):
    """SIGTERM, raised in the main thread so that every ``finally`` (temporary files, locks) runs."""


_APP_PID = []


def _raise_terminated(signum, frame):
    if _APP_PID and os.getpid() != _APP_PID[-1]:  # a worker forked with this handler: die as by default
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
        return
    raise Terminated()


def stop_descendants(grace=3.0):
    """SIGTERM every process this one started (Nipype's workers and the engine's), then SIGKILL those left
    after ``grace`` seconds: a terminated app leaves nothing running that could write into its folders."""
    import multiprocessing

    pids = _descendants(os.getpid()) or [child.pid for child in multiprocessing.active_children()]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except OSError:
            pass
    deadline = time.monotonic() + grace
    while pids and time.monotonic() < deadline:
        pids = [pid for pid in pids if _alive(pid)]
        time.sleep(0.05)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _descendants(root: int) -> list:
    """The process ids below ``root`` (Linux /proc; empty elsewhere)."""
    children = {}
    try:
        entries = [entry for entry in os.listdir("/proc") if entry.isdigit()]
    except OSError:
        return []
    for entry in entries:
        try:
            with open(f"/proc/{entry}/stat") as handle:
                parent = int(handle.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(parent, []).append(int(entry))
    found, queue = [], [root]
    while queue:
        for child in children.get(queue.pop(), []):
            found.append(child)
            queue.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        os.waitpid(pid, os.WNOHANG)  # reap it if it is our child
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise AppError(f"{message} (see {self.prog} --help)", EXIT["usage"])


def noise_source(text: str):
    """``--noise-in``: a positive number (float), or else a folder (str, checked in ``check_input``)."""
    try:
        value = float(text)
    except ValueError:
        return text
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number or a folder of noise maps, not {text!r}")
    return value


def report_error(message, status):
    """One line on stderr and the exit status (the shared helper from cli.common)."""
    fail(PROG, message, status)


def build_parser():
    parser = _Parser(prog=PROG, description=DESCRIPTION, epilog=EPILOG,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bids_dir", nargs="?", metavar="BIDS_DIR", help="the input BIDS dataset (read only)")
    parser.add_argument("output_dir", nargs="?", metavar="OUTPUT_DIR",
                        help="where the derivative dataset goes (created; must not lie inside BIDS_DIR)")
    parser.add_argument("analysis_level", nargs="?", metavar="participant", choices=["participant"],
                        help="the level of analysis; only 'participant'")
    parser.add_argument("--demo", metavar="DIR",
                        help="write a small generated BIDS dataset to DIR/bids (a DWI and a BOLD run, no "
                             "download) and denoise it into DIR/derivatives/mppca-nipype")
    select = parser.add_argument_group("what to denoise")
    select.add_argument("--participant-label", "--participant_label", nargs="+", metavar="LABEL",
                        help="participants to process, with or without 'sub-' (default: all)")
    select.add_argument("--session-label", "--session_label", nargs="+", metavar="LABEL",
                        help="sessions to process, with or without 'ses-' (default: all)")
    select.add_argument("--datatype", nargs="+", choices=["dwi", "func"], default=["dwi", "func"],
                        help="datatypes to denoise (default: dwi func)")
    select.add_argument("--bids-filter-file", metavar="FILE",
                        help="JSON of pybids filters per series kind, e.g. "
                             '{"bold": {"task": "rest"}, "dwi": {"acquisition": "multiband"}}; '
                             'null means "entity absent", "*" "any value"')
    select.add_argument("--skip-bids-validation", action="store_true",
                        help="do not check BIDS_DIR with the BIDS validator (bids-validator-deno)")
    denoising = parser.add_argument_group("denoising (as mppca-denoise)")
    add_denoising_options(denoising)
    denoising.add_argument("--noise-in", type=noise_source, metavar="NUMBER|DIR",
                           help="a given noise level (standard deviation) instead of each patch's estimate: one "
                                "positive number for every run, or a derivative dataset holding each run's "
                                "noise map under this app's name (*_desc-noise_<dwi|bold>map.nii[.gz]: an "
                                "earlier run's OUTPUT_DIR, or mppca-noise maps saved under those names) "
                                "(docs/usage.md)")
    add_filter_option(denoising)
    add_noise_floor_options(denoising)
    add_phase_method_option(denoising, what="a magnitude/phase pair (part-mag and part-phase runs, denoised as "
                                            "one complex series, with no noise floor)")
    add_map_options(denoising, files=False)
    parser.add_argument("--reports", action=argparse.BooleanOptionalAction, default=True,
                        help="write a QC report per subject (sub-<label>.html, figures under "
                             "sub-<label>/figures/) (default: on)")
    execution = parser.add_argument_group("execution")
    execution.add_argument("-w", "--work-dir", metavar="DIR",
                           help="Nipype's working directory and the pybids index, reused by reruns "
                                "(default: OUTPUT_DIR/.mppca-work)")
    execution.add_argument("--nprocs", "--n-cpus", type=positive_int, default=None, metavar="N",
                           help="CPUs to use in all (default: the CPUs this process may use)")
    execution.add_argument("--device", choices=DEVICES, default="auto",
                           help="auto: a CUDA GPU when usable, else the CPU (default: %(default)s)")
    add_gpu_memory_option(execution)
    execution.add_argument("--plugin", default="MultiProc",
                           help="Nipype execution plugin: Linear, MultiProc, SLURM, SGE, PBS... "
                                "(default: %(default)s)")
    execution.add_argument("--plugin-args", metavar="JSON",
                           help='arguments of the plugin as JSON, e.g. \'{"sbatch_args": "-p short"}\'')
    execution.add_argument("--quiet", action="store_true", help="print only warnings and errors")
    add_version_option(execution)
    return parser


def main(argv=None):
    os.environ.setdefault("NIPYPE_NO_ET", "1")  # no version check over the network
    _APP_PID.append(os.getpid())
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        args = build_parser().parse_args(argv)
        status = run(args)
    except AppError as err:
        report_error(err, err.status)
    except KeyboardInterrupt:
        exit_interrupted(PROG)
    except Terminated:
        stop_descendants()
        say(f"{PROG}: error: terminated; run the same command again to finish")
        sys.stdout.flush()
        os._exit(143)
    finally:
        signal.signal(signal.SIGTERM, previous)
        _APP_PID.pop()
    sys.exit(status)


# ------------------------------------------------------------------------------------------- checking

def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def check_arguments(args):
    """Everything that needs no file: positional arguments, option values, plugin and its arguments."""
    if args.demo:
        if args.bids_dir or args.output_dir:
            raise AppError("--demo takes its own directory; give either --demo DIR or "
                           "BIDS_DIR OUTPUT_DIR participant", EXIT["usage"])
    elif not (args.bids_dir and args.output_dir and args.analysis_level):
        missing = [name for name, value in (("BIDS_DIR", args.bids_dir), ("OUTPUT_DIR", args.output_dir),
                                            ("participant", args.analysis_level)) if not value]
        raise AppError(f"missing {', '.join(missing)}: the command is "
                       f"{PROG} BIDS_DIR OUTPUT_DIR participant (or {PROG} --demo DIR)", EXIT["usage"])
    if args.aggregation == "center" and args.stride != 1:
        raise AppError("--aggregation center takes each voxel from its own patch and needs --stride 1",
                       EXIT["usage"])
    if noise_floor_problem(args):
        raise AppError(noise_floor_problem(args), EXIT["usage"])
    if maps_problem(args):
        raise AppError(maps_problem(args), EXIT["usage"])
    from nipype.pipeline import plugins

    if not hasattr(plugins, f"{args.plugin}Plugin"):
        known = sorted(name[:-6] for name in dir(plugins) if name.endswith("Plugin") and name != "Plugin")
        raise AppError(f"--plugin {args.plugin} is not a Nipype plugin (one of {', '.join(known)})",
                       EXIT["usage"])
    plugin_args = {}
    if args.plugin_args:
        try:
            plugin_args = json.loads(args.plugin_args)
        except ValueError as err:
            raise AppError(f"--plugin-args is not valid JSON ({err})", EXIT["usage"]) from None
        if not isinstance(plugin_args, dict):
            raise AppError("--plugin-args must be a JSON object such as '{\"n_procs\": 4}'", EXIT["usage"])
    args.plugin_args = plugin_args


def check_input(args):
    """BIDS_DIR and the filter file exist and read; BIDS_DIR looks like BIDS; the filter file is JSON; a
    --noise-in folder exists (its maps are checked once the runs are known: ``check_noise_maps``)."""
    bids_dir = Path(args.bids_dir).resolve()
    if not bids_dir.exists():
        raise AppError(f"BIDS_DIR {args.bids_dir} does not exist", EXIT["input_missing"])
    if not bids_dir.is_dir():
        raise AppError(f"BIDS_DIR {args.bids_dir} is not a folder", EXIT["input_missing"])
    if not (bids_dir / "dataset_description.json").is_file():
        raise AppError(f"BIDS_DIR {args.bids_dir} is not a BIDS dataset: it has no dataset_description.json",
                       EXIT["invalid_bids"])
    filters = {}
    if args.bids_filter_file:
        path = Path(args.bids_filter_file)
        if not path.is_file():
            raise AppError(f"the BIDS filter file {path} does not exist", EXIT["input_missing"])
        try:
            filters = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            raise AppError(f"the BIDS filter file {path} is not valid JSON ({err})", EXIT["usage"]) from None
    if isinstance(args.noise_in, str):
        noise_dir = Path(args.noise_in)
        if noise_dir.is_file():
            raise AppError(f"--noise-in {args.noise_in} is a file; the app takes a number for every run or a "
                           "folder of noise maps, one per run (for one file, use mppca-denoise --noise-in)",
                           EXIT["usage"])
        if not noise_dir.is_dir():
            raise AppError(f"--noise-in {args.noise_in} is neither a positive number nor an existing folder",
                           EXIT["input_missing"])
        args.noise_in = noise_dir.resolve()
    return bids_dir, filters


def prepare_output(args, bids_dir):
    """Create OUTPUT_DIR and the work directory (never inside BIDS_DIR); refuse another tool's dataset."""
    from ..bids import owner_of

    output_dir = Path(args.output_dir).resolve()
    work_dir = Path(args.work_dir).resolve() if args.work_dir else output_dir / ".mppca-work"
    for what, path in (("OUTPUT_DIR", output_dir), ("the work directory", work_dir)):
        if _inside(path, bids_dir):
            raise AppError(f"{what} {path} lies inside BIDS_DIR, which is never written to; choose a folder "
                           "outside it", EXIT["cannot_create"])
        if _inside(bids_dir, path):
            raise AppError(f"{what} {path} contains BIDS_DIR; choose a folder outside it",
                           EXIT["cannot_create"])
    if isinstance(args.noise_in, Path) and _inside(args.noise_in, output_dir):
        raise AppError(f"--noise-in {args.noise_in} lies in OUTPUT_DIR, whose noise maps this run writes; give "
                       "an earlier run's folder other than OUTPUT_DIR", EXIT["usage"])
    owner = owner_of(output_dir)
    if owner:
        raise AppError(f"OUTPUT_DIR {output_dir} already holds a dataset made by {owner}; choose another "
                       "folder", EXIT["cannot_create"])
    for what, path in (("OUTPUT_DIR", output_dir), ("the work directory", work_dir)):
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise AppError(f"cannot create {what} {path}: {err.strerror or err}", EXIT["cannot_create"]) \
                from None
        if not os.access(path, os.W_OK | os.X_OK):
            raise AppError(f"cannot write into {what} {path}: permission denied", EXIT["cannot_create"])
    return output_dir, work_dir


def select_runs(args, layout, filters):
    """The runs to denoise and those skipped, after checking the labels exist."""
    from ..bids import check_filters, normalise_labels, query_runs

    participants = normalise_labels(args.participant_label, "sub-")
    sessions = normalise_labels(args.session_label, "ses-")
    for labels, known, what, prefix in ((participants, layout.get_subjects(), "participant", "sub-"),
                                        (sessions, layout.get_sessions(), "session", "ses-")):
        missing = sorted(set(labels or ()) - set(known))
        if missing:
            have = ", ".join(prefix + label for label in sorted(known)) or "none"
            raise AppError(f"{what} label {', '.join(prefix + m for m in missing)} is not in BIDS_DIR "
                           f"(it has: {have})", EXIT["nothing_selected"])
    try:
        filters = check_filters(filters, layout)
    except MPPCAInputError as err:
        raise AppError(str(err), EXIT["usage"]) from None
    runs = query_runs(layout, participants=participants, sessions=sessions, datatypes=args.datatype,
                      filters=filters)
    todo = [run for run in runs if run.skip is None]
    skipped = [run for run in runs if run.skip is not None]
    if not todo:
        why = (f"; {len(skipped)} skipped (" + "; ".join(f"{r.name}: {r.skip}" for r in skipped) + ")"
               if skipped else "")
        raise AppError(f"the labels and filters select no {' or '.join(args.datatype)} run to denoise{why}",
                       EXIT["nothing_selected"])
    return todo, skipped


def check_noise_maps(runs, noise_dir):
    """Every run to denoise has its noise map in ``noise_dir``, on its grid (``bids.check_given_noise_maps``)."""
    from ..bids import check_given_noise_maps

    try:
        check_given_noise_maps(runs, noise_dir)
    except MPPCAInputError as err:
        raise AppError(str(err), EXIT["input_missing"]) from None


def check_patch_shape(runs, args):
    """With ``--shape sphere``: every run's sphere (of its own extent rule and volumes) fits its image and its
    stride's grid of centres leaves no voxel outside every sphere (``engine.resolve_options``), so that such a
    run is refused in one sentence before any runs.
    Multi-echo runs, whose patches hold the echoes' contrasts, and the 2T volumes of a pair's ``mppca`` phase
    pass are checked by their node when it runs."""
    from ..engine import resolve_options
    from ..workflows import series_shape

    if args.shape != "sphere":
        return
    for run_ in runs:
        shape = series_shape(run_.path)
        if run_.echoes or shape is None:
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # (the run's own warnings come when it runs)
                resolve_options(shape, extent=args.extent, stride=args.stride, estimator=args.estimator,
                                aggregation=args.aggregation, demean=args.demean, shape=args.shape)
        except MPPCAInputError as err:
            raise AppError(f"{run_.relpath}: {err}", EXIT["usage"]) from None


def check_cuda():
    """Raise MPPCAInputError, with the reason, when the GPU engine cannot run here."""
    from ..engine import check_device

    check_device("cuda")


# -------------------------------------------------------------------------------------------- running

def run(args) -> int:
    started = time.monotonic()
    check_arguments(args)
    quiet = args.quiet

    def note(line):
        if not quiet:
            say(f"{PROG}: {line}")

    if args.demo:
        from ..demo import write_demo_dataset

        demo = Path(args.demo).resolve()
        if (demo / "bids").exists() and not (demo / "bids" / "dataset_description.json").exists():
            raise AppError(f"{demo / 'bids'} exists and is not the demo dataset; choose another DIR",
                           EXIT["cannot_create"])
        try:
            if not (demo / "bids").exists():
                write_demo_dataset(demo / "bids")
        except OSError as err:
            raise AppError(f"cannot write the demo dataset into {demo}: {err.strerror or err}",
                           EXIT["cannot_create"]) from None
        note(f"demo dataset (one subject: a DWI run and a BOLD run) in {demo / 'bids'}")
        args.bids_dir, args.output_dir = str(demo / "bids"), str(demo / "derivatives" / PROG)
        args.analysis_level = "participant"
        args.work_dir = args.work_dir or str(demo / "work")

    bids_dir, filters = check_input(args)
    if not args.skip_bids_validation:
        from ..bids import validate

        errors, why_not = validate(bids_dir)
        if errors:
            raise AppError(f"BIDS_DIR is not valid BIDS: the validator found {len(errors)} error"
                           f"{'s' if len(errors) > 1 else ''} ({'; '.join(errors[:3])}"
                           f"{'; ...' if len(errors) > 3 else ''}); fix them or pass --skip-bids-validation",
                           EXIT["invalid_bids"])
        if why_not:
            say(f"{PROG}: warning: BIDS_DIR was not validated: {why_not}")

    use_gpu = False
    if args.device == "cuda":
        try:
            check_cuda()
        except MPPCAInputError as err:
            raise AppError(str(err), EXIT["failure"]) from None
        use_gpu = True
    elif args.device == "auto":
        from ..interfaces import gpu_probably_usable

        use_gpu = gpu_probably_usable()
    output_dir, work_dir = prepare_output(args, bids_dir)
    worker = start_gpu_worker(args, use_gpu)
    if node_start_method(args, use_gpu) == "forkserver":
        start_node_server()
    try:
        return finish_run(args, bids_dir, filters, output_dir, work_dir, use_gpu, worker, note, started)
    finally:
        if worker is not None:
            worker.stop()
            for variable in worker.environment():
                os.environ.pop(variable, None)


#: GPU nodes at once where the GPU worker serves them: the worker runs their series one at a time, and the
#: others meanwhile decompress their input or compress their output on the CPU.
GPU_WORKER_NODES = 4


def start_gpu_worker(args, use_gpu):
    """The GPU worker that serves this run's nodes (``gpu_worker``), started now so that torch and CUDA start
    while the dataset is indexed; None where the nodes run on the CPU, in this process (Linear), as batch jobs,
    or on several GPUs (each node then takes one, ``interfaces.gpu_slot``)."""
    from ..interfaces import visible_gpus

    if not use_gpu or args.plugin != "MultiProc" or len(visible_gpus()) != 1:
        return None
    from ..gpu_worker import GPUWorker

    worker = GPUWorker.start()
    os.environ.update(worker.environment())  # the workflow's cost model and the nodes find it there
    return worker


def node_start_method(args, use_gpu) -> str | None:
    """How MultiProc starts its worker processes: as ``--plugin-args`` says, else through ``forkserver`` when
    GPUs are used (CUDA cannot be used in a process forked after it started), else the platform's default
    (None); None for any other plugin."""
    if args.plugin != "MultiProc":
        return None
    return args.plugin_args.get("mp_context", "forkserver" if use_gpu else None)


#: What a node's process imports to run a node of this workflow (Nipype's node and plugin code, the
#: interfaces, the reports' figures): imported once by the server that forks them (``start_node_server``).
NODE_MODULES = ("nipype.pipeline.engine", "nipype.pipeline.plugins.multiproc", "mppca_nipype.interfaces",
                "mppca_nipype.workflows", "mppca_nipype.reports", "matplotlib.figure")


def start_node_server() -> None:
    """Start multiprocessing's fork server now, with ``NODE_MODULES`` imported in it before it forks: its
    imports run while this process indexes the dataset, and each of MultiProc's workers starts forked with
    them (a worker of a fork server that imports nothing but ``__main__`` imports them itself: on the 2-core
    machine, 1.6-1.9 s more for the BIDS app than MultiProc's default ``fork``). Nothing in them starts CUDA."""
    from multiprocessing import forkserver

    forkserver.set_forkserver_preload(["__main__", *NODE_MODULES])
    forkserver.ensure_running()


def finish_run(args, bids_dir, filters, output_dir, work_dir, use_gpu, worker, note, started):
    """``run`` from indexing the dataset on: select the runs, denoise them, write the reports."""
    from ..bids import open_layout

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # pybids' deprecation chatter
        layout = open_layout(bids_dir, work_dir)
        todo, skipped = select_runs(args, layout, filters)
    if isinstance(args.noise_in, Path):
        check_noise_maps(todo, args.noise_in)
    check_patch_shape(todo, args)
    for run_ in skipped:
        say(f"{PROG}: warning: skipping {run_.relpath}: {run_.skip}")
    for run_ in todo:
        if run_.note:
            note(f"{run_.relpath}: {run_.note}")
    pairs = sum(run_.phase is not None for run_ in todo)
    if pairs and args.noise_floor != "none":
        note(f"--noise-floor {args.noise_floor} applies to the runs without a phase; a magnitude/phase pair is "
             "denoised through its phase-demodulated real part, with no floor to remove")
    note(f"denoising {len(todo)} run{'s' if len(todo) > 1 else ''} "
         f"({', '.join(sorted({r.suffix for r in todo}))}"
         f"{f'; {pairs} magnitude/phase pair' + ('s' if pairs > 1 else '') + ' as complex data' if pairs else ''}) "
         f"into {output_dir}")

    with ExitStack() as locks:  # this run's runs are ours alone until done (other runs may share OUTPUT_DIR)
        from ..bids import output_lock

        for run_ in sorted(todo, key=lambda r: r.node_name):  # one order for all: no deadlock
            locks.enter_context(output_lock(output_dir, f"run-{run_.node_name}", on_wait=lambda r=run_: note(
                f"waiting for another {PROG} run that is denoising {r.name} into {output_dir}")))
        if worker is not None:
            why_not = worker.wait_ready()
            if why_not is not None:
                for variable in worker.environment():
                    os.environ.pop(variable, None)
                say(f"{PROG}: warning: the GPU worker did not start ({why_not}); each GPU run starts the GPU "
                    "itself")
        failed = execute(args, todo, bids_dir, output_dir, work_dir, use_gpu, note)
    _report_runs(todo, output_dir, note)
    if args.reports:
        from ..reports import write_subject_report

        for subject in sorted({run_.entities["subject"] for run_ in todo}):
            page = write_subject_report(output_dir, subject)
            if page is not None:
                note(f"QC report: {page}")
    if failed:
        raise AppError(f"{len(failed)} of {len(todo)} runs failed ({', '.join(failed)}); crash reports are "
                       f"in {output_dir / 'logs'}", EXIT["failure"])
    note(f"done in {time.monotonic() - started:.1f} s: {len(todo)} denoised run"
         f"{'s' if len(todo) > 1 else ''} in {output_dir}; methods text in {output_dir / 'logs' / 'CITATION.md'}")
    if args.demo:
        from ..demo import BOLD_SIGMA, DWI_SIGMA

        note(f"the demo's true noise levels: {DWI_SIGMA:g} (DWI) and {BOLD_SIGMA:g} (BOLD); compare the "
             f"medians above, and view the *_desc-denoised_* images beside the inputs in {args.bids_dir}")
    return EXIT["ok"]


def execute(args, todo, bids_dir, output_dir, work_dir, use_gpu, note):
    """Build the workflow, write the dataset-level files, run it; return the names of failed runs."""
    from nipype import config, logging

    from ..bids import write_dataset_files
    from ..workflows import citation_text, init_bids_wf

    nprocs = args.nprocs or available_cpus()
    config.update_config({"execution": {"crashdump_dir": str(output_dir / "logs"), "crashfile_format": "txt",
                                        "stop_on_first_crash": False, "remove_unnecessary_outputs": False,
                                        "poll_sleep_duration": 0.2 if args.plugin in ("MultiProc", "Linear")
                                        else 2},
                          "monitoring": {"enabled": False}})
    config.set("logging", "workflow_level", "WARNING" if not args.quiet else "ERROR")
    config.set("logging", "interface_level", "ERROR")
    config.set("logging", "utils_level", "ERROR")
    logging.update_logging(config)

    workflow = init_bids_wf(todo, bids_dir=bids_dir, output_dir=output_dir, extent=args.extent,
                            stride=args.stride, patch_shape=args.shape, estimator=args.estimator,
                            aggregation=args.aggregation,
                            demean=args.demean, filter=args.filter, num_threads=nprocs, reports=args.reports, noise_in=args.noise_in,
                            gpu_memory=args.gpu_memory, **noise_floor_options(args), phase_method=args.phase_method,
                            maps=maps_asked(args),
                            # auto: each run on the GPU where it would finish first (engine.costs)
                            use_gpu=None if use_gpu and args.device == "auto" else use_gpu)
    workflow.base_dir = str(work_dir)
    try:
        write_dataset_files(output_dir, bids_dir, citation_text(workflow),
                            noise_dir=args.noise_in if isinstance(args.noise_in, Path) else None)
    except OSError as err:
        raise AppError(f"cannot write into OUTPUT_DIR {output_dir}: {err.strerror or err}",
                       EXIT["cannot_create"]) from None

    by_node = {f"run_{run.node_name}": run.relpath for run in todo}
    failed, finished = [], []

    def progress(node, status):
        parent = node.fullname.split(".")[-2] if "." in node.fullname else ""
        if node.name != "denoise" or parent not in by_node:
            return
        if status == "end":
            finished.append(parent)
            note(f"[{len(finished)}/{len(todo)}] denoised {Path(by_node[parent]).name}")
        elif status == "exception":
            failed.append(Path(by_node[parent]).name)

    plugin_args = dict(args.plugin_args)
    if args.plugin == "MultiProc":
        from ..gpu_worker import worker_address
        from ..interfaces import visible_gpus

        plugin_args.setdefault("n_procs", nprocs)
        plugin_args.setdefault("raise_insufficient", False)
        # one GPU node per visible device (nvidia-smi, Nipype's default, ignores CUDA_VISIBLE_DEVICES)
        # with the GPU worker, GPU_WORKER_NODES: nodes read and write their files while the worker runs another's
        plugin_args.setdefault("n_gpu_procs", (GPU_WORKER_NODES if worker_address() else len(visible_gpus()))
                               if use_gpu else 0)
        start_method = node_start_method(args, use_gpu)
        if start_method is not None:
            plugin_args["mp_context"] = start_method
    if args.plugin == "SLURM":
        import getpass

        from ..workflows import sbatch_resources

        os.environ.setdefault("LOGNAME", getpass.getuser())  # Nipype's SLURM plugin names jobs with it
        for node in workflow._get_all_nodes():
            if node.name == "denoise":  # --cpus-per-task, --mem (and --gres=gpu:1) from its input's size
                node.plugin_args = {"sbatch_args": sbatch_resources(node), "overwrite": False}
    if args.plugin in ("MultiProc", "Linear"):
        plugin_args.setdefault("status_callback", progress)
    # Nipype's MultiProc collects garbage before each round of submissions and after each node it runs
    # itself; the objects made so far (modules, the dataset's index, the workflow) live to the end, and
    # frozen out of the collector's reach they no longer make each collection slow
    gc.freeze()
    try:
        workflow.run(plugin=args.plugin, plugin_args=plugin_args)
    except RuntimeError:
        if not failed:
            failed.append("see the crash reports")
    except Exception as err:  # a plugin that cannot start (e.g. no sbatch for SLURM)
        raise AppError(f"the {args.plugin} plugin failed: {' '.join(str(err).split())[:300]}",
                       EXIT["failure"]) from None
    finally:
        gc.unfreeze()  # (a caller in this process, a test, gets its collector back as it was)
    return failed


def _report_runs(todo, output_dir, note):
    """Per run, from its sidecar: the engine's warnings (always) and one summary line (unless quiet)."""
    from ..bids import derivative_names

    for run_ in todo:
        sidecar = output_dir / derivative_names(run_.relpath, run_.phase_relpath)["denoised_json"]
        try:
            provenance = json.loads(sidecar.read_text())["MPPCADenoising"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        for text in provenance.get("Warnings", []):
            say(f"{PROG}: warning: {run_.name}: {text}")
        where = provenance["Backend"]
        if provenance["Device"] != where:
            where += f" on {provenance['Device']}"
        if run_.phase is not None:
            where = f"complex, phase by {provenance['Parameters']['phase_method']}; {where}"
        note(f"{run_.name}: median noise {provenance['NoiseMedian']:.4g}, median rank "
             f"{provenance['RankMedian']:.3g} ({where}, {provenance['WallTimeSeconds']:.1f} s)")


if __name__ == "__main__":
    main()
