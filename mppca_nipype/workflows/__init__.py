"""Workflow factories: one run (``init_mppca_wf``) and a BIDS dataset (``init_bids_wf``).

Each returns a Nipype ``Workflow`` whose ``__desc__`` is the methods boilerplate users paste into papers.
"""

from __future__ import annotations

from nipype.interfaces.base import (BaseInterfaceInputSpec, File, SimpleInterface, TraitedSpec, isdefined,
                                    traits)
from nipype.interfaces.utility import IdentityInterface, Select
from nipype.pipeline import engine as pe

from ..engine import DEFAULTS, default_filter
from ..engine.complex_data import PHASE_METHODS, PHASE_PASSES, PHASE_WIDTH
from ..interfaces import MPPCADenoise, gpu_probably_usable

REFERENCES = """\
- Veraart J, Novikov DS, Christiaens D, Ades-Aron B, Sijbers J, Fieremans E (2016). Denoising of
  diffusion MRI using random matrix theory. NeuroImage 142:394-406. doi:10.1016/j.neuroimage.2016.08.016
- Cordero-Grande L, Christiaens D, Hutter J, Price AN, Hajnal JV (2019). Complex diffusion-weighted image
  estimation via matrix recovery under general noise models. NeuroImage 200:391-404.
  doi:10.1016/j.neuroimage.2019.06.039
"""

#: Cited when a noise floor is removed.
NOISE_FLOOR_REFERENCES = """\
- Koay CG, Basser PJ (2006). Analytically exact correction scheme for signal extraction from noisy magnitude
  MR signals. J Magn Reson 179(2):317-322. doi:10.1016/j.jmr.2006.01.016
- Foi A (2011). Noise estimation and removal in MR imaging: the variance-stabilization approach. IEEE ISBI
  2011:1809-1814. doi:10.1109/ISBI.2011.5872758
"""

#: Cited when complex data (a magnitude with its phase) are denoised.
COMPLEX_REFERENCES = """\
- Eichner C, Cauley SF, Cohen-Adad J, et al. (2015). Real diffusion-weighted MRI enabling true signal
  averaging and increased diffusion contrast. NeuroImage 122:373-384. doi:10.1016/j.neuroimage.2015.07.074
"""

#: Cited for the estimators beyond dwidenoise's.
ESTIMATOR_REFERENCES = {
    "med": """\
- Gavish M, Donoho DL (2014). The optimal hard threshold for singular values is 4/sqrt(3). IEEE Trans Inf
  Theory 60(8):5040-5053. doi:10.1109/TIT.2014.2323359
""",
    "olesen2023": """\
- Olesen JL, Ianus A, Ostergaard L, Shemesh N, Jespersen SN (2023). Tensor denoising of multidimensional MRI
  data. Magn Reson Med 89(3):1160-1172. doi:10.1002/mrm.29478
""",
}

#: Cited when a filter other than ``hard`` is used.
FILTER_REFERENCES = {
    "optshrink": """\
- Gavish M, Donoho DL (2017). Optimal shrinkage of singular values. IEEE Trans Inf Theory 63(4):2137-2152.
  doi:10.1109/TIT.2017.2653801
""",
    "optthresh": """\
- Gavish M, Donoho DL (2014). The optimal hard threshold for singular values is 4/sqrt(3). IEEE Trans Inf
  Theory 60(8):5040-5053. doi:10.1109/TIT.2014.2323359
""",
}

_AGGREGATION_TEXT = {
    "center": "each voxel took the value reconstructed in the patch centred on it",
    "weighted": "overlapping reconstructions were averaged with weights 1/(1 + P) (P: the patch's rank, "
                "plus one when the voxel means were removed)",
    "uniform": "overlapping reconstructions were averaged with equal weights",
    "gaussian": "overlapping reconstructions were averaged with weights 1/(1 + P) (P: the patch's rank, plus "
                "one when the voxel means were removed) times a Gaussian of each voxel's distance from its "
                "patch's centre (standard deviation: the patch's half-width)",
}


