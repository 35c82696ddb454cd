"""``mppca-nipype BIDS_DIR OUTPUT_DIR participant``: derivatives, provenance, filters, reruns, exit codes."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
from pathlib import Path, PurePosixPath

import nibabel as nib
import numpy as np
import pytest

from bids_helpers import N_BOLD, N_DWI, SHAPE, checksums, make_dataset, read_json, validator_errors
from mppca_nipype import __version__, denoise, denoise_complex
from mppca_nipype.bids import SERIES, Run, derivative_names, pair_parts
from mppca_nipype.engine import DEFAULTS
from mppca_nipype.cli.bids_app import EXIT, main
from mppca_nipype.demo import write_series
from mppca_nipype.io import write_json_atomic
from mppca_nipype.phantoms import complex_dwi_phantom

FAST = ["--nprocs", "1", "--device", "cpu"]


def run_app(capsys, *args):
    """Run the app in this process; return (exit status, stdout, stderr)."""
    with pytest.raises(SystemExit) as stopped:
        main([str(a) for a in args])
    captured = capsys.readouterr()
    return stopped.value.code, captured.out, captured.err


def produced(output_dir):
    """Derivative files, relative to OUTPUT_DIR, without the work directory."""
    return sorted(str(p.relative_to(output_dir)) for p in Path(output_dir).rglob("*")
                  if p.is_file() and ".mppca-work" not in p.parts and "figures" not in p.parts
                  and p.suffix != ".html")


def run_files(stem, suffix):
    names = [f"{stem}_desc-denoised_{suffix}.nii.gz", f"{stem}_desc-denoised_{suffix}.json",
             f"{stem}_desc-noise_{suffix}map.nii.gz", f"{stem}_desc-noise_{suffix}map.json",
             f"{stem}_desc-rank_{suffix}map.nii.gz", f"{stem}_desc-rank_{suffix}map.json"]
    if suffix == "dwi":
        names += [f"{stem}_dwi.bval", f"{stem}_dwi.bvec"]
    return names


def expected_outputs(subjects=("01", "02"), datatypes=("dwi", "func"), runs=(1, 2)):
    files = []
    for subject in subjects:
        folder = f"sub-{subject}/ses-1"
        stem = f"sub-{subject}_ses-1"
        if "dwi" in datatypes:
            files += [f"{folder}/dwi/{name}" for name in run_files(stem, "dwi")]
        if "func" in datatypes:
            for run in runs:
                files += [f"{folder}/func/{name}" for name in run_files(f"{stem}_task-rest_run-{run}", "bold")]
    return sorted(files + [".bidsignore", "README.md", "dataset_description.json", "logs/CITATION.md"])


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = make_dataset(tmp_path_factory.mktemp("raw") / "bids")
    return root, checksums(root)


def module_run(bids_dir, tmp_path_factory, *args):
    """The app on ``bids_dir`` into a fresh OUTPUT_DIR, for a module-scoped fixture (no capsys there); returns
    (OUTPUT_DIR, exit status, stderr)."""
    output_dir = tmp_path_factory.mktemp("out") / "derivatives"
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as stopped:
        main([str(bids_dir), str(output_dir), "participant", *args, *FAST])
    return output_dir, stopped.value.code, err.getvalue()


@pytest.fixture(scope="module")
def full_run(dataset, tmp_path_factory):
    """The app on the whole dataset (validation of the input included), run once for several tests."""
    return module_run(dataset[0], tmp_path_factory)


# ------------------------------------------------------------------------------------------ derivatives

def test_every_run_is_denoised_into_the_derivative_dataset(full_run):
    output_dir, status, err = full_run
    assert status == EXIT["ok"], err
    assert produced(output_dir) == expected_outputs()
    assert "[6/6] denoised" in err


def test_the_outputs_pass_the_bids_validator(full_run):
    output_dir, status, _ = full_run
    assert status == 0
    assert validator_errors(output_dir) == []


def test_the_input_dataset_is_unchanged(dataset, full_run):
    bids_dir, before = dataset
    assert full_run[1] == 0
    assert checksums(bids_dir) == before


def test_dataset_description_names_the_pipeline_and_the_raw_dataset(dataset, full_run):
    description = read_json(full_run[0] / "dataset_description.json")
    assert description["DatasetType"] == "derivative"
    assert description["GeneratedBy"][0] == {"Name": "mppca-nipype", "Version": __version__,
                                             "CodeURL": "https://github.com/mppca-nipype/mppca-nipype"}
    assert description["DatasetLinks"]["raw"] == dataset[0].resolve().as_uri()
    assert description["SourceDatasets"] == [{"URL": dataset[0].resolve().as_uri()}]


def test_bold_sidecar_carries_inherited_metadata_sources_and_provenance(dataset, full_run):
    bids_dir, _ = dataset
    source = "sub-02/ses-1/func/sub-02_ses-1_task-rest_run-2_bold.nii.gz"
    sidecar = read_json(full_run[0] / "sub-02/ses-1/func/sub-02_ses-1_task-rest_run-2_desc-denoised_bold.json")
    assert sidecar["TaskName"] == "rest" and sidecar["RepetitionTime"] == 2.0  # from the top-level sidecar
    assert sidecar["Sources"] == [f"bids:raw:{source}"]
    assert sidecar["SkullStripped"] is False and "MP-PCA" in sidecar["Description"]
    provenance = sidecar["MPPCADenoising"]
    assert provenance["InputSHA256"] == hashlib.sha256((bids_dir / source).read_bytes()).hexdigest()
    assert provenance["Parameters"]["stride"] == DEFAULTS["stride"] and provenance["Parameters"]["use_gpu"] is False
    assert provenance["Backend"] == "cpu" and provenance["Device"] == "cpu"
    assert provenance["SoftwareVersions"]["mppca-nipype"] == __version__
    assert provenance["NoiseMedian"] > 0 and provenance["RankMedian"] > 0


def test_dwi_gradients_found_through_inheritance_are_copied(dataset, full_run):
    bids_dir, _ = dataset
    folder = full_run[0] / "sub-01/ses-1/dwi"
    assert (folder / "sub-01_ses-1_dwi.bval").read_bytes() == (bids_dir / "dwi.bval").read_bytes()
    assert (folder / "sub-01_ses-1_dwi.bvec").read_bytes() == (bids_dir / "dwi.bvec").read_bytes()


def test_the_derivative_is_what_the_engine_computes(dataset, full_run):
    bids_dir, _ = dataset
    raw = nib.load(bids_dir / "sub-01/ses-1/dwi/sub-01_ses-1_dwi.nii.gz")
    expected = denoise(raw.get_fdata(dtype=np.float32), device="cpu", nprocs=1)
    folder = full_run[0] / "sub-01/ses-1/dwi"
    denoised = nib.load(folder / "sub-01_ses-1_desc-denoised_dwi.nii.gz")
    assert denoised.shape == (*SHAPE, N_DWI)
    np.testing.assert_allclose(denoised.get_fdata(), expected.denoised, rtol=0, atol=1e-3)
    np.testing.assert_allclose(nib.load(folder / "sub-01_ses-1_desc-noise_dwimap.nii.gz").get_fdata(),
                               expected.sigma, rtol=0, atol=1e-4)
    assert nib.load(full_run[0] / "sub-01/ses-1/func/sub-01_ses-1_task-rest_run-1_desc-denoised_bold.nii.gz"
                    ).header.get_zooms()[3] == 2.0


def test_citation_has_the_methods_and_both_references(full_run):
    text = (full_run[0] / "logs" / "CITATION.md").read_text()
    assert "Marchenko-Pastur" in text and "Veraart" in text and "Cordero-Grande" in text


# ------------------------------------------------------------------------------------------------ reruns

def test_a_rerun_reuses_the_cache_and_restores_deleted_outputs(dataset, tmp_path, capsys):
    bids_dir, before = dataset
    args = [bids_dir, tmp_path / "out", "participant", "--participant-label", "01", "--datatype", "dwi",
            "--skip-bids-validation", *FAST]
    assert run_app(capsys, *args)[0] == 0
    node_file = next((tmp_path / "out" / ".mppca-work").rglob("sub-01_ses-1_dwi_denoised.nii.gz"))
    cached = node_file.stat().st_mtime_ns
    derivative = tmp_path / "out/sub-01/ses-1/dwi/sub-01_ses-1_desc-denoised_dwi.nii.gz"
    derivative.unlink()
    status, _, err = run_app(capsys, *args)
    assert status == 0, err
    assert derivative.exists(), "the sink always runs: a deleted derivative comes back"
    assert node_file.stat().st_mtime_ns == cached, "the denoising itself is served from the cache"
    assert produced(tmp_path / "out") == expected_outputs(subjects=("01",), datatypes=("dwi",))
    assert checksums(bids_dir) == before


def test_the_workflow_runs_with_the_objects_made_before_it_out_of_the_collectors_reach(dataset, tmp_path, capsys,
                                                                                        monkeypatch):
    """Nipype's MultiProc collects garbage before each round of submissions: the modules, the dataset's index
    and the workflow are frozen first (gc.freeze), so that each collection skips them; thawed after."""
    import gc

    from nipype.pipeline.engine import Workflow

    frozen = []
    run = Workflow.run

    def recorded(self, *args, **kwargs):
        frozen.append(gc.get_freeze_count())
        return run(self, *args, **kwargs)

    monkeypatch.setattr(Workflow, "run", recorded)
    before = gc.get_freeze_count()
    code, _, err = run_app(capsys, dataset[0], tmp_path / "out", "participant", "--participant-label", "01",
                           "--datatype", "dwi", "--skip-bids-validation", *FAST)
    assert code == 0, err
    assert len(frozen) == 1 and frozen[0] > before + 10_000
    assert gc.get_freeze_count() == before


def test_the_nodes_processes_start_from_a_fork_server_that_imported_their_modules(dataset, tmp_path, capsys):
    """Where MultiProc's workers start through ``forkserver`` (with GPUs, or asked for), the server starts
    before the workflow is built, with the modules a node needs imported, and the nodes run from it."""
    from argparse import Namespace
    from multiprocessing import forkserver

    from mppca_nipype.cli.bids_app import NODE_MODULES, node_start_method

    multiproc = Namespace(plugin="MultiProc", plugin_args={})
    assert node_start_method(multiproc, use_gpu=True) == "forkserver"
    assert node_start_method(multiproc, use_gpu=False) is None
    assert node_start_method(Namespace(plugin="MultiProc", plugin_args={"mp_context": "spawn"}), True) == "spawn"
    assert node_start_method(Namespace(plugin="Linear", plugin_args={}), True) is None
    code, _, err = run_app(capsys, dataset[0], tmp_path / "out", "participant", "--participant-label", "01",
                           "--datatype", "dwi", "--skip-bids-validation", "--plugin-args",
                           '{"mp_context": "forkserver"}', *FAST)
    assert code == 0, err
    assert forkserver._forkserver._preload_modules == ["__main__", *NODE_MODULES]
    assert forkserver._forkserver._forkserver_pid is not None
    assert produced(tmp_path / "out") == expected_outputs(subjects=("01",), datatypes=("dwi",))


# ------------------------------------------------------------------------------------------------ filters

@pytest.mark.parametrize("label", ["02", "sub-02"])
def test_participant_label_with_or_without_prefix(dataset, tmp_path, capsys, label):
    status, _, err = run_app(capsys, dataset[0], tmp_path / "out", "participant", "--participant-label", label,
                             "--datatype", "dwi", "--skip-bids-validation", *FAST)
    assert status == 0, err
    assert produced(tmp_path / "out") == expected_outputs(subjects=("02",), datatypes=("dwi",))


def test_denoising_options_reach_every_run(dataset, tmp_path, capsys):
    status, _, err = run_app(capsys, dataset[0], tmp_path / "out", "participant", "--participant-label", "01",
                             "--datatype", "dwi", "--extent", "3,3,5", "--stride", "1", "--aggregation",
                             "center", "--demean", "none", "--estimator", "exp1", "--skip-bids-validation",
                             *FAST)
    assert status == 0, err
    provenance = read_json(tmp_path / "out/sub-01/ses-1/dwi/sub-01_ses-1_desc-denoised_dwi.json")["MPPCADenoising"]
    assert provenance["EngineInfo"]["extent"] == [3, 3, 5]
    assert {k: provenance["EngineInfo"][k] for k in ("stride", "aggregation", "demean", "estimator")} == dict(
        stride=1, aggregation="center", demean="none", estimator="exp1")
    assert "centred on every voxel" in (tmp_path / "out/logs/CITATION.md").read_text()


def test_the_patch_shape_reaches_every_run_and_its_provenance(dataset, tmp_path, capsys):
    status, _, err = run_app(capsys, dataset[0], tmp_path / "out", "participant", "--participant-label", "01",
                             "--datatype", "dwi", "--shape", "sphere", "--extent", "3", "--skip-bids-validation",
                             *FAST)
    assert status == 0, err
    provenance = read_json(tmp_path / "out/sub-01/ses-1/dwi/sub-01_ses-1_desc-denoised_dwi.json")["MPPCADenoising"]
    assert provenance["Parameters"]["shape"] == "sphere"
    assert provenance["EngineInfo"]["shape"] == "sphere" and provenance["EngineInfo"]["extent"] == [5, 5, 5]
    assert "spheres (the voxels within a Euclidean radius" in (tmp_path / "out/logs/CITATION.md").read_text()


def test_a_sphere_larger_than_a_runs_image_is_refused_before_any_run(dataset, tmp_path, capsys):
    """The default extent (wide: 7^3 = 343 voxels) takes spheres of radius 5, cubes of 11: larger than the
    10x10x8 images."""
    status, _, err = run_app(capsys, dataset[0], tmp_path / "out", "participant", "--participant-label", "01",
                             "--datatype", "dwi", "--shape", "sphere", "--skip-bids-validation", *FAST)
    assert_clean_failure(err, status, EXIT["usage"])
    assert ("sub-01/ses-1/dwi/sub-01_ses-1_dwi.nii.gz: a sphere of radius 5 (515 voxels, at least the 343 of "
            "extent 7,7,7) needs 11 voxels along every axis, and the image is 10x10x8") in err
    assert not list((tmp_path / "out").glob("sub-*"))


@pytest.mark.parametrize("label", ["1", "ses-1"])
def test_session_label_with_or_without_prefix(dataset, tmp_path, capsys, label):
    status, _, err = run_app(capsys, dataset[0], tmp_path / "out", "participant", "--session-label", label,
                             "--participant-label", "sub-01", "--datatype", "dwi", "--skip-bids-validation",
                             *FAST)
    assert status == 0, err
    assert produced(tmp_path / "out") == expected_outputs(subjects=("01",), datatypes=("dwi",))


def test_bids_filter_file_selects_runs(dataset, tmp_path, capsys):
    filters = tmp_path / "filters.json"
    filters.write_text(json.dumps({"bold": {"run": 2}}))
    status, _, err = run_app(capsys, dataset[0], tmp_path / "out", "participant", "--datatype", "func",
                             "--participant-label", "01", "--bids-filter-file", filters,
                             "--skip-bids-validation", *FAST)
    assert status == 0, err
    assert produced(tmp_path / "out") == expected_outputs(subjects=("01",), datatypes=("func",), runs=(2,))


def test_real_imaginary_and_multi_echo_complex_runs_are_listed_and_skipped(tmp_path, capsys):
    root = make_dataset(tmp_path / "bids", subjects=("01",))
    func = root / "sub-01/ses-1/func"
    data = nib.load(func / "sub-01_ses-1_task-rest_run-1_bold.nii.gz").get_fdata(dtype=np.float32)
    for name in ("task-mx_echo-1_part-mag", "task-mx_echo-2_part-mag", "task-cx_part-real", "task-cx_part-imag"):
        write_series(func / f"sub-01_ses-1_{name}_bold.nii.gz", data, repetition_time=2.0)
    status, _, err = run_app(capsys, root, tmp_path / "out", "participant", "--datatype", "func",
                             "--skip-bids-validation", *FAST)
    assert status == 0, err
    assert ("skipping sub-01/ses-1/func/sub-01_ses-1_task-mx_echo-1_part-mag_bold.nii.gz: multi-echo "
            "magnitude/phase") in err
    assert ("skipping sub-01/ses-1/func/sub-01_ses-1_task-cx_part-real_bold.nii.gz: part-real runs are not denoised "
            "(complex data are denoised from part-mag and part-phase pairs)") in err
    assert produced(tmp_path / "out") == expected_outputs(subjects=("01",), datatypes=("func",))


# --------------------------------------------------------------------------------- magnitude/phase pairs

#: The complex runs ``complex_dataset`` adds in ses-2 of sub-01, as names with the part left to fill in: a DWI
#: pair and a BOLD pair, a phase without its magnitude and a magnitude without its phase.
DWI_PAIR = "sub-01/ses-2/dwi/sub-01_ses-2_part-{}_dwi.nii.gz"
BOLD_PAIR = "sub-01/ses-2/func/sub-01_ses-2_task-cx_part-{}_bold.nii.gz"
LONE_PHASE = "sub-01/ses-2/func/sub-01_ses-2_task-lone_part-{}_bold.nii.gz"
LONE_MAGNITUDE = "sub-01/ses-2/func/sub-01_ses-2_task-solo_part-{}_bold.nii.gz"


def pair_names(pair):
    """``derivative_names`` of a pair given as one of the names above."""
    return derivative_names(pair.format("mag"), pair.format("phase"))


def pair_files(stem, suffix):
    """The derivatives of the pair ``<stem>_part-mag/phase_<suffix>``: both parts, the maps and gradient table
    once, without part."""
    names = [f"{stem}_part-{part}_desc-denoised_{suffix}.{ending}" for part in ("mag", "phase")
             for ending in ("nii.gz", "json")]
    names += [f"{stem}_desc-{kind}_{suffix}map.{ending}" for kind in ("noise", "rank") for ending in ("nii.gz", "json")]
    return names + ([f"{stem}_dwi.bval", f"{stem}_dwi.bvec"] if suffix == "dwi" else [])


@pytest.fixture(scope="module")
def complex_dataset(tmp_path_factory):
    """sub-01 of ``make_dataset`` with, in ses-2, complex phantoms saved as magnitude and phase (radians, with the
    ``Units`` BIDS asks of a phase); their gradient table is the dataset's (inherited)."""
    root = make_dataset(tmp_path_factory.mktemp("raw") / "bids", subjects=("01",))
    series = {"dwi": complex_dwi_phantom(SHAPE, N_DWI, sigma=50.0, seed=3),
              "bold": complex_dwi_phantom(SHAPE, N_BOLD, sigma=50.0, seed=4)}
    runs = [(DWI_PAIR, "dwi", ("mag", "phase")), (BOLD_PAIR, "bold", ("mag", "phase")),
            (LONE_PHASE, "bold", ("phase",)), (LONE_MAGNITUDE, "bold", ("mag",))]
    for name, kind, parts in runs:
        magnitude, phase = series[kind][:2]
        for part in parts:
            write_series(root / name.format(part), phase if part == "phase" else magnitude,
                         repetition_time=2.0 if kind == "bold" else None)
            if part == "phase":
                write_json_atomic(root / name.format(part).replace(".nii.gz", ".json"), {"Units": "rad"})
    for task in ("cx", "lone", "solo"):
        write_json_atomic(root / f"task-{task}_bold.json", {"TaskName": task, "RepetitionTime": 2.0})
    return root, checksums(root)


