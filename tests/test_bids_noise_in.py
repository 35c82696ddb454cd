"""``mppca-nipype ... --noise-in NUMBER|DIR``: a given noise level for every run of a dataset.

A number applies to every run; a folder is a derivative dataset holding each run's ``desc-noise`` map under
this app's names (an earlier run's OUTPUT_DIR, or ``mppca-noise`` maps saved under those names). The map
reaches the engine, and the derivative records where it came from: ``DatasetLinks["noise"]``, the sidecars'
``Sources`` and ``NoiseInSource``, the map's checksum, the methods text.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys

import nibabel as nib
import numpy as np
import pytest

from bids_helpers import checksums, make_dataset, read_json, validator_errors
from mppca_nipype import denoise
from mppca_nipype.bids import derivative_names
from mppca_nipype.cli.bids_app import EXIT
from test_bids_app import assert_clean_failure, produced, run_app

FAST = ["--nprocs", "1", "--device", "cpu", "--skip-bids-validation", "--no-reports"]
DWI = "sub-01/ses-1/dwi/sub-01_ses-1_dwi.nii.gz"
BOLD = "sub-01/ses-1/func/sub-01_ses-1_task-rest_run-1_bold.nii.gz"


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = make_dataset(tmp_path_factory.mktemp("raw") / "bids", subjects=("01",))
    return root, checksums(root)


@pytest.fixture(scope="module")
def earlier(dataset, tmp_path_factory):
    """An earlier run of the app: its OUTPUT_DIR holds every run's estimated noise map."""
    import contextlib
    import io

    from mppca_nipype.cli.bids_app import main

    out = tmp_path_factory.mktemp("earlier") / "mppca"
    with contextlib.redirect_stderr(io.StringIO()), pytest.raises(SystemExit) as stopped:
        main([str(dataset[0]), str(out), "participant", *FAST])
    assert stopped.value.code == 0
    return out


@pytest.fixture(scope="module")
def given_maps(dataset, earlier, tmp_path_factory):
    """The app again, each run's noise given by the earlier run's map."""
    import contextlib
    import io

    from mppca_nipype.cli.bids_app import main

    out = tmp_path_factory.mktemp("given") / "mppca"
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as stopped:
        main([str(dataset[0]), str(out), "participant", "--noise-in", str(earlier), *FAST])
    assert stopped.value.code == 0, err.getvalue()
    return out


def test_each_run_is_denoised_with_its_map_from_the_earlier_run(dataset, earlier, given_maps):
    raw = nib.load(dataset[0] / DWI).get_fdata(dtype=np.float32)
    sigma = nib.load(earlier / derivative_names(DWI)["noise"]).get_fdata()
    expected = denoise(raw, noise=sigma, device="cpu", nprocs=1)
    names = derivative_names(DWI)
    np.testing.assert_allclose(nib.load(given_maps / names["denoised"]).get_fdata(), expected.denoised,
                               rtol=0, atol=1e-3)
    np.testing.assert_allclose(nib.load(given_maps / names["noise"]).get_fdata(), expected.sigma, rtol=0, atol=1e-4)
    estimated = denoise(raw, device="cpu", nprocs=1)
    assert not np.allclose(expected.denoised, estimated.denoised, atol=1e-3)  # the map changed the result


def test_the_sidecars_and_the_description_name_the_noise_source(earlier, given_maps):
    for source in (DWI, BOLD):
        names = derivative_names(source)
        noise_map = earlier / names["noise"]
        sidecar = read_json(given_maps / names["denoised_json"])
        uri = f"bids:noise:{names['noise']}"
        assert sidecar["Sources"] == [f"bids:raw:{source}", uri]
        provenance = sidecar["MPPCADenoising"]
        assert provenance["NoiseInSource"] == uri and provenance["EngineInfo"]["noise"] == "given"
        assert provenance["Parameters"]["noise_in"] == noise_map.name
        assert provenance["NoiseInSHA256"] == hashlib.sha256(noise_map.read_bytes()).hexdigest()
        map_sidecar = read_json(given_maps / names["noise_json"])
        assert map_sidecar["Sources"][1] == uri and "given" in map_sidecar["Description"]
    description = read_json(given_maps / "dataset_description.json")
    assert description["DatasetLinks"]["noise"] == earlier.resolve().as_uri()
    assert {"URL": earlier.resolve().as_uri()} in description["SourceDatasets"]
    assert "a noise map given for each series" in (given_maps / "logs" / "CITATION.md").read_text()