_FILTER_TEXT = {
    "hard": "only the signal components were kept",
    "optshrink": ("with that noise level taken as known, the singular values were shrunk by the optimal "
                  "shrinker for the Frobenius loss (Gavish & Donoho 2017)"),
    "optthresh": ("with that noise level taken as known, the components above the optimal hard threshold of "
                  "the singular values (Gavish & Donoho 2014) were kept"),
}


def methods_text(*, extent=DEFAULTS["extent"], stride=DEFAULTS["stride"], estimator=DEFAULTS["estimator"],
                 aggregation=DEFAULTS["aggregation"], demean=DEFAULTS["demean"], noise_in=None,
                 noise_floor="none", coils=1, what="series", filter=DEFAULTS["filter"],  # noqa: A002
                 phase_method=None, complex_filter=None, echoes=False, patch_shape=DEFAULTS["shape"]) -> str:
    """The methods paragraph for the given parameters (Markdown, with citations). ``noise_in``: None (the
    noise estimated per patch), a number (one given sigma) or "maps" (a given map per series);
    ``noise_floor`` and ``coils`` as for :func:`mppca_nipype.denoise`; ``phase_method``: how the background
    phase of the series saved with their phase was estimated (:func:`mppca_nipype.denoise_complex`), None
    when none was, and ``complex_filter`` their filter where it is not ``filter``; ``echoes``: some series
    were the echoes of multi-echo runs, denoised jointly."""
    from .. import __version__

    if extent == "auto":
        size = "the smallest odd cube holding at least as many voxels as volumes"
    elif extent == "wide":
        size = "the smallest odd cube of at least 7x7x7 voxels holding at least as many voxels as volumes"
    elif isinstance(extent, int):
        size = f"{extent}x{extent}x{extent} voxels"
    else:
        size = "x".join(str(e) for e in extent) + " voxels"
    if patch_shape == "sphere":
        size = (f"spheres (the voxels within a Euclidean radius of the centre) holding at least as many voxels as "
                f"cuboids of {size}")
    grid = ("centred on every voxel" if stride == 1
            else f"on a grid of step {stride} voxels (plus patches flush with the far edges)")
    if patch_shape == "sphere" and stride != 1:
        grid = f"centred on a grid of step {stride} voxels (and on the last voxel of each axis)"
    if patch_shape == "sphere":
        grid += ", clipped at the image's edges"
    demeaning = {"voxel": " after removing each voxel's temporal mean",
                 "volume": " after removing the patch's mean time course",
                 "shells": " after removing each voxel's mean over the volumes of each b-value shell",
                 "groups": " after removing each voxel's mean over the volumes of each group"}.get(demean, "")
    if noise_in is None and estimator == "med":
        split = ("split into signal and noise by the Marchenko-Pastur law: the noise level from the median of "
                 "the noise eigenvalues matched to the median of the Marchenko-Pastur distribution "
                 "([@gavish2014]), the signal components those above the distribution's upper edge")
    elif noise_in is None and estimator == "olesen2023":
        split = ("split into signal and noise by the Marchenko-Pastur law: the noise level from the sum of the "
                 "noise eigenvalues over the degrees of freedom the signal components leave, the signal "
                 "components those above the distribution's upper edge ([@olesen2023])")
    elif noise_in is None:
        split = (f"split into signal and noise by the Marchenko-Pastur law, with the noise level and number of "
                 f"signal components estimated as in MRtrix3's dwidenoise (estimator '{estimator}', "
                 f"[@cordero2019])")
    if noise_in is None:
        maps = "the estimated noise standard deviation"
    else:
        given = ("a noise map given for each series (the mean of sigma^2 over the patch)" if noise_in == "maps"
                 else f"a given noise standard deviation of {float(noise_in):g}")
        split = (f"split into signal and noise at the upper edge of the Marchenko-Pastur distribution, "
                 f"sigma^2 (1 + sqrt(gamma))^2, with sigma from {given}")
        maps = "the noise standard deviation used"
    floor = ""
    if noise_floor != "none":
        model = ("a Rician distribution" if noise_floor == "rician"
                 else f"a non-central chi distribution with {2 * coils} degrees of freedom ({coils} channels)")
        source = ("given" if noise_in is not None
                  else "estimated by a first MP-PCA pass and corrected for the magnitude's narrower spread")
        floor = (f" The magnitude noise floor{' of the series without a phase' if phase_method else ''} was "
                 f"modelled as {model} ([@koay2006]): before denoising, each "
                 f"magnitude divided by the channels' noise level ({source}) was mapped by a "
                 f"variance-stabilising transform ([@foi2011]), and the denoised values were mapped back to the "
                 f"signal by the exact unbiased inverse of that transform's expected value.")
    complex_data = ""
    if phase_method is not None:
        first = (" of the complex series first denoised by MP-PCA (its real and imaginary parts as one series of "
                 "twice the volumes)" if phase_method == "mppca" else "")
        complex_data = (f" Where the phase was saved with the magnitude, the two were denoised as one complex "
                        f"series: its smooth background phase was estimated in each slice and volume as the angle "
                        f"of a 2D Hann low-pass filter in k-space{first} (over the central {PHASE_WIDTH:g} of "
                        f"each in-plane axis, {PHASE_PASSES} passes; [@eichner2015]) and removed, and the real "
                        f"part of the demodulated series, whose noise is Gaussian with no magnitude floor, was "
                        f"denoised as above"
                        + (f", except that, {_FILTER_TEXT[complex_filter]}"
                           if complex_filter not in (None, filter) else "")
                        + f"; the denoised magnitude is its positive part, the denoised phase that "
                        f"of the denoised complex series, and the noise map the noise level of each real channel.")
    return (
        f"The {what} were denoised with Marchenko-Pastur principal component analysis (MP-PCA; "
        f"[@veraart2016]) using mppca-nipype {__version__}. Local patches ({size}) were placed {grid}; "
        f"for each patch, the eigenvalues of the voxel-by-volume matrix{demeaning} were {split}, and "
        f"{_FILTER_TEXT[filter]}; {_AGGREGATION_TEXT[aggregation]}. Maps of {maps} and of the number of "
        f"signal components were saved with the denoised data.{floor}{complex_data}"
        + (" The echoes of each multi-echo run were denoised jointly: each patch's matrix held the volumes of "
           "every echo, after removing each voxel's mean per echo." if echoes else "")
        + "\n"
    )


