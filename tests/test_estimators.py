"""The MP estimators, weights and projector (engine/estimators.py) against reference.mp_threshold, a plain
float64 loop over P written from DESIGN.md's formulas (exp1, exp2) and docs/options.md's (med, olesen2023),
and on NumPy and torch arrays alike."""

import numpy as np
import pytest

from mppca_nipype.engine.estimators import (
    ESTIMATORS, aggregation_weights, marchenko_pastur_median, marchenko_pastur_threshold, signal_projector)
from reference import mp_median, mp_threshold

torch = pytest.importorskip("torch")

ESTIMATORS = ["exp1", "exp2", "med", "olesen2023"]


def reference_thresholds(eigenvalues, n_voxels, n_volumes, estimator):
    n_volumes = np.broadcast_to(n_volumes, len(eigenvalues))
    found = [mp_threshold(e, int(n), int(t), estimator) for e, n, t in zip(eigenvalues, n_voxels, n_volumes)]
    return np.array([p for p, _ in found]), np.array([s for _, s in found])


def noisy_spectra(rng, n_patches, n_voxels, n_volumes, planted_rank=0, sigma=1.0, strength=30.0):
    """Ascending Gram eigenvalues of n x T matrices: a rank-``planted_rank`` signal plus N(0, sigma^2)."""
    spectra = []
    for _ in range(n_patches):
        X = sigma * rng.standard_normal((n_voxels, n_volumes))
        if planted_rank:
            u = np.linalg.qr(rng.standard_normal((n_voxels, planted_rank)))[0]
            v = np.linalg.qr(rng.standard_normal((n_volumes, planted_rank)))[0]
            singular = strength * sigma * np.sqrt(max(n_voxels, n_volumes)) * np.linspace(2, 1, planted_rank)
            X += (u * singular) @ v.T
        gram = X.T @ X if n_voxels >= n_volumes else X @ X.T
        spectra.append(np.linalg.eigvalsh(gram))
    return np.array(spectra)


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_random_spectra_match_the_formula_loop(estimator):
    rng = np.random.default_rng(1)
    eigenvalues = np.sort(rng.gamma(1.5, size=(400, 24)) ** 2, axis=1)
    n_voxels = np.full(400, 60)
    rank, sigma2 = marchenko_pastur_threshold(eigenvalues, n_voxels, 24, estimator)
    want_rank, want_sigma2 = reference_thresholds(eigenvalues, n_voxels, 24, estimator)
    assert np.array_equal(rank, want_rank)
    np.testing.assert_allclose(sigma2, want_sigma2, rtol=1e-12, atol=0)