@pytest.fixture(scope="module")
def complex_run(complex_dataset, tmp_path_factory):
    """The app on ses-2 of the complex dataset (validation of the input included)."""
    return module_run(complex_dataset[0], tmp_path_factory, "--session-label", "2")


def test_a_magnitude_phase_pair_is_denoised_into_both_parts(complex_run):
    output_dir, status, err = complex_run
    assert status == EXIT["ok"], err
    expected = [f"sub-01/ses-2/dwi/{name}" for name in pair_files("sub-01_ses-2", "dwi")]
    expected += [f"sub-01/ses-2/func/{name}" for name in pair_files("sub-01_ses-2_task-cx", "bold")]
    expected += [f"sub-01/ses-2/func/{name}" for name in run_files("sub-01_ses-2_task-solo_part-mag", "bold")]
    assert produced(output_dir) == sorted(expected + [".bidsignore", "README.md", "dataset_description.json",
                                                      "logs/CITATION.md"])
    assert "denoising 3 runs (bold, dwi; 2 magnitude/phase pairs as complex data)" in err
    assert "[3/3] denoised" in err


def test_the_pairs_outputs_pass_the_bids_validator(complex_run):
    assert complex_run[1] == 0
    assert validator_errors(complex_run[0]) == []


def test_the_pairs_magnitude_phase_and_noise_are_what_denoise_complex_gives(complex_dataset, complex_run):
    bids_dir, _ = complex_dataset
    output_dir = complex_run[0]
    for pair in (DWI_PAIR, BOLD_PAIR):
        magnitude, phase = (nib.load(bids_dir / pair.format(part)).get_fdata(dtype=np.float32)
                            for part in ("mag", "phase"))
        expected = denoise_complex(magnitude, phase, device="cpu", nprocs=1)
        written = {key: nib.load(output_dir / pair_names(pair)[key]).get_fdata() for key in ("denoised", "phase",
                                                                                             "noise")}
        np.testing.assert_allclose(written["denoised"], expected.denoised, rtol=0, atol=1e-3)
        assert np.abs(np.angle(np.exp(1j * (written["phase"] - expected.phase)))).max() < 1e-5  # modulo 2 pi
        np.testing.assert_allclose(written["noise"], expected.sigma, rtol=0, atol=1e-4)