#: The memory model (docs/hpc.md), in GiB: what a denoising node's process holds at its peak.
#: CPU: the interpreter with NumPy, SciPy, nibabel and Nipype (MEMORY_BASE), five copies of the
#: series in float32 (as read, the workers' shared copy, the weighted sums, the result, and one transient
#: of nibabel's scaling or saving), and per worker process its batch (engine.cpu.BATCH_BYTES, twice) and
#: its slab's sums (extent[0] planes of the series). GPU: the same base plus the CUDA context
#: (MEMORY_CUDA), and four copies (as read, pinned upload, pinned download, the result).
MEMORY_BASE = 0.5
MEMORY_CUDA = 1.5
SERIES_COPIES_CPU = 5
SERIES_COPIES_GPU = 4


def node_resources(shape, *, use_gpu, max_procs, extent=DEFAULTS["extent"], stride=DEFAULTS["stride"]):
    """``(n_procs, mem_gb)`` a denoising node needs for an input of ``shape`` (X, Y, Z, T).

    CPU: as many worker processes as the engine can keep busy (one per x-plane of patch corners), at most
    ``max_procs``; GPU: one process (MultiProc counts a GPU node's ``n_procs`` as GPU slots, so one GPU
    each). ``mem_gb`` follows the memory model above (MEMORY_BASE...), rounded up to 0.1 GiB.
    """
    import math

    from ..engine.cpu import BATCH_BYTES
    from ..engine.patches import resolve_extent

    x, y, z, t = (int(v) for v in shape[:4])
    series_gb = x * y * z * t * 4 / 2**30
    if use_gpu:
        return 1, math.ceil(10 * (MEMORY_BASE + MEMORY_CUDA + SERIES_COPIES_GPU * series_gb)) / 10
    try:
        ex = resolve_extent(extent, (x, y, z), t)[0]
    except ValueError:  # a wrong extent fails in the node itself, with its message
        ex = 1
    step = 1 if stride == 1 else min(stride, ex)
    units = math.ceil((x - ex) / step) + 1
    n_procs = max(1, min(int(max_procs), units))
    per_worker = 2 * BATCH_BYTES / 2**30 + series_gb * ex / x
    return n_procs, math.ceil(10 * (MEMORY_BASE + SERIES_COPIES_CPU * series_gb + n_procs * per_worker)) / 10


