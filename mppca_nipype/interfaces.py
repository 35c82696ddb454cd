"""Nipype interfaces: MP-PCA denoising as a node in any workflow.

``MPPCADenoise`` reads a 4D NIfTI series (and an optional mask), calls :func:`mppca_nipype.denoise` and writes
the denoised series, the noise and rank maps (and on request the lambda_plus and variance-removed maps) and a
provenance JSON into the node's directory; given the series'
phase (``phase_file``), it calls :func:`mppca_nipype.denoise_complex` and writes the denoised phase too. It holds no
algorithm: the engine does the work, :mod:`mppca_nipype.io` the reading and writing, and
:func:`mppca_nipype.bids.collect_provenance` the bookkeeping.

Example
-------
>>> from nipype import Node
>>> from mppca_nipype.interfaces import MPPCADenoise
>>> denoise = Node(MPPCADenoise(extent="auto", stride=1, aggregation="center", demean="none", estimator="exp2",
...                            filter="hard"), name="denoise")
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import lru_cache
from importlib.util import find_spec
import os
from pathlib import Path
import tempfile
import time
import warnings

from nipype import logging
from nipype.interfaces.base import (BaseInterfaceInputSpec, File, SimpleInterface, TraitedSpec, isdefined,
                                    traits)
from nipype.utils.filemanip import fname_presuffix

from .engine import DEFAULTS, NOISE_FLOORS, default_filter
from .engine.maps import MAPS
from .engine.gpu import absent_reason, visible_devices as visible_gpus
from .engine.complex_data import PHASE_METHODS
from .engine.estimators import AGGREGATIONS, DEMEANING, ESTIMATORS, FILTERS
from .engine.groups import GROUP_DEMEANING
from .engine.patches import EXTENT_RULES, PATCH_SHAPES

LOGGER = logging.getLogger("nipype.interface")


def default_first(option: str, choices) -> tuple:
    """The choices with the engine's default first (a traits.Enum's first value is its default)."""
    return (DEFAULTS[option], *(c for c in choices if c != DEFAULTS[option]))


@lru_cache(maxsize=1)
def gpu_probably_usable() -> bool:
    """Whether the GPU engine can probably run here, decided cheaply (nothing is imported or initialised).

    True when the engine's own cheap probe finds no reason against a GPU (torch and triton installed, an
    NVIDIA device present and not hidden by ``CUDA_VISIBLE_DEVICES``) and nvmath-python is installed too.
    This only picks the default of ``use_gpu`` (so that Nipype's MultiProc reserves a GPU slot); the engine
    makes the real check when it runs and falls back to the CPU.
    """
    try:
        if find_spec("nvmath") is None:
            return False
    except (ImportError, ValueError):
        return False
    return absent_reason() is None


def _gpu_lock_dir() -> Path:
    """Where the GPU locks live: one folder per user and machine, shared by every process of that user."""
    folder = Path(os.environ.get("MPPCA_GPU_LOCK_DIR") or Path(tempfile.gettempdir()) / f"mppca-gpu-{os.getuid()}")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@contextmanager
def gpu_slot(devices=None):
    """Hold one of the visible CUDA devices for the block; yields ``(index, name, shared)``.

    ``index`` is the device's position among the visible ones (what ``torch.cuda.set_device`` takes),
    ``name`` its CUDA name. Each device has a lock file (``fcntl`` lock, released when the holder exits,
    even by SIGKILL); the first free device is taken, starting from one picked by the process id so that
    concurrent nodes spread out. When every device is held (MultiProc's ``n_gpu_procs`` above the number of
    GPUs), a device is shared (``shared`` true) rather than waited for. Yields None without a visible GPU.
    """
    import fcntl

    devices = visible_gpus() if devices is None else list(devices)
    if not devices:
        yield None
        return
    folder = _gpu_lock_dir()
    first = os.getpid() % len(devices)
    order = [(first + k) % len(devices) for k in range(len(devices))]
    for index in order:
        handle = open(folder / f"gpu-{devices[index].replace('/', '_')}.lock", "a")
        try:
            fcntl.lockf(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            handle.close()
            continue
        try:
            yield index, devices[index], False
        finally:
            handle.close()  # closing releases the lock
        return
    yield first, devices[first], True


def denoise_on_device(data, mask, parameters, *, use_gpu, nprocs, gpu_memory=None, phase=None):
    """Run the engine on a GPU when asked and usable, else on the CPU; return (result, notes, placement).

    ``notes``: sentences for the provenance's warnings (the engine's, and ours when no GPU was usable or
    the GPU ran out of memory). ``placement``: how the run was placed (``GPUAsked``, ``GPUSlot``,
    ``CPUFallback``). With ``phase`` (radians or scanner units) the run is ``denoise_complex``'s and
    ``parameters`` holds its options (``phase_method``; no noise floor). The GPU runs on the device
    ``gpu_slot`` gives it, so that concurrent nodes on a machine with several GPUs each use their own; a run
    that goes on on the CPU after the GPU ran out of memory gives its slot back first (another node can use the
    GPU meanwhile). Where the BIDS app started a GPU worker (``gpu_worker``), a GPU run is the worker's: this
    process starts neither torch nor CUDA (``placement["GPUWorker"]``: the worker's process id).
    """
    from .engine import GPUOutOfMemoryError, MPPCAInputError, MPPCAWarning, check_device, denoise
    from .engine.complex_data import denoise_complex
    from .gpu_worker import denoise_remote, worker_address

    notes, placement = [], {"GPUAsked": bool(use_gpu), "GPUSlot": None, "CPUFallback": None}

    def run(device):  # device "worker": the app's GPU worker runs it (``gpu_worker``)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", MPPCAWarning)
            if device == "worker":
                result = denoise_remote(data, mask, parameters, phase=phase, gpu_memory=gpu_memory)
            elif phase is None:
                result = denoise(data, mask, **parameters, device=device, nprocs=nprocs, gpu_memory=gpu_memory)
            else:
                result = denoise_complex(data, phase, mask, **parameters, device=device, nprocs=nprocs,
                                         gpu_memory=gpu_memory)
        notes.extend(str(w.message) for w in caught if issubclass(w.category, MPPCAWarning))
        return result

    if use_gpu and worker_address():  # the app's GPU worker, started once for all its runs
        try:
            result = run("worker")
            placement["GPUWorker"] = result.info.get("gpu_worker")
            return result, notes, placement
        except GPUOutOfMemoryError as err:
            placement["CPUFallback"] = err.reason
            notes.append(err.fallback_note)
            return run("cpu"), notes, placement
        except ConnectionError as err:  # the worker is gone: this node starts the GPU itself
            notes.append(f"{err}; this run started the GPU itself")
    if use_gpu:
        try:
            check_device("cuda")
        except MPPCAInputError as err:
            reason = str(err).replace("device 'cuda' was asked for but ", "")
            placement["CPUFallback"] = f"no usable GPU: {reason}"
        else:
            with gpu_slot() as slot:
                if slot is not None:
                    placement["GPUSlot"] = dict(zip(("Index", "Device", "Shared"), slot))
                try:
                    return _run_pinned(run, slot), notes, placement
                except GPUOutOfMemoryError as err:
                    placement["CPUFallback"] = err.reason
                    fallback_note = err.fallback_note
            notes.append(fallback_note)
            return run("cpu"), notes, placement
        notes.append(f"a GPU was asked for, but {placement['CPUFallback']}; ran on the CPU instead")
    return run("cpu"), notes, placement


def _run_pinned(run, slot):
    """``run("cuda")`` with the slot's device as torch's current CUDA device (when there is a choice)."""
    if slot is None or len(visible_gpus()) < 2:
        return run("cuda")
    import torch

    with torch.cuda.device(slot[0]):
        return run("cuda")


class _MPPCADenoiseInputSpec(BaseInterfaceInputSpec):
    in_file = File(exists=True, mandatory=True, desc="4D series to denoise (DWI or BOLD), NIfTI")
    mask = File(exists=True, desc="voxels to denoise (non-zero); outputs are 0 outside it")
    extent = traits.Either(
        traits.Enum(*EXTENT_RULES), traits.Int, traits.List(traits.Int, minlen=3, maxlen=3),
        traits.Tuple(traits.Int, traits.Int, traits.Int),
        default=DEFAULTS["extent"], usedefault=True,
        desc="patch size in voxels, odd: 'auto' (smallest odd e with e^3 >= volumes, dwidenoise's rule), "
             "'wide' (the same but at least 7), one int or three")
    stride = traits.Int(DEFAULTS["stride"], usedefault=True,
                        desc="patch grid step; 1 makes every voxel the centre of a patch (dwidenoise)")
    shape = traits.Enum(*default_first("shape", PATCH_SHAPES), usedefault=True,
                        desc="patch shape: 'cuboid' the whole extent, 'sphere' the smallest sphere holding as "
                             "many voxels, centred on the stride's grid over the image and clipped at its edges")
    estimator = traits.Enum(*default_first("estimator", ESTIMATORS), usedefault=True,
                            desc="Marchenko-Pastur noise estimator: exp2 (Cordero-Grande 2019), exp1 (Veraart "
                                 "2016), med (the median noise eigenvalue, Gavish & Donoho 2014), olesen2023 "
                                 "(Olesen et al. 2023)")
    aggregation = traits.Enum(*default_first("aggregation", AGGREGATIONS), usedefault=True,
                              desc="how overlapping patches combine; 'center' needs stride 1")
    demean = traits.Enum(*default_first("demean", DEMEANING + GROUP_DEMEANING), usedefault=True,
                         desc="mean removed inside a patch before PCA: 'volume' the patch's mean time course, "
                              "'voxel' each voxel's temporal mean, 'none' nothing (dwidenoise), 'shells' each "
                              "voxel's mean per b-value shell (bval_file), 'groups' each voxel's mean per group of "
                              "volumes (volume_groups)")
    bval_file = File(exists=True, desc="with demean 'shells': the b-values of in_file's volumes (FSL's .bval)")
    volume_groups = traits.List(traits.Int, desc="with demean 'groups': the group label of each volume")
    filter = traits.Enum(*FILTERS,  # noqa: A003
                         desc="what each patch keeps of its components: 'hard' its P leading ones whole "
                              "(MP-PCA), 'optshrink' Gavish & Donoho's optimal shrinkage of the singular "
                              "values (Frobenius loss, 2017), 'optthresh' their optimal hard threshold (2014); "
                              "default 'optshrink', and 'optthresh' with phase_file (it leaves complex data the "
                              "least bias)")
    noise_in = traits.Either(
        traits.Float, File(exists=True),
        desc="a given noise level (standard deviation) instead of each patch's MP-PCA estimate: one positive "
             "number, or a 3D map on the input's grid (positive inside the mask); with a noise_floor, the "
             "channels' sigma of the magnitude data")
    noise_floor = traits.Enum(*NOISE_FLOORS, usedefault=True,
                              desc="the magnitude noise floor to remove: 'none' (signal plus Gaussian noise, "
                                   "dwidenoise), 'rician' (one complex channel), 'ncchi' (root sum of squares of "
                                   "'coils' channels): MP-PCA of a variance-stabilised transform, mapped back "
                                   "without the floor's bias")
    coils = traits.Int(1, usedefault=True, desc="channels of an 'ncchi' noise floor (1 otherwise)")
    phase_file = File(exists=True,
                      desc="the phase of in_file (then the magnitude of a complex series), 4D on its grid, in radians "
                           "or the scanner's whole-number units (detected): the background phase is removed and the "
                           "real part denoised, with no magnitude floor (needs noise_floor 'none')")
    phase_method = traits.Enum(*PHASE_METHODS, usedefault=True,
                               desc="how the background phase is estimated: 'hann', a 2D Hann low-pass per slice; "
                                    "'mppca', the same of the complex series first denoised by MP-PCA")
    lambda_plus = traits.Bool(False, usedefault=True,
                              desc="also write out_lambda_plus: the patches' Marchenko-Pastur upper edge "
                                   "sigma^2 (1 + sqrt(gamma))^2 (data variance units), aggregated as the noise map")
    variance_removed = traits.Bool(False, usedefault=True,
                                   desc="also write out_variance_removed: the mean over volumes of "
                                        "(input - denoised)^2 per voxel")
    use_gpu = traits.Bool(gpu_probably_usable(), usedefault=True,
                          desc="run on a CUDA GPU when one is usable (else on the CPU); MultiProc reserves a "
                               "GPU slot for the node. Default: true when a GPU is usable here")
    num_threads = traits.Int(1, usedefault=True, nohash=True, desc="CPU worker processes")
    echo_files = traits.List(File(exists=True),
                             desc="the other echoes of a multi-echo series (in_file the first), each 4D on its "
                                  "grid with as many volumes: denoised jointly with it, each voxel's mean per echo "
                                  "removed; noise_file and rank_file are shared")
    gpu_memory = traits.Either(traits.Float, traits.Str, nohash=True,
                               desc="the most GPU memory the run may take: GiB (8, '8GiB') or a share of the "
                                    "GPU's memory ('50%'); default: $MPPCA_GPU_MEMORY, else all the GPU can give")


class _MPPCADenoiseOutputSpec(TraitedSpec):
    out_file = File(exists=True, desc="denoised series (float32, same grid and header as the input)")
    noise_file = File(exists=True, desc="3D map of the noise standard deviation estimated by MP-PCA")
    rank_file = File(exists=True, desc="3D map of the number of signal components kept")
    out_phase_file = File(desc="with phase_file: the phase of the denoised complex series, in radians")
    echo_out_files = traits.List(File(exists=True), desc="with echo_files: each one denoised, in their order")
    out_lambda_plus = File(desc="with lambda_plus: 3D map of the patches' Marchenko-Pastur upper edge")
    out_variance_removed = File(desc="with variance_removed: 3D map of the variance removed from each voxel")
    provenance_file = File(exists=True, desc="JSON: parameters, backend, device, versions, timings, "
                                             "noise and rank summaries, input checksum")


class MPPCADenoise(SimpleInterface):
    """Marchenko-Pastur PCA denoising of a 4D series (Veraart 2016; Cordero-Grande 2019).

    With ``use_gpu`` false the CPU engine runs with ``num_threads`` worker processes; with ``use_gpu`` true
    the GPU engine runs when usable, else the CPU engine (the provenance records which ran).
    """

    input_spec = _MPPCADenoiseInputSpec
    output_spec = _MPPCADenoiseOutputSpec

    def _run_interface(self, runtime):
        from . import io
        from .bids import collect_provenance, sha256_file
        from .engine import MPPCAInputError, available_cpus
        from .phases import Phases

        start = time.perf_counter()
        phases = Phases()
        echo_files = list(self.inputs.echo_files) if isdefined(self.inputs.echo_files) else []
        with phases("read"):
            data, image = io.load_series(self.inputs.in_file)
            echoes = [io.load_series(path) for path in echo_files]  # (data, image) of each
        mask = None
        if isdefined(self.inputs.mask):
            mask = io.load_mask(self.inputs.mask, data.shape[:3])
        parameters = dict(extent=self.inputs.extent, stride=self.inputs.stride, shape=self.inputs.shape,
                          estimator=self.inputs.estimator, aggregation=self.inputs.aggregation,
                          demean=self.inputs.demean,
                          filter=(self.inputs.filter if isdefined(self.inputs.filter)
                                  else default_filter(isdefined(self.inputs.phase_file))))
        if self.inputs.demean == "shells" and isdefined(self.inputs.bval_file):
            parameters["bvals"] = io.read_numbers(self.inputs.bval_file, ".bval file")
        if self.inputs.demean == "groups" and isdefined(self.inputs.volume_groups):
            parameters["groups"] = list(self.inputs.volume_groups)
        maps = tuple(name for name in MAPS if getattr(self.inputs, name))
        if maps:
            parameters["maps"] = maps
        phase = None
        if isdefined(self.inputs.phase_file):
            if echo_files:
                raise MPPCAInputError("phase_file denoises one complex series and does not combine with echo_files")
            if maps:
                raise MPPCAInputError("the lambda_plus and variance_removed maps are not available with phase_file")
            if self.inputs.noise_floor != "none":
                raise MPPCAInputError(f"phase_file removes the magnitude floor by denoising the demodulated real "
                                      f"part; noise_floor must be 'none', not {self.inputs.noise_floor!r}")
            image_shape = tuple(io.load_image(self.inputs.phase_file, "phase").shape)
            if image_shape != data.shape:
                raise MPPCAInputError(f"the phase {self.inputs.phase_file} has shape {image_shape}, but the "
                                      f"magnitude's is {data.shape}")
            phase = io.read_data(io.load_image(self.inputs.phase_file, "phase"), self.inputs.phase_file, "phase")
            parameters["phase_method"] = self.inputs.phase_method
        else:
            parameters.update(noise_floor=self.inputs.noise_floor, coils=self.inputs.coils)
        noise_source = {}  # where a given noise level came from: the number, or the file's name and checksum
        if isdefined(self.inputs.noise_in):
            if isinstance(self.inputs.noise_in, str):
                parameters["noise"] = io.load_noise_map(self.inputs.noise_in, data.shape[:3])
                noise_source = dict(noise_in=Path(self.inputs.noise_in).name)
            else:
                parameters["noise"] = float(self.inputs.noise_in)
                noise_source = dict(noise_in=parameters["noise"])
        # never more workers than this process may use (its affinity, SLURM_CPUS_PER_TASK)
        nprocs = max(1, min(self.inputs.num_threads, available_cpus()))
        with phases("denoise"):
            series = [data, *(echo for echo, _ in echoes)] if echoes else data
            result, notes, placement = denoise_on_device(
                series, mask, parameters, use_gpu=self.inputs.use_gpu, nprocs=nprocs,
                gpu_memory=self.inputs.gpu_memory if isdefined(self.inputs.gpu_memory) else None, phase=phase)
        phases.parts_of("denoise", result.info["seconds"])
        for note in notes:
            LOGGER.warning("MPPCADenoise %s: %s", Path(self.inputs.in_file).name, note)

        out_file = fname_presuffix(self.inputs.in_file, suffix="_denoised", newpath=runtime.cwd)
        noise_file = fname_presuffix(self.inputs.in_file, suffix="_noise", newpath=runtime.cwd)
        rank_file = fname_presuffix(self.inputs.in_file, suffix="_rank", newpath=runtime.cwd)
        echo_out_files = [fname_presuffix(path, suffix="_denoised", newpath=runtime.cwd) for path in echo_files]
        with phases("write"):
            if echoes:  # (X, Y, Z, E, T): the first echo is in_file's
                for e, ((_, echo_image), path) in enumerate(zip(echoes, echo_out_files), 1):
                    io.save_like(result.denoised[:, :, :, e], echo_image, path)
                result.denoised = result.denoised[:, :, :, 0]
            io.save_like(result.denoised, image, out_file)
            io.save_like(result.sigma, image, noise_file)
            io.save_like(result.rank, image, rank_file)
            if phase is not None:
                out_phase_file = fname_presuffix(self.inputs.in_file, suffix="_phase", newpath=runtime.cwd)
                io.save_like(result.phase, image, out_phase_file)
                self._results["out_phase_file"] = out_phase_file
            for name in maps:  # (_lambdaplus, _varianceremoved: the desc labels of bids.MAPS)
                map_file = fname_presuffix(self.inputs.in_file, suffix="_" + name.replace("_", ""),
                                           newpath=runtime.cwd)
                io.save_like(getattr(result, name), image, map_file)
                self._results["out_" + name] = map_file

        provenance = collect_provenance(
            result, self.inputs.in_file,
            mask_file=self.inputs.mask if isdefined(self.inputs.mask) else None,
            mask=mask, parameters=dict({k: v for k, v in parameters.items() if k not in ("noise", "bvals")},
                                       **noise_source,
                                       **({"bval_file": Path(self.inputs.bval_file).name} if "bvals" in parameters
                                          else {}),
                                       **({} if phase is None else dict(phase_file=Path(self.inputs.phase_file).name)),
                                       # the noise model, with a phase too (where the floor is 'none')
                                       noise_floor=self.inputs.noise_floor, coils=self.inputs.coils,
                                       use_gpu=bool(self.inputs.use_gpu), num_threads=self.inputs.num_threads),
            wall_seconds=time.perf_counter() - start, warnings=notes, timings=phases.as_dict())
        provenance.update(placement)
        if phase is not None:
            provenance["PhaseSHA256"] = sha256_file(self.inputs.phase_file)
        if isdefined(self.inputs.noise_in) and isinstance(self.inputs.noise_in, str):
            provenance["NoiseInSHA256"] = sha256_file(self.inputs.noise_in)
        if echo_files:  # the echoes denoised with in_file
            provenance.update(EchoFiles=[Path(path).name for path in echo_files],
                              EchoSHA256=[sha256_file(path) for path in echo_files])
            self._results["echo_out_files"] = echo_out_files
        provenance_file = str(Path(runtime.cwd) / "provenance.json")
        io.write_json_atomic(provenance_file, provenance)
        self._results.update(out_file=out_file, noise_file=noise_file, rank_file=rank_file,
                             provenance_file=provenance_file)
        return runtime