@pytest.mark.parametrize("estimator", ESTIMATORS)
@pytest.mark.parametrize("n_voxels, n_volumes", [(125, 40), (27, 60), (48, 48)])
def test_planted_rank_is_recovered(estimator, n_voxels, n_volumes):
    rng = np.random.default_rng(2)
    eigenvalues = noisy_spectra(rng, 30, n_voxels, n_volumes, planted_rank=4)
    rank, sigma2 = marchenko_pastur_threshold(eigenvalues, np.full(30, n_voxels), n_volumes, estimator)
    want_rank, want_sigma2 = reference_thresholds(eigenvalues, np.full(30, n_voxels), n_volumes, estimator)
    assert np.array_equal(rank, want_rank)
    np.testing.assert_allclose(sigma2, want_sigma2, rtol=1e-12, atol=0)
    # the signal stands far above the noise edge: no planted component is lost (MP-PCA may keep one or two
    # noise components more, as it is known to, which lowers sigma), and sigma is near the truth, 1
    assert np.all(rank >= 4)
    assert np.median(rank) == 4
    assert np.all(np.abs(np.sqrt(sigma2[rank == 4]) - 1) < 0.15)
    assert abs(np.median(np.sqrt(sigma2)) - 1) < 0.1


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_pure_noise_keeps_almost_nothing(estimator):
    rng = np.random.default_rng(3)
    eigenvalues = noisy_spectra(rng, 40, 125, 30)
    rank, sigma2 = marchenko_pastur_threshold(eigenvalues, np.full(40, 125), 30, estimator)
    assert np.mean(rank) <= 1.0
    assert np.all(np.abs(np.sqrt(sigma2) - 1) < 0.15)


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_zero_spectrum_keeps_everything_with_sigma_zero(estimator):
    # all lambda = 0: (lambda_{P+1} - lambda_r) = 0 is never < 0 = 4 sqrt(gamma) sigma^2(P)
    rank, sigma2 = marchenko_pastur_threshold(np.zeros((2, 10)), np.array([30, 7]), 10, estimator)
    assert rank.tolist() == [10, 7]
    assert sigma2.tolist() == [0.0, 0.0]


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_flat_spectrum_is_all_noise(estimator):
    # every lambda = 3 / 30: their mean (exp1, exp2; olesen2023's q / (q - 0) = 1), or their median over the
    # median of the beta = 10 / 30 law (med)
    rank, sigma2 = marchenko_pastur_threshold(np.full((1, 10), 3.0), np.array([30]), 10, estimator)
    assert rank.tolist() == [0]
    want = 3.0 / 30 / (mp_median(10 / 30) if estimator == "med" else 1.0)
    assert sigma2[0] == pytest.approx(want, rel=1e-13)


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_ties_and_negative_roundoff_match_the_formula_loop(estimator):
    rng = np.random.default_rng(4)
    base = np.sort(rng.uniform(0.5, 1.5, size=(50, 16)), axis=1)
    base[:, :3] = np.array([-1e-9, 0.0, 0.0])  # eigensolver round-off below 0, exact zeros
    base[:, -3:] = 50.0  # three tied signal eigenvalues
    base[::5, 5:9] = base[::5, 5:6]  # ties inside the bulk
    eigenvalues = np.sort(base, axis=1)
    rank, sigma2 = marchenko_pastur_threshold(eigenvalues, np.full(50, 40), 16, estimator)
    want_rank, want_sigma2 = reference_thresholds(eigenvalues, np.full(50, 40), 16, estimator)
    assert np.array_equal(rank, want_rank)
    np.testing.assert_allclose(sigma2, want_sigma2, rtol=1e-12, atol=0)
    assert np.all(rank >= 3)


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_per_patch_voxel_counts_use_only_the_top_r_eigenvalues(estimator):
    # T = 20 volumes; patches of 1..60 voxels (NaN voxels left out). For n < T the matrix is n x n padded
    # to 20 with null directions below the usable eigenvalues; they must not change the answer.
    rng = np.random.default_rng(5)
    n_volumes, m = 20, 20
    n_voxels = rng.integers(1, 61, size=120)
    eigenvalues = np.sort(rng.gamma(2.0, size=(120, m)), axis=1)
    eigenvalues[:, -2:] += 40.0
    for b, n in enumerate(n_voxels):
        if n < m:
            eigenvalues[b, : m - n] = rng.uniform(-1e-9, 1e-9, size=m - n)
    rank, sigma2 = marchenko_pastur_threshold(eigenvalues, n_voxels, n_volumes, estimator)
    want_rank, want_sigma2 = reference_thresholds(eigenvalues, n_voxels, n_volumes, estimator)
    assert np.array_equal(rank, want_rank)
    np.testing.assert_allclose(sigma2, want_sigma2, rtol=1e-12, atol=0)

    nulled = eigenvalues.copy()
    for b, n in enumerate(n_voxels):
        if n < m:
            nulled[b, : m - n] = 0.0
    again = marchenko_pastur_threshold(nulled, n_voxels, n_volumes, estimator)
    assert np.array_equal(again[0], rank)
    np.testing.assert_allclose(again[1], sigma2, rtol=1e-12, atol=0)


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_per_patch_degrees_of_freedom_along_time(estimator):
    # demeaning leaves T - 1 usable directions; n_volumes may be an array
    rng = np.random.default_rng(6)
    eigenvalues = noisy_spectra(rng, 20, 40, 25, planted_rank=2)
    n_volumes = np.where(np.arange(20) % 2 == 0, 25, 24)
    rank, sigma2 = marchenko_pastur_threshold(eigenvalues, np.full(20, 40), n_volumes, estimator)
    want_rank, want_sigma2 = reference_thresholds(eigenvalues, np.full(20, 40), n_volumes, estimator)
    assert np.array_equal(rank, want_rank)
    np.testing.assert_allclose(sigma2, want_sigma2, rtol=1e-12, atol=0)