def gpu_finishes_first(shape, extent, stride, num_threads) -> bool:
    """Whether the GPU engine would finish a series of ``shape`` before the CPU engine on ``num_threads``
    workers (``engine.costs``: what ``denoise(device="auto")`` decides): started in the node's own process,
    or already started by the app's GPU worker (``gpu_worker``) where it serves the nodes."""
    from ..engine import costs
    from ..gpu_worker import worker_address
    from ..engine.patches import resolve_extent

    try:
        extents = resolve_extent(extent, tuple(shape[:3]), int(shape[3]))
    except ValueError:  # a wrong extent fails in the node itself, with its message
        return True
    return costs.estimate(tuple(shape[:3]), int(shape[3]), extents, stride, num_threads,
                          started=True if worker_address() else None).device == "cuda"


def sbatch_resources(node) -> str:
    """The sbatch options a node needs under Nipype's SLURM plugin: ``--cpus-per-task`` and ``--mem`` from
    its ``n_procs`` and ``mem_gb``, and ``--gres=gpu:1`` for a GPU node."""
    options = f"--cpus-per-task={node.n_procs} --mem={max(1, int(round(node.mem_gb * 1024)))}M"
    return options + (" --gres=gpu:1" if node.is_gpu_node() else "")


def init_mppca_wf(*, name="mppca_wf", extent=DEFAULTS["extent"], stride=DEFAULTS["stride"],
                  estimator=DEFAULTS["estimator"], aggregation=DEFAULTS["aggregation"],
                  demean=DEFAULTS["demean"], filter=None, use_gpu=None,  # noqa: A002
                  num_threads=1, shape=None, patch_shape=DEFAULTS["shape"], noise_in=None, gpu_memory=None,
                  noise_floor="none", coils=1, phase_method=None, maps=()):
    """MP-PCA denoising of one 4D series.

    Parameters
    ----------
    name : str
        The workflow's name.
    extent, stride, estimator, aggregation, demean, filter
        The denoising options (see :func:`mppca_nipype.denoise`); ``filter`` None: the defaults' (optshrink),
        or with ``phase_method`` complex data's (``COMPLEX_FILTER``, optthresh).
    use_gpu : bool, optional
        Run on a CUDA GPU when usable (default: when a GPU is usable here and, the shape given, it would
        finish first, its start included: :func:`gpu_finishes_first`).
    num_threads : int
        CPU worker processes for the node, at most (Nipype's MultiProc reserves as many).
    shape : tuple, optional
        The input's shape (X, Y, Z, T): the node's ``n_procs`` and ``mem_gb`` are then set from it
        (:func:`node_resources`), so that MultiProc and the cluster plugins reserve what it needs.
    patch_shape : {"cuboid", "sphere"}
        The patch shape, :func:`mppca_nipype.denoise`'s ``shape`` (``MPPCADenoise.shape``).
    noise_in : None, a number or "maps"
        How the noise level is known, for the methods text and the placement: estimated (None), one given
        sigma, or a map per series given through ``inputnode.noise_in``.
    gpu_memory : number or str, optional
        The most GPU memory the node's run may take (see :func:`mppca_nipype.denoise`).
    noise_floor, coils
        The magnitude noise floor to remove (see :func:`mppca_nipype.denoise`).
    phase_method : {"hann", "mppca"}, optional
        Given, ``in_file`` is the magnitude of a complex series whose phase comes through
        ``inputnode.phase_file``: denoised by :func:`mppca_nipype.denoise_complex` with this way of estimating
        the background phase (``noise_floor`` must be "none"). None: the series alone.
    maps : tuple of str
        Extra maps to write: ``lambda_plus``, ``variance_removed`` (see :func:`mppca_nipype.denoise`).

    Inputs (``inputnode``)
    ----------------------
    in_file
        The 4D series (NIfTI).
    phase_file
        With ``phase_method``: the phase of ``in_file`` (radians or the scanner's units).
    mask
        Optional mask of the voxels to denoise.
    noise_in
        Optional given noise level: a number or a 3D map of sigma (``MPPCADenoise.noise_in``).
    metadata
        The series' metadata (a dict, e.g. its BIDS sidecar); carried forward into ``provenance``.
    echo_files
        Optional: the other echoes of a multi-echo series (``in_file`` the first), denoised jointly with it
        (``MPPCADenoise.echo_files``).

    Outputs (``outputnode``)
    ------------------------
    denoised
        The denoised series.
    noise, rank
        3D maps of the noise standard deviation and the number of signal components.
    phase
        With ``phase_method``: the phase of the denoised complex series (radians).
    lambda_plus, variance_removed
        With ``maps``: 3D maps of the patches' Marchenko-Pastur upper edge and of the variance removed.
    provenance
        JSON: the provenance block (parameters, backend, device, versions, timings, summaries, checksum)
        under ``MPPCADenoising``, next to the input's metadata.
    echo_denoised, provenance_file
        With ``echo_files``: each of them denoised; the provenance alone (for the other echoes' sidecars).
    """
    filter = filter or default_filter(phase_method is not None)  # noqa: A001
    workflow = pe.Workflow(name=name)
    workflow.__desc__ = methods_text(extent=extent, stride=stride, estimator=estimator,
                                     aggregation=aggregation, demean=demean, noise_in=noise_in,
                                     noise_floor=noise_floor, coils=coils, filter=filter, phase_method=phase_method,
                                     patch_shape=patch_shape)
    workflow.__postdesc__ = references_text(noise_floor, filter, estimator, complex_data=phase_method is not None)
    inputnode = pe.Node(IdentityInterface(fields=["in_file", "mask", "metadata", "noise_in", "phase_file",
                                                  "echo_files"]), name="inputnode")
    outputnode = pe.Node(IdentityInterface(fields=["denoised", "noise", "rank", "phase", "provenance",
                                                   "echo_denoised", "provenance_file", "lambda_plus",
                                                   "variance_removed"]), name="outputnode")
    if use_gpu is None:  # where a GPU is usable, and (the shape known) it would finish first
        use_gpu = gpu_probably_usable() and (shape is None or gpu_finishes_first(shape, extent, stride,
                                                                               num_threads))
    use_gpu = bool(use_gpu)
    n_procs, mem_gb = num_threads, None
    if shape is not None:
        n_procs, mem_gb = node_resources(shape, use_gpu=use_gpu, max_procs=num_threads, extent=extent,
                                         stride=stride)
    denoise = pe.Node(
        MPPCADenoise(extent=extent, stride=stride, shape=patch_shape, estimator=estimator, aggregation=aggregation,
                     demean=demean, filter=filter, noise_floor=noise_floor, coils=coils, use_gpu=use_gpu, num_threads=n_procs,
                     **({} if gpu_memory is None else {"gpu_memory": str(gpu_memory)}),
                     **({} if phase_method is None else {"phase_method": phase_method}),
                     **{name: True for name in maps}),
        name="denoise", n_procs=n_procs, **({} if mem_gb is None else {"mem_gb": mem_gb}))
    sidecar = pe.Node(_MetadataSidecar(), name="sidecar", run_without_submitting=True)
    workflow.connect([
        (inputnode, denoise, [("in_file", "in_file"), ("mask", "mask"), ("noise_in", "noise_in"),
                              ("echo_files", "echo_files")]),
        (inputnode, sidecar, [("metadata", "metadata")]),
        (denoise, sidecar, [("provenance_file", "provenance_file")]),
        (denoise, outputnode, [("out_file", "denoised"), ("noise_file", "noise"), ("rank_file", "rank"),
                               ("echo_out_files", "echo_denoised"), ("provenance_file", "provenance_file")]),
        (sidecar, outputnode, [("out_file", "provenance")]),
    ])
    if phase_method is not None:
        workflow.connect([(inputnode, denoise, [("phase_file", "phase_file")]),
                          (denoise, outputnode, [("out_phase_file", "phase")])])
    if maps:
        workflow.connect([(denoise, outputnode, [(f"out_{name}", name) for name in maps])])
    return workflow