def test_the_derivative_with_given_maps_passes_the_bids_validator(given_maps):
    assert validator_errors(given_maps) == []


def test_one_number_is_every_run_s_noise_level(dataset, tmp_path, capsys):
    status, _, err = run_app(capsys, dataset[0], tmp_path / "out", "participant", "--noise-in", "20", *FAST)
    assert status == 0, err
    for source in (DWI, BOLD):
        names = derivative_names(source)
        np.testing.assert_allclose(nib.load(tmp_path / "out" / names["noise"]).get_fdata(), 20.0, rtol=1e-6)
        provenance = read_json(tmp_path / "out" / names["denoised_json"])["MPPCADenoising"]
        assert provenance["Parameters"]["noise_in"] == 20.0 and provenance["EngineInfo"]["noise"] == "given"
        assert "NoiseInSource" not in provenance
    assert "a given noise standard deviation of 20" in (tmp_path / "out" / "logs" / "CITATION.md").read_text()
    assert "noise" not in read_json(tmp_path / "out" / "dataset_description.json")["DatasetLinks"]


def test_maps_written_by_mppca_noise_under_the_app_s_names_are_taken(dataset, tmp_path, capsys):
    noise_dir = tmp_path / "noise"
    target = noise_dir / derivative_names(DWI)["noise"].replace(".nii.gz", ".nii")
    target.parent.mkdir(parents=True)
    done = subprocess.run([sys.executable, "-m", "mppca_nipype.cli.noise", str(dataset[0] / DWI), str(target),
                           "--nprocs", "1", "--quiet"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    status, _, err = run_app(capsys, dataset[0], tmp_path / "out", "participant", "--datatype", "dwi",
                             "--noise-in", noise_dir, *FAST)
    assert status == 0, err
    sidecar = read_json(tmp_path / "out" / derivative_names(DWI)["denoised_json"])
    assert sidecar["Sources"][1] == f"bids:noise:{target.relative_to(noise_dir)}"
    np.testing.assert_allclose(nib.load(tmp_path / "out" / derivative_names(DWI)["noise"]).get_fdata(),
                               np.asarray(nib.load(target).dataobj), rtol=0.05)


# -- what is refused, before any run is denoised ---------------------------------------------------------------

def _wrong_grid(root):
    path = root / derivative_names(DWI)["noise"]
    path.parent.mkdir(parents=True)
    nib.save(nib.Nifti1Image(np.full((4, 4, 4), 20.0, np.float32), np.eye(4)), path)
    return root


CASES = {
    "a number below zero": (lambda tmp: "-1", EXIT["usage"], "must be a positive number or a folder"),
    "one file for many runs": (lambda tmp: tmp / "sigma.nii.gz", EXIT["usage"], "is a file"),
    "a missing folder": (lambda tmp: tmp / "absent", EXIT["input_missing"], "neither a positive number"),
    "a folder without the maps": (lambda tmp: tmp, EXIT["input_missing"],
                                  "no usable noise map for 3 of 3 runs: sub-01_ses-1_dwi.nii.gz has none"),
    "a map on another grid": (lambda tmp: _wrong_grid(tmp / "noise"), EXIT["input_missing"],
                              "has shape (4, 4, 4), but sub-01_ses-1_dwi.nii.gz's grid is (10, 10, 8)"),
    "OUTPUT_DIR itself": (lambda tmp: tmp / "out", EXIT["usage"], "lies in OUTPUT_DIR"),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_bad_noise_sources_exit_with_one_sentence_and_denoise_nothing(dataset, tmp_path, capsys, case):
    make, status, phrase = case
    (tmp_path / "sigma.nii.gz").write_bytes(b"")
    (tmp_path / "out").mkdir()
    result = run_app(capsys, dataset[0], tmp_path / "out", "participant", "--noise-in", make(tmp_path), *FAST)
    assert_clean_failure(result[2], result[0], status)
    assert phrase in result[2]
    assert produced(tmp_path / "out") == []
    assert checksums(dataset[0]) == dataset[1]