def test_exp2_keeps_no_more_than_exp1_and_is_closer_to_the_planted_rank():
    # exp2's gamma (r-P)/(q-P) exceeds exp1's (r-P)/q, so its threshold is higher: it never keeps more.
    # With 6 planted components in 27 x 30 patches exp1 keeps noise components that exp2 drops.
    rng = np.random.default_rng(7)
    eigenvalues = noisy_spectra(rng, 60, 27, 30, planted_rank=6, strength=2.0)
    n = np.full(60, 27)
    rank1, _ = marchenko_pastur_threshold(eigenvalues, n, 30, "exp1")
    rank2, _ = marchenko_pastur_threshold(eigenvalues, n, 30, "exp2")
    assert np.all(rank2 <= rank1)
    assert np.sum(rank2 < rank1) >= 10
    assert np.mean(np.abs(rank2 - 6)) < np.mean(np.abs(rank1 - 6))


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_numpy_and_torch_agree_exactly(estimator):
    # (med's median of the law takes sines and arctangents, which NumPy's and torch's libraries may round
    # apart by an ulp)
    rng = np.random.default_rng(8)
    n_voxels = rng.integers(5, 80, size=200)
    eigenvalues = np.sort(rng.gamma(1.5, size=(200, 30)) ** 2, axis=1)
    eigenvalues[:, -3:] += 20.0
    rank, sigma2 = marchenko_pastur_threshold(eigenvalues, n_voxels, 30, estimator)
    t_rank, t_sigma2 = marchenko_pastur_threshold(torch.from_numpy(eigenvalues), torch.from_numpy(n_voxels),
                                                  30, estimator)
    assert isinstance(t_rank, torch.Tensor)
    assert np.array_equal(t_rank.numpy(), rank)
    np.testing.assert_allclose(t_sigma2.numpy(), sigma2, rtol=1e-14 if estimator == "med" else 0, atol=0)


@pytest.mark.parametrize("xp", ["numpy", "torch"])
def test_the_marchenko_pastur_median_is_the_laws_median(xp):
    """mu(beta) against quadrature of the law's density (reference.mp_median), from beta near 0 to 1; 0.6528
    for a square matrix (Gavish & Donoho 2014's mu_1), decreasing in beta towards the law's mean 1 at 0."""
    beta = np.array([1e-6, 1e-4, 1 / 1331, 0.01, 0.05, 0.2, 1 / 3, 0.5, 0.75, 0.9, 48 / 49, 0.999, 0.999999, 1.0])
    got = marchenko_pastur_median(torch.from_numpy(beta) if xp == "torch" else beta)
    got = np.asarray(got)
    np.testing.assert_allclose(got, [mp_median(b) for b in beta], rtol=1e-13, atol=0)
    assert got[-1] == pytest.approx(0.6528, abs=5e-5)
    assert np.all(np.diff(got) < 0) and got[0] == pytest.approx(1, abs=1e-5)


@pytest.mark.parametrize("n_voxels, n_volumes", [(125, 40), (27, 60), (48, 48)])
def test_med_without_signal_is_gavish_and_donohos_median_estimate(n_voxels, n_volumes):
    """Pure noise: P_hat = 0 in most patches, and there sigma^2 is the median lambda over mu(r / q) (Gavish &
    Donoho's sigma from the median singular value); close to the truth, 1."""
    rng = np.random.default_rng(10)
    eigenvalues = noisy_spectra(rng, 40, n_voxels, n_volumes)
    rank, sigma2 = marchenko_pastur_threshold(eigenvalues, np.full(40, n_voxels), n_volumes, "med")
    r, q = min(n_voxels, n_volumes), max(n_voxels, n_volumes)
    median = np.median(eigenvalues[:, -r:] / q, axis=1)
    assert np.mean(rank == 0) >= 0.75
    np.testing.assert_allclose(sigma2[rank == 0], median[rank == 0] / mp_median(r / q), rtol=1e-13)
    assert abs(np.median(np.sqrt(sigma2)) - 1) < 0.03


def test_olesen2023_noise_variance_is_the_noise_sum_over_the_degrees_of_freedom_left():
    """sigma^2 = sum(s_{P+1..r}) / ((r - P)(q - P)) at the P_hat it chose, and the rank is the count above the
    whole patch's edge sigma^2 (1 + sqrt(r / q))^2 (given_noise_threshold's rule at that sigma^2)."""
    from mppca_nipype.engine.estimators import given_noise_threshold

    rng = np.random.default_rng(11)
    eigenvalues = noisy_spectra(rng, 30, 125, 40, planted_rank=3)
    rank, sigma2 = marchenko_pastur_threshold(eigenvalues, np.full(30, 125), 40, "olesen2023")
    assert np.all(rank == 3)
    noise_sum = eigenvalues[:, :-3].sum(axis=1)  # ascending: all but the top three
    np.testing.assert_allclose(sigma2, noise_sum / ((40 - 3) * (125 - 3)), rtol=1e-12)
    np.testing.assert_array_equal(given_noise_threshold(eigenvalues, np.full(30, 125), 40, sigma2), rank)