def init_bids_wf(runs, *, bids_dir, output_dir, name="mppca_bids_wf", extent=DEFAULTS["extent"],
                 stride=DEFAULTS["stride"], patch_shape=DEFAULTS["shape"], estimator=DEFAULTS["estimator"],
                 aggregation=DEFAULTS["aggregation"], demean=DEFAULTS["demean"], filter=None,  # noqa: A002
                 use_gpu=None, num_threads=1, reports=True, noise_in=None, gpu_memory=None, noise_floor="none",
                 coils=1, phase_method=PHASE_METHODS[0], maps=()):
    """Denoise the given BIDS runs and write them as derivatives of ``bids_dir`` into ``output_dir``.

    Parameters
    ----------
    runs : list of mppca_nipype.bids.Run
        From :func:`mppca_nipype.bids.query_runs` (runs with ``skip`` set are left out).
    bids_dir, output_dir : path
        The raw dataset (only read) and the derivative dataset.
    noise_in : None, a number, or a folder
        A given noise level for every run: one sigma, or a derivative dataset holding each run's
        ``desc-noise`` map (:func:`mppca_nipype.bids.given_noise_map`: an earlier run of this app, or maps
        written under its names); recorded in each sidecar (``Sources``, ``NoiseInSource``). None: estimated.
    reports : bool
        Also make each run's QC figures (:class:`mppca_nipype.reports.RunReport`); the sink writes them under
        ``sub-<label>/figures/`` (the subject pages come from :func:`mppca_nipype.reports.write_subject_report`).
    phase_method : {"hann", "mppca"}
        How the background phase of a magnitude/phase pair (a run with ``phase``) is estimated: the pair is
        denoised as one complex series, with no noise floor whatever ``noise_floor`` says (that applies to the
        runs without a phase), and the sink writes both parts.
    maps : tuple of str
        Extra maps each run without a phase writes (``lambda_plus``, ``variance_removed``), named by
        :func:`mppca_nipype.bids.derivative_names`.
    other parameters
        As for :func:`init_mppca_wf`; applied to every run (``filter`` None: each run its kind's default,
        optthresh for a magnitude/phase pair).

    One ``init_mppca_wf`` sub-workflow per run, named after the run, each followed by a
    :class:`mppca_nipype.bids.DerivativesSink` node. A multi-echo run (``run.echoes``) is denoised jointly by
    one sub-workflow, and each echo gets its own sink (its own derivatives, sidecar and figures; the noise and
    rank maps shared). Each denoising node's ``n_procs`` and ``mem_gb`` come
    from its input's shape (:func:`node_resources`), with ``num_threads`` as the most CPUs one may take.
    """
    from ..bids import given_noise_map, noise_uri

    workflow = pe.Workflow(name=name)
    todo = [run for run in runs if run.skip is None]
    kinds = sorted({run.datatype for run in todo})
    what = {("dwi",): "diffusion-weighted series", ("func",): "BOLD series"}.get(
        tuple(kinds), "diffusion-weighted and BOLD series")
    noise_maps = noise_in is not None and not isinstance(noise_in, (int, float))
    noise_kind = "maps" if noise_maps else noise_in
    pairs = any(run.phase is not None for run in todo)
    magnitudes = any(run.phase is None for run in todo)
    floor = noise_floor if magnitudes else "none"  # (a pair has no floor)
    pair_filter = filter or default_filter(True)
    main_filter = filter or default_filter(not magnitudes)  # (the filter of the runs without a phase, if any)
    workflow.__desc__ = methods_text(extent=extent, stride=stride, estimator=estimator,
                                     aggregation=aggregation, demean=demean, noise_in=noise_kind,
                                     noise_floor=floor, coils=coils, what=what, filter=main_filter,
                                     phase_method=phase_method if pairs else None,
                                     complex_filter=pair_filter if pairs else None,
                                     echoes=any(run.echoes for run in todo), patch_shape=patch_shape)
    workflow.__postdesc__ = references_text(floor, main_filter, estimator, complex_data=pairs,
                                            complex_filter=pair_filter if pairs else None)
    for run in todo:
        run_maps = maps if run.phase is None else ()  # (a magnitude/phase pair: denoise_complex, no extra maps)
        shape = series_shape(run.path)
        if run.phase is not None and shape is not None:
            # a complex run holds about twice a magnitude run's arrays (the complex series, the background
            # phase, the demodulated parts), and 'mppca' denoises 2T volumes first: sized as 2T volumes
            shape = (*shape[:3], 2 * shape[3])
        if run.echoes and shape is not None:  # the node holds every echo (node_resources)
            shape = shape[:3] + (shape[3] * (1 + len(run.echoes)),)
        run_wf = init_mppca_wf(name=f"run_{run.node_name}", extent=extent, stride=stride, patch_shape=patch_shape,
                               estimator=estimator, aggregation=aggregation, demean=demean, filter=filter,
                               use_gpu=use_gpu, num_threads=num_threads, shape=shape,
                               noise_in=noise_kind, gpu_memory=gpu_memory,
                               noise_floor=noise_floor if run.phase is None else "none",
                               coils=coils if run.phase is None else 1,
                               phase_method=None if run.phase is None else phase_method, maps=run_maps)
        run_wf.inputs.inputnode.in_file = str(run.path)
        run_wf.inputs.inputnode.metadata = run.metadata
        if run.phase is not None:
            run_wf.inputs.inputnode.phase_file = str(run.phase.path)
        if run.echoes:
            run_wf.inputs.inputnode.echo_files = [str(echo.path) for echo in run.echoes]
        noise_source = None
        if noise_maps:
            noise_map = given_noise_map(run.relpath, noise_in, run.phase_relpath)
            run_wf.inputs.inputnode.noise_in = str(noise_map)
            noise_source = noise_uri(noise_map, noise_in)
        elif noise_in is not None:
            run_wf.inputs.inputnode.noise_in = float(noise_in)
        # each echo's denoised series and sidecar (its own metadata beside the shared provenance)
        outputs = [(run, "outputnode.denoised", "outputnode.provenance")]
        for index, echo in enumerate(run.echoes):
            pick = pe.Node(Select(index=index), name=f"select_{echo.node_name}", run_without_submitting=True)
            sidecar = pe.Node(_MetadataSidecar(metadata=echo.metadata), name=f"sidecar_{echo.node_name}",
                              run_without_submitting=True)
            workflow.connect([(run_wf, pick, [("outputnode.echo_denoised", "inlist")]),
                              (run_wf, sidecar, [("outputnode.provenance_file", "provenance_file")])])
            outputs.append((echo, (pick, "out"), (sidecar, "out_file")))
        for series, denoised, provenance in outputs:
            sink = _sink_run(workflow, series, run_wf, denoised, provenance, output_dir, reports, noise_source)
            if run_maps:  # (each echo's like its noise map: the run's)
                workflow.connect([(run_wf, sink, [(f"outputnode.{name}", f"{name}_file") for name in run_maps])])
        if run.phase is not None:  # a magnitude/phase pair: the sink writes both parts
            sink.inputs.phase_source_file = run.phase.relpath
            sink.inputs.phase_metadata = run.phase.metadata
            workflow.connect([(run_wf, sink, [("outputnode.phase", "phase_file")])])
    return workflow


