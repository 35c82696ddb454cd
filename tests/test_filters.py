"""``denoise(filter=...)``: Gavish & Donoho's optimal shrinkage (``optshrink``) and optimal hard threshold
(``optthresh``) of each patch's singular values, the noise level (estimated or given) taken as known.
``estimators.component_weights`` against reference.filter_weights (a plain float64 loop written from the
papers' formulas), the CPU engine against reference.denoise_reference (same tolerances as
test_engine_cpu.py), and optshrink's error to the truth against hard thresholding's on a phantom."""

import math
import warnings

import numpy as np
import pytest

from mppca_nipype import MPPCAInputError, denoise
from mppca_nipype.engine import MPPCAWarning
from mppca_nipype.engine.estimators import component_weights, marchenko_pastur_threshold, optimal_hard_threshold
from mppca_nipype.phantoms import dwi_phantom, low_rank_phantom
from reference import filter_weights
from test_engine_cpu import assert_matches_reference, case_data, nonfinite_data, run_engine
from test_estimators import noisy_spectra

FILTERS = ["optshrink", "optthresh"]


def reference_weights(eigenvalues, n_voxels, n_volumes, sigma2, filter_name):
    """(B, m) ascending, as ``component_weights`` returns them, from the reference's descending loop."""
    batch, m = eigenvalues.shape
    n_volumes = np.broadcast_to(n_volumes, batch)
    weights = np.zeros((batch, m))
    for b in range(batch):
        w = filter_weights(eigenvalues[b], int(n_voxels[b]), int(n_volumes[b]), float(sigma2[b]), filter_name)
        weights[b, m - len(w):] = w[::-1]
    return weights


# -- the weights ------------------------------------------------------------------------------------------

def test_the_optimal_hard_threshold_is_4_over_sqrt_3_for_square_matrices():
    assert optimal_hard_threshold(np.float64(1.0)) == pytest.approx(4 / math.sqrt(3), rel=1e-15)
    # towards a thin matrix (beta -> 0) it falls to sqrt(2), growing with beta on the way
    betas = np.array([1e-12, 0.1, 0.25, 0.5, 1.0])
    assert optimal_hard_threshold(betas)[0] == pytest.approx(math.sqrt(2), rel=1e-6)
    assert np.all(np.diff(optimal_hard_threshold(betas)) > 0)
    # above the bulk edge 1 + sqrt(beta) of pure noise's singular values, always
    assert np.all(optimal_hard_threshold(betas) > 1 + np.sqrt(betas))


@pytest.mark.parametrize("filter_name", FILTERS)
@pytest.mark.parametrize("n_voxels, n_volumes", [(125, 40), (27, 60), (48, 48), (343, 30), (8, 96)])
def test_weights_match_the_formula_loop(filter_name, n_voxels, n_volumes):
    rng = np.random.default_rng(31)
    eigenvalues = noisy_spectra(rng, 30, n_voxels, n_volumes, planted_rank=4, sigma=2.0, strength=2.5)
    counts = np.full(30, n_voxels)
    sigma2 = np.full(30, 4.0)
    weights = component_weights(eigenvalues, counts, n_volumes, sigma2, filter_name)
    want = reference_weights(eigenvalues, counts, n_volumes, sigma2, filter_name)
    np.testing.assert_allclose(weights, want, rtol=1e-12, atol=1e-15)
    assert np.all((weights >= 0) & (weights <= 1))
    kept = (weights > 0).sum(axis=1)
    assert np.median(kept) == 4  # the planted components stand above the noise edge, the noise below it


@pytest.mark.parametrize("filter_name", FILTERS)
def test_per_patch_counts_and_variances_match_the_formula_loop(filter_name):
    # patches that lost voxels use only their top r = min(n, T) eigenvalues; T - 1 after voxel demeaning
    rng = np.random.default_rng(32)
    eigenvalues = np.sort(rng.gamma(1.5, size=(300, 24)) ** 2, axis=1)
    eigenvalues[:, :2] -= 1e-9  # negative round-off is clamped at 0
    n_voxels = rng.integers(3, 60, size=300)
    n_volumes = rng.choice([23, 24], size=300)
    sigma2 = rng.uniform(0.05, 0.5, size=300)
    sigma2[:5] = 0.0  # no noise found: every usable component whole
    weights = component_weights(eigenvalues, n_voxels, n_volumes, sigma2, filter_name)
    want = reference_weights(eigenvalues, n_voxels, n_volumes, sigma2, filter_name)
    np.testing.assert_allclose(weights, want, rtol=1e-12, atol=1e-15)
    assert np.array_equal((weights[:5] > 0).sum(axis=1), np.minimum(n_voxels, n_volumes)[:5])
    kept = (weights > 0).sum(axis=1)
    assert 0 < kept.mean() < 20  # neither all kept nor none
    # the kept components are each patch's leading ones (what the engines' eigenvectors hold)
    m = eigenvalues.shape[1]
    assert np.array_equal(weights > 0, np.arange(m)[None, :] >= (m - kept)[:, None])