def test_the_pairs_sidecars_record_both_sources_the_phase_method_and_the_noise_model(complex_dataset, complex_run):
    bids_dir, _ = complex_dataset
    names = pair_names(BOLD_PAIR)
    magnitude, phase = (read_json(complex_run[0] / names[key]) for key in ("denoised_json", "phase_json"))
    raw = [f"bids:raw:{BOLD_PAIR.format(part)}" for part in ("mag", "phase")]
    assert magnitude["Sources"] == raw and phase["Sources"] == raw[::-1]
    assert phase["Units"] == "rad" and phase["TaskName"] == "cx" and phase["SkullStripped"] is False
    assert phase["MPPCADenoising"] == magnitude["MPPCADenoising"]
    provenance = magnitude["MPPCADenoising"]
    assert provenance["Parameters"]["phase_method"] == "hann"
    assert provenance["Parameters"]["phase_file"] == "sub-01_ses-2_task-cx_part-phase_bold.nii.gz"
    assert (provenance["Parameters"]["noise_floor"], provenance["Parameters"]["coils"]) == ("none", 1)
    assert provenance["EngineInfo"]["phase_method"] == "hann" and provenance["EngineInfo"]["noise"] == "estimated"
    assert provenance["PhaseSHA256"] == hashlib.sha256((bids_dir / BOLD_PAIR.format("phase")).read_bytes()).hexdigest()
    noise = read_json(complex_run[0] / names["noise_json"])
    assert noise["Sources"] == raw and "real channel" in noise["Description"]
    citation = (complex_run[0] / "logs" / "CITATION.md").read_text()
    assert "denoised as one complex series" in citation and "Eichner" in citation