def _sink_run(workflow, run, run_wf, denoised, provenance, output_dir, reports, noise_source):
    """The ``DerivativesSink`` (and QC report) of one run, or one echo of a multi-echo run: ``denoised`` and
    ``provenance`` are an output of ``run_wf`` ("outputnode.x") or (node, output) pairs. Returns the sink."""
    from ..bids import DerivativesSink
    from ..reports import RunReport

    def connect(source, destination, field):
        node, output = (run_wf, source) if isinstance(source, str) else source
        workflow.connect(node, output, destination, field)

    sink = pe.Node(DerivativesSink(source_file=run.relpath, output_dir=str(output_dir)),
                   name=f"ds_{run.node_name}", run_without_submitting=True)
    if noise_source is not None:
        sink.inputs.noise_source = noise_source
    if run.bval is not None:
        sink.inputs.bval = str(run.bval)
        sink.inputs.bvec = str(run.bvec)
    connect(denoised, sink, "in_file")
    connect(provenance, sink, "sidecar_file")
    workflow.connect([(run_wf, sink, [("outputnode.noise", "noise_file"), ("outputnode.rank", "rank_file")])])
    if reports:
        report = pe.Node(RunReport(in_file=str(run.path), title=run.name), name=f"report_{run.node_name}")
        connect(denoised, report, "denoised_file")
        connect(provenance, report, "provenance_file")
        workflow.connect([(run_wf, report, [("outputnode.noise", "noise_file"), ("outputnode.rank", "rank_file")]),
                          (report, sink, [("figures", "figures")])])
    return sink