@pytest.mark.parametrize("estimator", ["med", "olesen2023"])
@pytest.mark.parametrize("n_voxels, n_volumes", [(125, 40), (343, 48), (27, 60), (48, 48)])
def test_the_edge_estimators_find_a_known_sigma_without_exp2s_bias(estimator, n_voxels, n_volumes):
    """A planted rank 4 in noise of sigma 1: the rank is found, and sigma within 1% in the median patch
    (olesen2023: 0.5%), closer than exp2, whose mean of the noise eigenvalues divides by q, not q - P (low by
    1-5% on the smaller patches)."""
    rng = np.random.default_rng(12)
    eigenvalues = noisy_spectra(rng, 100, n_voxels, n_volumes, planted_rank=4)
    rank, sigma2 = marchenko_pastur_threshold(eigenvalues, np.full(100, n_voxels), n_volumes, estimator)
    assert np.median(rank) == 4 and np.mean(rank == 4) >= 0.9
    error = abs(np.median(np.sqrt(sigma2)) - 1)
    assert error < (0.005 if estimator == "olesen2023" else 0.01)
    _, exp2_sigma2 = marchenko_pastur_threshold(eigenvalues, np.full(100, n_voxels), n_volumes, "exp2")
    assert abs(np.median(np.sqrt(exp2_sigma2)) - 1) > error


@pytest.mark.parametrize("n_voxels, n_volumes", [(125, 40), (343, 48), (27, 60), (48, 48)])
def test_med_scatters_more_from_patch_to_patch_than_olesen2023(n_voxels, n_volumes):
    """med's sigma rests on one or two noise eigenvalues, olesen2023's on their mean: on the same planted
    spectra the interquartile range of med's sigma is the wider."""
    rng = np.random.default_rng(13)
    eigenvalues = noisy_spectra(rng, 100, n_voxels, n_volumes, planted_rank=4)
    spreads = {}
    for estimator in ("med", "olesen2023"):
        _, sigma2 = marchenko_pastur_threshold(eigenvalues, np.full(100, n_voxels), n_volumes, estimator)
        low, high = np.percentile(np.sqrt(sigma2), [25, 75])
        spreads[estimator] = high - low
    assert spreads["med"] > spreads["olesen2023"]


def test_unknown_estimator_is_rejected():
    with pytest.raises(ValueError, match="estimator"):
        marchenko_pastur_threshold(np.ones((1, 4)), np.array([10]), 4, "exp3")


@pytest.mark.parametrize("xp", ["numpy", "torch"])
def test_aggregation_weights(xp):
    rank = np.array([0, 1, 5, 47])
    if xp == "torch":
        rank = torch.from_numpy(rank)
    as_list = lambda w: [float(v) for v in w]  # noqa: E731
    assert as_list(aggregation_weights(rank, False, "weighted")) == [1.0, 1 / 2, 1 / 6, 1 / 48]
    assert as_list(aggregation_weights(rank, True, "weighted")) == [1 / 2, 1 / 3, 1 / 7, 1 / 49]
    assert as_list(aggregation_weights(rank, True, "uniform")) == [1.0] * 4
    assert as_list(aggregation_weights(rank, False, "center")) == [1.0] * 4