def test_optshrink_shrinks_less_the_stronger_the_component():
    # eta(y) / y grows from 0 at the bulk edge 1 + sqrt(beta) towards 1
    beta, q = 0.5, 100
    y = np.array([1.0, 1 + math.sqrt(beta), 2.0, 4.0, 10.0, 100.0])
    eigenvalues = np.sort(y**2 * q)[None, :]  # sigma^2 = 1, lambda = y^2
    weights = component_weights(eigenvalues, np.array([50]), 100, np.array([1.0]), "optshrink")[0]
    assert weights[0] == 0 and weights[1] == 0
    assert np.all(np.diff(weights[1:]) > 0) and 0.99 < weights[-1] < 1


@pytest.mark.parametrize("filter_name", ["optshrink", "optthresh"])
def test_a_component_within_reach_of_the_cut_leaves_its_window_unsettled(filter_name):
    """The cut in eigenvalue units is q sigma^2 c (c = (1 + sqrt(beta))^2 or lambda*(beta)^2): an eigenvalue
    within (1 + c) uncertainties of it leaves the window unsettled; one beyond, or an uncertainty of 0, not."""
    beta, q = 0.5, 100
    c = (float(optimal_hard_threshold(np.asarray(beta))) ** 2 if filter_name == "optthresh"
         else (1 + math.sqrt(beta)) ** 2)
    cut = q * c  # sigma^2 = 1
    offsets = np.array([0.5, -0.5, 3.0, -3.0, 1e-9])  # in units of (1 + c) uncertainties
    eigenvalues = np.sort(np.stack([np.full(offsets.size, 0.2 * q), cut + offsets * (1 + c) * 1e-3,
                                    np.full(offsets.size, 50.0 * q)], axis=1), axis=1)
    sigma2 = np.ones(offsets.size)
    weights, unsettled = component_weights(eigenvalues, np.full(offsets.size, 50), q, sigma2, filter_name,
                                           np.full(offsets.size, 1e-3))
    assert unsettled.tolist() == [True, True, False, False, True]
    np.testing.assert_array_equal(weights, component_weights(eigenvalues, np.full(offsets.size, 50), q, sigma2,
                                                             filter_name))
    assert not component_weights(eigenvalues, np.full(offsets.size, 50), q, sigma2, filter_name,
                                 np.zeros(offsets.size))[1][:4].any()


def test_numpy_and_torch_agree():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(33)
    n_voxels = rng.integers(5, 80, size=200)
    eigenvalues = np.sort(rng.gamma(1.5, size=(200, 30)) ** 2, axis=1)
    sigma2 = rng.uniform(0.1, 1.0, size=200)
    for filter_name in FILTERS:
        weights = component_weights(eigenvalues, n_voxels, 30, sigma2, filter_name)
        t_weights = component_weights(torch.from_numpy(eigenvalues), torch.from_numpy(n_voxels), 30,
                                      torch.from_numpy(sigma2), filter_name)
        assert isinstance(t_weights, torch.Tensor)
        np.testing.assert_allclose(t_weights.numpy(), weights, rtol=1e-14, atol=0)


# -- the CPU engine against the reference -----------------------------------------------------------------

OPTION_SETS = [("center", "none", 1), ("center", "voxel", 1), ("weighted", "volume", 2),
               ("weighted", "voxel", 3), ("uniform", "none", 2)]


@pytest.mark.parametrize("filter_name", FILTERS)
@pytest.mark.parametrize("case", ["time-side", "voxel-side", "square", "anisotropic", "mask"])
@pytest.mark.parametrize("aggregation, demean, stride", OPTION_SETS)
def test_filters_match_the_reference(filter_name, case, aggregation, demean, stride):
    data, mask, extent = case_data(case, seed=41)
    result, _ = assert_matches_reference(data, mask, extent=extent, stride=stride, aggregation=aggregation,
                                         demean=demean, estimator="exp2", filter=filter_name)
    assert result.info["filter"] == filter_name


@pytest.mark.parametrize("filter_name", FILTERS)
@pytest.mark.parametrize("case", ["time-side", "voxel-side"])
@pytest.mark.parametrize("given", [None, "number"])
def test_filters_leave_nonfinite_voxels_out_and_take_a_given_noise_level(filter_name, case, given):
    data, mask = nonfinite_data(case)
    result, _ = assert_matches_reference(data, mask, extent=3, stride=2, aggregation="weighted",
                                         demean="volume", estimator="exp2", filter=filter_name,
                                         noise=None if given is None else 1.0)
    bad = ~np.isfinite(data).all(axis=3)
    assert np.all(result.rank[bad & mask] == 0)


def test_optshrink_changes_the_image_but_not_the_noise_map_at_center_aggregation():
    data, mask, extent = case_data("time-side", seed=42)
    options = dict(extent=extent, stride=1, aggregation="center", demean="none", estimator="exp2")
    hard = run_engine(data, mask, **options, filter="hard")
    shrunk = run_engine(data, mask, **options, filter="optshrink")
    assert np.array_equal(hard.sigma, shrunk.sigma)
    assert not np.array_equal(hard.denoised, shrunk.denoised)