def series_shape(path):
    """The 4D shape from the NIfTI header (no data read); None when the header cannot be read (the node
    then fails with the reader's message)."""
    import nibabel as nib

    try:
        shape = nib.load(str(path)).shape
    except Exception:  # noqa: BLE001
        return None
    return tuple(shape) if len(shape) == 4 else None


def references_text(noise_floor="none", filter="hard", estimator=DEFAULTS["estimator"],  # noqa: A002
                    complex_data=False, complex_filter=None) -> str:
    """The references section of a workflow's methods text (``complex_filter``: that of the complex series,
    where it is not ``filter``)."""
    cited = [ESTIMATOR_REFERENCES.get(estimator, ""), FILTER_REFERENCES.get(filter, ""),
             FILTER_REFERENCES.get(complex_filter, "")]
    return ("\n### References\n\n" + REFERENCES + (NOISE_FLOOR_REFERENCES if noise_floor != "none" else "")
            + (COMPLEX_REFERENCES if complex_data else "") + "".join(dict.fromkeys(cited)))


def citation_text(workflow) -> str:
    """CITATION.md for a workflow built here: its methods paragraph and references."""
    return ("# Methods\n\n" + workflow.__desc__.replace("[@veraart2016]", "Veraart et al., 2016")
            .replace("[@cordero2019]", "Cordero-Grande et al., 2019").replace("[@koay2006]", "Koay and Basser, 2006")
            .replace("[@foi2011]", "Foi, 2011").replace("[@eichner2015]", "Eichner et al., 2015")
            .replace("[@gavish2014]", "Gavish and Donoho, 2014").replace("[@olesen2023]", "Olesen et al., 2023")
            + workflow.__postdesc__)


# --- the small interface that joins the input's metadata and the provenance (kept next to its only user)

class _MetadataSidecarInputSpec(BaseInterfaceInputSpec):
    metadata = traits.Dict(desc="the input's metadata")
    provenance_file = File(exists=True, mandatory=True, desc="provenance JSON from MPPCADenoise")


class _MetadataSidecarOutputSpec(TraitedSpec):
    out_file = File(exists=True, desc="JSON: the metadata plus MPPCADenoising (the provenance)")


class _MetadataSidecar(SimpleInterface):
    """Join the input's metadata and the provenance into one JSON sidecar."""

    input_spec = _MetadataSidecarInputSpec
    output_spec = _MetadataSidecarOutputSpec

    def _run_interface(self, runtime):
        import json
        from pathlib import Path

        from ..io import write_json_atomic

        metadata = dict(self.inputs.metadata) if isdefined(self.inputs.metadata) else {}
        provenance = json.loads(Path(self.inputs.provenance_file).read_text())
        out_file = str(Path(runtime.cwd) / "sidecar.json")
        write_json_atomic(out_file, {**metadata, "MPPCADenoising": provenance})
        self._results["out_file"] = out_file
        return runtime