@pytest.mark.parametrize("xp", ["numpy", "torch"])
def test_signal_projector_is_the_projector_onto_the_leading_eigenvectors(xp):
    rng = np.random.default_rng(9)
    m = 12
    rank = np.arange(m + 1)
    vectors = np.array([np.linalg.qr(rng.standard_normal((m, m)))[0] for _ in rank])
    if xp == "torch":
        projector = signal_projector(torch.from_numpy(vectors), torch.from_numpy(rank)).numpy()
    else:
        projector = signal_projector(vectors, rank)
    for P, V, proj in zip(rank, vectors, projector):
        np.testing.assert_allclose(proj @ proj, proj, atol=1e-12)  # idempotent
        np.testing.assert_allclose(proj, proj.T, atol=1e-12)  # orthogonal projector
        assert np.trace(proj) == pytest.approx(P, abs=1e-12)  # its rank is its trace
        leading, trailing = V[:, m - P:], V[:, : m - P]  # ascending order: the last P columns lead
        np.testing.assert_allclose(proj @ leading, leading, atol=1e-12)
        np.testing.assert_allclose(proj @ trailing, 0, atol=1e-12)


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_a_rank_that_is_not_unsettled_survives_every_move_within_the_uncertainty(estimator):
    """Spectra near their threshold: each is moved 60 times by up to ``delta`` (random moves, and the four
    extreme ones: all up, all down, spread apart, drawn together); a rank not flagged unsettled never changes,
    and a flagged one is flagged for a reason (a move within 100 times ``delta`` changes it)."""
    rng = np.random.default_rng(11)
    n_voxels, n_volumes = 27, 20
    spectra = noisy_spectra(rng, 400, n_voxels, n_volumes, planted_rank=3, strength=3.0)
    counts = np.full(len(spectra), n_voxels)
    for share in (2e-4, 1e-3, 5e-3):  # an uncertainty that leaves some ranks unsettled, not most
        delta = share * spectra[:, -1]
        rank, sigma2, unsettled = marchenko_pastur_threshold(spectra, counts, n_volumes, estimator, delta)
        if 0 < unsettled.sum() < len(spectra) / 2:
            break
    else:
        pytest.fail("no uncertainty left some of the ranks unsettled and not most")
    plain = marchenko_pastur_threshold(spectra, counts, n_volumes, estimator)
    np.testing.assert_array_equal(rank, plain[0])
    np.testing.assert_array_equal(sigma2, plain[1])

    def rank_moved(moves):
        return marchenko_pastur_threshold(spectra + moves, counts, n_volumes, estimator)[0]

    order = np.linspace(-1, 1, spectra.shape[1])[None, :]
    extreme = [np.ones_like(spectra), -np.ones_like(spectra), order * np.ones_like(spectra), -order]
    changed = np.zeros(len(spectra), bool)
    for unit_move in extreme + [rng.uniform(-1, 1, spectra.shape) for _ in range(56)]:
        changed |= rank_moved(unit_move * delta[:, None]) != rank
    assert not np.any(changed & ~unsettled)
    far = np.zeros(len(spectra), bool)
    for unit_move in extreme + [rng.uniform(-1, 1, spectra.shape) for _ in range(56)]:
        far |= rank_moved(100 * unit_move * delta[:, None]) != rank
    assert np.all(far[unsettled])


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_no_uncertainty_settles_everything_and_a_huge_one_nothing(estimator):
    rng = np.random.default_rng(12)
    spectra = noisy_spectra(rng, 50, 27, 20, planted_rank=2)
    counts = np.full(50, 27)
    assert not marchenko_pastur_threshold(spectra, counts, 20, estimator, np.zeros(50))[2].any()
    assert marchenko_pastur_threshold(spectra, counts, 20, estimator, np.full(50, 1e30))[2].all()


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_eigenvalues_at_round_off_give_every_machine_the_rank_of_exact_zeros(estimator):
    """A rank-deficient patch (voxels of exact zeros beside data: 27 voxels, 16 volumes, 7 null directions):
    its null eigenvalues are round-off, of either sign and any size within m eps of the largest, which each
    machine's BLAS sets differently. Every such spectrum gets the rank and noise level of exact zeros, in the
    engine's estimator and in the reference."""
    rng = np.random.default_rng(8)
    signal = np.sort(np.concatenate([rng.uniform(5.0, 200.0, 8), [9.9e5]]))
    exact = np.concatenate([np.zeros(7), signal])[None, :]
    want_rank, want_sigma2 = marchenko_pastur_threshold(exact, np.array([27]), 16, estimator)
    want_reference = mp_threshold(exact[0], 27, 16, estimator)
    for _ in range(20):
        null = rng.uniform(-1.0, 1.0, 7) * rng.uniform(0.01, 1.0) * 16 * np.finfo(np.float64).eps * 9.9e5
        noisy = np.sort(np.concatenate([null, signal]))[None, :]
        rank, sigma2 = marchenko_pastur_threshold(noisy, np.array([27]), 16, estimator)
        assert rank[0] == want_rank[0] and sigma2[0] == want_sigma2[0]
        assert mp_threshold(noisy[0], 27, 16, estimator) == want_reference