def test_a_phase_without_its_magnitude_is_skipped_and_a_magnitude_without_its_phase_denoised_alone(complex_run):
    output_dir, status, err = complex_run
    assert status == 0, err
    assert (f"skipping {LONE_PHASE.format('phase')}: no part-mag run with the same entities was selected (a phase "
            "alone is not denoised)") in err
    assert (f"{LONE_MAGNITUDE.format('mag')}: no part-phase run with the same entities was selected: denoised as a "
            "magnitude series") in err
    provenance = read_json(output_dir / derivative_names(LONE_MAGNITUDE.format("mag"))["denoised_json"])[
        "MPPCADenoising"]
    assert "phase_method" not in provenance["Parameters"] and "phase_method" not in provenance["EngineInfo"]


def test_the_complex_input_dataset_is_unchanged(complex_dataset, complex_run):
    bids_dir, before = complex_dataset
    assert complex_run[1] == 0
    assert checksums(bids_dir) == before


def test_phase_method_and_a_given_noise_map_reach_the_pair(complex_dataset, complex_run, tmp_path, capsys):
    """``--phase-method mppca`` denoises the pair as ``denoise_complex`` does with it, and ``--noise-in DIR`` finds
    the pair's noise map under the name given once for both parts."""
    bids_dir, before = complex_dataset
    status, _, err = run_app(capsys, bids_dir, tmp_path / "out", "participant", "--session-label", "2",
                             "--datatype", "dwi", "--phase-method", "mppca", "--noise-in", complex_run[0],
                             "--skip-bids-validation", *FAST)
    assert status == 0, err
    names = pair_names(DWI_PAIR)
    sigma = nib.load(complex_run[0] / names["noise"]).get_fdata()
    magnitude, phase = (nib.load(bids_dir / DWI_PAIR.format(part)).get_fdata(dtype=np.float32)
                        for part in ("mag", "phase"))
    expected = denoise_complex(magnitude, phase, phase_method="mppca", noise=sigma, device="cpu", nprocs=1)
    np.testing.assert_allclose(nib.load(tmp_path / "out" / names["denoised"]).get_fdata(), expected.denoised,
                               rtol=0, atol=1e-3)
    sidecar = read_json(tmp_path / "out" / names["phase_json"])
    provenance = sidecar["MPPCADenoising"]
    assert provenance["Parameters"]["phase_method"] == "mppca" and provenance["EngineInfo"]["noise"] == "given"
    assert provenance["NoiseInSource"] == "bids:noise:sub-01/ses-2/dwi/sub-01_ses-2_desc-noise_dwimap.nii.gz"
    assert sidecar["Sources"][2] == provenance["NoiseInSource"]
    assert "first denoised by MP-PCA" in (tmp_path / "out" / "logs" / "CITATION.md").read_text()
    assert checksums(bids_dir) == before


