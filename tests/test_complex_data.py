"""Complex data (``denoise_complex``, ``engine.complex_data``): the phase's units, the background phase found
on a noiseless phantom, the imaginary part left as noise alone, the bias removed against magnitude-only
denoising, a complex series given as such, and the command's and the interface's handling of a phase file and
of a complex NIfTI file."""

import json
import math
import os
import re
import subprocess
import sys

import nibabel as nib
import numpy as np
import pytest

from mppca_nipype import MPPCAInputError, denoise, denoise_complex
from mppca_nipype.engine.complex_data import background_phase, phase_in_radians
from mppca_nipype.phantoms import complex_dwi_phantom

SHAPE, VOLUMES = (24, 24, 12), 24


def wrapped(angle):
    return np.angle(np.exp(1j * angle))


# -- the phase's units ------------------------------------------------------------------------------------

def test_radians_are_taken_as_they_are():
    phase = np.linspace(-math.pi, math.pi, 60, dtype=np.float32).reshape(3, 4, 5, 1)
    radians, units = phase_in_radians(phase)
    assert units == "radians"
    np.testing.assert_array_equal(radians, phase)


@pytest.mark.parametrize("low, high, units", [(-4096, 4095, "[-4096, 4095]"), (0, 4095, "[0, 4095]")])
def test_scanner_units_are_detected_and_rescaled_to_minus_pi_pi(low, high, units):
    truth = np.linspace(-math.pi, math.pi - 2 * math.pi / 4096, 4096)
    values = np.round((truth + math.pi) / (2 * math.pi) * (high - low + 1) + low).reshape(16, 16, 16, 1)
    radians, found = phase_in_radians(values)
    assert found == units
    assert np.abs(wrapped(radians.ravel() - truth)).max() < 1e-5


@pytest.mark.parametrize("values, sentence", [
    (np.full((2, 2, 2, 3), 100.5), "neither radians"),
    (np.full((2, 2, 2, 3), 5000.0), "neither radians"),
    (np.where(np.arange(24).reshape(2, 2, 2, 3) == 7, np.nan, 0.0), "NaN or Inf at 1 of its values, the first at "
                                                                      "(0, 1, 0, 1)"),
])
def test_a_phase_that_is_not_a_phase_fails_with_one_sentence(values, sentence):
    with pytest.raises(MPPCAInputError, match=sentence.replace("(", r"\(").replace(")", r"\)")):
        phase_in_radians(values)


def test_a_phase_of_another_shape_fails():
    with pytest.raises(MPPCAInputError, match="does not match the magnitude's"):
        denoise_complex(np.ones((4, 4, 4, 5)), np.zeros((4, 4, 4, 4)))


# -- the background phase -----------------------------------------------------------------------------------

def test_the_hann_filter_recovers_a_smooth_phase_on_a_noiseless_phantom():
    _, _, truth, phi, _, _ = complex_dwi_phantom(SHAPE, VOLUMES, sigma=0.0)
    estimate = background_phase(truth * np.exp(1j * phi))
    head = truth > 0.2 * truth.max()
    error = np.abs(wrapped(estimate - phi))[head]
    # the signal's loss cos(error) is below 0.5% in the median voxel and 5% in the 99th percentile
    assert np.median(error) < 0.1
    assert np.percentile(error, 99) < 0.32


@pytest.mark.parametrize("order", ["C", "F"])
def test_the_host_steps_give_the_same_numbers_on_any_number_of_threads(order):
    """The background phase (volumes on threads) and the elementwise steps (slabs on threads) are
    bit-identical for any number of threads, in either memory order."""
    magnitude, phase = (np.asarray(a, order=order) for a in complex_dwi_phantom((18, 15, 9), 16, sigma=80.0,
                                                                               seed=8)[:2])
    image = magnitude * np.exp(1j * phase)
    np.testing.assert_array_equal(background_phase(image, threads=3), background_phase(image, threads=1))
    one = denoise_complex(magnitude, phase, device="cpu", nprocs=1)
    three = denoise_complex(magnitude, phase, device="cpu", nprocs=3)
    for name in ("denoised", "phase", "sigma", "rank"):
        np.testing.assert_array_equal(getattr(three, name), getattr(one, name))


