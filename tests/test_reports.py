"""QC reports: the figures of each run, the subject page, their speed, and what they claim about the data."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
import re

import matplotlib.figure  # noqa: F401  (imported once per process, as a MultiProc worker does on its first report)
import numpy as np
import pytest

from bids_helpers import validator_errors
from mppca_nipype import denoise
from mppca_nipype.bids import FIGURE_KINDS, report_names, subject_report_name
from mppca_nipype.cli.bids_app import main
from mppca_nipype.phantoms import low_rank_phantom
from mppca_nipype.reports import (FIGURES, _median_volume, expected_residual_sd, marchenko_pastur_density,
                                  sample_spectra, scaled_residuals,
                                  subject_report_html, write_run_figures)

FAST = ["--nprocs", "1", "--device", "cpu", "--plugin", "Linear"]
DEMO_RUNS = ("sub-01/dwi/sub-01_dwi.nii.gz", "sub-01/func/sub-01_task-rest_bold.nii.gz")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def run_app(*args):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as stopped:
        main([str(a) for a in args])
    return stopped.value.code, err.getvalue()


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """``mppca-nipype --demo`` (reports on by default), one run at a time so each report is timed alone."""
    root = tmp_path_factory.mktemp("demo")
    status, err = run_app("--demo", root, *FAST)
    assert status == 0, err
    return root, root / "derivatives" / "mppca-nipype", err


def read_png_size(path):
    """(width, height) of a PNG, after checking it decodes."""
    from matplotlib.image import imread

    data = Path(path).read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path} is not a PNG"
    image = imread(path)
    return image.shape[1], image.shape[0]


# ------------------------------------------------------------------------------------------ the BIDS app

def test_every_run_gets_its_figures_under_the_subjects_figures_folder(demo):
    _, derivatives, _ = demo
    for source in DEMO_RUNS:
        names = report_names(source)
        assert set(names) == set(FIGURES)
        for kind, name in names.items():
            assert name.startswith("sub-01/figures/") and name.endswith(f"_desc-{kind}_{Path(name).stem.split('_')[-1]}.png")
            width, height = read_png_size(derivatives / name)
            assert width >= 500 and height >= 250, f"{name} is {width}x{height}"


def test_the_subject_page_references_every_figure_of_every_run(demo):
    _, derivatives, err = demo
    page = derivatives / subject_report_name("01")
    assert f"QC report: {page}" in err
    text = page.read_text()
    sources = re.findall(r"<img src='([^']+)'", text)
    expected = [name for source in DEMO_RUNS for name in report_names(source).values()]
    assert sorted(sources) == sorted(expected)
    assert all((derivatives / source).is_file() for source in sources)
    assert "sub-01_desc-denoised_dwi" in text and "sub-01_task-rest_desc-denoised_bold" in text
    assert "median noise" in text and "logs/CITATION.md" in text


def test_each_run_report_takes_under_two_seconds(demo):
    """Loading the run, sampling the spectra, drawing and saving the four figures, on the demo's sizes.

    Measured in CPU time, which is the wall time on an idle core (the report is single-threaded) but does not
    grow when other work shares the machine. Matplotlib's import (0.3-0.5 s once per process) is done at the
    top of this module."""
    from nipype.utils.filemanip import loadpkl

    root, _, _ = demo
    results = sorted((root / "work").rglob("report_*/result_report_*.pklz"))
    assert len(results) == len(DEMO_RUNS)
    for result in results:
        outputs = loadpkl(result).outputs
        assert 0 < outputs.cpu_seconds < 2.0, f"{result.parent.name} took {outputs.cpu_seconds:.2f} s of CPU"
        assert outputs.seconds >= 0.8 * outputs.cpu_seconds


def test_the_derivatives_with_reports_pass_the_validator(demo):
    _, derivatives, _ = demo
    assert validator_errors(derivatives) == []


def test_no_reports_writes_no_figure_and_no_page(demo, tmp_path):
    root, _, _ = demo
    output = tmp_path / "out"
    status, err = run_app(root / "bids", output, "participant", "--no-reports", "--skip-bids-validation", *FAST)
    assert status == 0, err
    assert (output / "sub-01/dwi/sub-01_desc-denoised_dwi.nii.gz").is_file()
    assert not list(output.rglob("*.png")) and not list(output.glob("*.html"))
    assert not (output / "sub-01" / "figures").exists()
    assert "QC report" not in err


# ------------------------------------------------------------------------------------ what the figures say

@pytest.mark.parametrize("estimator", ["exp2", "med", "olesen2023"])
def test_sampled_spectra_make_the_runs_decision(estimator):
    """In dwidenoise's mode a voxel's noise and rank are its own patch's: a sampled patch must agree, and its
    cut-off (the estimator's) must separate what it kept from what it dropped."""
    noisy, _ = low_rank_phantom((14, 13, 12), 30, rank=4, sigma=10.0, seed=3)
    options = dict(extent=(5, 5, 5), stride=1, estimator=estimator, demean="none")
    result = denoise(noisy, aggregation="center", device="cpu", nprocs=1, **options)
    spectra = sample_spectra(noisy, n_sampled=60, **options)
    assert len(spectra) == 3 and spectra[0].rank <= spectra[1].rank <= spectra[2].rank
    for spectrum in spectra:
        centre = tuple(c + 2 for c in spectrum.corner)  # an interior voxel whose window this is
        assert spectrum.rank == result.rank[centre]
        assert np.sqrt(spectrum.sigma2) == pytest.approx(result.sigma[centre], rel=1e-5)
        assert spectrum.eigenvalues.size == 30 and np.all(np.diff(spectrum.eigenvalues) <= 0)
        noise = spectrum.eigenvalues[spectrum.rank:]
        assert noise.max() < spectrum.cutoff, "every noise eigenvalue is under the cut-off"
        if spectrum.rank:
            assert spectrum.eigenvalues[spectrum.rank - 1] > noise.max()
        if estimator != "exp2":  # the edge estimators keep exactly what lies above their cut-off
            assert spectrum.rank == 0 or spectrum.eigenvalues[spectrum.rank - 1] > spectrum.cutoff


def test_the_marchenko_pastur_density_has_mass_one_and_mean_sigma2():
    sigma2, gamma = 4.0, 0.3
    x = np.linspace(0, 20, 400_001)
    density = marchenko_pastur_density(x, sigma2, gamma)
    step = x[1] - x[0]
    assert density.sum() * step == pytest.approx(1, abs=2e-3)
    assert (x * density).sum() * step == pytest.approx(sigma2, rel=2e-3)
    assert density[x > sigma2 * (1 + np.sqrt(gamma)) ** 2].max() == 0


@pytest.mark.parametrize("demean", ["none", "voxel"])
def test_residuals_of_pure_signal_plus_noise_scale_to_unit_variance(demean):
    """The histogram's scale: residual / (sigma sqrt(1 - (P + d)/T)) has SD 1 when the model holds."""
    noisy, truth = low_rank_phantom((20, 20, 16), 40, rank=3, sigma=5.0, seed=4)
    result = denoise(noisy, stride=1, aggregation="center", demean=demean, device="cpu", nprocs=1)
    expected = expected_residual_sd(result.sigma, result.rank, noisy.shape[3], demean != "none")
    scaled = (noisy - result.denoised) / expected[..., None]
    assert scaled.std() == pytest.approx(1.0, abs=0.03)


def _series_in(order, values):
    """``values`` (X, Y, Z, T) as a C-order, a Fortran-order (nibabel's) or an axis-flipped view (a report's
    RAS turn of an image stored in another orientation)."""
    if order == "F":
        return np.asfortranarray(values)
    if order == "flipped":
        return np.asfortranarray(values[::-1, :, ::-1])[::-1, :, ::-1]
    return np.ascontiguousarray(values)


@pytest.mark.parametrize("order", ["C", "F", "flipped"])
def test_the_residuals_drawn_are_the_scaled_residuals_of_served_voxels(order):
    rng = np.random.default_rng(7)
    shape, n_volumes = (9, 7, 5), 11
    noisy = _series_in(order, rng.normal(100, 10, shape + (n_volumes,)).astype(np.float32))
    denoised = _series_in(order, rng.normal(100, 10, shape + (n_volumes,)).astype(np.float32))
    sigma = rng.uniform(1, 3, shape).astype(np.float32)
    sigma[rng.random(shape) < 0.3] = 0  # not served
    rank = rng.integers(0, 4, shape).astype(np.float32)
    rank[0, 0, 0], sigma[0, 0, 0] = n_volumes, 2.0  # served, but no residual expected: left out
    served = (sigma > 0) & (rank + 1 < n_volumes)
    every = ((noisy - denoised)[served] / expected_residual_sd(sigma, rank, n_volumes, True)[served][:, None]).ravel()

    all_drawn = scaled_residuals(noisy, denoised, sigma, rank, True, max_values=every.size)
    np.testing.assert_array_equal(np.sort(all_drawn), np.sort(every))
    some = scaled_residuals(noisy, denoised, sigma, rank, True, max_values=50, seed=3)
    assert some.size == 50 and np.isin(some, every).all() and np.unique(some).size == 50
    np.testing.assert_array_equal(some, scaled_residuals(noisy, denoised, sigma, rank, True, max_values=50, seed=3))


@pytest.mark.parametrize("order", ["C", "F", "flipped"])
def test_the_slices_show_the_volume_of_median_mean_over_the_served_voxels(order):
    rng = np.random.default_rng(8)
    values = rng.normal(0, 1, (8, 6, 5, 9)).astype(np.float32) + rng.permutation(9).astype(np.float32) * 10
    served = rng.random((8, 6, 5)) < 0.5
    values[~served] += np.arange(9, dtype=np.float32)[::-1] * 100  # voxels outside: the other way round
    means = values[served].mean(axis=0)
    assert _median_volume(_series_in(order, values), served) == int(np.argsort(means)[4])
    everywhere = values.reshape(-1, 9).mean(axis=0)
    assert _median_volume(_series_in(order, values), np.zeros_like(served)) == int(np.argsort(everywhere)[4])


def test_each_figure_kind_the_derivative_names_know_has_a_title_and_caption_in_page_order():
    assert tuple(FIGURES) == FIGURE_KINDS
    assert all(title and caption for title, caption in FIGURES.values())


def test_write_run_figures_from_python(tmp_path):
    noisy, _ = low_rank_phantom((12, 12, 10), 20, rank=3, sigma=5.0, seed=5)
    result = denoise(noisy, device="cpu", nprocs=1)
    paths = write_run_figures(noisy, result, tmp_path / "figures", zooms=(2.0, 2.0, 2.5), title="phantom")
    assert tuple(paths) == FIGURE_KINDS
    for path in paths.values():
        read_png_size(path)


def test_the_page_escapes_what_it_shows():
    run = dict(name="sub-01_<b>_bold", figures={"slices": "sub-01/figures/a.png"},
               provenance={"NoiseMedian": 1.0, "RankMedian": 2.0, "Warnings": ["<script>"]})
    text = subject_report_html("01", [run])
    assert "<script>" not in text and "&lt;script&gt;" in text and "sub-01_&lt;b&gt;_bold" in text


@pytest.mark.parametrize("affine", [np.diag([-2.0, 3.0, 1.5, 1.0]),
                                    np.array([[0, -1.0, 0, 0], [0, 0, 2.5, 0], [-3.0, 0, 0, 0], [0, 0, 0, 1.0]])])
def test_a_report_reads_the_series_as_nibabels_closest_canonical(tmp_path, affine):
    """``load_for_report`` (ISA-L, axes turned as a view) gives what ``nibabel.as_closest_canonical`` gives."""
    import nibabel as nib

    from mppca_nipype.reports import load_for_report

    data = np.random.default_rng(6).standard_normal((5, 6, 7, 3)).astype(np.float32)
    image = nib.Nifti1Image(data, affine)
    image.header.set_zooms((*np.abs(affine[:3, :3]).max(axis=0), 2.0))
    nib.save(image, tmp_path / "series.nii.gz")
    canonical = nib.as_closest_canonical(nib.load(tmp_path / "series.nii.gz"))
    values, zooms = load_for_report(tmp_path / "series.nii.gz")
    np.testing.assert_array_equal(values, canonical.get_fdata(dtype=np.float32))
    assert zooms == tuple(float(z) for z in canonical.header.get_zooms()[:3])