def run_record(relpath, **fields):
    """A ``bids.Run`` of the raw file ``relpath`` with the entities its name gives."""
    name = PurePosixPath(relpath).name
    entities = dict(part.split("-", 1) for part in name.split("_")[:-1])
    entities = {{"sub": "subject", "ses": "session", "acq": "acquisition"}.get(k, k): v for k, v in entities.items()}
    datatype = PurePosixPath(relpath).parent.name
    return Run(path=Path(relpath), relpath=relpath, datatype=datatype, suffix=SERIES[datatype], entities=entities,
               **fields)


def test_a_pair_whose_maps_would_take_another_runs_names_is_skipped():
    plain, magnitude, phase = (run_record(f"sub-01/dwi/sub-01_{part}dwi.nii.gz") for part in
                               ("", "part-mag_", "part-phase_"))
    runs = pair_parts([plain, magnitude, phase])
    assert runs == [plain, magnitude] and magnitude.phase is phase and plain.skip is None
    assert magnitude.skip == ("its noise and rank maps, named once for the pair with sub-01_part-phase_dwi.nii.gz "
                              "(without part-), would take the names of sub-01_dwi.nii.gz's")


def test_a_phase_whose_magnitude_is_skipped_is_skipped_with_it():
    magnitude = run_record("sub-01/dwi/sub-01_part-mag_dwi.nii.gz", skip="no .bval/.bvec found for it")
    phase = run_record("sub-01/dwi/sub-01_part-phase_dwi.nii.gz")
    assert pair_parts([magnitude, phase]) == [magnitude, phase]
    assert phase.skip == "its part-mag run sub-01_part-mag_dwi.nii.gz is skipped" and magnitude.phase is None