def test_the_demodulated_imaginary_part_is_noise_of_sigma():
    sigma = 100.0
    magnitude, phase, _, _, _, _ = complex_dwi_phantom(SHAPE, VOLUMES, sigma=sigma)
    result = denoise_complex(magnitude, phase, device="cpu", nprocs=1)
    assert result.info["imaginary_sd_ratio"] == pytest.approx(1, abs=0.06)
    head = result.sigma > 0
    assert np.median(result.sigma[head]) == pytest.approx(sigma, rel=0.05)  # the real channel's sigma
    assert result.info["phase_units"] == "radians" and result.info["phase_method"] == "hann"


def test_the_output_phase_is_the_background_phase_where_the_signal_is_strong():
    magnitude, phase, truth, phi, _, _ = complex_dwi_phantom(SHAPE, VOLUMES, sigma=50.0)
    result = denoise_complex(magnitude, phase, device="cpu", nprocs=1)
    strong = truth > 400
    assert np.median(np.abs(wrapped(result.phase - phi))[strong]) < 0.1
    assert result.phase.min() >= -math.pi and result.phase.max() < math.pi


# -- what it is for: no magnitude floor ---------------------------------------------------------------------

def test_complex_denoising_removes_most_of_the_magnitude_floors_bias():
    sigma = 250.0  # SNR 4 at b = 0
    magnitude, phase, truth, _, _, _ = complex_dwi_phantom(SHAPE, VOLUMES, sigma=sigma)
    head = truth[..., :1] > 0
    low = (truth < 3 * sigma) & head
    magnitude_only = denoise(magnitude, device="cpu", nprocs=1).denoised - truth
    complex_data = denoise_complex(magnitude, phase, device="cpu", nprocs=1).denoised - truth
    assert magnitude_only[low].mean() > 0.2 * sigma  # the floor
    assert abs(complex_data[low].mean()) < 0.25 * magnitude_only[low].mean()
    assert np.sqrt(np.mean(complex_data**2)) < 0.7 * np.sqrt(np.mean(magnitude_only**2))


def test_a_complex_series_is_denoised_as_its_magnitude_and_phase_are():
    sigma = 100.0
    magnitude, phase, _, _, _, _ = complex_dwi_phantom(SHAPE, VOLUMES, sigma=sigma)
    series = (magnitude * np.exp(1j * phase)).astype(np.complex64)
    before = series.copy()
    given = denoise_complex(series, device="cpu", nprocs=1)
    np.testing.assert_array_equal(series, before)  # the caller's series is not demodulated in place
    parts = denoise_complex(np.abs(series), np.angle(series), device="cpu", nprocs=1)
    assert given.info["phase_units"] == "complex"
    # the parts rebuild the series to complex64 rounding: the results agree to a thousandth of the noise
    assert np.abs(given.denoised_complex - parts.denoised_complex).max() < 1e-3 * sigma
    np.testing.assert_allclose(given.sigma, parts.sigma, rtol=1e-5)
    np.testing.assert_array_equal(given.rank, parts.rank)
    assert given.denoised_complex.dtype == np.complex64


@pytest.mark.parametrize("phase, sentence", [
    (np.zeros((4, 4, 4, 5)), "a complex series carries its own phase; give it without a phase"),
    (None, "the magnitude needs its phase (or give the complex series itself)"),
])
def test_a_phase_with_a_complex_series_or_none_with_a_magnitude_fails(phase, sentence):
    data = np.ones((4, 4, 4, 5), np.complex64) if phase is not None else np.ones((4, 4, 4, 5))
    with pytest.raises(MPPCAInputError, match=re.escape(sentence)):
        denoise_complex(data, phase)


