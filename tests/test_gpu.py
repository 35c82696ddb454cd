"""The GPU engine on a CUDA device against the CPU backend, for every option (the engine's tolerances):
denoised series within 1e-4 rms (relative), ranks equal in at least 99.5% of patches.

Marked ``gpu``; skipped where the GPU engine cannot run (no torch/triton, no CUDA device).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from mppca_nipype.engine import denoise
from mppca_nipype.phantoms import dwi_phantom, low_rank_phantom

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def cuda():
    from mppca_nipype.engine.gpu import usable

    reason = usable()
    if reason is not None:
        pytest.skip(reason)


def compare(noisy, mask=None, **options):
    """Denoise on the GPU and on the CPU; check the denoised series and noise maps; return both results.

    Ranks are compared patch by patch in ``test_patch_ranks_match_cpu`` (with ``center`` aggregation the
    rank map is the patches' ranks, so it is checked here too).
    """
    gpu = denoise(noisy, mask, device="cuda", **options)
    cpu = denoise(noisy, mask, device="cpu", nprocs=4, **options)
    assert gpu.info["backend"] == "gpu" and cpu.info["backend"] == "cpu"
    finite = np.isfinite(cpu.denoised)
    assert (np.isfinite(gpu.denoised) == finite).all()
    rms = np.sqrt(np.mean((gpu.denoised[finite].astype(np.float64) - cpu.denoised[finite]) ** 2)
                  / np.mean(cpu.denoised[finite].astype(np.float64) ** 2))
    sigma_rms = np.sqrt(np.mean((gpu.sigma - cpu.sigma) ** 2) / np.mean(cpu.sigma**2))
    rank_difference = np.abs(gpu.rank - cpu.rank)
    summary = (f"denoised rms {rms:.2e}, noise map rms {sigma_rms:.2e}, rank maps equal in "
               f"{np.mean(rank_difference < 1e-3):.4f} of voxels, mean |difference| {rank_difference.mean():.2e}")
    print(options, summary)
    assert rms <= 1e-4, summary
    assert sigma_rms <= 1e-3, summary
    if options.get("aggregation") == "center":
        assert np.mean(rank_difference < 1e-3) >= 0.995, summary
    else:
        assert rank_difference.mean() <= 1e-2, summary
    return gpu, cpu


@pytest.mark.parametrize("estimator", ["exp2", "exp1", "med", "olesen2023"])
@pytest.mark.parametrize("demean", ["voxel", "volume", "none"])
def test_patch_ranks_match_cpu(estimator, demean):
    """Every patch's rank from the GPU's Gram, eigensolver and estimator equals the CPU's in >= 99.5%."""
    import torch

    from mppca_nipype.engine import check_data, plan_patches, resolve_options
    from mppca_nipype.engine.cpu import fit_windows
    from mppca_nipype.engine.estimators import marchenko_pastur_threshold
    from mppca_nipype.engine.gpu import gram as fused
    from mppca_nipype.engine.gpu.cusolver import BatchedEigh
    from mppca_nipype.engine.gpu.plan import gram_precision

    noisy, _ = low_rank_phantom((30, 28, 20), n_volumes=32, rank=5, sigma=4.0, seed=2)
    data, mask = check_data(noisy, None)
    options = resolve_options(data.shape, extent="auto", stride=2, estimator=estimator, aggregation="weighted",
                              demean=demean)
    finite = np.isfinite(data).all(axis=3)
    plan = plan_patches(data.shape[:3], options.extent, options.stride, mask, finite)
    volume = data.reshape(-1, data.shape[3])
    cpu_rank = fit_windows(volume, finite.ravel(), plan, options, slice(None)).rank

    gram, n_took_part, _ = fused.gram(
        torch.from_numpy(volume).cuda(), torch.from_numpy(finite.ravel().astype(np.float32)).cuda(),
        torch.from_numpy(plan.window_base()).cuda(), torch.from_numpy(plan.voxel_offsets.astype(np.int32)).cuda(),
        demean=demean, dtype=gram_precision(options))
    values, _, info = BatchedEigh("cuda")(gram)
    gpu_rank, _ = marchenko_pastur_threshold(values.double(), n_took_part - int(demean == "volume"),
                                             data.shape[3] - int(demean == "voxel"), estimator)
    assert (info == 0).all()
    same = np.mean(gpu_rank.cpu().numpy() == cpu_rank)
    print(estimator, demean, f"patch ranks equal in {same:.5f} of {plan.n_windows}")
    assert same >= 0.995


@pytest.mark.parametrize("estimator", ["exp2", "exp1"])
@pytest.mark.parametrize("demean", ["voxel", "volume", "none"])
@pytest.mark.parametrize("aggregation, stride", [("weighted", 2), ("uniform", 3), ("center", 1), ("gaussian", 2)])
def test_gpu_matches_cpu_for_every_option(estimator, demean, aggregation, stride):
    noisy, _ = low_rank_phantom((30, 28, 20), n_volumes=32, rank=5, sigma=4.0, seed=stride)
    gpu, _ = compare(noisy, extent="auto", stride=stride, estimator=estimator, aggregation=aggregation,
                     demean=demean)
    # voxel demeaning on a full grid of windows takes the box sums (uniform weights within each window)
    assert gpu.info["gram_path"] == ("box" if demean == "voxel" and aggregation in ("weighted", "uniform")
                                     else "fused")


@pytest.mark.parametrize("aggregation, stride, demean, filter_name", [
    ("gaussian", 2, "volume", "optshrink"), ("weighted", 3, "voxel", "hard"), ("center", 1, "none", "hard"),
    ("uniform", 2, "volume", "optthresh")])
def test_spheres_match_cpu(aggregation, stride, demean, filter_name):
    """Spheres (radius 5 for extent 7, 4 for extent 5; clipped at the image's edges) on the compiled kernels,
    with a mask and a voxel holding NaN."""
    noisy, _ = low_rank_phantom((30, 28, 20), n_volumes=40, rank=5, sigma=4.0, seed=7)
    noisy[3, 4, 5, 6] = np.nan
    mask = np.ones(noisy.shape[:3], bool)
    mask[:4] = False
    gpu, _ = compare(noisy, mask, extent=7 if stride > 1 else 5, stride=stride, aggregation=aggregation,
                     demean=demean, filter=filter_name, shape="sphere")
    assert gpu.info["shape"] == "sphere" and gpu.info["gram_path"] == "fused"


@pytest.mark.parametrize("estimator", ["med", "olesen2023"])
@pytest.mark.parametrize("shape, n_volumes, options, path", [
    ((30, 28, 20), 32, dict(extent="auto", stride=2, aggregation="weighted", demean="volume"), "fused"),
    ((30, 28, 20), 32, dict(extent="auto", stride=2, aggregation="uniform", demean="voxel"), "box"),
    ((24, 24, 16), 48, dict(extent=5, stride=1, aggregation="center", demean="none"), "fused"),
    ((24, 24, 16), 48, dict(extent="wide", stride=3, aggregation="weighted", demean="volume"), "fused"),
    ((16, 16, 12), 200, dict(extent=7, stride=3, aggregation="weighted", demean="volume"), "gather")])
def test_the_edge_estimators_match_cpu(estimator, shape, n_volumes, options, path):
    """``denoise(..., estimator=med|olesen2023, device="cuda")`` against the CPU on each first-pass path (the
    float32 Gram with the tridiagonal kernels, the box sums, dwidenoise's mode with the mean taken apart, the
    defaults' geometry, a long series refined at both ends): denoised within 1e-4 rms, noise map within
    1e-3, ranks equal in at least 99.5% of the voxels (the rank map of weighted aggregation too), and few
    windows redone in float64."""
    noisy, _ = low_rank_phantom(shape, n_volumes=n_volumes, rank=5, sigma=4.0, seed=31)
    gpu, cpu = compare(noisy, estimator=estimator, **options)
    assert gpu.info["gram_path"] == path
    same = np.mean(np.abs(gpu.rank - cpu.rank) < 1e-3)
    print(estimator, options, f"ranks equal in {same:.5f} of voxels, {gpu.info['n_settled_in_float64']} of "
          f"{gpu.info['n_windows']} windows settled in float64")
    assert same >= 0.995
    assert gpu.info["n_settled_in_float64"] <= 0.25 * gpu.info["n_windows"]


@pytest.mark.parametrize("aggregation, stride", [("weighted", 2), ("center", 1)])
def test_volume_demeaning_in_float32_on_a_large_baseline_matches_cpu(aggregation, stride):
    """Voxel offsets of up to 300 on a baseline of 1000, noise 4: the float32 Gram of the centred patch
    (centred before accumulating) keeps the noise eigenvalues."""
    noisy, _ = low_rank_phantom((24, 24, 16), n_volumes=48, rank=5, sigma=4.0, seed=12)
    noisy += (300 * np.random.default_rng(12).random(noisy.shape[:3], dtype=np.float32))[..., None]
    gpu, _ = compare(noisy, extent=5, stride=stride, aggregation=aggregation, demean="volume")
    assert gpu.info["gram_precision"] == "float32" and gpu.info["gram_path"] == "fused"


def test_dwidenoise_mode_on_a_large_baseline_matches_cpu(monkeypatch):
    """No demeaning on a baseline near 1000: float32 eigenvalues of X^T X would lose the noise bulk, so the
    default run takes the patch's mean apart (float32, tridiagonal kernels); the plain float64 run too."""
    noisy, _ = low_rank_phantom((24, 24, 16), n_volumes=48, rank=5, sigma=4.0, seed=11)
    options = dict(extent=5, stride=1, estimator="exp2", aggregation="center", demean="none")
    gpu, _ = compare(noisy, **options)
    assert gpu.info["gram_precision"] == "float32" and gpu.info["mean_taken_apart"]
    assert gpu.info["eigensolver"].startswith("triton tridiagonal")
    from mppca_nipype.engine.gpu import plan

    monkeypatch.setattr(plan, "takes_mean_apart", lambda *args: False)
    gpu, _ = compare(noisy, **options)
    assert gpu.info["gram_precision"] == "float64" and not gpu.info["mean_taken_apart"]


@pytest.mark.parametrize("aggregation, stride", [("weighted", 2), ("center", 1)])
@pytest.mark.parametrize("demean", ["voxel", "volume"])
def test_gpu_matches_cpu_with_mask_and_nonfinite_voxels(aggregation, stride, demean):
    noisy, _, _, _ = dwi_phantom((26, 24, 18), n_volumes=30, sigma=20.0, seed=3)
    noisy[5, 6, 7, 3] = np.nan
    noisy[10, 10, 10, :] = np.inf
    mask = np.zeros(noisy.shape[:3], bool)
    mask[3:22, 2:20, 1:15] = True
    with pytest.warns(Warning, match="NaN or Inf"):
        gpu, _ = compare(noisy, mask, extent=(5, 5, 3), stride=stride, aggregation=aggregation, demean=demean)
    assert np.isnan(gpu.denoised[5, 6, 7, 3]) and (gpu.denoised[~mask] == 0).all()


@pytest.mark.parametrize("aggregation, stride", [("weighted", 2), ("center", 1)])
@pytest.mark.parametrize("demean", ["voxel", "volume"])
def test_voxel_side_gram_when_patches_have_fewer_voxels_than_volumes(aggregation, stride, demean):
    noisy, _ = low_rank_phantom((20, 18, 14), n_volumes=60, rank=4, sigma=4.0, seed=5)
    gpu, _ = compare(noisy, extent=3, stride=stride, aggregation=aggregation, demean=demean)
    assert gpu.info["gram_path"] == "gather"


@pytest.mark.parametrize("demean", ["voxel", "volume"])
def test_long_series_take_the_gathered_path(demean):
    noisy, _ = low_rank_phantom((16, 16, 12), n_volumes=200, rank=6, sigma=4.0, seed=8)
    gpu, _ = compare(noisy, extent=7, stride=3, demean=demean)
    assert gpu.info["gram_path"] == "gather"


@pytest.mark.parametrize("noise", [None, 8.0])
def test_the_longest_series_find_only_the_leading_eigenpairs(noise):
    """A multi-echo series of 3 x 300 volumes with a mask cutting through the patches: with the defaults
    (olesen2023), or a given noise level, the GPU finds only the leading eigenpairs of the 900-column Grams,
    matches the CPU, and redoes few windows with the full eigensolve."""
    from mppca_nipype.phantoms import multi_echo_phantom

    noisy, _ = multi_echo_phantom((20, 20, 14), n_volumes=300, seed=4)
    mask = np.zeros(noisy.shape[:3], bool)
    mask[2:18, 3:19, 1:12] = True
    gpu, _ = compare(noisy, mask, extent=11, noise=noise)  # (the phantom's noise is 8)
    assert gpu.info["leading_eigenpairs"] and gpu.info["gram_path"] == "gather"
    print(f"{gpu.info['n_settled_in_float64']} of {gpu.info['n_windows']} windows redone")
    assert gpu.info["n_settled_in_float64"] <= 0.1 * gpu.info["n_windows"]


@pytest.mark.parametrize("demean", ["voxel", "volume"])
def test_float32_runs_redo_few_windows_in_float64(demean):
    """The windows whose rank float32 cannot settle are redone in float64: some, not most (2-11% on the
    H200 on low-rank phantoms of 12,600-14,415 windows)."""
    noisy, _ = low_rank_phantom((30, 28, 20), n_volumes=32, rank=5, sigma=4.0, seed=2)
    gpu, _ = compare(noisy, extent="auto", stride=2, aggregation="weighted", demean=demean)
    assert gpu.info["gram_precision"] == "float32"
    assert gpu.info["n_settled_in_float64"] <= 0.25 * gpu.info["n_windows"]


def test_the_gpu_returns_values_divided_on_the_device():
    """The engine gets normalized sums from the GPU (no host-side division of the (V, T) sums)."""
    from mppca_nipype.engine import check_data, plan_patches, resolve_options
    from mppca_nipype.engine.gpu.pipeline import denoise_gpu

    noisy, _ = low_rank_phantom((16, 14, 12), n_volumes=32, rank=4, sigma=4.0, seed=9)
    data, mask = check_data(noisy, None)
    options = resolve_options(data.shape, extent=5, stride=2, estimator="exp2", aggregation="weighted",
                              demean="volume")
    finite = np.isfinite(data).all(axis=3)
    plan = plan_patches(data.shape[:3], options.extent, options.stride, mask, finite)
    values = denoise_gpu(data, finite, plan, options)
    sums = denoise_gpu(data, finite, plan, options, normalize=False)
    assert values.normalized and not sums.normalized
    served = sums.weight > 0
    np.testing.assert_allclose(values.image[served], sums.image[served] / sums.weight[served, None], rtol=1e-6)
    np.testing.assert_allclose(values.rank[served], sums.rank[served] / sums.weight[served], rtol=1e-6)


def test_cusolver_eigensolver_matches_numpy():
    import torch

    from mppca_nipype.engine.gpu.cusolver import BatchedEigh

    solver = BatchedEigh("cuda")
    assert solver.backend == "cusolverDnXsyevBatched"
    rng = np.random.default_rng(0)
    a = rng.standard_normal((300, 48, 40))
    matrices = a @ a.transpose(0, 2, 1)
    want = np.linalg.eigvalsh(matrices)
    for dtype, tolerance in ((torch.float32, 1e-5), (torch.float64, 1e-12)):
        values, vectors, info = solver(torch.tensor(matrices, dtype=dtype, device="cuda"))
        assert (info == 0).all()
        values, vectors = values.double().cpu().numpy(), vectors.double().cpu().numpy()
        assert np.abs(values - want).max() / np.abs(want).max() < tolerance
        residual = matrices @ vectors - vectors * values[:, None, :]
        assert np.abs(residual).max() / np.abs(want).max() < 10 * tolerance


@pytest.mark.parametrize("m", [16, 33, 48, 64, 100, 128])
def test_tridiagonal_eigensolver_matches_numpy(m):
    """The Triton tridiagonal kernels on the device: eigenvalues and the projector onto the leading
    eigenvectors against NumPy's float64 LAPACK, in float32 and float64, at every matrix order they take."""
    import torch

    from mppca_nipype.engine.gpu.tridiagonal import TridiagonalEigh

    rng = np.random.default_rng(m)
    a = rng.standard_normal((200, m, m + 7))
    a[:, :, :3] *= 30  # three leading components
    matrices = a @ a.transpose(0, 2, 1)
    want, vectors = np.linalg.eigh(matrices)
    ranks = rng.choice([0, 1, 2, 3, m], size=200)  # cuts at the leading components' wide gaps
    expected = np.stack([v[:, m - r:] @ v[:, m - r:].T for v, r in zip(vectors, ranks)])
    solver = TridiagonalEigh("cuda")
    for dtype, tolerance in ((torch.float32, 1e-5), (torch.float64, 1e-12)):
        values, info = solver.values(torch.tensor(matrices, dtype=dtype, device="cuda"))
        projector = solver.projector(torch.tensor(ranks, device="cuda")).double().cpu().numpy()
        assert (info == 0).all() and values.dtype == dtype
        assert np.abs(values.double().cpu().numpy() - want).max() / np.abs(want).max() < tolerance
        # a projector's error is the eigenvalues' over the gap at its cut: compare where the gap is wide
        gap = np.array([(w[m - r] - w[m - r - 1]) / w[-1] if 0 < r < m else 1.0 for w, r in zip(want, ranks)])
        wide = gap > 1e-3
        assert wide.sum() > 150
        assert np.abs(projector - expected)[wide].max() < 1e3 * tolerance


@pytest.mark.parametrize("dtype_name", ["float32", "float64"])
def test_the_compiled_tridiagonal_kernels_divide_by_the_hardwares_reciprocal_to_lapacks_precision(dtype_name):
    """Compiled, the Sturm counts and the inverse iteration multiply by the hardware's approximate reciprocal
    (float64: refined by Newton steps) instead of dividing: on seed-like patches the eigenvalues are LAPACK's
    to the precision's rounding of the largest and the projectors LAPACK's to the precision's rounding over
    the gap at their cut, in a whole launch and in a counted one (a settling pass's: its own warps and two
    shifts a Sturm count)."""
    import torch

    from mppca_nipype.engine.gpu import tridiagonal

    dtype, m, solved = getattr(torch, dtype_name), 48, 200
    rng = np.random.default_rng(7)
    # seed-like patches: 1331 voxels, five signal components of decreasing strength on noise 4
    loads = rng.standard_normal((300, m, 5)) * np.array([60.0, 30, 15, 8, 5])
    a = rng.standard_normal((300, m, 1331)) * 4 + loads @ rng.standard_normal((300, 5, 1331))
    matrices = a @ a.transpose(0, 2, 1)
    want, vectors = np.linalg.eigh(matrices[:solved])
    ranks = rng.choice([0, 5], size=300)
    expected = np.stack([v[:, m - r:] @ v[:, m - r:].T for v, r in zip(vectors, ranks)])
    gap = np.array([w[m - r] - w[m - r - 1] if r else np.inf for w, r in zip(want, ranks)])
    eps, scale = torch.finfo(dtype).eps, np.abs(want).max()
    for count in (None, torch.tensor(solved, device="cuda")):
        solver = tridiagonal.TridiagonalEigh("cuda")
        values, _ = solver.values(torch.tensor(matrices, dtype=dtype, device="cuda"), count=count)
        projector = solver.projector(torch.tensor(ranks, device="cuda")).double().cpu().numpy()[:solved]
        assert np.abs(values.double().cpu().numpy()[:solved] - want).max() <= 8 * m * eps * scale, count
        error = np.abs(projector - expected).max(axis=(1, 2))
        assert (error <= 40 * m * eps + 2 * eps * scale / gap).all(), (count, error.max())


@pytest.mark.parametrize("options", [dict(extent=5, stride=2, demean="volume"),
                                     dict(extent=5, stride=1, aggregation="center", demean="none")])
def test_pipeline_with_the_tridiagonal_eigensolver_matches_cpu(options):
    from mppca_nipype.engine import check_data, plan_patches, resolve_options
    from mppca_nipype.engine.cpu import denoise_cpu
    from mppca_nipype.engine.gpu.pipeline import denoise_gpu

    noisy, _ = low_rank_phantom((30, 28, 20), n_volumes=48, rank=5, sigma=8.0, seed=5)
    data, mask = check_data(noisy, None)
    resolved = resolve_options(data.shape, **{**dict(estimator="exp2", aggregation="weighted"), **options})
    finite = np.ones(data.shape[:3], bool)
    plan = plan_patches(data.shape[:3], resolved.extent, resolved.stride, mask, finite)
    cpu = denoise_cpu(data, finite, plan, resolved, nprocs=4)
    gpu = denoise_gpu(data, finite, plan, resolved, eigensolver="tridiagonal")
    assert gpu.info["eigensolver"].startswith("triton tridiagonal")
    served = cpu.weight > 0
    want = cpu.image[served] / cpu.weight[served][:, None]
    rms = np.sqrt(np.mean((gpu.image[served] - want) ** 2) / np.mean(want**2))
    ranks = np.mean(np.abs(gpu.rank[served] - cpu.rank[served] / cpu.weight[served]) < 1e-3)
    print(options, f"denoised rms {rms:.2e}, ranks equal in {ranks:.4f} of voxels")
    assert rms <= 1e-4
    assert ranks >= (0.995 if options.get("aggregation") == "center" else 0.9)


@pytest.mark.parametrize("demean", ["voxel", "volume"])
def test_the_reconstructions_tf32x3_products_keep_float32_accuracy(demean):
    """The fused reconstruction multiplies X_c P with ``tl.dot(input_precision="tf32x3")`` (three TF32
    tensor-core products a tile): its sums within 1e-6 of a float64 reference, as float32's own products."""
    import torch

    from mppca_nipype.engine.gpu import gram, reconstruction

    rng = np.random.default_rng(3)
    n_rows, n_volumes, n_voxels, batch = 4000, 48, 343, 64
    volume = (1000 + 30 * rng.standard_normal((n_rows, n_volumes))).astype(np.float32)
    finite = np.ones(n_rows, dtype=np.float32)
    offsets = np.sort(rng.choice(n_rows // 2, size=n_voxels, replace=False)).astype(np.int32)
    base = rng.integers(0, n_rows - offsets.max(), size=batch).astype(np.int64)
    q, _ = np.linalg.qr(rng.standard_normal((batch, n_volumes, 5)))
    projector = (q @ q.transpose(0, 2, 1)).astype(np.float32)
    weight = rng.uniform(0.1, 1, batch).astype(np.float32)
    on_device = [torch.from_numpy(x).cuda() for x in (volume, finite, base, offsets)]
    _, _, volume_mean = gram.gram(*on_device, demean=demean)
    sums = [torch.zeros((n_rows, n_volumes), device="cuda")] + [torch.zeros(n_rows, device="cuda") for _ in range(3)]
    reconstruction.reconstruct_accumulate(*on_device, torch.from_numpy(projector).cuda(),
                                          *(torch.from_numpy(weight).cuda(),) * 3, *sums, demean=demean,
                                          volume_mean=volume_mean)
    patches = volume[base[:, None] + offsets[None, :]].astype(np.float64)
    means = patches.mean(axis=2 if demean == "voxel" else 1, keepdims=True)
    restored = (patches - means) @ projector.astype(np.float64) + means
    expected = np.zeros((n_rows, n_volumes))
    np.add.at(expected, base[:, None] + offsets[None, :], restored * weight[:, None, None])
    got = sums[0].cpu().numpy()
    assert np.linalg.norm(got - expected) / np.linalg.norm(expected) < 1e-6


def test_dwidenoise_mode_in_float32_with_the_mean_taken_apart_matches_cpu():
    """No demeaning, in float32: the volume-demeaned Gram through the tridiagonal kernels with n mu mu^T as
    a rank-one term (dwidenoise's mode without float64 solves); the CPU's float64 result within the engine's
    tolerances, and few windows left for the float64 pass."""
    from mppca_nipype.engine import check_data, plan_patches, resolve_options
    from mppca_nipype.engine.gpu.pipeline import denoise_gpu

    noisy, _ = low_rank_phantom((32, 30, 24), n_volumes=48, rank=5, sigma=4.0, baseline=1000.0, seed=6)
    options = dict(extent=5, stride=1, estimator="exp2", aggregation="center", demean="none", filter="hard")
    data, mask = check_data(noisy, None)
    resolved = resolve_options(data.shape, **options)
    finite = np.ones(data.shape[:3], bool)
    plan = plan_patches(data.shape[:3], resolved.extent, resolved.stride, mask, finite)
    gpu = denoise_gpu(data, finite, plan, resolved, eigensolver="tridiagonal", precision="float32")
    cpu = denoise(noisy, device="cpu", nprocs=4, **options)
    denoised = gpu.image.reshape(data.shape)
    rms = np.sqrt(np.mean((denoised.astype(np.float64) - cpu.denoised) ** 2) / np.mean(cpu.denoised.astype(np.float64) ** 2))
    rank_equal = np.mean(np.abs(gpu.rank.reshape(data.shape[:3]) - cpu.rank) < 1e-3)
    print(f"rms {rms:.2e}, ranks equal {rank_equal:.4f}, settled {gpu.info['n_settled_in_float64']} of {plan.n_windows}")
    assert rms <= 1e-4 and rank_equal >= 0.995
    assert gpu.info["n_settled_in_float64"] <= 0.1 * plan.n_windows


@pytest.mark.parametrize("order", ["C", "F"])
@pytest.mark.parametrize("threads, rounds", [(5, 3), (1, 1), (16, 4)])
def test_staged_uploads_copy_the_rows(monkeypatch, threads, rounds, order):
    """Row ranges (overlapping, on two streams) arrive intact through the staging rounds, whatever the number
    of threads and rounds (parts of a row, empty parts) and the series' order (a volume-major one reordered
    into rows by the staging, in rounds of whole x-planes); each round's copy is queued once, and the rows
    there after each round only grow."""
    import torch

    from mppca_nipype.engine.gpu import upload

    monkeypatch.setattr(upload, "STAGE_THREADS", threads)
    monkeypatch.setattr(upload, "STAGE_ROUNDS", rounds)
    series = np.asarray(np.random.default_rng(6).standard_normal((29, 23, 30, 47)), np.float32, order=order)
    rows = np.ascontiguousarray(series).reshape(-1, 47)
    plane = 23 * 30
    # rows of whole x-planes for a volume-major series (as the engine's slabs are); any rows else
    first_rows, second_rows = ((slice(0, 12000), slice(19999, 20010)) if order == "C"
                               else (slice(0, 17 * plane), slice(27 * plane, 29 * plane)))
    uploads = upload.StagedSeries(series)
    stream = torch.cuda.current_stream()
    arriving = uploads.upload(first_rows, torch.device("cuda"), stream)
    arrived = list(arriving.arrivals(stream))  # whole rows there after each round
    first = arriving.wait(stream)
    second = uploads.upload(second_rows, torch.device("cuda"), torch.cuda.Stream()).wait(stream)
    torch.cuda.synchronize()
    assert len(arrived) == rounds and arrived[-1] == first_rows.stop and arrived == sorted(arrived)
    if order == "F":
        assert all(stop % plane == 0 for stop in arrived)
    np.testing.assert_array_equal(first.cpu().numpy(), rows[first_rows])
    np.testing.assert_array_equal(second.cpu().numpy(), rows[second_rows])
    assert sorted(uploads.queued_at) == list(range(rounds))


@pytest.mark.parametrize("planes", [None, 7])
def test_a_volume_major_series_gives_the_same_result_in_its_own_order(planes):
    """A series as nibabel reads a file (Fortran order) is denoised without a transpose, whole or in slabs,
    into the values of its C-order copy (to the rounding of the float64 settling pass's atomic additions,
    whose order may differ from run to run), and comes back in its own order."""
    from mppca_nipype.engine import check_data, plan_patches, resolve_options, _finish
    from mppca_nipype.engine.gpu.pipeline import denoise_gpu

    noisy, *_ = dwi_phantom((31, 26, 22), n_volumes=30, sigma=20.0, seed=17)
    chosen = dict(extent="wide", stride=3, estimator="exp2", aggregation="weighted", demean="volume", filter="hard")
    outputs = []
    for order in ("C", "F"):
        data, mask = check_data(np.asarray(noisy, np.float32, order=order), None)
        options = resolve_options(data.shape, **chosen)
        finite = np.ones(data.shape[:3], bool)
        plan = plan_patches(data.shape[:3], options.extent, options.stride, mask, finite)
        sums = denoise_gpu(data, finite, plan, options, planes=planes)
        outputs.append(_finish(data, mask, finite, sums))
    assert outputs[1].denoised.flags.f_contiguous and not outputs[0].denoised.flags.f_contiguous
    assert relative_rms(outputs[1].denoised, outputs[0].denoised) <= 1e-6
    assert relative_rms(outputs[1].sigma, outputs[0].sigma) <= 1e-6
    if planes is None:  # and through the public call
        public = denoise(np.asfortranarray(noisy), device="cuda", **chosen)
        assert public.denoised.flags.f_contiguous
        assert relative_rms(public.denoised, outputs[0].denoised) <= 1e-6


def relative_rms(values, reference) -> float:
    reference = np.asarray(reference, np.float64)
    return float(np.sqrt(np.mean((np.asarray(values, np.float64) - reference) ** 2) / np.mean(reference**2)))


def seed_like(seed, shape=(40, 36, 26)):
    """The seed's geometry on a smaller phantom: (data, finite, plan, options) for ``denoise_gpu``."""
    from mppca_nipype.engine import check_data, plan_patches, resolve_options

    noisy, _ = low_rank_phantom(shape, n_volumes=48, rank=5, sigma=4.0, baseline=1000.0, seed=seed)
    data, mask = check_data(noisy, None)
    options = resolve_options(data.shape, extent=11, stride=3, estimator="exp2", aggregation="weighted",
                              demean="voxel")
    finite = np.ones(data.shape[:3], bool)
    return data, finite, plan_patches(data.shape[:3], options.extent, options.stride, mask, finite), options


@pytest.mark.parametrize("graphs", ["1", "0"])
def test_the_seeds_geometry_runs_with_one_wait_for_the_device(monkeypatch, graphs):
    """Voxel demeaning on a full grid (box sums, tridiagonal kernels, the settling pass chosen on the
    device): nothing in ``denoise_gpu`` waits for the device but its final synchronisation (torch's sync
    debug mode warns at each synchronising call), with the first pass replayed as CUDA graphs or queued by
    the host, and the windows redone are those the host would choose."""
    import torch

    from mppca_nipype.engine.gpu import pipeline
    from mppca_nipype.engine.gpu.plan import GPURun

    monkeypatch.setenv("MPPCA_GPU_GRAPHS", graphs)
    data, finite, plan, options = seed_like(8)
    for _ in range(2):  # builds the kernels; captures the graphs
        pipeline.denoise_gpu(data, finite, plan, options)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            on_device = pipeline.denoise_gpu(data, finite, plan, options)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    waits = [str(w.message) for w in caught if "called a synchronizing" in str(w.message)]
    assert len(waits) == 1, waits  # the final synchronisation
    assert on_device.info["first_pass"] == ("replayed" if graphs == "1" else "queued")
    monkeypatch.setattr(GPURun, "settles_on_device", lambda self, n_volumes: False)
    on_host = pipeline.denoise_gpu(data, finite, plan, options)
    n_settled = on_device.info["n_settled_in_float64"]
    print(f"settled {n_settled} of {plan.n_windows}")
    assert on_device.info["gram_path"] == "box" and 0 < n_settled == on_host.info["n_settled_in_float64"]
    for got, want in ((on_device.image, on_host.image), (on_device.rank, on_host.rank)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-3)


def test_the_first_pass_replays_as_cuda_graphs_on_each_runs_series(monkeypatch):
    """A geometry's first run queues its first pass, the second captures and replays it, later ones replay it:
    the same sums each time, and a replay on another series of the geometry gives that series' result (what
    the host-queued pass gives), not the captured one's."""
    from mppca_nipype.engine.gpu import graphs, pipeline

    monkeypatch.setenv("MPPCA_GPU_GRAPHS", "1")
    graphs.FirstPassGraphs._kept.clear()
    data, finite, plan, options = seed_like(8)
    runs = [pipeline.denoise_gpu(data, finite, plan, options) for _ in range(3)]
    assert [run.info["first_pass"] for run in runs] == ["queued", "captured", "replayed"]
    for run in runs[1:]:
        assert run.info["n_settled_in_float64"] == runs[0].info["n_settled_in_float64"] > 0
        for got, want in ((run.image, runs[0].image), (run.weight, runs[0].weight), (run.rank, runs[0].rank)):
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-3)
    other, _, _, _ = seed_like(9)
    replayed = pipeline.denoise_gpu(other, finite, plan, options)
    monkeypatch.setenv("MPPCA_GPU_GRAPHS", "0")
    queued = pipeline.denoise_gpu(other, finite, plan, options)
    assert replayed.info["first_pass"] == "replayed" and queued.info["first_pass"] == "queued"
    assert replayed.info["n_settled_in_float64"] == queued.info["n_settled_in_float64"]
    np.testing.assert_allclose(replayed.image, queued.image, rtol=1e-6, atol=1e-3)
    assert np.abs(replayed.image - runs[0].image).max() > 1.0  # (another series: another result)


@pytest.mark.parametrize("planes", [None, 8])
def test_nan_in_a_series_of_a_replayed_geometry_gives_the_host_checked_result(monkeypatch, planes):
    """``denoise`` takes the series as finite and the device finds the NaN/Inf: a geometry whose first pass
    replays as CUDA graphs (whole), or runs in slabs, gives what the host's check first gives (one warning),
    and its graphs then serve a finite series as before."""
    import mppca_nipype.engine as engine
    from mppca_nipype.engine import MPPCAWarning
    from mppca_nipype.engine.gpu import graphs, pipeline

    monkeypatch.setenv("MPPCA_GPU_GRAPHS", "1")
    graphs.FirstPassGraphs._kept.clear()
    if planes is not None:
        denoise_gpu = pipeline.denoise_gpu
        monkeypatch.setattr(engine, "_backend", lambda device: lambda *args, **kwargs: denoise_gpu(
            *args, planes=planes, **kwargs))
    noisy, _ = low_rank_phantom((40, 36, 26), n_volumes=48, rank=5, sigma=4.0, baseline=1000.0, seed=8)
    options = dict(extent=11, stride=3, estimator="exp2", aggregation="weighted", demean="voxel")
    finite_runs = [denoise(noisy, device="cuda", **options) for _ in range(3)]  # queued, captured, replayed
    spoilt = noisy.copy()
    spoilt[37, 20, 10, 5] = np.nan  # (in the last slab)
    spoilt[3, 4, 5, 47] = np.inf
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found_on_device = denoise(spoilt, device="cuda", **options)
    assert [str(w.message) for w in caught if issubclass(w.category, MPPCAWarning)] == [
        "2 voxels hold NaN or Inf; they are left out of every patch and left as they were"]
    taking_finite = engine._gpu_sums_of_a_finite_series
    monkeypatch.setattr(engine, "_gpu_sums_of_a_finite_series", lambda *args: None)  # the host's check first
    with pytest.warns(MPPCAWarning, match="2 voxels hold NaN or Inf"):
        host_checked = denoise(spoilt, device="cuda", **options)
    # (the same run twice: equal but for the order of the device's atomic additions)
    np.testing.assert_allclose(found_on_device.denoised, host_checked.denoised, rtol=1e-6, atol=1e-3)
    np.testing.assert_allclose(found_on_device.rank, host_checked.rank, rtol=1e-6, atol=1e-4)
    assert np.isnan(found_on_device.denoised[37, 20, 10, 5]) and np.isinf(found_on_device.denoised[3, 4, 5, 47])
    monkeypatch.setattr(engine, "_gpu_sums_of_a_finite_series", taking_finite)
    again = denoise(noisy, device="cuda", **options)
    if planes is None:
        assert [run.info["first_pass"] for run in finite_runs] == ["queued", "captured", "replayed"]
        assert again.info["first_pass"] == "replayed"
    np.testing.assert_allclose(again.denoised, finite_runs[-1].denoised, rtol=1e-6, atol=1e-3)


@pytest.mark.parametrize("estimator", ["exp2", "exp1", "med", "olesen2023"])
def test_the_estimator_and_the_settling_test_never_wait_for_the_device(estimator):
    """No host synchronisation in what runs per batch after the eigensolver (a Python count of volumes
    used to be copied to the device, and each such copy waits for all queued work)."""
    import torch

    from mppca_nipype.engine.estimators import marchenko_pastur_threshold
    from mppca_nipype.engine.gpu.threshold import rounding_uncertainty, threshold_on_device

    values = torch.rand(64, 48, device="cuda", dtype=torch.float64).sort(dim=1).values
    voxels = torch.full((64,), 125, device="cuda", dtype=torch.int32)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        rank, _ = marchenko_pastur_threshold(values, voxels, 48, estimator)
        threshold_on_device(values, voxels, 48, estimator, rounding_uncertainty(values))
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_box_sums_match_the_cpu_on_the_seeds_geometry():
    """The box sums (``auto``'s path for voxel demeaning on a full grid) compiled: the CPU's float64 result
    within the engine's tolerances at the seed's 11^3 windows, stride 3, and the same denoising as the fused
    kernels."""
    from mppca_nipype.engine import check_data, plan_patches, resolve_options
    from mppca_nipype.engine.gpu.pipeline import denoise_gpu

    noisy, _ = low_rank_phantom((40, 36, 26), n_volumes=48, rank=5, sigma=4.0, baseline=1000.0, seed=7)
    options = dict(extent=11, stride=3, estimator="exp2", aggregation="weighted", demean="voxel")
    gpu, cpu = compare(noisy, **options)
    assert gpu.info["gram_path"] == "box"
    data, mask = check_data(noisy, None)
    resolved = resolve_options(data.shape, **options)
    finite = np.ones(data.shape[:3], bool)
    plan = plan_patches(data.shape[:3], resolved.extent, resolved.stride, mask, finite)
    box = denoise_gpu(data, finite, plan, resolved)
    fused = denoise_gpu(data, finite, plan, resolved, path="fused")
    assert box.info["gram_path"] == "box" and fused.info["gram_path"] == "fused"
    want = fused.image.astype(np.float64)
    rms = np.sqrt(np.mean((box.image - want) ** 2) / np.mean(want**2))
    print(f"box vs fused {rms:.2e}, ranks equal {np.mean(np.abs(box.rank - fused.rank) < 1e-3):.4f}")
    assert rms <= 1e-5 and np.mean(np.abs(box.rank - fused.rank) < 1e-3) >= 0.999


@pytest.mark.parametrize("options", [dict(), dict(extent=5, stride=1, aggregation="center", demean="none")])
def test_a_memory_budget_holds_the_run_and_gives_the_unlimited_result(options):
    """A budget in which the series and its sums do not fit whole: the run is planned in slabs and batches that
    fit, torch's allocator holds it there (the peak of allocated memory stays under the budget), the result
    is the unlimited run's, and the process's own limit is back as it was after."""
    import torch

    from mppca_nipype.engine import GPUOutOfMemoryError

    noisy = low_rank_phantom((72, 40, 30), n_volumes=60, rank=5, sigma=5.0, seed=21)[0]
    unlimited = denoise(noisy, device="cuda", **options)
    held = torch.cuda.memory_allocated()  # (what earlier runs keep: graphs, tables; the budget counts it)
    whole = noisy[..., 0].size * (8 * noisy.shape[3] + 20)  # the series and its sums (``plan.slab_bytes``)
    budget = (held + 2.5 * whole) / 2**30
    fraction = torch.cuda.get_per_process_memory_fraction()
    small = denoise(noisy, device="cuda", gpu_memory=budget, **options)
    print(f"unlimited peak {unlimited.info['gpu_peak_bytes'] / 2**20:.0f} MiB ({held / 2**20:.0f} held before), "
          f"budget {budget * 1024:.0f} MiB: peak {small.info['gpu_peak_bytes'] / 2**20:.0f} MiB, "
          f"{small.info['n_slabs']} slabs, batch {small.info['batch']} (unlimited: {unlimited.info['batch']})")
    assert torch.cuda.get_per_process_memory_fraction() == fraction
    assert small.info["n_slabs"] > 1 and small.info["gpu_peak_bytes"] <= budget * 2**30
    assert small.info["gpu_memory_budget"] == int(budget * 2**30)
    rms = np.sqrt(np.mean((small.denoised.astype(np.float64) - unlimited.denoised) ** 2)
                  / np.mean(unlimited.denoised.astype(np.float64) ** 2))
    assert rms <= 1e-6 and np.mean(np.abs(small.rank - unlimited.rank) < 1e-3) >= 0.999
    with pytest.raises(GPUOutOfMemoryError, match="too small for this series"):
        denoise(noisy, device="cuda", gpu_memory=0.001, **options)


@pytest.mark.parametrize("options", [dict(), dict(extent=5, stride=1, aggregation="center", demean="none"),
                                     dict(extent=11, stride=3, demean="voxel")])
@pytest.mark.parametrize("given", ["number", "map"])
def test_a_given_noise_level_matches_cpu(options, given):
    """``noise`` given on the GPU: the CPU's ranks and denoised series (the engines' tolerances), and the
    noise map the given level; with a mask (the map 0 outside it) and non-finite voxels."""
    noisy, _ = low_rank_phantom((40, 36, 24), n_volumes=48, rank=5, sigma=5.0, seed=23)
    mask = np.ones(noisy.shape[:3], bool)
    mask[:4] = False
    noisy[10, 11, 12, 7] = np.nan
    sigma = np.random.default_rng(24).uniform(3.0, 4.0, size=noisy.shape[:3]) * mask
    gpu, cpu = compare(noisy, mask, noise=3.5 if given == "number" else sigma, **options)
    served = mask & np.isfinite(noisy).all(axis=3)
    assert gpu.info["noise"] == "given" and np.all(gpu.sigma[served] < 4.0) and np.all(gpu.sigma[served] > 3.0)
    print(f"{gpu.info['n_settled_in_float64']} of {gpu.info['n_windows']} windows settled in float64")


def test_a_slab_that_runs_out_of_memory_is_redone_thinner_on_the_device(monkeypatch):
    """Out of memory while a slab's sums are allocated: the run's uploads are drained, and it starts over in
    slabs of half as many x-planes, with the unlimited run's result."""
    from mppca_nipype.engine.gpu import pipeline

    noisy = low_rank_phantom((48, 40, 30), n_volumes=60, rank=5, sigma=5.0, seed=25)[0]
    whole = denoise(noisy, device="cuda")
    sums_class, plane = pipeline.SlabSums, 40 * 30

    def sums(n_rows, *args, **kwargs):
        if n_rows > 20 * plane:
            import torch
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
        return sums_class(n_rows, *args, **kwargs)

    monkeypatch.setattr(pipeline, "SlabSums", sums)
    thinner = denoise(noisy, device="cuda")
    assert thinner.info["slab_retries"] == 2 and thinner.info["n_slabs"] > 1
    rms = np.sqrt(np.mean((thinner.denoised.astype(np.float64) - whole.denoised) ** 2)
                  / np.mean(whole.denoised.astype(np.float64) ** 2))
    assert rms <= 1e-6


@pytest.mark.parametrize("options", [dict(filter="optshrink"), dict(filter="optthresh"),
                                     dict(filter="optshrink", extent=5, stride=1, aggregation="center",
                                          demean="none")])
def test_the_filters_match_cpu(options):
    """Optimal shrinkage and the optimal hard threshold on the GPU: the CPU's series and ranks."""
    noisy, _ = low_rank_phantom((40, 36, 24), n_volumes=48, rank=5, sigma=5.0, seed=27)
    noisy[10, 11, 12, 7] = np.nan
    gpu, cpu = compare(noisy, **options)
    assert gpu.info["filter"] == options["filter"]


@pytest.mark.parametrize("floor", [dict(noise_floor="rician"), dict(noise_floor="ncchi", coils=4)])
def test_the_noise_floor_matches_cpu(floor):
    """A magnitude noise floor removed on the GPU: the CPU's series (the noise level, the transform and its
    inverse run with torch on the GPU and with NumPy around the CPU engine, to 1e-5 of each other:
    tests/test_series_steps.py; so the engines' tolerances hold)."""
    noisy = dwi_phantom((36, 32, 20), n_volumes=40, sigma=60.0, seed=28, rician=True, **(
        dict(coils=floor["coils"]) if "coils" in floor else {}))[0]
    gpu = denoise(noisy, device="cuda", **floor)
    cpu = denoise(noisy, device="cpu", nprocs=4, **floor)
    assert gpu.info["backend"] == "gpu" and cpu.info["backend"] == "cpu"
    rms = np.sqrt(np.mean((gpu.denoised.astype(np.float64) - cpu.denoised) ** 2)
                  / np.mean(cpu.denoised.astype(np.float64) ** 2))
    assert rms <= 1e-4 and np.mean(np.abs(gpu.rank - cpu.rank) < 0.5) >= 0.995


@pytest.mark.parametrize("phase_method", ["hann", "mppca"])
def test_complex_data_match_cpu(phase_method):
    """Complex data (the background phase removed, the real part denoised) on the GPU: the CPU's magnitude,
    phase and ranks."""
    from mppca_nipype.engine.complex_data import denoise_complex
    from mppca_nipype.phantoms import complex_dwi_phantom

    magnitude, phase = complex_dwi_phantom((36, 32, 20), n_volumes=40, sigma=60.0, seed=29)[:2]
    gpu = denoise_complex(magnitude, phase, phase_method=phase_method, device="cuda")
    cpu = denoise_complex(magnitude, phase, phase_method=phase_method, device="cpu", nprocs=4)
    rms = np.sqrt(np.mean((gpu.denoised.astype(np.float64) - cpu.denoised) ** 2)
                  / np.mean(cpu.denoised.astype(np.float64) ** 2))
    assert rms <= 1e-4 and np.mean(np.abs(gpu.rank - cpu.rank) < 0.5) >= 0.995
    strong = cpu.denoised > 4 * np.median(cpu.sigma[cpu.sigma > 0])  # where the phase is defined well
    turn = np.angle(np.exp(1j * (gpu.phase[strong].astype(np.float64) - cpu.phase[strong])))
    assert np.sqrt(np.mean(turn ** 2)) <= 1e-3


@pytest.mark.parametrize("order, options", [("C", dict(demean="voxel", aggregation="weighted")),  # the box sums
                                            ("F", {}),  # the defaults: the fused kernels
                                            ("F", dict(shape="sphere"))])
def test_a_series_on_the_device_denoises_as_from_the_host(order, options):
    """``denoise`` of a CUDA tensor (written on the device just before, by a kernel of its own): the same
    result as the same series from the host (within float32's rounding: the host's series arrives in more
    parts), on the device in the series' layout; twice, so that a geometry's CUDA graphs replay on it."""
    import torch

    noisy = np.asarray(dwi_phantom((30, 28, 20), 24, sigma=20.0, seed=5)[0], order=order)
    from_host = denoise(noisy, device="cuda", **options)
    for _ in range(2):
        on_device = torch.from_numpy(noisy).cuda() * 2  # (a product: written on the device, in the layout)
        result = denoise(on_device / 2, device="cuda", **options)
        assert isinstance(result.denoised, torch.Tensor) and result.denoised.is_cuda
        denoised = result.denoised.cpu().numpy()
        assert denoised.flags.f_contiguous == (order == "F")
        difference = denoised.astype(np.float64) - from_host.denoised
        assert np.sqrt(np.mean(difference**2) / np.mean(from_host.denoised.astype(np.float64) ** 2)) <= 1e-6
        np.testing.assert_allclose(result.sigma, from_host.sigma, rtol=1e-5)
        assert np.mean(np.abs(result.rank - from_host.rank) < 1e-3) >= 0.999