def test_the_pairs_names_come_from_the_one_naming_function():
    names = derivative_names("sub-01/func/sub-01_task-x_part-mag_bold.nii",
                             "sub-01/func/sub-01_task-x_part-phase_bold.nii.gz")
    assert names["denoised"] == "sub-01/func/sub-01_task-x_part-mag_desc-denoised_bold.nii"
    assert names["phase"] == "sub-01/func/sub-01_task-x_part-phase_desc-denoised_bold.nii"  # the node's format
    assert names["noise"] == "sub-01/func/sub-01_task-x_desc-noise_boldmap.nii"
    alone = derivative_names("sub-01/func/sub-01_task-x_part-mag_bold.nii")
    assert "phase" not in alone and alone["noise"] == "sub-01/func/sub-01_task-x_part-mag_desc-noise_boldmap.nii"


def test_the_echoes_of_a_multi_echo_run_are_denoised_jointly_one_derivative_each(tmp_path, capsys):
    from test_groups import echo_phantom

    root = make_dataset(tmp_path / "bids", subjects=("01",))
    func = root / "sub-01/ses-1/func"
    noisy, _ = echo_phantom(shape=SHAPE, n_volumes=14)
    for echo in (1, 2, 3):
        stem = func / f"sub-01_ses-1_task-me_echo-{echo}_bold"
        write_series(stem.with_name(stem.name + ".nii.gz"), noisy[:, :, :, echo - 1], repetition_time=2.0)
        stem.with_name(stem.name + ".json").write_text(json.dumps({"EchoTime": 0.015 * echo}))
    write_series(func / "sub-01_ses-1_task-solo_echo-1_bold.nii.gz", noisy[:, :, :, 0], repetition_time=2.0)
    status, _, err = run_app(capsys, root, tmp_path / "out", "participant", "--datatype", "func",
                             "--skip-bids-validation", *FAST)
    assert status == 0, err
    assert "skipping sub-01/ses-1/func/sub-01_ses-1_task-solo_echo-1_bold.nii.gz: only one echo" in err
    echoes = [f"sub-01/ses-1/func/{name}" for echo in (1, 2, 3)
              for name in run_files(f"sub-01_ses-1_task-me_echo-{echo}", "bold")]
    assert produced(tmp_path / "out") == sorted(expected_outputs(subjects=("01",), datatypes=("func",)) + echoes)
    written = [np.asarray(nib.load(tmp_path / "out" / name).dataobj, np.float32)
               for name in echoes if name.endswith("desc-denoised_bold.nii.gz")]
    expected = denoise(noisy, device="cpu", nprocs=1, **{k: DEFAULTS[k] for k in
                                                         ("extent", "stride", "estimator", "aggregation")})
    for echo in (1, 2, 3):
        np.testing.assert_array_equal(written[echo - 1], expected.denoised[:, :, :, echo - 1])
        sidecar = read_json(tmp_path / "out" / echoes[6 * (echo - 1) + 1])  # its desc-denoised_bold.json
        assert sidecar["EchoTime"] == 0.015 * echo
        assert sidecar["MPPCADenoising"]["EngineInfo"]["echoes"] == 3
    assert "The echoes of each multi-echo run were denoised jointly" in (tmp_path / "out/logs/CITATION.md").read_text()


