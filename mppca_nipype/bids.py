"""Everything BIDS: the dataset query, derivative names, dataset_description, sidecars and provenance.

The one place that names outputs. For a source run ``<entities>_<suffix>.nii[.gz]`` (``suffix`` is ``dwi``
or ``bold``) the derivative dataset holds, in the same sub-/ses-/datatype folder:

``<entities>_desc-denoised_<suffix>.nii.gz`` + ``.json``
    The denoised series and its sidecar: the source's metadata carried forward, ``Sources`` (``bids:raw:``
    URIs), ``Description``, ``SkullStripped`` and the provenance block ``MPPCADenoising``.
``<entities>_<suffix>.bval`` / ``.bvec`` (DWI only)
    Copies of the gradient table found through BIDS inheritance. They carry no ``desc`` entity because the
    BIDS validator accepts gradient files only under the raw naming rule; by the inheritance principle they
    apply to the ``desc-denoised`` series next to them.
``<entities>_desc-noise_<suffix>map.nii.gz`` and ``<entities>_desc-rank_<suffix>map.nii.gz`` + ``.json``
    3D maps of the noise standard deviation and of the number of signal components kept. BIDS has no
    suffix for such maps (``dwimap`` is the suffix BEP016 proposes for DWI-derived parameter maps), and a
    3D image named ``_bold``/``_dwi`` would be read as a (broken) series by BIDS tools and rejected by the
    validator (BOLD_NOT_4D, DWI_MISSING_BVAL). So they get a suffix no tool mistakes for a series, and the
    derivative's ``.bidsignore`` lists them (``BIDSIGNORE`` below), with ``logs/``.
``<entities>_desc-lambdaplus_<suffix>map.nii.gz``, ``<entities>_desc-varianceremoved_<suffix>map.nii.gz`` + ``.json``
    On request (``--lambda-plus``, ``--variance-removed``): the patches' Marchenko-Pastur upper edge and the
    variance removed from each voxel (``engine.maps``; ``REQUESTED_MAPS``), named and listed in ``.bidsignore``
    as the noise map.
``logs/CITATION.md``
    The methods boilerplate with its references.

A magnitude/phase pair (``<entities>_part-mag_<suffix>`` and ``<entities>_part-phase_<suffix>``, every other
entity the same: ``pair_parts``) is denoised as one complex series and written as both parts,
``<entities>_part-mag_desc-denoised_<suffix>`` and ``<entities>_part-phase_desc-denoised_<suffix>`` (+ ``.json``
each), with the maps and the gradient table named once for the pair, without ``part``: they belong to both parts
(BIDS asks a derivative to carry all its source's entities only when it comes from one raw file, and even then
lets go of those no longer relevant): ``<entities>_desc-noise_<suffix>map``, ``<entities>_<suffix>.bval``.

A given noise level (``--noise-in DIR``) is read from another derivative dataset in the same names: the
``desc-noise`` map of each run, as this app (or ``mppca-noise`` writing into those names) left it
(``given_noise_map``). That dataset is ``DatasetLinks["noise"]``, and each sidecar names its map as
``bids:noise:<path>`` in ``Sources``.
``sub-<label>/figures/<entities>_desc-<kind>_<suffix>.png`` and ``sub-<label>.html`` (unless --no-reports)
    The QC figures of each run (kinds: ``FIGURE_KINDS``; :mod:`mppca_nipype.reports` draws them) and one
    report page per subject, as fMRIPrep lays them out. Not BIDS files: ``.bidsignore`` lists them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
import hashlib
from importlib.metadata import PackageNotFoundError, version as package_version
import json
import os
from pathlib import Path, PurePosixPath
import re
import shutil
import subprocess
import tempfile

import numpy as np

from nipype.interfaces.base import (BaseInterfaceInputSpec, File, SimpleInterface, TraitedSpec, isdefined,
                                    traits)

from .engine.errors import MPPCAInputError
from .engine.maps import MAPS as REQUESTED_MAPS
from .io import (commit_together, file_lock, json_text, remove_stale_temporaries, staged_files,
                 write_json_atomic, write_text_atomic)

PIPELINE_NAME = "mppca-nipype"
CODE_URL = "https://github.com/mppca-nipype/mppca-nipype"
BIDS_VERSION = "1.10.0"

#: The series the app denoises: datatype -> suffix. Keys of a --bids-filter-file are the suffixes.
SERIES = {"dwi": "dwi", "func": "bold"}

#: Extra derivative outputs: kind -> (desc label, suffix ending, what the map holds).
MAPS = {
    "noise": ("noise", "map", "Noise standard deviation estimated by MP-PCA (same units as the input)"),
    "rank": ("rank", "map", "Number of signal components kept by MP-PCA (mean over the patches used)"),
    "lambda_plus": ("lambdaplus", "map", "Upper edge of the Marchenko-Pastur noise bulk of the patches, "
                    "sigma^2 (1 + sqrt(gamma))^2, in the input's units squared (combined as the noise map)"),
    "variance_removed": ("varianceremoved", "map", "Variance removed by MP-PCA: the mean over volumes of "
                         "(input - denoised)^2, in the input's units squared"),
}
#: The noise map's description when the noise level was given (``--noise-in``), not estimated.
GIVEN_NOISE_DESCRIPTION = ("Noise standard deviation given to MP-PCA (--noise-in), as the patches used it (the "
                           "mean over each patch, combined as the estimate is)")
#: The estimated noise map's description for a magnitude/phase pair.
COMPLEX_NOISE_DESCRIPTION = ("Noise standard deviation of each real channel of the complex series (magnitude and "
                             "phase), estimated by MP-PCA on its phase-demodulated real part (same units as the "
                             "magnitude)")
DENOISED_DESC = "denoised"

#: The sidecars' ``Description``: a series denoised alone, and the two parts of a magnitude/phase pair.
DESCRIPTIONS = {
    "denoised": "Denoised by Marchenko-Pastur PCA (MP-PCA); see logs/CITATION.md",
    "magnitude": ("Magnitude of the complex series (this run with its part-phase run) denoised by MP-PCA of its "
                  "phase-demodulated real part; see logs/CITATION.md"),
    "phase": ("Phase, in radians, of the complex series (this run with its part-mag run) denoised by MP-PCA of "
              "its phase-demodulated real part; see logs/CITATION.md"),
}

#: The ``part`` labels of a complex series' magnitude and phase (BIDS), which are denoised together.
PARTS = ("mag", "phase")

#: The ``DatasetLinks`` key of the derivative dataset that gave the noise maps (``--noise-in DIR``).
NOISE_LINK = "noise"

#: The QC figures of a run, in page order: each is ``desc-<kind>`` in the figure's name.
FIGURE_KINDS = ("slices", "maps", "residuals", "spectra")

#: What the derivative's .bidsignore lists: the noise/rank maps (no BIDS suffix exists for them), logs and the
#: QC reports. (bids-validator-deno 3.0 fails to match globs with a wildcard between fixed parts, such as
#: ``*_desc-noise_*map.*``; a leading and a trailing wildcard work. It reports the folder ``sub-01/figures/``
#: itself unless the entry names it without a trailing slash.)
BIDSIGNORE = ("*_desc-noise_*", "*_desc-rank_*", "*_desc-lambdaplus_*", "*_desc-varianceremoved_*", "logs/",
              "sub-*/figures", "sub-*.html")

#: Packages whose versions every provenance block records.
VERSIONED_PACKAGES = ("mppca-nipype", "numpy", "torch", "triton", "nvmath-python", "nipype", "pybids",
                      "nibabel")

_NIFTI = re.compile(r"(\.nii(\.gz)?)$")


# ------------------------------------------------------------------------------------------------ locks

#: Where the lock files live, inside OUTPUT_DIR (hidden; also the default work directory's parent).
LOCK_FOLDER = ".mppca-work/locks"


def output_lock(output_dir, name="dataset", **how):
    """The lock ``name`` of the derivative dataset in ``output_dir`` (a file in ``LOCK_FOLDER``).

    ``dataset`` guards the dataset-level files; ``run-<node name>`` one run's work and derivatives.
    ``how``: as for :func:`mppca_nipype.io.file_lock`."""
    return file_lock(Path(output_dir) / LOCK_FOLDER / f"{name}.lock", **how)


# ------------------------------------------------------------------------------------------ provenance

def package_versions() -> dict:
    """Versions of the packages that shape the result; 'not installed' for those absent."""
    versions = {}
    for name in VERSIONED_PACKAGES:
        try:
            versions[name] = package_version(name)
        except PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def sha256_file(path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def collect_provenance(result, in_file, *, parameters, wall_seconds, mask_file=None, mask=None,
                       warnings=(), timings=None) -> dict:
    """The provenance block of one run.

    Parameters
    ----------
    result : DenoiseResult
        Its ``info`` gives the resolved options, backend, device and engine timings.
    in_file : path
        The input series (its sha256 is recorded).
    parameters : dict
        The options as asked for (``extent`` may be 'auto'; ``info`` holds the resolved value).
    wall_seconds : float
        Time from reading the input to having the result.
    mask_file, mask : path and (X, Y, Z) bool array, optional
        The medians of the noise and rank maps are taken inside the mask (every voxel without one).
    warnings : list of str
        What the engine warned about.
    timings : dict, optional
        Seconds by phase of the run (``phases.Phases.as_dict()``: read, denoise with the engine's parts,
        write).
    """
    inside = np.ones(result.sigma.shape, bool) if mask is None else np.asarray(mask, bool)
    info = dict(result.info)
    return {
        "Parameters": dict(parameters),
        "Backend": info.get("backend"),
        "Device": info.get("device"),
        "EngineInfo": info,
        "SoftwareVersions": package_versions(),
        "WallTimeSeconds": round(float(wall_seconds), 3),
        "Timings": dict(timings or {}),
        "NoiseMedian": float(np.median(result.sigma[inside])) if inside.any() else None,
        "RankMedian": float(np.median(result.rank[inside])) if inside.any() else None,
        "InputFile": Path(in_file).name,
        "InputSHA256": sha256_file(in_file),
        "MaskFile": None if mask_file is None else Path(mask_file).name,
        "MaskSHA256": None if mask_file is None else sha256_file(mask_file),
        "Warnings": list(warnings),
    }


# ------------------------------------------------------------------------------------------------ names

def split_name(filename: str):
    """``sub-01_task-x_bold.nii.gz`` -> (["sub-01", "task-x"], "bold", ".nii.gz"); drops any ``desc``."""
    match = _NIFTI.search(filename)
    if match is None:
        raise MPPCAInputError(f"{filename} is not a NIfTI file")
    stem = filename[:match.start()]
    parts = stem.split("_")
    entities = [part for part in parts[:-1] if not part.startswith("desc-")]
    return entities, parts[-1], match.group(1)


def derivative_names(source_relpath, phase_relpath=None, maps=()) -> dict:
    """Paths, relative to OUTPUT_DIR, of every derivative of the raw run at ``source_relpath``.

    Keys: ``denoised``, ``denoised_json``, ``noise``, ``noise_json``, ``rank``, ``rank_json``, the maps written
    on request that ``maps`` names (``lambda_plus``, ``variance_removed``; each with its ``_json``), and for
    DWI ``bval``, ``bvec``. With ``phase_relpath``, the ``part-phase`` run paired with the ``part-mag`` run at
    ``source_relpath``, also ``phase`` and ``phase_json`` (the denoised phase: the phase run's name with
    ``desc-denoised``, in the magnitude's format), and the maps and gradient files are named once for the pair,
    without ``part``.
    """
    source = PurePosixPath(source_relpath)
    entities, suffix, extension = split_name(source.name)
    folder = source.parent
    shared = entities if phase_relpath is None else [e for e in entities if not e.startswith("part-")]

    def name(entities, desc, ending):
        return str(folder / "_".join([*entities, *([f"desc-{desc}"] if desc else []), ending]))

    names = {"denoised": name(entities, DENOISED_DESC, suffix) + extension,
             "denoised_json": name(entities, DENOISED_DESC, suffix) + ".json"}
    if phase_relpath is not None:
        phase_entities = split_name(PurePosixPath(phase_relpath).name)[0]
        names.update(phase=name(phase_entities, DENOISED_DESC, suffix) + extension,
                     phase_json=name(phase_entities, DENOISED_DESC, suffix) + ".json")
    for kind, (desc, ending, _) in MAPS.items():
        if kind in REQUESTED_MAPS and kind not in maps:
            continue
        names[kind] = name(shared, desc, suffix + ending) + extension
        names[f"{kind}_json"] = name(shared, desc, suffix + ending) + ".json"
    if suffix == "dwi":
        names["bval"] = name(shared, None, suffix) + ".bval"
        names["bvec"] = name(shared, None, suffix) + ".bvec"
    return names


def given_noise_map(source_relpath, noise_dir, phase_relpath=None) -> Path:
    """Where the noise map of the raw run at ``source_relpath`` (with its phase run ``phase_relpath``, for a
    magnitude/phase pair) lies in the derivative dataset ``noise_dir``: its ``desc-noise`` map under this app's
    name (``derivative_names``), ``.nii.gz`` or else ``.nii`` (the first that exists; the ``.nii.gz`` name when
    neither does)."""
    name = Path(noise_dir) / derivative_names(source_relpath, phase_relpath)["noise"]
    stem = _NIFTI.sub("", name.name)
    for candidate in (name.with_name(stem + ".nii.gz"), name.with_name(stem + ".nii")):
        if candidate.is_file():
            return candidate
    return name.with_name(stem + ".nii.gz")


def check_given_noise_maps(runs, noise_dir) -> dict:
    """{run.relpath: its noise map in ``noise_dir``} (``given_noise_map``), each checked to exist and to be a
    3D image on its run's grid (headers only); MPPCAInputError naming the first runs without a usable one."""
    import nibabel as nib

    maps, problems = {}, []
    for run in runs:
        path = given_noise_map(run.relpath, noise_dir, run.phase_relpath)
        if not path.is_file():
            problems.append(f"{run.name} has none ({path.relative_to(noise_dir)} is missing)")
            continue
        try:
            shape, grid = tuple(nib.load(str(path)).shape), tuple(nib.load(str(run.path)).shape[:3])
        except Exception as err:  # noqa: BLE001 - any unreadable header is the same problem to the user
            problems.append(f"{path.name} cannot be read ({' '.join(str(err).split())[:100]})")
            continue
        if shape[:3] != grid or len(shape) > 4 or (len(shape) == 4 and shape[3] != 1):
            problems.append(f"{path.name} has shape {shape}, but {run.name}'s grid is {grid}")
            continue
        maps[run.relpath] = path
    if problems:
        more = f"; and {len(problems) - 3} more" if len(problems) > 3 else ""
        raise MPPCAInputError(f"--noise-in {noise_dir} has no usable noise map for {len(problems)} of {len(runs)} "
                              f"runs: {'; '.join(problems[:3])}{more}")
    return maps


def noise_uri(noise_map, noise_dir) -> str:
    """A given noise map as a BIDS URI into the ``NOISE_LINK`` dataset: ``bids:noise:sub-01/...``."""
    return f"bids:{NOISE_LINK}:{PurePosixPath(Path(noise_map).resolve().relative_to(Path(noise_dir).resolve()))}"


def report_names(source_relpath) -> dict:
    """Paths, relative to OUTPUT_DIR, of the QC figures of the raw run at ``source_relpath``:
    {kind: ``sub-<label>/figures/<entities>_desc-<kind>_<suffix>.png``} for each of ``FIGURE_KINDS``.
    """
    source = PurePosixPath(source_relpath)
    entities, suffix, _ = split_name(source.name)
    folder = PurePosixPath(source.parts[0]) / "figures"
    return {kind: str(folder / "_".join([*entities, f"desc-{kind}", f"{suffix}.png"]))
            for kind in FIGURE_KINDS}


def subject_report_name(subject) -> str:
    """The report page of a subject, relative to OUTPUT_DIR: ``sub-<label>.html``."""
    return f"sub-{subject}.html"


def raw_uri(relpath) -> str:
    return f"bids:raw:{PurePosixPath(relpath)}"


# ------------------------------------------------------------------------------------------------ query

@dataclass
class Run:
    """One series found in the input dataset."""

    path: Path
    relpath: str
    datatype: str
    suffix: str
    entities: dict
    metadata: dict = field(default_factory=dict)
    bval: Path | None = None
    bvec: Path | None = None
    skip: str | None = None
    #: The ``part-phase`` run denoised with this ``part-mag`` run as one complex series (``pair_parts``).
    phase: Run | None = None
    #: Something to tell the user about how the run is denoised (a ``part-mag`` run without its phase).
    note: str | None = None
    #: With echo-1 of a multi-echo run: the runs of its other echoes, in echo order, denoised jointly with it
    #: (``pair_echoes``); each gets its own derivatives under its own name.
    echoes: list = field(default_factory=list)

    @property
    def name(self) -> str:
        return PurePosixPath(self.relpath).name

    @property
    def phase_relpath(self) -> str | None:
        """The paired phase run's path relative to BIDS_DIR (POSIX), or None."""
        return None if self.phase is None else self.phase.relpath

    @property
    def node_name(self) -> str:
        """A name Nipype accepts, unique within the dataset."""
        stem = _NIFTI.sub("", self.name)
        return re.sub(r"[^A-Za-z0-9]", "_", stem)


def dataset_fingerprint(bids_dir) -> str:
    """A digest of the dataset's file list (names, sizes, times): a changed dataset gets a fresh index."""
    digest = hashlib.sha256()
    root = Path(bids_dir)
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = sorted(d for d in subfolders if not d.startswith(".")
                               and not (Path(folder) == root and d in ("derivatives", "sourcedata", "code")))
        for name in sorted(files):
            stat = os.stat(os.path.join(folder, name))
            digest.update(f"{os.path.relpath(os.path.join(folder, name), root)}\0{stat.st_size}\0"
                          f"{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16]


def open_layout(bids_dir, work_dir):
    """A pybids BIDSLayout of ``bids_dir`` whose database lives in ``work_dir`` (reused while the dataset
    is unchanged). Nothing is written into ``bids_dir``.

    The database is built in a temporary folder and renamed into place, under a lock: concurrent runs
    sharing a work directory (the tasks of an array job) index the dataset once, and a run killed while
    indexing leaves no half-built database behind.
    """
    from bids import BIDSLayout

    database = Path(work_dir) / "bids_db" / dataset_fingerprint(bids_dir)
    database.parent.mkdir(parents=True, exist_ok=True)
    if not database.is_dir():
        with file_lock(database.parent / "index.lock"):
            if not database.is_dir():
                building = Path(tempfile.mkdtemp(prefix=f".{database.name}.", dir=database.parent))
                try:
                    BIDSLayout(str(bids_dir), validate=False, database_path=str(building))
                    os.replace(building, database)
                finally:
                    shutil.rmtree(building, ignore_errors=True)
    return BIDSLayout(str(bids_dir), validate=False, database_path=str(database))


def _label(value: str, prefix: str) -> str:
    return value[len(prefix):] if value.startswith(prefix) else value


def normalise_labels(labels, prefix):
    """Labels given with or without their prefix (``sub-01`` or ``01``) -> bare labels, or None."""
    if not labels:
        return None
    return [_label(str(label), prefix) for label in labels]


def check_filters(filters, layout) -> dict:
    """Validate a pybids-style filter dict ({"dwi": {...}, "bold": {...}}); turn null/"*" into queries."""
    from bids.layout import Query

    if not isinstance(filters, dict):
        raise MPPCAInputError("the BIDS filter file must hold a JSON object such as {\"bold\": {\"task\": \"rest\"}}")
    known = set(layout.get_entities()) | {"extension", "suffix", "datatype", "subject", "session"}
    checked = {}
    for key, query in filters.items():
        if key not in SERIES.values():
            raise MPPCAInputError(
                f"the BIDS filter file has a key {key!r}; the keys are {' and '.join(SERIES.values())}")
        if not isinstance(query, dict):
            raise MPPCAInputError(f"the BIDS filter file's {key!r} entry must be an object of entity: value")
        unknown = sorted(set(query) - known)
        if unknown:
            raise MPPCAInputError(f"the BIDS filter file names unknown entities: {', '.join(unknown)}")
        checked[key] = {entity: Query.NONE if value is None else Query.ANY if value == "*" else value
                        for entity, value in query.items()}
    return checked


def query_runs(layout, *, participants=None, sessions=None, datatypes=("dwi", "func"), filters=None):
    """Every DWI and BOLD run the labels and filters select, in a stable order.

    DWI runs get their ``.bval``/``.bvec`` through BIDS inheritance. Magnitude/phase runs are paired
    (``pair_parts``): a ``part-mag`` run carries its ``part-phase`` run as ``phase``, and the phase run is not
    listed on its own. The echoes of a multi-echo (``echo-``) run come back as one run, its first echo, holding
    the others (``pair_echoes``). Multi-echo magnitude/phase runs, real/imaginary (``part-real``,
    ``part-imag``) and unpaired ``part-phase`` runs, and DWI runs without a gradient table, come back with
    ``skip`` set to the reason.
    """
    filters = filters or {}
    runs, echoes = [], []
    for datatype in datatypes:
        suffix = SERIES[datatype]
        query = dict(datatype=datatype, suffix=suffix, extension=[".nii.gz", ".nii"])
        if participants:
            query["subject"] = participants
        if sessions:
            query["session"] = sessions
        query.update(filters.get(suffix, {}))
        for bids_file in layout.get(return_type="object", invalid_filters="allow", **query):
            path = Path(bids_file.path)
            entities = {k: v for k, v in bids_file.get_entities().items() if k not in ("extension",)}
            run = Run(path=path, relpath=PurePosixPath(path.relative_to(layout.root)).as_posix(),
                      datatype=datatype, suffix=suffix, entities=entities,
                      metadata=dict(layout.get_metadata(str(path))))
            if "echo" in entities and "part" in entities:
                run.skip = ("multi-echo magnitude/phase (echo- and part-) runs are not denoised yet (the echoes "
                            "are denoised jointly as magnitude series only)")
            elif "part" in entities and entities["part"] not in PARTS:
                run.skip = (f"part-{entities['part']} runs are not denoised (complex data are denoised from "
                            "part-mag and part-phase pairs)")
            elif entities.get("part") == "phase":
                pass  # denoised with its magnitude, with the magnitude's gradient table
            elif datatype == "dwi":
                bval, bvec = layout.get_bval(str(path)), layout.get_bvec(str(path))
                if not bval or not bvec:
                    run.skip = "no .bval/.bvec found for it"
                else:
                    run.bval, run.bvec = Path(bval), Path(bvec)
            (echoes if "echo" in entities and run.skip is None else runs).append(run)
    runs += pair_echoes(echoes)
    runs.sort(key=lambda run: run.relpath)
    return pair_parts(runs)


def pair_parts(runs) -> list:
    """``runs`` with each ``part-mag`` run paired with the ``part-phase`` run of the same datatype and every other
    entity the same: the magnitude run carries it as ``phase`` (one complex series to denoise) and the phase run
    is no longer listed. A ``part-mag`` run without its phase is denoised as a magnitude series (``note`` says
    so); a ``part-phase`` run without its magnitude gets ``skip``. So does a pair whose maps, named once for the
    pair without ``part`` (``derivative_names``), would take another run's map names."""
    def pair_key(run):
        return run.datatype, run.suffix, tuple(sorted((k, str(v)) for k, v in run.entities.items() if k != "part"))

    parts = {}  # pair key -> {"mag": run, "phase": run}
    for run in runs:
        if run.entities.get("part") in PARTS and "echo" not in run.entities:
            parts.setdefault(pair_key(run), {})[run.entities["part"]] = run
    kept = []
    for run in runs:
        part = run.entities.get("part") if run.skip is None else None
        if part == "mag":
            run.phase = parts[pair_key(run)].get("phase")
            if run.phase is None:
                run.note = ("no part-phase run with the same entities was selected: denoised as a magnitude "
                            "series, without its phase")
        elif part == "phase":
            magnitude = parts[pair_key(run)].get("mag")
            if magnitude is None:
                run.skip = "no part-mag run with the same entities was selected (a phase alone is not denoised)"
            elif magnitude.skip is not None:
                run.skip = f"its part-mag run {magnitude.name} is skipped"
            else:
                continue  # denoised with its magnitude
        kept.append(run)
    # the maps of a pair are named without part: they must not take the names of another run's
    owners = {}
    for run in kept:
        if run.skip is None:
            owners.setdefault(derivative_names(run.relpath, run.phase_relpath)["noise"], []).append(run)
    for clashing in (group for group in owners.values() if len(group) > 1):
        for run in clashing:
            if run.phase is not None:
                others = ", ".join(other.name for other in clashing if other is not run)
                run.skip = (f"its noise and rank maps, named once for the pair with {run.phase.name} (without "
                            f"part-), would take the names of {others}'s")
    return kept


def pair_echoes(echo_runs) -> list:
    """The echoes of each multi-echo run, paired: runs that differ only in their ``echo`` entity form one run,
    the first echo holding the others in ``echoes`` (echo order; their shapes are checked when read). One
    echo alone comes back with ``skip`` set: it cannot be denoised jointly."""
    groups = {}
    for run in echo_runs:
        key = (run.datatype, tuple(sorted((k, str(v)) for k, v in run.entities.items() if k != "echo")))
        groups.setdefault(key, []).append(run)
    paired = []
    for group in groups.values():
        group.sort(key=lambda run: (int(run.entities["echo"]) if str(run.entities["echo"]).isdigit()
                                    else 0, str(run.entities["echo"])))
        first, *others = group
        if not others:
            first.skip = "only one echo of this multi-echo run was found (the echoes are denoised jointly)"
        first.echoes = others
        paired.append(first)
    return paired


# ------------------------------------------------------------------------------------ dataset-level files

def dataset_description(bids_dir, noise_dir=None) -> dict:
    """The derivative's dataset_description.json; ``noise_dir``: the dataset that gave the noise maps, linked as
    ``NOISE_LINK``."""
    from . import __version__

    raw_path = Path(bids_dir) / "dataset_description.json"
    try:
        raw = json.loads(raw_path.read_text())
    except (OSError, ValueError):
        raw = {}
    source = {"URL": Path(bids_dir).resolve().as_uri()}
    if raw.get("DatasetDOI"):
        source["DOI"] = raw["DatasetDOI"]
    sources, links = [source], {"raw": Path(bids_dir).resolve().as_uri()}
    if noise_dir is not None:
        links[NOISE_LINK] = Path(noise_dir).resolve().as_uri()
        sources.append({"URL": links[NOISE_LINK]})
    return {
        "Name": f"MP-PCA denoised: {raw.get('Name', Path(bids_dir).name)}",
        "BIDSVersion": BIDS_VERSION,
        "DatasetType": "derivative",
        "GeneratedBy": [{"Name": PIPELINE_NAME, "Version": __version__, "CodeURL": CODE_URL}],
        "SourceDatasets": sources,
        "DatasetLinks": links,
        "HowToAcknowledge": "Cite Veraart et al. 2016 and Cordero-Grande et al. 2019; "
                            "logs/CITATION.md has a methods paragraph.",
    }


def owner_of(output_dir):
    """The pipeline that made the dataset in ``output_dir`` (None when there is none or it is ours)."""
    path = Path(output_dir) / "dataset_description.json"
    if not path.exists():
        return None
    try:
        generated = json.loads(path.read_text()).get("GeneratedBy") or [{}]
        name = generated[0].get("Name")
    except (OSError, ValueError, AttributeError, IndexError):
        return "an unreadable dataset_description.json"
    return None if name == PIPELINE_NAME else (name or "another tool")


def write_dataset_files(output_dir, bids_dir, citation: str, noise_dir=None):
    """dataset_description.json, .bidsignore, README.md (when absent) and logs/CITATION.md.

    Under the dataset lock, each file written atomically: runs sharing OUTPUT_DIR (an array job's tasks)
    never see or leave a half-written one, and .bidsignore's read-modify-write loses no line.
    """
    output_dir = Path(output_dir)
    (output_dir / "logs").mkdir(parents=True, exist_ok=True)
    with output_lock(output_dir, "dataset"):
        files = [output_dir / name for name in ("dataset_description.json", ".bidsignore", "README.md")]
        for path in files + [output_dir / "logs" / "CITATION.md"]:
            remove_stale_temporaries(path)
        write_json_atomic(output_dir / "dataset_description.json", dataset_description(bids_dir, noise_dir))
        ignore = output_dir / ".bidsignore"
        lines = ignore.read_text().splitlines() if ignore.exists() else []
        write_text_atomic(ignore, "\n".join(lines + [p for p in BIDSIGNORE if p not in lines]) + "\n")
        readme = output_dir / "README.md"
        if not readme.exists():
            write_text_atomic(readme, README)
        write_text_atomic(output_dir / "logs" / "CITATION.md", citation)


README = """# MP-PCA denoised derivatives (mppca-nipype)

Each DWI and BOLD run of the source dataset, denoised by Marchenko-Pastur PCA:

- `*_desc-denoised_<dwi|bold>.nii.gz` and `.json`: the denoised series; the sidecar carries the source's
  metadata forward and records every parameter, the backend and device, library versions, timings, noise
  and rank summaries and the input's sha256 under `MPPCADenoising`.
- `*_part-mag_desc-denoised_*` and `*_part-phase_desc-denoised_*`: a magnitude/phase pair, denoised as one
  complex series (the phase in radians); its maps and gradient table are named once, without `part-`.
- `*_dwi.bval` / `*_dwi.bvec`: the gradient table (applies to the denoised series by BIDS inheritance).
- `*_desc-noise_<dwi|bold>map.nii.gz`, `*_desc-rank_<dwi|bold>map.nii.gz`: noise standard deviation and
  number of signal components (BIDS has no suffix for these; listed in `.bidsignore`); on request
  `*_desc-lambdaplus_<dwi|bold>map.nii.gz` and `*_desc-varianceremoved_<dwi|bold>map.nii.gz`, the patches'
  Marchenko-Pastur upper edge and the variance removed, likewise.
- `logs/CITATION.md`: a methods paragraph with references.
- `sub-<label>.html` and `sub-<label>/figures/`: a QC report per subject (input, denoised and residual
  slices, noise and rank maps, residual histogram, eigenvalue spectra); listed in `.bidsignore`.
"""


# --------------------------------------------------------------------------------------- derivative sink

class _DerivativesSinkInputSpec(BaseInterfaceInputSpec):
    source_file = traits.Str(mandatory=True, desc="the raw run, relative to BIDS_DIR (POSIX)")
    output_dir = traits.Str(mandatory=True, desc="the derivative dataset's root")
    in_file = File(exists=True, mandatory=True, desc="denoised series")
    noise_file = File(exists=True, mandatory=True, desc="noise map")
    rank_file = File(exists=True, mandatory=True, desc="rank map")
    lambda_plus_file = File(exists=True, desc="map of the patches' Marchenko-Pastur upper edge, when asked for")
    variance_removed_file = File(exists=True, desc="map of the variance removed, when asked for")
    sidecar_file = File(exists=True, mandatory=True,
                        desc="JSON from init_mppca_wf's outputnode.provenance: the source's metadata and the "
                             "provenance block MPPCADenoising")
    bval = File(exists=True, desc="DWI b-values")
    bvec = File(exists=True, desc="DWI gradient directions")
    figures = traits.List(File(exists=True), desc="QC figures named <kind>.png (reports.RunReport)")
    noise_source = traits.Str(desc="the given noise map as a BIDS URI (``noise_uri``): added to the sidecar's "
                                   "Sources and to its provenance as NoiseInSource")
    phase_source_file = traits.Str(desc="the raw part-phase run paired with source_file, relative to BIDS_DIR "
                                        "(POSIX): the pair's derivatives are named as derivative_names names them")
    phase_file = File(exists=True, desc="with phase_source_file: the denoised phase (radians)")
    phase_metadata = traits.Dict(desc="with phase_source_file: the phase run's metadata, carried forward into the "
                                      "denoised phase's sidecar")


class _DerivativesSinkOutputSpec(TraitedSpec):
    out_file = File(desc="the denoised series in the derivative dataset")
    out_files = traits.List(File, desc="every file written")


class DerivativesSink(SimpleInterface):
    """Write one run's derivatives into OUTPUT_DIR under the names ``derivative_names`` gives, atomically.

    Like Nipype's DataSink it always runs, so that deleted outputs come back on a rerun.
    """

    input_spec = _DerivativesSinkInputSpec
    output_spec = _DerivativesSinkOutputSpec
    always_run = True

    def _run_interface(self, runtime):
        root = Path(self.inputs.output_dir)
        phase_source = self.inputs.phase_source_file if isdefined(self.inputs.phase_source_file) else None
        asked = [kind for kind in REQUESTED_MAPS if isdefined(getattr(self.inputs, f"{kind}_file"))]
        names = derivative_names(self.inputs.source_file, phase_source, maps=asked)
        # the pair's files derive from both parts: each part's own raw run first (reports.write_subject_report)
        sources = [raw_uri(self.inputs.source_file), *([raw_uri(phase_source)] if phase_source else [])]
        sidecar = json.loads(Path(self.inputs.sidecar_file).read_text())
        provenance = sidecar.pop("MPPCADenoising", None)
        given = ((provenance or {}).get("EngineInfo") or {}).get("noise") == "given"
        if isdefined(self.inputs.noise_source):
            sources.append(self.inputs.noise_source)
            if provenance is not None:
                provenance["NoiseInSource"] = self.inputs.noise_source
        sidecar.update({"Sources": sources,
                        "Description": DESCRIPTIONS["magnitude" if phase_source else "denoised"],
                        "SkullStripped": False, "MPPCADenoising": provenance})
        noise_description = (GIVEN_NOISE_DESCRIPTION if given else COMPLEX_NOISE_DESCRIPTION if phase_source
                             else MAPS["noise"][2])
        # what goes where: (key, a file to copy or JSON to write); the denoised series comes last, so a
        # run whose series is there has all its files
        contents = [("noise", self.inputs.noise_file), ("rank", self.inputs.rank_file),
                    ("noise_json", {"Description": noise_description, "Sources": sources}),
                    ("rank_json", {"Description": MAPS["rank"][2], "Sources": sources})]
        for kind in asked:
            contents += [(kind, getattr(self.inputs, f"{kind}_file")),
                         (f"{kind}_json", {"Description": MAPS[kind][2], "Sources": sources})]
        if "bval" in names and isdefined(self.inputs.bval) and isdefined(self.inputs.bvec):
            contents += [("bval", self.inputs.bval), ("bvec", self.inputs.bvec)]
        if isdefined(self.inputs.figures):  # QC figures <kind>.png from reports.RunReport
            names.update(report_names(self.inputs.source_file))
            contents += [(Path(figure).stem, figure) for figure in self.inputs.figures]
        if phase_source:
            metadata = dict(self.inputs.phase_metadata) if isdefined(self.inputs.phase_metadata) else {}
            phase_sidecar = {**metadata, "Units": "rad", "Sources": [sources[1], sources[0], *sources[2:]],
                             "Description": DESCRIPTIONS["phase"], "SkullStripped": False,
                             "MPPCADenoising": provenance}
            contents += [("phase_json", phase_sidecar), ("phase", self.inputs.phase_file)]
        contents += [("denoised_json", sidecar), ("denoised", self.inputs.in_file)]

        # stage every file beside its destination, then rename them all at once (SIGTERM held off):
        # a run killed at any point leaves either all of its derivatives or none it did not have before
        # (stale temporaries of a killed run are cleared: the app holds this run's lock)
        destinations = [root / names[key] for key, _ in contents]
        with staged_files(destinations, commit=commit_together, clear_stale=True, make_folders=True) as staged:
            for (_, content), path in zip(contents, destinations):
                if isinstance(content, dict):
                    staged[path].write_text(json_text(content))
                else:
                    shutil.copyfile(content, staged[path])
        written = [str(path) for path in destinations]
        self._results.update(out_file=written[-1], out_files=written)
        return runtime


# ------------------------------------------------------------------------------------------ the validator

def validator_command():
    """The BIDS validator's executable (``bids-validator-deno`` from PyPI), or None when not installed."""
    return shutil.which("bids-validator-deno") or shutil.which("bids-validator")


def validate(dataset, timeout=600):
    """Run the BIDS validator on ``dataset``.

    Returns ``(errors, note)``: ``errors`` is a list of ``"CODE at /path"`` strings (None when the validator
    could not run) and ``note`` says why it could not.
    """
    command = validator_command()
    if command is None:
        return None, "the BIDS validator is not installed (pip install bids-validator-deno)"
    try:
        done = subprocess.run([command, "--format", "json", str(dataset)], capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL)
        report = json.loads(done.stdout)
        issues = report["issues"]["issues"]
    except subprocess.TimeoutExpired:
        return None, f"the BIDS validator did not finish within {timeout} s"
    except (OSError, ValueError, KeyError, TypeError):
        return None, "the BIDS validator could not run"
    errors = [f"{issue.get('code')} at {issue.get('location', '/')}" for issue in issues
              if issue.get("severity") == "error"]
    return errors, None