def test_a_negative_magnitude_fails_with_one_sentence():
    magnitude = np.ones((4, 4, 4, 5))
    magnitude[0, 0, 0, 0] = -1
    with pytest.raises(MPPCAInputError, match="1 negative values"):
        denoise_complex(magnitude, np.zeros(magnitude.shape))


# -- the command and the interface ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("complex")
    magnitude, phase, _, _, _, _ = complex_dwi_phantom((12, 12, 8), 16, sigma=100.0)
    paths = {}
    for name, array in (("mag", magnitude), ("phase", phase), ("phase_short", phase[..., :5]),
                        ("phase_degrees", np.degrees(phase) * 10),
                        ("complex", (magnitude * np.exp(1j * phase)).astype(np.complex64))):
        paths[name] = folder / f"{name}.nii.gz"
        nib.save(nib.Nifti1Image(array, np.eye(4)), paths[name])
    return paths


def run_cli(*args, cwd):
    command = [sys.executable, "-m", "mppca_nipype.cli.denoise", *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=cwd)


def test_the_command_writes_the_engines_magnitude_and_phase(files, tmp_path):
    result = run_cli(files["mag"], "out.nii.gz", "--phase", files["phase"], "--phase-out", "phase.nii.gz",
                     "--device", "cpu", "--nprocs", "1", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "phase in radians, background by hann" in result.stderr
    expected = denoise_complex(nib.load(files["mag"]).get_fdata(), nib.load(files["phase"]).get_fdata(),
                               device="cpu", nprocs=1)
    np.testing.assert_allclose(nib.load(tmp_path / "out.nii.gz").get_fdata(), expected.denoised, atol=1e-3)
    np.testing.assert_allclose(nib.load(tmp_path / "phase.nii.gz").get_fdata(), expected.phase, atol=1e-5)


def test_complex_data_take_optthresh_unless_a_filter_is_given(files, tmp_path):
    """Complex data's filter (``COMPLEX_FILTER``) in the engine, the command, the interface's default and the
    methods texts; a filter given is taken as it is, and magnitude data keep the defaults' optshrink."""
    from mppca_nipype.engine import COMPLEX_FILTER, DEFAULTS, default_filter
    from mppca_nipype.workflows import init_mppca_wf, methods_text, references_text

    assert COMPLEX_FILTER == default_filter(True) == "optthresh" and default_filter(False) == DEFAULTS["filter"]
    magnitude, phase = (nib.load(files[name]).get_fdata() for name in ("mag", "phase"))
    default = denoise_complex(magnitude, phase, device="cpu", nprocs=1)
    assert default.info["filter"] == "optthresh"
    np.testing.assert_array_equal(
        default.denoised, denoise_complex(magnitude, phase, filter="optthresh", device="cpu", nprocs=1).denoised)
    shrunk = denoise_complex(magnitude, phase, filter="optshrink", device="cpu", nprocs=1)
    assert shrunk.info["filter"] == "optshrink" and np.abs(shrunk.denoised - default.denoised).max() > 1.0
    result = run_cli(files["mag"], "out.nii.gz", "--phase", files["phase"], "--filter", "optshrink", "--device",
                     "cpu", "--nprocs", "1", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    np.testing.assert_allclose(nib.load(tmp_path / "out.nii.gz").get_fdata(), shrunk.denoised, atol=1e-3)
    assert "optimal hard threshold" in init_mppca_wf(phase_method="hann", use_gpu=False).__desc__
    assert "optimal shrinker" in init_mppca_wf(use_gpu=False).__desc__
    both = methods_text(filter="optshrink", phase_method="hann", complex_filter="optthresh")
    assert "optimal shrinker" in both and "denoised as above, except that, with that noise level" in both
    assert "denoised as above;" in methods_text(filter="optthresh", phase_method="hann", complex_filter="optthresh")
    cited = references_text(filter="optshrink", complex_data=True, complex_filter="optthresh")
    assert "10.1109/TIT.2017.2653801" in cited and "10.1109/TIT.2014.2323359" in cited


def test_the_command_denoises_a_complex_file_as_its_magnitude_and_phase_and_writes_complex64(files, tmp_path):
    result = run_cli(files["complex"], "out.nii.gz", "--noise", "sigma.nii.gz", "--device", "cpu", "--nprocs", "1",
                     cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "complex input, background by hann" in result.stderr
    parts = run_cli(files["mag"], "mag.nii.gz", "--phase", files["phase"], "--phase-out", "phase.nii.gz",
                    "--noise", "mag_sigma.nii.gz", "--device", "cpu", "--nprocs", "1", cwd=tmp_path)
    assert parts.returncode == 0, parts.stderr
    out = nib.load(tmp_path / "out.nii.gz")
    assert out.get_data_dtype() == np.complex64 and out.shape == (12, 12, 8, 16)
    denoised = np.asarray(out.dataobj)
    expected = (nib.load(tmp_path / "mag.nii.gz").get_fdata()
                * np.exp(1j * nib.load(tmp_path / "phase.nii.gz").get_fdata()))
    # the parts rebuild the file's series to complex64 rounding: the results agree to a thousandth of the noise (100)
    assert np.abs(denoised - expected).max() < 0.1
    np.testing.assert_allclose(nib.load(tmp_path / "sigma.nii.gz").get_fdata(),
                               nib.load(tmp_path / "mag_sigma.nii.gz").get_fdata(), rtol=1e-5)
    assert nib.load(tmp_path / "sigma.nii.gz").get_data_dtype() == np.float32


@pytest.mark.parametrize("arguments, sentence", [
    (("--phase", "{phase}"), "IN {complex} is a complex series, which carries its own phase; leave out --phase"),
    (("--noise-floor", "rician"), "with no magnitude floor; leave out --noise-floor rician"),
])
def test_the_command_refuses_a_phase_or_a_floor_with_a_complex_file(files, tmp_path, arguments, sentence):
    arguments = [a.format(**files) for a in arguments]
    result = run_cli(files["complex"], "out.nii.gz", *arguments, "--device", "cpu", cwd=tmp_path)
    assert result.returncode == 2
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and sentence.format(**files) in lines[0]
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("arguments, sentence", [
    (("--phase", "{phase_short}"), "has shape (12, 12, 8, 5), but the magnitude's is (12, 12, 8, 16)"),
    (("--phase", "{phase_degrees}"), "neither radians"),
    (("--phase-out", "p.nii.gz"), "--phase-out writes the denoised phase and needs --phase"),
    (("--phase", "{phase}", "--noise-floor", "rician"), "leave out --noise-floor rician"),
])
def test_the_command_fails_with_one_sentence_and_writes_nothing(files, tmp_path, arguments, sentence):
    arguments = [a.format(**files) for a in arguments]
    result = run_cli(files["mag"], "out.nii.gz", *arguments, "--noise", "sigma.nii.gz", "--device", "cpu",
                     cwd=tmp_path)
    assert result.returncode in (1, 2)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and sentence in lines[0]
    assert os.listdir(tmp_path) == []


def test_the_interface_round_trip_writes_the_phase_and_records_it(files, tmp_path):
    from mppca_nipype.interfaces import MPPCADenoise

    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        outputs = MPPCADenoise(in_file=str(files["mag"]), phase_file=str(files["phase"]), use_gpu=False).run().outputs
    finally:
        os.chdir(cwd)
    expected = denoise_complex(nib.load(files["mag"]).get_fdata(), nib.load(files["phase"]).get_fdata(),
                               device="cpu", nprocs=1)
    np.testing.assert_allclose(nib.load(outputs.out_file).get_fdata(), expected.denoised, atol=1e-3)
    np.testing.assert_allclose(nib.load(outputs.out_phase_file).get_fdata(), expected.phase, atol=1e-5)
    provenance = json.loads(open(outputs.provenance_file).read())
    assert provenance["Parameters"]["filter"] == provenance["EngineInfo"]["filter"] == "optthresh"
    assert provenance["Parameters"]["phase_method"] == "hann"
    assert provenance["Parameters"]["phase_file"] == "phase.nii.gz"
    assert (provenance["Parameters"]["noise_floor"], provenance["Parameters"]["coils"]) == ("none", 1)
    assert provenance["EngineInfo"]["phase_units"] == "radians"
    assert len(provenance["PhaseSHA256"]) == 64


def test_the_mppca_phase_method_denoises_first_and_lowers_the_whole_image_error():
    sigma = 250.0
    magnitude, phase, truth, _, _, _ = complex_dwi_phantom(SHAPE, VOLUMES, sigma=sigma)
    errors = {}
    for method in ("hann", "mppca"):
        result = denoise_complex(magnitude, phase, phase_method=method, device="cpu", nprocs=1)
        assert result.info["phase_method"] == method
        errors[method] = np.sqrt(np.mean((result.denoised - truth) ** 2))
    assert errors["mppca"] < 0.9 * errors["hann"]
    assert "first pass" in result.info["seconds"]
    assert result.info["phase_first_pass_stride"] == 2 * result.info["stride"]  # (FIRST_PASS_COARSENING)
    centre = denoise_complex(magnitude, phase, phase_method="mppca", device="cpu", nprocs=1, extent=5, stride=1,
                             aggregation="center")  # its first pass too takes every voxel's own window
    assert centre.info["phase_first_pass_stride"] == 1


def test_an_unknown_phase_method_fails_with_one_sentence():
    with pytest.raises(MPPCAInputError, match="phase_method must be one of hann, mppca, not 'apc'"):
        denoise_complex(np.ones((4, 4, 4, 5)), np.zeros((4, 4, 4, 5)), phase_method="apc")


def test_the_filter_reaches_the_real_parts_denoising():
    magnitude, phase, _, _, _, _ = complex_dwi_phantom(SHAPE, VOLUMES, sigma=100.0)
    hard = denoise_complex(magnitude, phase, device="cpu", nprocs=1, filter="hard")
    shrunk = denoise_complex(magnitude, phase, device="cpu", nprocs=1, filter="optshrink")
    assert shrunk.info["filter"] == "optshrink" and hard.info["filter"] == "hard"
    assert not np.array_equal(shrunk.denoised, hard.denoised)


def test_the_complex_benchmark_holds_the_filter_it_is_given(tmp_path):
    """benchmarks/complex_data.py --quick --filter hard: every run takes the filter; its complex row scores
    what denoise_complex(..., filter="hard") scores, not what the default filter does."""
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(repo / "benchmarks"))
    try:
        from noise_floor import QUICK_SHAPE, QUICK_SNRS, QUICK_VOLUMES, scores
    finally:
        sys.path.remove(str(repo / "benchmarks"))
    out = tmp_path / "complex.json"
    done = subprocess.run([sys.executable, str(repo / "benchmarks" / "complex_data.py"), "--quick", "--filter", "hard",
                           "--out", str(out)], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")])))
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["settings"]["filter"] == "hard"
    assert "filter 'hard'" in out.with_suffix(".md").read_text()
    row = next(row for row in report["rows"] if row["method"] == "complex, clip")
    sigma = 1000.0 / QUICK_SNRS[0]
    magnitude, phase, truth, _, _, _ = complex_dwi_phantom(QUICK_SHAPE, QUICK_VOLUMES, sigma=sigma, seed=0)
    expected = {name: scores(denoise_complex(magnitude, phase, device="cpu", nprocs=2, **options).denoised, truth,
                             sigma)["rmse_all"] for name, options in (("hard", dict(filter="hard")), ("default", {}))}
    assert expected["hard"] != expected["default"]
    assert row["rmse_all"] == pytest.approx(expected["hard"], rel=1e-9)