# ---------------------------------------------------------------------------------------------- failures

def assert_clean_failure(err, status, expected):
    assert status == expected, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mppca-nipype: error: "), err
    assert "Traceback" not in err


@pytest.mark.parametrize("args", [
    [],
    ["{bids}"],
    ["{bids}", "{out}", "group"],
    ["{bids}", "{out}", "participant", "--no-such-option"],
    ["{bids}", "{out}", "participant", "--stride", "0"],
    ["{bids}", "{out}", "participant", "--extent", "4"],
    ["{bids}", "{out}", "participant", "--aggregation", "center"],
    ["{bids}", "{out}", "participant", "--datatype", "anat"],
    ["{bids}", "{out}", "participant", "--device", "tpu"],
    ["{bids}", "{out}", "participant", "--plugin", "NoSuchPlugin"],
    ["{bids}", "{out}", "participant", "--plugin-args", "{{not json"],
    ["{bids}", "{out}", "participant", "--bids-filter-file", "{bad_filter}"],
    ["{bids}", "{out}", "participant", "--bids-filter-file", "{unknown_key_filter}"],
    ["--demo", "{out}", "{bids}"],
], ids=["nothing", "no-output", "group-level", "unknown-option", "stride-0", "even-extent", "center-stride-2",
        "anat", "tpu", "plugin", "plugin-args", "filter-not-json", "filter-unknown-key", "demo-and-bids"])
def test_usage_errors_exit_64(dataset, tmp_path, capsys, args):
    bids_dir, before = dataset
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "unknown.json").write_text(json.dumps({"t1w": {"run": 1}}))
    filled = [a.format(bids=bids_dir, out=tmp_path / "out", bad_filter=tmp_path / "bad.json",
                       unknown_key_filter=tmp_path / "unknown.json") for a in args]
    status, _, err = run_app(capsys, *filled, "--skip-bids-validation")
    assert_clean_failure(err, status, EXIT["usage"])
    assert checksums(bids_dir) == before


def test_missing_inputs_exit_66(dataset, tmp_path, capsys):
    status, _, err = run_app(capsys, tmp_path / "nowhere", tmp_path / "out", "participant")
    assert_clean_failure(err, status, EXIT["input_missing"])
    status, _, err = run_app(capsys, dataset[0], tmp_path / "out", "participant", "--bids-filter-file",
                             tmp_path / "missing.json", "--skip-bids-validation")
    assert_clean_failure(err, status, EXIT["input_missing"])
    assert not (tmp_path / "out").exists()


def test_a_folder_without_dataset_description_exits_16(tmp_path, capsys):
    (tmp_path / "notbids" / "sub-01").mkdir(parents=True)
    status, _, err = run_app(capsys, tmp_path / "notbids", tmp_path / "out", "participant")
    assert_clean_failure(err, status, EXIT["invalid_bids"])
    assert not (tmp_path / "out").exists()


def test_validator_errors_exit_16_unless_skipped(tmp_path, capsys):
    root = make_dataset(tmp_path / "bids", subjects=("01",))
    (root / "sub-01" / "ses-1" / "func" / "not_a_bids_name.nii.gz").write_bytes(
        (root / "sub-01/ses-1/func/sub-01_ses-1_task-rest_run-1_bold.nii.gz").read_bytes())
    assert validator_errors(root), "the stray file must be a validator error"
    before = checksums(root)
    status, _, err = run_app(capsys, root, tmp_path / "out", "participant", *FAST)
    assert_clean_failure(err, status, EXIT["invalid_bids"])
    assert "--skip-bids-validation" in err and not (tmp_path / "out").exists()
    status, _, err = run_app(capsys, root, tmp_path / "out", "participant", "--datatype", "dwi",
                             "--skip-bids-validation", *FAST)
    assert status == 0, err
    assert checksums(root) == before


@pytest.mark.parametrize("args", [["--participant-label", "sub-03"], ["--session-label", "2"],
                                  ["--bids-filter-file", "{filters}"]],
                         ids=["participant", "session", "filter"])
def test_filters_that_select_nothing_exit_18(dataset, tmp_path, capsys, args):
    (tmp_path / "filters.json").write_text(json.dumps({"bold": {"task": "nback"}, "dwi": {"acquisition": "x"}}))
    filled = [a.format(filters=tmp_path / "filters.json") for a in args]
    status, _, err = run_app(capsys, dataset[0], tmp_path / "out", "participant", *filled,
                             "--skip-bids-validation", *FAST)
    assert_clean_failure(err, status, EXIT["nothing_selected"])
    assert checksums(dataset[0]) == dataset[1]