# -- where it runs, and what it refuses -------------------------------------------------------------------

def test_an_unknown_filter_is_refused_in_one_sentence():
    data, _, _ = case_data("time-side")
    with pytest.raises(MPPCAInputError, match="filter must be one of hard, optshrink, optthresh, not 'soft'"):
        denoise(data, filter="soft", device="cpu")


def test_auto_chooses_the_device_for_a_filter_as_for_hard():
    from mppca_nipype.engine import choose_device, resolve_options

    for shape in ((9, 8, 7, 12), (96, 96, 60, 100)):
        chosen = [choose_device("auto", shape, resolve_options(shape, extent="wide", stride=3, estimator="exp2",
                                                                aggregation="weighted", demean="volume",
                                                                filter=filter_name))
                  for filter_name in ("hard", "optshrink", "optthresh")]
        assert chosen[1] == chosen[0] and chosen[2] == chosen[0]


# -- the point of it: closer to the truth -----------------------------------------------------------------

@pytest.mark.parametrize("phantom", ["low-rank", "dwi"])
def test_optshrink_is_closer_to_the_truth_than_hard_thresholding(phantom):
    if phantom == "low-rank":
        noisy, truth = low_rank_phantom((16, 16, 12), n_volumes=48, rank=8, sigma=20.0, seed=5)[:2]
    else:
        noisy, truth = dwi_phantom((16, 16, 12), n_volumes=48, sigma=20.0, seed=5)[:2]
    errors = {}
    for filter_name in ("hard", "optshrink"):
        result = denoise(noisy, filter=filter_name, device="cpu", nprocs=1)
        errors[filter_name] = float(np.sqrt(np.mean((result.denoised - truth) ** 2)))
    assert errors["optshrink"] < 0.99 * errors["hard"], errors


# -- the same option in the command, the interface and the provenance ------------------------------------

def test_mppca_denoise_takes_filter_and_its_help_gives_the_choices(tmp_path):
    import nibabel as nib
    from test_cli_denoise import run_cli, save

    data, _, _ = case_data("time-side", seed=43)
    save(data, tmp_path / "in.nii")
    out = tmp_path / "out.nii"
    result = run_cli(tmp_path / "in.nii", out, "--filter", "optshrink", "--nprocs", "1", "--quiet")
    assert result.returncode == 0, result.stderr
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MPPCAWarning)
        expected = denoise(data, filter="optshrink", device="cpu", nprocs=1)
    np.testing.assert_allclose(nib.load(out).get_fdata(), expected.denoised, rtol=0, atol=1e-3)
    assert "hard,optshrink,optthresh" in run_cli("--help").stdout


def test_the_interface_passes_filter_and_the_provenance_records_it(tmp_path):
    import nibabel as nib
    from bids_helpers import read_json
    from mppca_nipype.demo import write_series
    from mppca_nipype.interfaces import MPPCADenoise
    from test_interfaces import run_in

    noisy = dwi_phantom((10, 10, 8), 30, sigma=20.0, seed=3)[0]
    series = write_series(tmp_path / "in" / "dwi.nii.gz", noisy)
    result = run_in(tmp_path / "node", MPPCADenoise(in_file=str(series), filter="optthresh", use_gpu=False,
                                                     num_threads=1))
    provenance = read_json(result.outputs.provenance_file)
    assert provenance["Parameters"]["filter"] == "optthresh"
    assert provenance["EngineInfo"]["filter"] == "optthresh" and provenance["Backend"] == "cpu"
    expected = denoise(nib.load(series).get_fdata(dtype=np.float32), filter="optthresh", device="cpu", nprocs=1)
    np.testing.assert_allclose(nib.load(result.outputs.out_file).get_fdata(), expected.denoised, rtol=0,
                               atol=1e-3)


def test_the_methods_text_names_the_filter_and_cites_its_paper():
    from mppca_nipype.workflows import init_mppca_wf

    shrunk = init_mppca_wf(filter="optshrink", use_gpu=False)
    assert "optimal shrinker for the Frobenius loss" in shrunk.__desc__
    assert "10.1109/TIT.2017.2653801" in shrunk.__postdesc__
    hard = init_mppca_wf(filter="hard", use_gpu=False)
    assert "only the signal components were kept" in hard.__desc__ and "Gavish" not in hard.__postdesc__


def test_mppca_nipype_takes_filter_and_hands_it_to_every_run(tmp_path):
    from mppca_nipype.cli.bids_app import AppError, build_parser

    args = build_parser().parse_args([str(tmp_path), str(tmp_path / "out"), "participant", "--filter", "optthresh"])
    assert args.filter == "optthresh"
    assert build_parser().parse_args([str(tmp_path), str(tmp_path / "out"), "participant"]).filter is None
    assert "default: optshrink; for complex data" in " ".join(build_parser().format_help().split())
    with pytest.raises(AppError, match="--filter: invalid choice: 'soft'"):
        build_parser().parse_args([str(tmp_path), str(tmp_path / "out"), "participant", "--filter", "soft"])