def test_outputs_that_cannot_be_created_exit_73(dataset, tmp_path, capsys):
    bids_dir, before = dataset
    status, _, err = run_app(capsys, bids_dir, bids_dir / "derivatives" / "mppca", "participant",
                             "--skip-bids-validation")
    assert_clean_failure(err, status, EXIT["cannot_create"])
    status, _, err = run_app(capsys, bids_dir, tmp_path / "out", "participant", "-w", bids_dir / "work",
                             "--skip-bids-validation")
    assert_clean_failure(err, status, EXIT["cannot_create"])
    (tmp_path / "a_file").write_text("")
    status, _, err = run_app(capsys, bids_dir, tmp_path / "a_file" / "out", "participant",
                             "--skip-bids-validation")
    assert_clean_failure(err, status, EXIT["cannot_create"])
    other = tmp_path / "fmriprep"
    other.mkdir()
    (other / "dataset_description.json").write_text(json.dumps({"GeneratedBy": [{"Name": "fMRIPrep"}]}))
    status, _, err = run_app(capsys, bids_dir, other, "participant", "--skip-bids-validation")
    assert_clean_failure(err, status, EXIT["cannot_create"])
    assert "fMRIPrep" in err
    assert checksums(bids_dir) == before


def test_device_cuda_without_a_usable_gpu_exits_1_before_writing(dataset, tmp_path, capsys):
    from mppca_nipype.cli.bids_app import check_cuda
    from mppca_nipype.engine import MPPCAInputError

    try:
        check_cuda()
        pytest.skip("a GPU is usable here")
    except MPPCAInputError:
        pass
    status, _, err = run_app(capsys, dataset[0], tmp_path / "out", "participant", "--device", "cuda",
                             "--skip-bids-validation")
    assert_clean_failure(err, status, EXIT["failure"])
    assert "cuda" in err and not (tmp_path / "out").exists()


def test_a_run_that_fails_exits_1_and_leaves_no_half_written_derivative(tmp_path, capsys):
    root = make_dataset(tmp_path / "bids", subjects=("01",))
    broken = root / "sub-01/ses-1/func/sub-01_ses-1_task-rest_run-2_bold.nii.gz"
    broken.write_bytes(broken.read_bytes()[:200])  # truncated
    before = checksums(root)
    status, _, err = run_app(capsys, root, tmp_path / "out", "participant", "--datatype", "func",
                             "--skip-bids-validation", *FAST)
    assert status == EXIT["failure"], err
    assert "Traceback" not in err
    assert "1 of 2 runs failed (sub-01_ses-1_task-rest_run-2_bold.nii.gz)" in err
    files = produced(tmp_path / "out")
    assert not any("run-2" in f and not f.startswith("logs/") for f in files)
    assert "sub-01/ses-1/func/sub-01_ses-1_task-rest_run-1_desc-denoised_bold.nii.gz" in files
    assert not any(Path(f).name.startswith(".") and f != ".bidsignore" for f in files), "no temporary files"
    assert any(f.startswith("logs/crash") for f in files)
    assert checksums(root) == before


# ---------------------------------------------------------------------------------------- demo, version

def test_demo_writes_a_dataset_and_valid_derivatives(tmp_path, capsys):
    status, out, err = run_app(capsys, "--demo", tmp_path / "demo", *FAST)
    assert status == 0, err
    derivatives = tmp_path / "demo" / "derivatives" / "mppca-nipype"
    assert "sub-01/dwi/sub-01_desc-denoised_dwi.nii.gz" in produced(derivatives)
    assert "sub-01/func/sub-01_task-rest_desc-denoised_bold.nii.gz" in produced(derivatives)
    assert "done in" in err and str(derivatives) in err
    raw_size = sum(p.stat().st_size for p in (tmp_path / "demo" / "bids").rglob("*") if p.is_file())
    assert raw_size < 5 * 2**20
    assert validator_errors(tmp_path / "demo" / "bids") == []
    assert validator_errors(derivatives) == []


def test_the_demo_generator_writes_as_many_subjects_of_the_sizes_asked_for(tmp_path):
    from mppca_nipype.demo import write_demo_dataset

    root = write_demo_dataset(tmp_path / "bids", dwi_shape=(9, 8, 7), n_dwi=12, bold_shape=(6, 7, 5), n_bold=15,
                              subjects=3)
    assert (root / "participants.tsv").read_text().split() == ["participant_id", "sub-01", "sub-02", "sub-03"]
    dwi = [nib.load(root / f"sub-{s}" / "dwi" / f"sub-{s}_dwi.nii.gz").get_fdata() for s in ("01", "03")]
    bold = nib.load(root / "sub-02" / "func" / "sub-02_task-rest_bold.nii.gz")
    assert dwi[0].shape == (9, 8, 7, 12) and bold.shape == (6, 7, 5, 15)
    assert len((root / "sub-03" / "dwi" / "sub-03_dwi.bval").read_text().split()) == 12
    assert not np.allclose(dwi[0], dwi[1]), "each subject has its own noise"


def test_version(capsys):
    status, out, _ = run_app(capsys, "--version")
    assert status == 0 and out.strip() == f"mppca-nipype {__version__}"
