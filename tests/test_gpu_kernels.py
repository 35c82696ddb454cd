"""The GPU engine's Triton kernels and pipeline, run on the CPU under Triton's interpreter.

Each kernel is compared with a float64 NumPy reference on small inputs of awkward sizes (T not a power of
two, patch sizes not multiples of the voxel tile, overlapping windows, windows with weight 0); the whole
pipeline is compared with the CPU backend for every option. Needs torch and triton (CPU builds suffice);
skipped without them, except in CI (MPPCA_REQUIRE_PEERS=1), where they must be present.

Triton decides at decoration time whether a kernel is interpreted, for its own library too, so
TRITON_INTERPRET=1 must be set before triton is first imported. Where no CUDA device is present and triton is
not yet imported (CI), this module sets it and runs its tests in this process. Elsewhere (a GPU machine,
where other tests need compiled kernels) one test runs this file in a child process under the interpreter.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import numpy as np
import pytest

if os.environ.get("MPPCA_REQUIRE_PEERS") != "1":
    pytest.importorskip("torch")
import torch  # noqa: E402


def _interpret_in_this_process() -> bool:
    if os.environ.get("TRITON_INTERPRET") == "1":
        return True
    return "triton" not in sys.modules and not torch.cuda.is_available()


IN_PROCESS = _interpret_in_this_process()
if IN_PROCESS:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton's first import
if os.environ.get("MPPCA_REQUIRE_PEERS") != "1":
    pytest.importorskip("triton")
interpreted = pytest.mark.skipif(not IN_PROCESS, reason="runs in a child process under TRITON_INTERPRET=1")


@pytest.mark.skipif(IN_PROCESS, reason="the interpreted tests run in this process")
def test_kernels_under_the_interpreter_in_a_child_process():
    env = dict(os.environ, TRITON_INTERPRET="1")
    child = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
                           env=env, capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stdout[-4000:] + child.stderr[-2000:]

from mppca_nipype.engine import check_data, plan_patches, resolve_options  # noqa: E402
from mppca_nipype.engine.cpu import denoise_cpu  # noqa: E402
from mppca_nipype.engine.gpu.cusolver import BatchedEigh, ProjectorFromVectors  # noqa: E402
from mppca_nipype.phantoms import low_rank_phantom  # noqa: E402


@pytest.fixture(scope="module")
def kernels():
    """The kernels' launchers (decorated under the interpreter: see the module's docstring)."""
    from types import SimpleNamespace

    from mppca_nipype.engine.gpu import gram, reconstruction, settling

    assert os.environ.get("TRITON_INTERPRET") == "1"
    return SimpleNamespace(gram=gram.gram, reconstruct_accumulate=reconstruction.reconstruct_accumulate,
                           reconstruct_centres=reconstruction.reconstruct_centres,
                           choose_windows=settling.choose_windows)


def moved_ranks_differ(values, n_voxels, n_volumes, estimator, rank, delta):
    """The settling test's reference, on the CPU estimator: whether the rank changes when the eigenvalues
    (B, m) move by ``delta`` (B, 1): all up, all down, spread apart, drawn together."""
    from mppca_nipype.engine.estimators import marchenko_pastur_threshold

    ramp = torch.linspace(-1.0, 1.0, values.shape[1], dtype=values.dtype)[None, :]
    unsettled = torch.zeros(rank.shape, dtype=torch.bool)
    for moved in (values + delta, values - delta, values + delta * ramp, values - delta * ramp):
        unsettled |= marchenko_pastur_threshold(moved, n_voxels, n_volumes, estimator)[0] != rank
    return unsettled


def random_windows(rng, n_rows, n_windows, n_voxels):
    """Window corners and voxel offsets of a random layout whose windows overlap."""
    offsets = np.sort(rng.choice(n_rows // 2, size=n_voxels, replace=False)).astype(np.int32)
    base = rng.integers(0, n_rows - offsets.max(), size=n_windows).astype(np.int64)
    return base, offsets


def as_tensors(*arrays):
    return [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]


def centred(patches, took, demean):
    """The float64 reference of the kernels' centring: (B, n, T) patches, (B, n) voxels taking part.

    ``voxel``: each row minus its mean; ``volume``: the finite rows minus their mean row, left-out rows
    zero (as ``cpu.fit_windows``); returns the centred patches and the means that were removed.
    """
    if demean == "voxel":
        means = patches.mean(axis=2, keepdims=True)
        return patches - means, means
    if demean == "volume":
        took = took[:, :, None].astype(np.float64)
        means = (patches * took).sum(axis=1, keepdims=True) / np.maximum(took.sum(axis=1, keepdims=True), 1)
        return (patches - means) * took, means
    return patches, 0


@interpreted
@pytest.mark.parametrize("demean", ["none", "voxel", "volume"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("n_volumes, n_voxels", [(13, 37), (20, 20), (3, 70)])
def test_gram_kernel_matches_float64_reference(kernels, demean, dtype, n_volumes, n_voxels):
    rng = np.random.default_rng(n_volumes * 100 + n_voxels)
    n_rows = 400
    volume = (1000 + 30 * rng.standard_normal((n_rows, n_volumes))).astype(np.float32)
    finite = (rng.random(n_rows) > 0.1).astype(np.float32)
    base, offsets = random_windows(rng, n_rows, 7, n_voxels)
    gram, n_took_part, volume_mean = kernels.gram(*as_tensors(volume, finite, base, offsets), demean=demean,
                                                  dtype=getattr(torch, dtype))
    voxels = base[:, None] + offsets[None, :]
    patches, means = centred(volume[voxels].astype(np.float64), finite[voxels], demean)
    expected = patches.transpose(0, 2, 1) @ patches
    tolerance = 1e-5 if dtype == "float32" else 1e-12
    assert gram.dtype == getattr(torch, dtype)
    assert np.linalg.norm(gram.numpy() - expected) / np.linalg.norm(expected) < tolerance
    np.testing.assert_array_equal(n_took_part.numpy(), finite[voxels].sum(axis=1))
    if demean == "volume":
        np.testing.assert_allclose(volume_mean.numpy(), means[:, 0], rtol=1e-6)
    else:
        assert volume_mean is None


@interpreted
def test_volume_centring_keeps_float32_gram_exact_on_a_large_baseline(kernels):
    """Noise of 1 on a baseline of 1000: X^T X - n mu mu^T in float32 would be wrong by ~10%; centring
    before accumulating keeps the Gram within 1e-5 of float64 (and the noise eigenvalues within 1e-4)."""
    rng = np.random.default_rng(11)
    n_rows, n_volumes, n_voxels = 2000, 48, 343
    volume = (1000 + rng.standard_normal((n_rows, n_volumes))).astype(np.float32)
    finite = np.ones(n_rows, np.float32)
    base, offsets = random_windows(rng, n_rows, 5, n_voxels)
    gram, _, _ = kernels.gram(*as_tensors(volume, finite, base, offsets), demean="volume")
    voxels = base[:, None] + offsets[None, :]
    patches, _ = centred(volume[voxels].astype(np.float64), finite[voxels], "volume")
    expected = patches.transpose(0, 2, 1) @ patches
    assert np.linalg.norm(gram.numpy() - expected) / np.linalg.norm(expected) < 1e-5
    values = np.linalg.eigvalsh(gram.numpy().astype(np.float64))
    want = np.linalg.eigvalsh(expected)
    assert np.abs(values - want).max() / want.max() < 1e-4


@interpreted
@pytest.mark.parametrize("demean", ["none", "voxel", "volume"])
@pytest.mark.parametrize("n_volumes, n_voxels, projector_dtype, scaled", [
    (13, 37, np.float32, False), (33, 40, np.float32, False), (13, 37, np.float64, False), (33, 40, np.float32, True)])
def test_reconstruct_accumulate_adds_weighted_projections(kernels, demean, n_volumes, n_voxels, projector_dtype,
                                                          scaled):
    """(A float64 projector, a settling pass's, is read rounded to float32; ``scaled``: a weight per patch
    voxel, the ``gaussian`` aggregation's.)"""
    rng = np.random.default_rng(n_volumes)
    n_rows, n_windows = 300, 9
    volume = (100 + 10 * rng.standard_normal((n_rows, n_volumes))).astype(np.float32)
    finite = (rng.random(n_rows) > 0.1).astype(np.float32)
    base, offsets = random_windows(rng, n_rows, n_windows, n_voxels)
    projector = rng.standard_normal((n_windows, n_volumes, n_volumes)).astype(projector_dtype)
    patch_weight = rng.uniform(0.1, 1, n_windows).astype(np.float32)
    patch_weight[3] = 0  # a window left to the CPU adds nothing
    patch_sigma = rng.uniform(1, 5, n_windows).astype(np.float32)
    patch_rank = rng.integers(0, 5, n_windows).astype(np.float32)
    volume_mean = (100 + rng.standard_normal((n_windows, n_volumes))).astype(np.float32)
    voxel_scale = rng.uniform(0.2, 1, n_voxels).astype(np.float32) if scaled else np.ones(n_voxels)
    outputs = as_tensors(np.zeros((n_rows, n_volumes), np.float32), *(np.zeros(n_rows, np.float32) for _ in range(3)))
    kernels.reconstruct_accumulate(*as_tensors(volume, finite, base, offsets, projector, patch_weight,
                                               patch_sigma, patch_rank), *outputs, demean=demean,
                                   volume_mean=torch.from_numpy(volume_mean) if demean == "volume" else None,
                                   voxel_scale=torch.from_numpy(voxel_scale) if scaled else None)

    voxels = base[:, None] + offsets[None, :]
    patches = volume[voxels].astype(np.float64)
    if demean == "volume":  # the kernel takes mu as given: X_hat = (X - mu) P + mu
        means = volume_mean[:, None, :].astype(np.float64)
    else:
        means = centred(patches, None, demean)[1]
    restored = (patches - means) @ projector.astype(np.float64) + means
    voxel_weight = patch_weight[:, None].astype(np.float64) * finite[voxels] * voxel_scale[None, :]
    expected = [np.zeros((n_rows, n_volumes)), np.zeros(n_rows), np.zeros(n_rows), np.zeros(n_rows)]
    np.add.at(expected[0], voxels.ravel(), (restored * voxel_weight[:, :, None]).reshape(-1, n_volumes))
    np.add.at(expected[1], voxels.ravel(), voxel_weight.ravel())
    np.add.at(expected[2], voxels.ravel(), (voxel_weight * patch_sigma[:, None]).ravel())
    np.add.at(expected[3], voxels.ravel(), (voxel_weight * patch_rank[:, None]).ravel())
    for got, want in zip(outputs, expected):
        assert np.linalg.norm(got.numpy() - want) / np.linalg.norm(want) < 1e-6


@interpreted
@pytest.mark.parametrize("demean", ["none", "voxel", "volume"])
def test_reconstruct_centres_writes_each_centre_row(kernels, demean):
    rng = np.random.default_rng(5)
    n_rows, n_volumes, n_windows = 60, 19, 6
    volume = (100 + 10 * rng.standard_normal((n_rows, n_volumes))).astype(np.float32)
    centre_voxel = rng.choice(n_rows, size=15, replace=False).astype(np.int64)
    centre_window = np.sort(rng.integers(0, n_windows, size=15)).astype(np.int32)
    projector = rng.standard_normal((n_windows, n_volumes, n_volumes)).astype(np.float32)
    patch_weight = np.ones(n_windows, np.float32)
    patch_sigma = rng.uniform(1, 5, n_windows).astype(np.float32)
    patch_rank = rng.integers(0, 5, n_windows).astype(np.float32)
    volume_mean = (100 + rng.standard_normal((n_windows, n_volumes))).astype(np.float32)
    poison = np.float32(-7.0)
    outputs = as_tensors(np.full((n_rows, n_volumes), poison), *(np.full(n_rows, poison) for _ in range(3)))
    kernels.reconstruct_centres(*as_tensors(volume, centre_voxel, centre_window, projector, patch_weight,
                                            patch_sigma, patch_rank), *outputs, demean=demean,
                                volume_mean=torch.from_numpy(volume_mean) if demean == "volume" else None)

    rows = volume[centre_voxel].astype(np.float64)
    mean = {"none": 0, "voxel": rows.mean(axis=1, keepdims=True),
            "volume": volume_mean[centre_window].astype(np.float64)}[demean]
    expected = np.einsum("ct,cts->cs", rows - mean, projector[centre_window].astype(np.float64)) + mean
    image, weight, sigma, rank = (x.numpy() for x in outputs)
    assert np.linalg.norm(image[centre_voxel] - expected) / np.linalg.norm(expected) < 1e-6
    np.testing.assert_array_equal(weight[centre_voxel], 1)
    np.testing.assert_allclose(sigma[centre_voxel], patch_sigma[centre_window])
    np.testing.assert_array_equal(rank[centre_voxel], patch_rank[centre_window])
    others = np.setdiff1d(np.arange(n_rows), centre_voxel)
    assert (image[others] == poison).all() and (weight[others] == poison).all()


@interpreted
def test_eigensolver_fallback_returns_ascending_values_and_column_vectors():
    rng = np.random.default_rng(1)
    a = rng.standard_normal((5, 11, 11))
    matrices = a @ a.transpose(0, 2, 1)
    values, vectors, info = BatchedEigh("cpu")(torch.from_numpy(matrices.copy()))
    values, vectors = values.numpy(), vectors.numpy()
    assert (np.diff(values, axis=1) >= 0).all()
    np.testing.assert_allclose(matrices @ vectors, vectors * values[:, None, :], atol=1e-9)
    assert (info.numpy() == 0).all()


def prepared(noisy, mask=None, **options):
    """What ``denoise`` hands a backend: float32 data with non-finite voxels zeroed, the mask, the finite
    voxels, the plan and the resolved options."""
    data, mask = check_data(noisy, mask)
    resolved = resolve_options(data.shape, mask=mask, **options)
    finite = np.isfinite(data).all(axis=3)
    data = data.copy(order="K")  # (in its own order)
    data[~finite] = 0
    plan = plan_patches(data.shape[:3], resolved.extent, resolved.stride, mask, finite, resolved.shape)
    return data, mask, finite, plan, resolved


def run_both(noisy, mask=None, path="auto", **options):
    """The CPU backend's sums and the GPU pipeline's (on the CPU, interpreted), for the same plan."""
    from mppca_nipype.engine.gpu.pipeline import denoise_gpu

    data, mask, finite, plan, resolved = prepared(noisy, mask, **options)
    cpu = denoise_cpu(data, finite, plan, resolved, nprocs=1)
    gpu = denoise_gpu(data, finite, plan, resolved, device="cpu", path=path)
    return cpu, gpu, mask


def per_voxel(sums, served):
    """Denoised rows, sigma and rank of the served voxels from a backend's sums (divided, unless the
    backend already did)."""
    if sums.normalized:
        return sums.image[served], sums.sigma[served], sums.rank[served]
    weight = sums.weight[served]
    return sums.image[served] / weight[:, None], sums.sigma[served] / weight, sums.rank[served] / weight


def assert_same_denoising(cpu, gpu, mask):
    served = (cpu.weight > 0) & mask.ravel()
    np.testing.assert_allclose(gpu.weight, cpu.weight, rtol=1e-5, atol=1e-6)
    denoised_cpu, sigma_cpu, rank_cpu = per_voxel(cpu, served)
    denoised_gpu, sigma_gpu, rank_gpu = per_voxel(gpu, served)
    rms = np.sqrt(np.mean((denoised_gpu - denoised_cpu) ** 2) / np.mean(denoised_cpu**2))
    assert rms < 1e-5
    assert np.mean(np.abs(rank_gpu - rank_cpu) < 1e-3) >= 0.995
    assert np.sqrt(np.mean((sigma_gpu - sigma_cpu) ** 2) / np.mean(sigma_cpu**2)) < 1e-3


@interpreted
@pytest.mark.parametrize("aggregation, stride", [("weighted", 2), ("uniform", 3), ("center", 1), ("gaussian", 2)])
@pytest.mark.parametrize("demean", ["voxel", "volume", "none"])
def test_pipeline_matches_cpu_backend(kernels, aggregation, stride, demean):
    noisy, _ = low_rank_phantom((6, 5, 5) if stride == 1 else (7, 6, 5), n_volumes=14, rank=3, sigma=5.0, seed=stride)
    cpu, gpu, mask = run_both(noisy, extent=3, stride=stride, estimator="exp2", aggregation=aggregation,
                              demean=demean)
    # voxel demeaning on a full grid of windows takes the box sums (their weights are uniform within a
    # window), everything else here the fused kernels
    assert gpu.info["gram_path"] == ("box" if demean == "voxel" and aggregation in ("weighted", "uniform")
                                     else "fused")
    assert gpu.info["gram_precision"] == ("float64" if demean == "none" else "float32")
    assert_same_denoising(cpu, gpu, mask)


@interpreted
@pytest.mark.parametrize("path, aggregation, stride, demean, eigensolver", [
    ("fused", "weighted", 2, "volume", "tridiagonal"), ("box", "weighted", 2, "voxel", "tridiagonal"),
    ("gather", "uniform", 3, "voxel", "xsyev"), ("fused", "center", 1, "none", "auto")])
@pytest.mark.parametrize("given", ["number", "map"])
def test_a_given_noise_level_gives_the_cpus_ranks(kernels, path, aggregation, stride, demean, eigensolver, given):
    """``noise`` given as one number or a map (positive inside the mask, 0 and NaN outside): every path and
    eigensolver thresholds each window at the given sigma^2's edge as the CPU backend does, and the noise map
    reports the given level. With a mask and non-finite voxels where the path takes them."""
    from mppca_nipype.engine.gpu.pipeline import denoise_gpu

    rng = np.random.default_rng(7)
    noisy, _ = low_rank_phantom((8, 6, 5), n_volumes=14, rank=3, sigma=5.0, seed=17)
    mask = np.ones(noisy.shape[:3], bool)
    if path != "box":  # (the box sums take every voxel finite)
        mask[0, :2] = False
        noisy[4, 3, 1, 5] = np.nan
    sigma = rng.uniform(2.0, 3.0, size=noisy.shape[:3])  # below the phantom's 5: more is kept than estimated
    sigma[~mask] = rng.choice([0.0, np.nan], size=int((~mask).sum()))
    data, mask, finite, plan, options = prepared(noisy, mask, extent=3, stride=stride, estimator="exp2",
                                                 aggregation=aggregation, demean=demean,
                                                 noise=2.5 if given == "number" else sigma)
    cpu = denoise_cpu(data, finite, plan, options, nprocs=1)
    gpu = denoise_gpu(data, finite, plan, options, device="cpu", path=path, eigensolver=eigensolver)
    assert gpu.info["gram_path"] == path
    assert_same_denoising(cpu, gpu, mask)
    served = (cpu.weight > 0) & mask.ravel()
    estimated = denoise_gpu(data, finite, plan, dataclasses.replace(options, noise_variance=None), device="cpu",
                            path=path, eigensolver=eigensolver)
    assert per_voxel(gpu, served)[2].mean() > per_voxel(estimated, served)[2].mean() + 0.5
    assert np.all(per_voxel(gpu, served)[1] < 3.0) and np.all(per_voxel(estimated, served)[1] > 3.5)
    if given == "number":
        np.testing.assert_allclose(per_voxel(gpu, served)[1], 2.5, rtol=1e-6)


@interpreted
@pytest.mark.parametrize("planes", [None, 2])
def test_pipeline_takes_a_volume_major_series_whole_or_in_slabs(kernels, planes):
    """A Fortran-order series (as nibabel reads a file) gives the sums of its C-order copy, whole or in
    slabs of x-planes, with no transpose of the whole series."""
    from mppca_nipype.engine.gpu.pipeline import denoise_gpu

    noisy, _ = low_rank_phantom((7, 6, 5), n_volumes=13, rank=3, sigma=5.0, seed=8)
    sums = []
    for order in ("C", "F"):
        data, mask, finite, plan, resolved = prepared(np.asarray(noisy, order=order), extent=3, stride=2,
                                                      estimator="exp2", aggregation="weighted", demean="volume")
        assert data.flags.f_contiguous == (order == "F")
        sums.append(denoise_gpu(data, finite, plan, resolved, device="cpu", planes=planes))
    for name in ("image", "weight", "sigma", "rank"):
        np.testing.assert_array_equal(getattr(sums[1], name), getattr(sums[0], name))


@interpreted
@pytest.mark.parametrize("aggregation, stride", [("weighted", 2), ("center", 1)])
@pytest.mark.parametrize("demean", ["voxel", "volume"])
def test_pipeline_with_mask_nan_voxels_and_exp1_matches_cpu_backend(kernels, aggregation, stride, demean):
    noisy, _ = low_rank_phantom((7, 6, 5), n_volumes=17, rank=3, sigma=5.0, seed=4)
    noisy[2, 3, 1, 5] = np.nan
    noisy[4, 1, 2, 0] = np.inf
    mask = np.zeros(noisy.shape[:3], bool)
    mask[1:6, 1:5, 0:4] = True
    cpu, gpu, mask = run_both(noisy, mask, extent=(3, 3, 5), stride=stride, estimator="exp1",
                              aggregation=aggregation, demean=demean)
    assert_same_denoising(cpu, gpu, mask)


@pytest.fixture
def gpu_denoise(monkeypatch):
    """``denoise(device="cuda")`` on the GPU pipeline interpreted on the CPU, with the ``plan.GPUSettings``
    put in ``settings``; returns (the list of the host's finiteness passes, ``settings``)."""
    import mppca_nipype.engine as engine
    from mppca_nipype.engine.gpu.pipeline import denoise_gpu

    settings, passes, finite_voxels = {}, [], engine._finite_voxels

    def interpreted_gpu(*args, **kwargs):
        return denoise_gpu(*args, device="cpu", **settings, **kwargs)

    def counted(data):
        passes.append(data.shape)
        return finite_voxels(data)

    monkeypatch.setattr(engine, "check_device", lambda device: "cpu" if device == "cpu" else "cuda")
    monkeypatch.setattr(engine, "_backend", lambda device: denoise_cpu if device == "cpu" else interpreted_gpu)
    monkeypatch.setattr(engine, "_finite_voxels", counted)
    return passes, settings


def _denoised_with_warnings(noisy, mask, **options):
    """``denoise``'s result and the messages of the MPPCAWarnings it gave."""
    import warnings

    from mppca_nipype.engine import MPPCAWarning, denoise

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = denoise(noisy, mask, **options)
    return result, [str(w.message) for w in caught if issubclass(w.category, MPPCAWarning)]


FINITE_CASES = [dict(extent=3, stride=2, demean="voxel", planes=None),  # the box sums, whole
                dict(extent=3, stride=2, demean="volume", planes=2),  # the fused kernels, four slabs
                dict(extent=3, stride=2, demean="voxel", planes=3)]  # the box sums, three slabs


@interpreted
@pytest.mark.parametrize("case", FINITE_CASES)
def test_a_finite_series_on_the_gpu_takes_no_host_pass_and_gives_the_host_checked_result(
        kernels, gpu_denoise, monkeypatch, case):
    import mppca_nipype.engine as engine

    passes, settings = gpu_denoise
    options = dict(case)
    settings.update(planes=options.pop("planes"))
    noisy, _ = low_rank_phantom((8, 6, 5), n_volumes=16, rank=3, sigma=5.0, seed=11)
    taken_finite, messages = _denoised_with_warnings(noisy, None, device="cuda", **options)
    assert passes == [] and "series_finite" not in taken_finite.info
    assert taken_finite.info["n_slabs"] == (1 if settings["planes"] is None else -(-8 // settings["planes"]))
    _denoised_with_warnings(noisy, None, device="cpu", nprocs=1, **options)
    assert len(passes) == 1  # the CPU's run checks on the host first
    monkeypatch.setattr(engine, "_gpu_sums_of_a_finite_series", lambda *args: None)  # the host's check first
    host_checked, host_messages = _denoised_with_warnings(noisy, None, device="cuda", **options)
    assert len(passes) == 2 and messages == host_messages
    for name in ("denoised", "sigma", "rank"):
        np.testing.assert_array_equal(getattr(taken_finite, name), getattr(host_checked, name))


@interpreted
@pytest.mark.parametrize("case, where, eigensolver, n_passes", [
    # the device's flag, then the host's pass of the checked run
    (FINITE_CASES[0], "outside the mask", "tridiagonal", 1),
    (FINITE_CASES[1], "in the mask and the last slab", "tridiagonal", 1),
    (FINITE_CASES[2], "in the mask and the last slab", "tridiagonal", 1),
    # LAPACK's eigh (the CPU's stand-in for cuSOLVER) raises on NaN: a look after the error, then that pass
    (FINITE_CASES[1], "outside the mask", "xsyev", 2)])
def test_nan_and_inf_found_on_the_gpu_give_the_host_checked_result_and_one_warning(
        kernels, gpu_denoise, monkeypatch, case, where, eigensolver, n_passes):
    import mppca_nipype.engine as engine

    passes, settings = gpu_denoise
    options = dict(case)
    settings.update(planes=options.pop("planes"), eigensolver=eigensolver)
    noisy, _ = low_rank_phantom((8, 6, 5), n_volumes=16, rank=3, sigma=5.0, seed=12)
    mask = np.zeros(noisy.shape[:3], bool)
    mask[1:7, 1:5, 0:4] = True
    noisy[0, 5, 4, 3] = np.nan
    if where == "in the mask and the last slab":
        noisy[7, 2, 1, 15] = np.inf  # (outside the mask, x = 7: the last slab's own plane)
        noisy[6, 2, 1, 0] = -np.inf  # (inside the mask)
    result, messages = _denoised_with_warnings(noisy, mask, device="cuda", **options)
    assert len(passes) == n_passes
    monkeypatch.setattr(engine, "_gpu_sums_of_a_finite_series", lambda *args: None)  # the host's check first
    expected, expected_messages = _denoised_with_warnings(noisy, mask, device="cuda", **options)
    assert messages == expected_messages
    n_inside = int(where != "outside the mask")
    assert sum("NaN or Inf" in m for m in messages) == (1 if n_inside else 0)
    assert result.info["n_nonfinite_voxels"] == expected.info["n_nonfinite_voxels"] == n_inside
    for name in ("denoised", "sigma", "rank"):
        np.testing.assert_array_equal(getattr(result, name), getattr(expected, name))
    if n_inside:
        np.testing.assert_array_equal(result.denoised[6, 2, 1], noisy[6, 2, 1])  # kept as it was


def test_an_error_of_the_gpu_run_over_nan_leads_to_the_host_checked_run(gpu_denoise, monkeypatch):
    """A run over a series taken as finite may fail where it holds NaN (the settling pass on the host, the CPU's
    redo of failed eigensolves): the host's check then answers; over a finite series the error goes up."""
    import mppca_nipype.engine as engine
    from mppca_nipype.engine import denoise

    passes, _ = gpu_denoise

    def fails_unless_checked(data, finite, plan, options, **kwargs):  # the CPU backend standing in
        if finite.all():
            raise RuntimeError("the eigensolver did not converge")
        return denoise_cpu(data, finite, plan, options, nprocs=1)

    monkeypatch.setattr(engine, "_backend", lambda device: fails_unless_checked)
    noisy, _ = low_rank_phantom((7, 6, 5), n_volumes=16, rank=3, sigma=5.0, seed=13)
    with pytest.raises(RuntimeError, match="did not converge"):
        denoise(noisy, device="cuda", extent=3, stride=2)
    noisy[3, 2, 1, 4] = np.nan
    with pytest.warns(engine.MPPCAWarning, match="1 voxels hold NaN or Inf"):
        result = denoise(noisy, device="cuda", extent=3, stride=2)
        expected = denoise(noisy, device="cpu", extent=3, stride=2, nprocs=1)
    np.testing.assert_array_equal(result.denoised, expected.denoised)
    # a look after each failed run (the finite series', the NaN's), the NaN's checked run, the CPU's run
    assert len(passes) == 4


@interpreted
@pytest.mark.parametrize("path, aggregation, stride, demean, gram_path", [
    ("auto", "weighted", 2, "volume", "fused"), ("auto", "weighted", 2, "voxel", "fused"),
    ("auto", "center", 1, "none", "fused"), ("auto", "center", 1, "voxel", "fused"),
    ("gather", "uniform", 3, "voxel", "gather"), ("gather", "center", 1, "volume", "gather"),
    ("auto", "gaussian", 2, "volume", "fused"), ("gather", "gaussian", 1, "voxel", "gather")])
def test_sphere_patches_match_cpu_backend(kernels, path, aggregation, stride, demean, gram_path):
    """Spheres of radius 2 (33 voxels, cubes of 5): the fused kernels (the box sums do not take a sphere,
    even with voxel demeaning on a full grid) and the gathered path give the CPU backend's sums, every voxel
    of the image served, corners included."""
    noisy, _ = low_rank_phantom((7, 6, 6), n_volumes=14, rank=3, sigma=5.0, seed=stride)
    cpu, gpu, mask = run_both(noisy, extent=3, stride=stride, estimator="exp2", aggregation=aggregation,
                              demean=demean, shape="sphere", path=path)
    assert gpu.info["gram_path"] == gram_path
    assert (cpu.weight > 0).all()
    assert_same_denoising(cpu, gpu, mask)


@interpreted
@pytest.mark.parametrize("order, planes, aggregation, stride", [("F", None, "weighted", 2), ("C", 3, "center", 1)])
def test_spheres_of_a_masked_volume_major_series_or_in_slabs_match_cpu_backend(kernels, order, planes, aggregation,
                                                                               stride):
    """Spheres clipped at the image's edges (the series padded by their radius, the sums cropped): a
    Fortran-order series, slabs of x-planes, a mask and a voxel holding NaN give the CPU backend's sums on the
    image's grid."""
    from mppca_nipype.engine.gpu.pipeline import denoise_gpu

    noisy, _ = low_rank_phantom((8, 6, 5), n_volumes=14, rank=3, sigma=5.0, seed=4)
    noisy[4, 3, 1, 5] = np.nan
    mask = np.ones(noisy.shape[:3], bool)
    mask[0, :2] = False
    data, mask, finite, plan, resolved = prepared(np.asarray(noisy, order=order), mask, extent=3, stride=stride,
                                                  estimator="exp2", aggregation=aggregation, demean="volume",
                                                  shape="sphere")
    cpu = denoise_cpu(data, finite, plan, resolved, nprocs=1)
    gpu = denoise_gpu(data, finite, plan, resolved, device="cpu", planes=planes)
    assert plan.padding == 2 and gpu.weight.shape == (8 * 6 * 5,)
    assert data.flags.f_contiguous == (order == "F")
    assert_same_denoising(cpu, gpu, mask)


@interpreted
@pytest.mark.parametrize("aggregation, stride", [("weighted", 2), ("center", 1)])
@pytest.mark.parametrize("demean", ["voxel", "volume", "none"])
def test_voxel_side_gram_when_patch_has_fewer_voxels_than_volumes(kernels, aggregation, stride, demean):
    noisy, _ = low_rank_phantom((6, 5, 5), n_volumes=40, rank=3, sigma=5.0, seed=6)
    cpu, gpu, mask = run_both(noisy, extent=3, stride=stride, estimator="exp2", aggregation=aggregation,
                              demean=demean)
    assert gpu.info["gram_path"] == "gather"
    assert_same_denoising(cpu, gpu, mask)


@interpreted
@pytest.mark.parametrize("shape, n_volumes, extent, path", [((14, 13, 13), 1500, "wide", "auto"),
                                                            ((9, 8, 8), 70, 7, "gather")])
def test_refined_gathered_runs_match_cpu(kernels, shape, n_volumes, extent, path):
    """T = 1500 (the longest series the engine is meant for) with the defaults' patch (13^3 voxels), and
    T = 70 on the gathered path (blocks of 35, half the spectrum each): the float32 eigensolve refined at
    both ends in float64 gives what the CPU backend gives in float64."""
    noisy, _ = low_rank_phantom(shape, n_volumes=n_volumes, rank=4, sigma=5.0, seed=12)
    cpu, gpu, mask = run_both(noisy, extent=extent, stride=3, estimator="exp2", aggregation="weighted",
                              demean="volume", path=path)
    assert gpu.info["gram_path"] == "gather" and gpu.info["eigenvalues_refined"]
    assert_same_denoising(cpu, gpu, mask)


@interpreted
@pytest.mark.parametrize("demean", ["voxel", "volume"])
def test_gathered_path_matches_fused_path(kernels, demean):
    noisy, _ = low_rank_phantom((7, 6, 5), n_volumes=12, rank=2, sigma=5.0, seed=7)
    options = dict(extent=3, stride=2, estimator="exp2", aggregation="weighted", demean=demean)
    _, fused, _ = run_both(noisy, path="fused", **options)
    _, gathered, _ = run_both(noisy, path="gather", **options)
    np.testing.assert_allclose(gathered.image, fused.image, rtol=1e-5, atol=1e-3)
    np.testing.assert_allclose(gathered.rank, fused.rank, atol=1e-4)


@interpreted
def test_a_rank_at_the_threshold_is_unsettled_and_one_far_from_it_is_not():
    """The settling test moves the eigenvalues by a few float32 roundings of the largest one: a window whose
    signal eigenvalue sits where the estimator's answer changes is unsettled; the same window with that
    eigenvalue 1% away from there is not."""
    from mppca_nipype.engine.estimators import marchenko_pastur_threshold
    from mppca_nipype.engine.gpu.threshold import rounding_uncertainty, threshold_on_device

    rng = np.random.default_rng(3)
    noise = rng.standard_normal((200, 30))
    values = np.linalg.eigvalsh(noise.T @ noise)  # ascending, pure noise: rank 0

    def with_signal(scale):
        moved = values.copy()
        moved[-1] *= scale
        return torch.from_numpy(moved[None])

    def rank_of(scale):
        return int(marchenko_pastur_threshold(with_signal(scale), torch.tensor([200]), 30)[0][0])

    low, high = 1.0, 10.0  # rank 0 at low, 1 at high: find where it changes
    assert rank_of(low) == 0 and rank_of(high) == 1
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if rank_of(middle) == 0 else (low, middle)

    def unsettled(scale):
        values = with_signal(scale)
        unsettled_kernel = threshold_on_device(values, torch.tensor([200]), 30, "exp2",
                                               rounding_uncertainty(values, slack=10.0))[2]
        return bool(unsettled_kernel[0])

    assert unsettled(low) and unsettled(high)
    assert not unsettled(0.99 * low) and not unsettled(1.01 * high)


def test_refined_ends_of_the_spectrum_are_far_closer_to_float64_than_float32():
    """A spectrum as on long series: a bulk whose spacing is below float32's error (~eps lambda_max) and a
    few large signal eigenvalues. Rayleigh-Ritz in float64 on the float32 eigenvectors at both ends gives
    the signal eigenvalues 10^4x closer to float64 LAPACK than float32's (measured ~10^6x) and leaves the
    bulk's ends no farther (their vectors are not resolved in float32: measured 1-2x closer, the margin
    depending on the CPU's LAPACK); and their sum stays the trace."""
    rng = np.random.default_rng(11)
    m, block = 40, 8
    spectrum = np.concatenate([np.sort(1.0 + 0.5 * rng.random(m - 3)), [2e5, 4e5, 1e6]])
    errors32, errors_refined = [], []
    matrices = []
    for _ in range(6):
        q, _ = np.linalg.qr(rng.standard_normal((m, m)))
        matrices.append((q * spectrum) @ q.T)
    matrices = torch.from_numpy(np.stack(matrices))
    solver = BatchedEigh("cpu")  # (without CUDA: torch.linalg.eigh)
    values32, info = solver.values(matrices.to(torch.float32).contiguous())
    refined, refine_info = solver.refine(matrices, block)
    exact = np.linalg.eigvalsh(matrices.numpy())
    bulk, signal = np.r_[0:block, m - block:m - 3], np.r_[m - 3:m]
    errors32 = np.abs(values32.double().numpy() - exact)
    errors_refined = np.abs(refined.numpy() - exact)
    assert errors32[:, bulk].max() > 0.01  # the float32 bulk is blurred (spacing ~0.014)
    assert errors_refined[:, signal].max() < 1e-4 * errors32[:, signal].max()
    assert errors_refined[:, bulk].max() <= errors32[:, bulk].max()
    assert int(refine_info.abs().sum()) == 0 and refined.dtype == torch.float64
    np.testing.assert_allclose(refined.sum(dim=1).numpy(), np.trace(matrices.numpy(), axis1=1, axis2=2), rtol=1e-9)
    assert (np.diff(refined.numpy(), axis=1) >= 0).all()
    # the projector now comes from the top block's Ritz vectors, in float64
    projector = solver.projector(torch.full((len(matrices),), 3))
    _, exact_vectors = np.linalg.eigh(matrices.numpy())
    top = exact_vectors[:, :, -3:]
    assert projector.dtype == torch.float64 and projector.shape == matrices.shape
    np.testing.assert_allclose(projector.numpy(), top @ top.transpose(0, 2, 1), atol=1e-5)


def _patch_grams(rng, n_voxels, n_volumes, rank, count):
    """``count`` Gram matrices (T side) of volume-demeaned patches: ``rank`` components of decreasing strength
    (some near the noise edge) in unit Gaussian noise."""
    grams = []
    for _ in range(count):
        strength = np.geomspace(40.0, 1.3, rank) * np.sqrt(n_voxels)
        signal = (rng.standard_normal((n_voxels, rank)) * strength) @ rng.standard_normal((rank, n_volumes))
        patch = signal / np.sqrt(n_volumes) + rng.standard_normal((n_voxels, n_volumes))
        patch -= patch.mean(axis=0)
        grams.append(patch.T @ patch)
    return torch.from_numpy(np.stack(grams))


def test_leading_eigenpairs_are_within_their_bounds_and_keep_the_trace(monkeypatch):
    """The block Krylov solver of the longest series: its kept Ritz values lie within their bounds of float64
    LAPACK's eigenvalues (and the signal ones within 1e-9), the filled spectrum is ascending and sums to the
    trace, its projector matches LAPACK's eigenvectors', and a window with too few usable dimensions is
    reported failed with zeros rather than anything a reconstruction could spread."""
    from mppca_nipype.engine.gpu import cusolver

    monkeypatch.setattr(cusolver, "LEADING_BLOCK", 8)
    monkeypatch.setattr(cusolver, "LEADING_STEPS", 12)
    monkeypatch.setattr(cusolver, "LEADING_KEEP", 24)
    rng = np.random.default_rng(21)
    n_voxels, n_volumes, rank = 400, 240, 5
    grams = _patch_grams(rng, n_voxels, n_volumes, rank, 4)
    usable = torch.tensor([n_volumes, n_volumes, n_volumes, 90])  # the last: under 13 blocks of 8
    solver = BatchedEigh("cpu")
    values, info, bounds = solver.leading(grams, usable)
    exact = np.linalg.eigvalsh(grams.numpy())
    assert info.tolist() == [0, 0, 0, 1]
    kept = values[:3, -24:].numpy()
    errors = np.abs(kept - exact[:3, -24:])
    assert (errors <= bounds[:3].numpy()).all()
    assert errors[:, -rank:].max() < 1e-9 * exact[:3, -1].max()
    assert bounds[:3, -rank:].max() < 1e-6 * exact[:3, -1].min()
    assert (np.diff(values.numpy(), axis=1) >= 0).all()
    np.testing.assert_allclose(values[:3].sum(dim=1).numpy(), np.trace(grams[:3].numpy(), axis1=1, axis2=2),
                               rtol=1e-12)
    assert float(values[3].abs().max()) == 0 and float(bounds[3].abs().max()) == 0
    projector = solver.projector(torch.full((4,), rank))
    _, vectors = np.linalg.eigh(grams.numpy())
    top = vectors[:3, :, -rank:]
    np.testing.assert_allclose(projector[:3].numpy(), top @ top.transpose(0, 2, 1), atol=1e-8)
    assert float(projector[3].abs().max()) == 0
    # the estimator's answer from the filled spectrum is the full one's
    from mppca_nipype.engine.estimators import marchenko_pastur_threshold

    counts = torch.full((3,), n_voxels - 1)
    got_rank, got_sigma2 = marchenko_pastur_threshold(values[:3], counts, n_volumes, "olesen2023")
    want_rank, want_sigma2 = marchenko_pastur_threshold(torch.from_numpy(exact[:3]), counts, n_volumes, "olesen2023")
    assert got_rank.tolist() == want_rank.tolist()
    np.testing.assert_allclose(got_sigma2.numpy(), want_sigma2.numpy(), rtol=1e-8)


def test_a_windows_leading_eigenpairs_ignore_the_batch_and_a_failed_one_stays_finite(monkeypatch):
    """A window's leading eigenpairs are the same alone and beside others (one starting block for all); a
    window whose Gram has far lower rank than its usable count (finite voxels of value 0) loses its Krylov
    space: it is reported failed, with zeros, and the eigensolver is handed only finite matrices."""
    from mppca_nipype.engine.gpu import cusolver

    monkeypatch.setattr(cusolver, "LEADING_BLOCK", 8)
    monkeypatch.setattr(cusolver, "LEADING_STEPS", 12)
    monkeypatch.setattr(cusolver, "LEADING_KEEP", 16)
    rng = np.random.default_rng(8)
    grams = _patch_grams(rng, 400, 240, 5, 2)
    zeros = rng.standard_normal((400, 240))
    zeros[30:] = 0  # 30 voxels of signal, 370 of value 0: rank 30
    grams = torch.from_numpy(np.concatenate([grams, (zeros.T @ zeros)[None]]))
    handed = []

    class Recording(BatchedEigh):
        def __call__(self, matrices, vectors=True):
            handed.append(bool(torch.isfinite(matrices).all()))
            return super().__call__(matrices, vectors)

    solver = Recording("cpu")
    usable = torch.full((3,), 240)
    together, info, bounds = solver.leading(grams, usable)
    alone, _, _ = solver.leading(grams[1:2], usable[1:2])
    assert info.tolist() == [0, 0, 1] and all(handed)
    assert torch.equal(together[1], alone[0])
    assert not together[2].any() and not bounds[2].any()


@interpreted
@pytest.mark.parametrize("filter_name, noise, steps", [("optshrink", None, 12), ("hard", None, 12),
                                                       ("optthresh", 30.0, 12), ("optshrink", None, 6)])
def test_leading_eigenpairs_runs_match_cpu(kernels, monkeypatch, filter_name, noise, steps):
    """A long series on the gathered path with ``olesen2023`` (or a given noise level) finds only the leading
    eigenpairs (blocks of 8 here, so that 120 x 120 Grams take the path) and gives what the CPU backend gives
    in float64, filters and given noise included. With 12 blocks every window settles; with 6 the first noise
    eigenvalues' bounds are ~2% of them and every window is redone by the full eigensolve."""
    from mppca_nipype.engine.gpu import cusolver

    monkeypatch.setattr(cusolver, "LEADING_BLOCK", 8)
    monkeypatch.setattr(cusolver, "LEADING_STEPS", steps)
    monkeypatch.setattr(cusolver, "LEADING_KEEP", 16)
    monkeypatch.setattr(cusolver, "LEADING_MIN_ORDER", 100)
    noisy, _ = low_rank_phantom((11, 10, 10), n_volumes=120, rank=4, sigma=5.0, seed=17)
    options = dict(extent=7, stride=3, estimator="olesen2023", aggregation="gaussian", demean="volume",
                   filter=filter_name, noise=noise)
    cpu, gpu, mask = run_both(noisy, path="gather", **options)
    assert gpu.info["leading_eigenpairs"] and not gpu.info["eigenvalues_refined"]
    assert gpu.info["n_settled_in_float64"] == (0 if steps == 12 else prepared(noisy, **options)[3].n_windows)
    assert_same_denoising(cpu, gpu, mask)


@interpreted
def test_leading_eigenpairs_leave_windows_of_few_voxels_to_the_full_eigensolve(kernels, monkeypatch):
    """Where non-finite voxels leave a window too few for the Krylov space (r = 97 usable dimensions under
    the 104 of 13 blocks of 8: the windows at the grid's far x-edge hold two finite planes), the window is
    reported failed and redone by the full float64 eigensolve; the run still gives the CPU's."""
    from mppca_nipype.engine.gpu import cusolver

    monkeypatch.setattr(cusolver, "LEADING_BLOCK", 8)
    monkeypatch.setattr(cusolver, "LEADING_STEPS", 12)
    monkeypatch.setattr(cusolver, "LEADING_KEEP", 16)
    monkeypatch.setattr(cusolver, "LEADING_MIN_ORDER", 100)
    noisy, _ = low_rank_phantom((11, 10, 10), n_volumes=120, rank=4, sigma=5.0, seed=17)
    noisy[6:] = np.nan
    options = dict(extent=7, stride=3, estimator="olesen2023", aggregation="gaussian", demean="volume")
    cpu, gpu, mask = run_both(noisy, path="gather", **options)
    plan = prepared(noisy, **options)[3]
    few = int(np.count_nonzero(plan.window_base(slice(None)) // (10 * 10) == 4))  # corners at x = 4
    assert gpu.info["leading_eigenpairs"] and few > 0
    assert gpu.info["n_settled_in_float64"] >= few
    assert_same_denoising(cpu, gpu, mask)


@interpreted
@pytest.mark.parametrize("aggregation, stride, filter_name", [("weighted", 2, "hard"), ("center", 1, "hard"),
                                                              ("gaussian", 2, "optshrink")])
def test_refined_gathered_runs_match_float64(kernels, monkeypatch, aggregation, stride, filter_name):
    """Gathered float32 runs with a full-eigenvector solver refine the spectrum's ends in float64 (with
    blocks of 4 here, so that 14 x 14 matrices take the path) and match the float64 run; a filter's weights
    are taken over the refined block's vectors."""
    from mppca_nipype.engine.gpu import cusolver, pipeline, threshold

    noisy, _ = low_rank_phantom((7, 6, 5), n_volumes=14, rank=2, sigma=5.0, seed=6)
    data, _, finite, plan, options = prepared(noisy, extent=3, stride=stride, estimator="exp2",
                                              aggregation=aggregation, demean="volume", filter=filter_name)
    monkeypatch.setattr(cusolver, "REFINE_BLOCK", 4)
    monkeypatch.setattr(cusolver, "REFINE_MIN_ORDER", 8)
    monkeypatch.setattr(threshold, "REFINE_GUARD", 0)
    refined = pipeline.denoise_gpu(data, finite, plan, options, device="cpu", path="gather")
    in_float64 = pipeline.denoise_gpu(data, finite, plan, options, device="cpu", path="gather", precision="float64")
    assert refined.info["eigenvalues_refined"] and refined.info["gram_precision"] == "float32"
    assert refined.info["n_settled_in_float64"] < plan.n_windows
    for got, want in ((refined.image, in_float64.image), (refined.sigma, in_float64.sigma),
                      (refined.rank, in_float64.rank), (refined.weight, in_float64.weight)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


@interpreted
@pytest.mark.parametrize("aggregation, stride", [("weighted", 2), ("center", 1)])
@pytest.mark.parametrize("demean", ["voxel", "volume"])
def test_unsettled_windows_are_redone_in_float64(kernels, monkeypatch, aggregation, stride, demean):
    """With every window unsettled, the float32 run gives what the float64 run gives."""
    from mppca_nipype.engine.gpu import pipeline, threshold

    noisy, _ = low_rank_phantom((7, 6, 5), n_volumes=14, rank=3, sigma=5.0, seed=3)
    data, _, finite, plan, options = prepared(noisy, extent=3, stride=stride, estimator="exp2",
                                              aggregation=aggregation, demean=demean)
    monkeypatch.setattr(threshold, "SETTLE_SLACK", 1e12)
    settled = pipeline.denoise_gpu(data, finite, plan, options, device="cpu")
    in_float64 = pipeline.denoise_gpu(data, finite, plan, options, device="cpu", precision="float64")
    assert settled.info["gram_precision"] == "float32"
    assert settled.info["n_settled_in_float64"] == plan.n_windows
    for got, want in ((settled.image, in_float64.image), (settled.sigma, in_float64.sigma),
                      (settled.rank, in_float64.rank), (settled.weight, in_float64.weight)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)


class _FaultySolver(ProjectorFromVectors):
    """torch.linalg.eigh in the pipeline's solver interface, for subclasses to make fail."""

    def __init__(self, device):
        self.inner = BatchedEigh(device)  # (without CUDA: torch.linalg.eigh)
        self.backend = self.inner.backend

    def workspace_bytes(self, batch, m, dtype):
        return 0

    def release_workspaces(self):
        pass


class _SolverWithLittleMemory(_FaultySolver):
    """The pipeline's eigensolver, out of memory for batches above ``limit`` windows (after the Gram
    matrices are made, before anything is added into the sums)."""

    limit = 2
    calls: list = []

    def __call__(self, matrices):
        type(self).calls.append(len(matrices))
        if len(matrices) > self.limit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return self.inner(matrices)


@interpreted
@pytest.mark.parametrize("path, aggregation, stride", [("fused", "weighted", 2), ("gather", "weighted", 2),
                                                       ("fused", "center", 1)])
def test_out_of_memory_batches_are_redone_smaller_with_the_same_result(kernels, monkeypatch, path,
                                                                       aggregation, stride):
    from mppca_nipype.engine.gpu import pipeline, plan as plan_module

    noisy, _ = low_rank_phantom((7, 6, 5), n_volumes=14, rank=3, sigma=5.0, seed=4)
    data, _, finite, plan, options = prepared(noisy, extent=3, stride=stride, estimator="exp2",
                                              aggregation=aggregation, demean="volume")
    reference = pipeline.denoise_gpu(data, finite, plan, options, device="cpu", path=path, max_batch=2,
                                     settle=False)
    monkeypatch.setattr(plan_module, "BatchedEigh", _SolverWithLittleMemory)
    monkeypatch.setattr(plan_module, "MIN_BATCH", 1)
    _SolverWithLittleMemory.calls = []
    retried = pipeline.denoise_gpu(data, finite, plan, options, device="cpu", path=path, max_batch=16,
                                   settle=False)
    assert plan.n_windows > 16
    assert _SolverWithLittleMemory.calls[:3] == [16, 8, 4]  # halved until it fits, then kept small
    assert set(_SolverWithLittleMemory.calls[3:]) <= {2, plan.n_windows % 2}
    assert retried.info["out_of_memory_retries"] == 3 and retried.info["batch"] == 2
    for got, want in ((retried.image, reference.image), (retried.weight, reference.weight),
                      (retried.sigma, reference.sigma), (retried.rank, reference.rank)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@interpreted
def test_out_of_memory_at_the_smallest_batch_goes_up(kernels, monkeypatch):
    from mppca_nipype.engine.gpu import pipeline, plan as plan_module

    noisy, _ = low_rank_phantom((6, 5, 5), n_volumes=12, rank=2, sigma=5.0, seed=5)
    data, _, finite, plan, options = prepared(noisy, extent=3, stride=2, estimator="exp2",
                                              aggregation="weighted", demean="volume")
    monkeypatch.setattr(plan_module, "BatchedEigh", _SolverWithLittleMemory)
    monkeypatch.setattr(plan_module, "MIN_BATCH", 4)
    with pytest.raises(torch.OutOfMemoryError):
        pipeline.denoise_gpu(data, finite, plan, options, device="cpu", max_batch=16)


def test_run_in_batches_only_retries_out_of_memory():
    from mppca_nipype.engine.gpu.plan import run_in_batches

    def broken(a, b):
        raise RuntimeError("an illegal memory access was encountered")

    with pytest.raises(RuntimeError, match="illegal memory access"):
        run_in_batches(100, 50, broken, min_batch=1)
    done = []
    results, step, retries = run_in_batches(10, 4, lambda a, b: (a, b), on_batch=done.append)
    assert results == [(0, 4), (4, 8), (8, 10)] and step == 4 and retries == 0 and done == [4, 8, 10]


@interpreted
@pytest.mark.parametrize("path, aggregation, stride, planes", [
    ("fused", "weighted", 2, 1), ("fused", "weighted", 3, 2), ("gather", "uniform", 2, 3),
    ("fused", "center", 1, 2), ("gather", "center", 1, 1)])
def test_slabs_with_a_halo_give_what_one_slab_gives(kernels, path, aggregation, stride, planes):
    """A series cut into slabs of a few x-planes (as when it does not fit the device): the halo's sums are
    carried from slab to slab, so every voxel ends with the same values; with a mask and NaN voxels."""
    from mppca_nipype.engine.gpu.pipeline import denoise_gpu
    from mppca_nipype.engine.gpu.plan import plan_slabs

    noisy, _ = low_rank_phantom((9, 6, 5), n_volumes=14, rank=3, sigma=5.0, seed=8)
    noisy[4, 3, 1, 5] = np.nan
    mask = np.zeros(noisy.shape[:3], bool)
    mask[1:8, 1:5, 0:4] = True
    data, mask, finite, plan, options = prepared(noisy, mask, extent=(3, 3, 5), stride=stride, estimator="exp2",
                                                 aggregation=aggregation, demean="volume")
    slabs = plan_slabs(plan, planes)
    assert len(slabs) > 2 and slabs[-1].windows.stop == plan.n_windows and slabs[-1].done == 9
    assert all(a.windows.stop == b.windows.start and a.done == b.first for a, b in zip(slabs, slabs[1:]))
    whole = denoise_gpu(data, finite, plan, options, device="cpu", path=path)
    cut = denoise_gpu(data, finite, plan, options, device="cpu", path=path, planes=planes)
    assert whole.info["n_slabs"] == 1 and cut.info["n_slabs"] == len(slabs)
    for got, want in ((cut.image, whole.image), (cut.weight, whole.weight), (cut.sigma, whole.sigma),
                      (cut.rank, whole.rank)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    served = whole.weight > 0
    assert served.sum() >= mask.sum() - 1 and np.abs(whole.image[served]).min() > 100  # real values compared


@interpreted
@pytest.mark.parametrize("shape, n_volumes, extent, stride", [((9, 8, 11), 7, (5, 3, 5), 2),
                                                               ((7, 10, 6), 20, (3, 3, 3), 3),
                                                               ((6, 7, 13), 33, (3, 5, 7), 4)])
def test_box_sums_match_float64_reference(kernels, shape, n_volumes, extent, stride):
    """Each window's Gram of its voxel-centred patch (computed at once, and as the rows arrive in parts),
    and the sums of w (X_c P + mean), w, w sigma, w rank over the windows holding each voxel, against float64
    loops over the windows (awkward T, extents, and a stride above the extent on one axis)."""
    from mppca_nipype.engine.gpu.boxsums import BoxSums
    from mppca_nipype.engine.gpu.plan import plan_slabs

    rng = np.random.default_rng(n_volumes)
    data = (100 + 10 * rng.standard_normal(shape + (n_volumes,))).astype(np.float32)
    everywhere = np.ones(shape, bool)
    plan = plan_patches(shape, extent, stride, everywhere, everywhere)
    volume = data.reshape(-1, n_volumes).astype(np.float64)
    patches = volume[plan.window_base()[:, None] + plan.voxel_offsets[None, :]]
    means = patches.mean(axis=2, keepdims=True)
    patches -= means
    box = BoxSums(plan, plan_slabs(plan, shape[0])[0], n_volumes, "cpu")
    box_volume = torch.from_numpy(data.reshape(-1, n_volumes).copy())
    gram = box.gram(box_volume).numpy()
    expected = patches.transpose(0, 2, 1) @ patches
    assert np.abs(gram - expected).max() < 1e-6 * np.abs(expected).max()
    # the rows arriving in parts (a part of a line, a line, nothing new, several planes): the same sums
    plane = shape[1] * shape[2]
    arriving = [shape[2] // 2, shape[2], shape[2], plane + 1, 3 * plane - 1]
    np.testing.assert_array_equal(box.gram(box_volume, iter(arriving)).numpy(), gram)

    n_windows = plan.n_windows
    projector = rng.standard_normal((n_windows, n_volumes, n_volumes))
    projector += projector.transpose(0, 2, 1)  # symmetric, as projectors are
    weight, sigma, rank = rng.uniform(0.5, 2, n_windows), rng.uniform(1, 2, n_windows), rng.integers(0, 5, n_windows)
    # the windows added in parts along x, the planes no later window holds spread back after each (as the
    # first pass does with the settling pass on the device); a window not added yet holds NaN
    box.projectors.fill_(float("nan"))
    box.scalars.fill_(float("nan"))
    per_corner = n_windows // box.grid[0]
    parts = sorted({0, per_corner, min(2 * per_corner + per_corner // 2, n_windows), n_windows})
    values = as_tensors(*(a.astype(np.float32) for a in (projector, weight, sigma, rank)))
    spread = []
    for first, stop in zip(parts, parts[1:]):
        box.add_windows(slice(first, stop), *(v[first:stop] for v in values))
        box.spread(stop)
        spread.append(box.planes_spread)
    assert 0 < spread[0] < shape[0] and spread[-1] == shape[0]
    sums = [torch.zeros((len(volume), n_volumes))] + [torch.zeros(len(volume)) for _ in range(3)]
    box.accumulate(box_volume, *sums)
    want = [np.zeros((len(volume), n_volumes))] + [np.zeros(len(volume)) for _ in range(3)]
    voxels = plan.window_base()[:, None] + plan.voxel_offsets[None, :]
    restored = (patches @ projector + means) * weight[:, None, None]
    for k in range(n_windows):
        for target, value in zip(want, (restored[k], weight[k], weight[k] * sigma[k], weight[k] * rank[k])):
            target[voxels[k]] += value
    for got, expected in zip(sums, want):
        assert np.abs(got.numpy() - expected).max() < 1e-5 * np.abs(expected).max()


@interpreted
@pytest.mark.parametrize("aggregation, planes", [("weighted", None), ("uniform", 2)])
def test_box_path_gives_the_fused_kernels_result(kernels, monkeypatch, aggregation, planes):
    """Voxel demeaning on a full grid: the box sums (``auto``'s choice; in slabs too) denoise as the fused
    kernels do, the windows the settling pass redoes included (a wide slack makes it redo some)."""
    from mppca_nipype.engine.gpu import threshold
    from mppca_nipype.engine.gpu.pipeline import denoise_gpu
    from mppca_nipype.engine.gpu.plan import plan_slabs

    monkeypatch.setattr(threshold, "SETTLE_SLACK", 3e3)
    monkeypatch.setattr(threshold, "TRIDIAGONAL_SETTLE_SLACK", 3e3)

    noisy, _ = low_rank_phantom((9, 7, 8), n_volumes=15, rank=3, sigma=5.0, seed=12)
    data, mask, finite, plan, options = prepared(noisy, extent=(5, 3, 5), stride=2, estimator="exp2",
                                                 aggregation=aggregation, demean="voxel")
    box = denoise_gpu(data, finite, plan, options, device="cpu", planes=planes)
    fused = denoise_gpu(data, finite, plan, options, device="cpu", path="fused")
    assert box.info["gram_path"] == "box" and fused.info["gram_path"] == "fused"
    assert box.info["n_slabs"] == len(plan_slabs(plan, planes or 9)) and box.info["n_settled_in_float64"] > 0
    for got, want in ((box.image, fused.image), (box.weight, fused.weight), (box.sigma, fused.sigma),
                      (box.rank, fused.rank)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    assert np.abs(box.image).min() > 100  # real values compared


def test_box_sums_apply_only_to_voxel_demeaning_on_a_full_grid_of_finite_voxels():
    from mppca_nipype.engine.gpu.boxsums import MAX_VOLUMES, applies

    def case(shape=(12, 10, 9), n_volumes=20, mask=None, finite=None, fused=True, dtype=torch.float32, **options):
        options = dict(dict(extent=5, stride=2, estimator="exp2", demean="voxel", aggregation="weighted"), **options)
        resolved = resolve_options(shape + (n_volumes,), **options)
        everywhere = np.ones(shape, bool)
        finite = everywhere if finite is None else finite
        plan = plan_patches(shape, resolved.extent, resolved.stride, everywhere if mask is None else mask, finite,
                            resolved.shape)
        return applies(plan, resolved, finite, n_volumes, dtype, fused)

    assert case() and case(aggregation="uniform") and case(n_volumes=MAX_VOLUMES)
    assert not case(demean="volume") and not case(demean="none") and not case(aggregation="center", stride=1)
    assert not case(n_volumes=MAX_VOLUMES + 1) and not case(dtype=torch.float64) and not case(fused=False)
    corner = np.zeros((12, 10, 9), bool)
    corner[:3, :3, :3] = True
    assert not case(mask=corner)  # windows far from the mask do not run: not a full grid
    nan = np.ones((12, 10, 9), bool)
    nan[5, 5, 5] = False
    assert not case(finite=nan)
    # spheres (of radius 2 in cubes of 5, centred on 0, 2, ... and the last voxel) on a full grid of finite
    # voxels with voxel demeaning: not a box
    sphere = resolve_options((12, 10, 9, 20), extent=3, stride=2, estimator="exp2", demean="voxel",
                             aggregation="weighted", shape="sphere")
    everywhere = np.ones((12, 10, 9), bool)
    plan = plan_patches((12, 10, 9), sphere.extent, sphere.stride, everywhere, everywhere, "sphere")
    assert plan.n_windows == 7 * 6 * 5 and not applies(plan, sphere, everywhere, 20, torch.float32, True)


@interpreted
def test_box_path_asked_for_where_it_does_not_apply_is_refused(kernels):
    from mppca_nipype.engine.gpu.pipeline import denoise_gpu

    noisy, _ = low_rank_phantom((7, 6, 5), n_volumes=14, rank=3, sigma=5.0, seed=2)
    data, mask, finite, plan, options = prepared(noisy, extent=3, stride=2, estimator="exp2", aggregation="weighted",
                                                 demean="volume")
    with pytest.raises(ValueError, match="the box sums take voxel demeaning"):
        denoise_gpu(data, finite, plan, options, device="cpu", path="box")
    with pytest.raises(ValueError, match="path must be one of"):
        denoise_gpu(data, finite, plan, options, device="cpu", path="boxes")


class _SolverThatFailsSomeWindows(_FaultySolver):
    """The pipeline's eigensolver reporting ``info != 0`` for every third matrix of each batch (a failed
    eigensolve, in float32 and float64 alike)."""

    def __call__(self, matrices):
        values, vectors, info = self.inner(matrices)
        info[::3] = 1
        values[::3] *= 3.7  # what a failed solve returns must not be used
        return values, vectors, info


@interpreted
@pytest.mark.parametrize("aggregation, stride, planes, shape", [
    ("weighted", 2, None, "cuboid"), ("center", 1, None, "cuboid"), ("weighted", 3, 2, "cuboid"),
    ("center", 1, 2, "cuboid"), ("weighted", 2, None, "sphere"), ("center", 1, 2, "sphere")])
def test_windows_whose_eigensolve_fails_are_redone_on_the_cpu(kernels, monkeypatch, aggregation, stride, planes,
                                                              shape):
    from mppca_nipype.engine.gpu import pipeline, plan as plan_module

    # (a sphere's windows are cubes of 5: a larger image for as many windows to fail)
    noisy, _ = low_rank_phantom((8, 6, 5) if shape == "cuboid" else (10, 8, 7), n_volumes=14, rank=3, sigma=5.0,
                                seed=9)
    data, mask, finite, plan, options = prepared(noisy, extent=3, stride=stride, estimator="exp2",
                                                 aggregation=aggregation, demean="volume", shape=shape)
    cpu = denoise_cpu(data, finite, plan, options, nprocs=1)
    monkeypatch.setattr(plan_module, "BatchedEigh", _SolverThatFailsSomeWindows)
    gpu = pipeline.denoise_gpu(data, finite, plan, options, device="cpu", max_batch=7, planes=planes)
    # a third failed in float32 and went to float64, where a third of those failed again
    assert gpu.info["n_settled_in_float64"] >= plan.n_windows // 3 and gpu.info["n_redone_on_cpu"] >= 2
    assert_same_denoising(cpu, gpu, mask)


def symmetric_test_matrices(kind, count, m, rng):
    """Random Gram matrices, clustered spectra (repeated eigenvalues) or rank-deficient ones on a large
    scale (float64, (count, m, m)); with the ranks at which the leading eigenspace is well defined."""
    if kind == "random":
        x = rng.standard_normal((count, m, 2 * m))
        return x @ x.transpose(0, 2, 1), [0, 3, m // 2][:count]
    if kind == "clustered":  # 1 (m - 6 times), 5, 5, 5 (+1e-7), 9, 20, 20: ranks 2, 3 and 6 split no cluster
        q, _ = np.linalg.qr(rng.standard_normal((count, m, m)))
        spectrum = np.concatenate([np.ones(m - 6), [5.0, 5.0, 5.0000001, 9.0, 20.0, 20.0]])
        return np.einsum("bij,j,bkj->bik", q, spectrum, q), [2, 3, 6][:count]
    y = rng.standard_normal((count, m, 4)) * 100  # rank 4 plus a tiny ridge
    return y @ y.transpose(0, 2, 1) + 1e-3 * np.eye(m), [4, 1, 4][:count]


@interpreted
@pytest.mark.parametrize("kind", ["random", "clustered", "rank-deficient"])
@pytest.mark.parametrize("m, dtype", [(16, torch.float32), (21, torch.float32), (33, torch.float64)])
def test_tridiagonal_eigensolver_matches_lapack(kind, m, dtype):
    """Eigenvalues to float32's (float64's) rounding of the largest, and the projector onto the leading
    ``rank`` eigenvectors, against NumPy's float64 LAPACK; clusters of equal eigenvalues included."""
    from mppca_nipype.engine.gpu.tridiagonal import TridiagonalEigh

    rng = np.random.default_rng(m)
    matrices, ranks = symmetric_test_matrices(kind, 3, m, rng)
    solver = TridiagonalEigh("cpu")
    values, info = solver.values(torch.from_numpy(matrices).to(dtype).clone())  # overwritten
    projector = solver.projector(torch.tensor(ranks)).numpy()
    expected_values, vectors = np.linalg.eigh(matrices)
    eps = torch.finfo(dtype).eps
    scale = np.abs(expected_values).max(axis=1, keepdims=True)
    assert (info == 0).all() and values.dtype == dtype
    assert np.abs(values.numpy() - expected_values).max() <= 8 * m * eps * scale.max()
    assert (np.diff(values.numpy(), axis=1) >= 0).all()
    for b, rank in enumerate(ranks):
        kept = vectors[b][:, m - rank:]
        np.testing.assert_allclose(projector[b], kept @ kept.T, rtol=0, atol=40 * m * eps)


def undemeaned_patch_grams(rng, count, n, m):
    """Gram matrices of undemeaned patches on a baseline near 1000 (float64): the raw X^T X, and its parts
    n mu mu^T + X_c^T X_c as (the volume-demeaned Gram, the unit mean direction, n ||mu||^2)."""
    signal = rng.standard_normal((count, n, 3)) @ (rng.standard_normal((count, 3, m))
                                                   * np.array([50.0, 20.0, 8.0])[None, :, None])
    x = 1000 + signal + 4 * rng.standard_normal((count, n, m))
    mean = x.mean(axis=1)
    centred = x - mean[:, None, :]
    norm2 = (mean**2).sum(axis=1)
    return (x.transpose(0, 2, 1) @ x, centred.transpose(0, 2, 1) @ centred, mean / np.sqrt(norm2[:, None]),
            n * norm2)


@interpreted
@pytest.mark.parametrize("m, dtype", [(21, torch.float32), (33, torch.float64)])
def test_a_counted_launch_gives_the_eigenvalues_and_projectors_of_a_whole_launch(m, dtype):
    """A counted launch (a settling pass's: ``COUNTED_LAUNCH``'s warps and two shifts a Sturm count, so fewer
    counts) on random, clustered and rank-deficient matrices: the eigenvalues of a whole launch (one shift a
    count) to a rounding, LAPACK's to the precision's, in ascending order, and the same projectors."""
    from mppca_nipype.engine.gpu.tridiagonal import COUNTED_LAUNCH, TridiagonalEigh

    assert COUNTED_LAUNCH[1] > 1
    rng = np.random.default_rng(m)
    eps = torch.finfo(dtype).eps
    for kind in ("random", "clustered", "rank-deficient"):
        matrices, ranks = symmetric_test_matrices(kind, 3, m, rng)
        exact = np.linalg.eigvalsh(matrices)
        results = []
        for count in (None, torch.tensor(3)):
            solver = TridiagonalEigh("cpu")
            values, info = solver.values(torch.from_numpy(matrices).to(dtype).clone(), count=count)
            results.append((values.double().numpy(), solver.projector(torch.tensor(ranks)).double().numpy()))
        (whole, projector_whole), (counted, projector_counted) = results
        scale = np.abs(whole).max()
        assert np.abs(counted - whole).max() <= 2 * eps * scale, kind
        assert (np.diff(counted, axis=1) >= 0).all()
        assert np.abs(counted - exact).max() <= 8 * m * eps * scale
        np.testing.assert_allclose(projector_counted, projector_whole, rtol=0, atol=10 * m * eps)


@interpreted
@pytest.mark.parametrize("m", [16, 21])
def test_tridiagonal_eigensolver_takes_a_rank_one_term_apart(m):
    """Eigenvalues of A + rho w w^T with rho ~1e8 times A's noise eigenvalues: in float32 the small ones
    come out to a few roundings of ||A|| (solving the sum directly: 30-130 of them), the largest to a
    rounding of itself; and the projectors onto the mean direction, the signal, and into the noise."""
    from mppca_nipype.engine.gpu.tridiagonal import TridiagonalEigh

    rng = np.random.default_rng(m)
    full, demeaned, direction, weight = undemeaned_patch_grams(rng, 6, 40, m)
    exact, vectors = np.linalg.eigh(full)
    solver = TridiagonalEigh("cpu")
    values, info = solver.values(torch.from_numpy(demeaned).float().contiguous(),
                                 rank_one=(torch.from_numpy(direction), torch.from_numpy(weight)))
    eps = np.finfo(np.float32).eps
    scale = np.abs(np.linalg.eigvalsh(demeaned)).max(axis=1)
    values = values.double().numpy()
    assert (info == 0).all()
    assert (np.abs(values - exact)[:, :-1].max(axis=1) <= 8 * eps * scale).all()
    assert (np.abs(values[:, -1] - exact[:, -1]) <= 4 * eps * exact[:, -1]).all()
    # the projectors to float32's rounding over the gap at the cut (eps ||A|| / gap, as LAPACK's), also where
    # the cut lies in the noise (rank 6): the inverse iteration's shifts are spaced by A's rounding, not rho's
    for rank in (1, 3, 6):
        kept = vectors[:, :, m - rank:]
        projector = solver.projector(torch.full((6,), rank)).double().numpy()
        gap = exact[:, m - rank] - exact[:, m - rank - 1]
        error = np.abs(projector - kept @ kept.transpose(0, 2, 1)).max(axis=(1, 2))
        assert (error <= 40 * m * eps + 2 * eps * scale / gap).all(), (rank, error, eps * scale / gap)


@interpreted
@pytest.mark.parametrize("m, dtype, rank_one", [(40, torch.float32, False), (33, torch.float64, False),
                                                (21, torch.float32, True)])
def test_the_low_rank_projector_launch_and_the_full_one_give_lapacks_projectors(m, dtype, rank_one):
    """The ranks up to ``PROJECTOR_LANES`` take a launch with 16 lanes and the others a full one: every
    projector is LAPACK's, to the precision's rounding over the gap at its cut."""
    from mppca_nipype.engine.gpu.tridiagonal import TridiagonalEigh

    rng = np.random.default_rng(m)
    ranks = torch.tensor([0, 1, 5, 16, 17, m // 2 + 10, m - 1, m])
    if rank_one:
        full, demeaned, direction, weight = undemeaned_patch_grams(rng, len(ranks), 40, m)
        matrices, extra = demeaned, dict(rank_one=(torch.from_numpy(direction), torch.from_numpy(weight)))
        ranks = torch.tensor([0, 1, 2, 3, 16, 17, 20, 21])  # where the gaps are wide enough for float32
    else:
        x = rng.standard_normal((len(ranks), m, 2 * m))
        full = matrices = x @ x.transpose(0, 2, 1)
        extra = {}
    solver = TridiagonalEigh("cpu")
    solver.values(torch.from_numpy(matrices).to(dtype).clone(), **extra)  # overwritten
    projector = solver.projector(ranks).double().numpy()
    eps = torch.finfo(dtype).eps
    exact, vectors = np.linalg.eigh(full)
    scale = np.abs(np.linalg.eigvalsh(matrices)).max(axis=1)  # ||A|| (without the rank-one term)
    for b, r in enumerate(ranks.tolist()):  # each to float32's (float64's) rounding over its gap, as LAPACK's
        gap = exact[b, m - r] - exact[b, m - r - 1] if 0 < r < m else np.inf
        error = np.abs(projector[b] - vectors[b][:, m - r:] @ vectors[b][:, m - r:].T).max()
        assert error <= 40 * m * eps + 2 * eps * scale[b] / gap, (r, error, eps * scale[b] / gap)


@pytest.mark.parametrize("as_array", [torch.tensor, np.asarray])
def test_projectors_whose_cut_float32_cannot_resolve_are_flagged(as_array):
    """eps ||A|| / gap at the rank's cut above the limit: flagged; a wide gap, rank 0 or rank m: not. The same
    code on the GPU's tensors and the CPU's arrays."""
    from mppca_nipype.engine.estimators import unresolved_projectors

    values = as_array([[1.0, 2.0, 3.0, 1e4], [1.0, 2.0, 2.0 + 1e-3, 1e4], [1.0, 2.0, 2.0 + 1e-3, 1e4],
                       [1.0, 1.0, 1.0, 1.0]])
    rank = as_array([2, 2, 0, 4])
    scale = as_array([1e4] * 4)
    # eps * 1e4 = 1.2e-3: over a gap of 1 that is 1.2e-3, over a gap of 1e-3 it is 1.2
    assert unresolved_projectors(values, rank, scale, limit=1e-2).tolist() == [False, True, False, False]
    assert unresolved_projectors(values, rank, scale, limit=1e-4).tolist() == [True, True, False, False]


def test_undemeaned_runs_take_the_mean_apart_where_fused_and_tridiagonal_kernels_serve_them():
    """float32 for dwidenoise's mode only where the fused Gram kernel and the tridiagonal kernels serve the
    patch (``auto`` picks them on CUDA for m <= 64); float64 otherwise; demeaned runs are float32 anyway."""
    from mppca_nipype.engine import resolve_options
    from mppca_nipype.engine.gpu.plan import gram_precision, takes_mean_apart

    none, volume = (resolve_options((20, 20, 20, 48), extent=5, stride=1, estimator="exp2", aggregation="center",
                                    demean=demean) for demean in ("none", "volume"))
    assert takes_mean_apart(none, "cuda", "auto", "auto", 125, 48)
    assert takes_mean_apart(none, "cpu", "auto", "tridiagonal", 125, 48)
    assert not takes_mean_apart(none, "cpu", "auto", "auto", 125, 48)  # "auto" there is XsyevBatched's stand-in
    assert not takes_mean_apart(none, "cuda", "auto", "xsyev", 125, 48)
    assert not takes_mean_apart(none, "cuda", "gather", "auto", 125, 48)
    assert not takes_mean_apart(none, "cuda", "auto", "auto", 125, 96)  # auto's tridiagonal range is m <= 64
    assert not takes_mean_apart(none, "cuda", "auto", "auto", 40, 48)  # voxel side: not fused
    assert not takes_mean_apart(volume, "cuda", "auto", "auto", 125, 48)
    assert gram_precision(none, "auto", True) == torch.float32 and gram_precision(none) == torch.float64
    assert gram_precision(volume) == torch.float32 and gram_precision(none, "float64", True) == torch.float64


@interpreted
def test_the_tridiagonal_kernels_settle_with_their_own_slack(kernels, monkeypatch):
    """A run with the tridiagonal kernels flags by ``TRIDIAGONAL_SETTLE_SLACK`` roundings, not
    ``SETTLE_SLACK``: at a huge slack every window is redone in float64, and gives the float64 run."""
    from mppca_nipype.engine.gpu import pipeline, threshold

    noisy, _ = low_rank_phantom((7, 6, 5), n_volumes=14, rank=3, sigma=5.0, seed=5)
    data, _, finite, plan, options = prepared(noisy, extent=3, stride=2, estimator="exp2",
                                              aggregation="weighted", demean="volume")
    monkeypatch.setattr(threshold, "TRIDIAGONAL_SETTLE_SLACK", 1e12)
    settled = pipeline.denoise_gpu(data, finite, plan, options, device="cpu", eigensolver="tridiagonal")
    in_float64 = pipeline.denoise_gpu(data, finite, plan, options, device="cpu", precision="float64",
                                      eigensolver="tridiagonal")
    assert settled.info["n_settled_in_float64"] == plan.n_windows
    np.testing.assert_allclose(settled.image, in_float64.image, rtol=1e-6, atol=1e-5)
    monkeypatch.setattr(threshold, "TRIDIAGONAL_SETTLE_SLACK", 0.0)
    monkeypatch.setattr(threshold, "SETTLE_SLACK", 1e12)
    assert pipeline.denoise_gpu(data, finite, plan, options, device="cpu", eigensolver="tridiagonal"
                                ).info["n_settled_in_float64"] < plan.n_windows


@interpreted
@pytest.mark.parametrize("path, aggregation, demean, planes", [("auto", "weighted", "voxel", None),
                                                              ("fused", "uniform", "volume", 2)])
def test_the_settling_pass_chosen_on_the_device_redoes_what_the_host_would(kernels, monkeypatch, path, aggregation,
                                                                          demean, planes):
    """The settling pass queued without the host (the windows to redo sorted first on the device, launches
    sized for every window whose programs past the count return) gives what the pass chosen on the host
    gives: the same windows redone, the same sums; with the box sums, and with the fused kernels in slabs."""
    from mppca_nipype.engine.gpu import pipeline, plan as plan_module, settling, threshold

    monkeypatch.setattr(threshold, "TRIDIAGONAL_SETTLE_SLACK", 3e3)  # wide: some windows, not all, redone
    noisy, _ = low_rank_phantom((9, 7, 8), n_volumes=15, rank=3, sigma=5.0, seed=21)
    data, _, finite, plan, options = prepared(noisy, extent=(5, 3, 5), stride=2, estimator="exp2",
                                              aggregation=aggregation, demean=demean)
    run = dict(device="cpu", eigensolver="tridiagonal", path=path, planes=planes)
    parts = []  # with the box sums: each part of the first pass settled and finished in turn
    finish_part = settling.PartFinishing.part
    monkeypatch.setattr(settling.PartFinishing, "part", lambda self, ready, *args: (
        parts.append((ready, self.windows.box.final_planes(ready))), finish_part(self, ready, *args)))
    on_device = pipeline.denoise_gpu(data, finite, plan, options, **run)
    if path == "auto":  # the upload's three rounds of rows: corners along x in two parts, planes 0-1 first
        assert parts == [(plan.n_windows // 3, 2), (plan.n_windows, 9)]
    else:
        assert parts == []
    monkeypatch.setattr(plan_module.GPURun, "settles_on_device", lambda self, n_volumes: False)
    on_host = pipeline.denoise_gpu(data, finite, plan, options, **run)
    n_settled = on_device.info["n_settled_in_float64"]
    assert n_settled == on_host.info["n_settled_in_float64"] and 0 < n_settled < plan.n_windows
    assert on_device.info["gram_path"] == ("box" if path == "auto" else "fused")
    for got, want in ((on_device.image, on_host.image), (on_device.weight, on_host.weight),
                      (on_device.sigma, on_host.sigma), (on_device.rank, on_host.rank)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)
    assert np.abs(on_device.image).min() > 100  # real values compared


@interpreted
def test_a_spheres_settling_pass_on_the_device_adds_its_spheres_as_the_hosts_does(kernels, monkeypatch):
    """Spheres redone in float64 by the pass chosen on the device (launches sized for every window, on the
    padded series) give the sums the pass chosen on the host gives."""
    from mppca_nipype.engine.gpu import pipeline, plan as plan_module, threshold

    monkeypatch.setattr(threshold, "TRIDIAGONAL_SETTLE_SLACK", 3e3)  # wide: some windows, not all, redone
    noisy, _ = low_rank_phantom((9, 8, 7), n_volumes=15, rank=3, sigma=5.0, seed=21)
    data, _, finite, plan, options = prepared(noisy, extent=3, stride=2, estimator="exp2", aggregation="weighted",
                                              demean="voxel", shape="sphere")
    run = dict(device="cpu", eigensolver="tridiagonal")
    on_device = pipeline.denoise_gpu(data, finite, plan, options, **run)
    monkeypatch.setattr(plan_module.GPURun, "settles_on_device", lambda self, n_volumes: False)
    on_host = pipeline.denoise_gpu(data, finite, plan, options, **run)
    n_settled = on_device.info["n_settled_in_float64"]
    assert n_settled == on_host.info["n_settled_in_float64"] and 0 < n_settled < plan.n_windows
    assert on_device.info["gram_path"] == "fused"
    for got, want in ((on_device.image, on_host.image), (on_device.weight, on_host.weight),
                      (on_device.sigma, on_host.sigma), (on_device.rank, on_host.rank)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)
    assert np.abs(on_device.image).min() > 100  # real values compared


@interpreted
@pytest.mark.parametrize("n_windows, first", [(0, 0), (7, 3), (2500, 11)])
def test_the_windows_to_redo_are_chosen_on_the_device_in_order(kernels, n_windows, first):
    """``choose_windows``: the failed and unsettled windows' base rows and multiplicities compacted to the
    front in order (over several of the kernel's blocks), their count, and which places are before it."""
    rng = np.random.default_rng(n_windows)
    info = torch.from_numpy(np.where(rng.random(n_windows) < 0.05, 1, 0).astype(np.int32))
    unsettled = torch.from_numpy(rng.random(n_windows) < 0.1)
    base = torch.from_numpy(rng.integers(0, 10**6, first + n_windows + 5))
    multiplicity = torch.from_numpy(rng.uniform(1, 3, first + n_windows + 5))
    chosen_base, chosen_multiplicity, asked, count = kernels.choose_windows(info, unsettled, base, multiplicity,
                                                                            first)
    redo = first + np.flatnonzero((info.numpy() != 0) | unsettled.numpy())
    assert count.shape == () and int(count) == len(redo)
    np.testing.assert_array_equal(chosen_base.numpy()[:len(redo)], base.numpy()[redo])
    np.testing.assert_array_equal(chosen_multiplicity.numpy()[:len(redo)], multiplicity.numpy()[redo])
    np.testing.assert_array_equal(asked.numpy(), np.arange(n_windows) < len(redo))


@interpreted
def test_counted_launches_compute_the_first_count_windows_as_whole_launches_do(kernels):
    """``count`` (a device integer): the Gram kernel and the tridiagonal kernels give the first ``count``
    windows what a launch without it gives (the pipeline reads nothing past the count): the Gram exactly, the
    eigenvalues (the counted launch takes ``COUNTED_LAUNCH``'s shifts a count) to a rounding, and so the
    projectors."""
    from mppca_nipype.engine.gpu.tridiagonal import TridiagonalEigh

    rng = np.random.default_rng(3)
    n_rows, n_volumes, n_voxels, batch, count = 600, 12, 27, 9, 5
    volume = torch.from_numpy((100 + 10 * rng.standard_normal((n_rows, n_volumes))).astype(np.float32))
    finite = torch.ones(n_rows)
    base = torch.from_numpy(rng.integers(0, n_rows - 200, batch))
    offsets = torch.from_numpy((np.arange(n_voxels) * 7).astype(np.int32))
    for demean in ("voxel", "volume"):
        whole = kernels.gram(volume, finite, base, offsets, demean=demean, dtype=torch.float64)
        first = kernels.gram(volume, finite, base, offsets, demean=demean, dtype=torch.float64,
                             count=torch.tensor(count))
        for got, want in zip(first, whole):
            if want is not None:
                np.testing.assert_array_equal(got[:count].numpy(), want[:count].numpy())
    gram = whole[0]
    rank = torch.from_numpy(rng.integers(1, 6, batch))
    whole_launch = TridiagonalEigh("cpu")
    values = whole_launch.values(gram.clone())[0]
    projector = whole_launch.projector(rank)
    solver = TridiagonalEigh("cpu")
    got_values = solver.values(gram.clone(), count=torch.tensor(count))[0]
    got_projector = solver.projector(rank)
    eps = torch.finfo(torch.float64).eps
    scale = values.abs().amax(dim=1, keepdim=True)
    assert ((got_values - values)[:count].abs() <= 2 * eps * scale[:count]).all()
    np.testing.assert_allclose(got_projector[:count].numpy(), projector[:count].numpy(), rtol=0, atol=1e-10)


@interpreted
def test_undemeaned_float32_runs_take_the_mean_apart_and_match_cpu_backend(kernels):
    """dwidenoise's mode (no demeaning, centre aggregation) in float32 with the tridiagonal kernels: the
    Gram kernel returns the volume-demeaned Gram and the mean, the eigensolver takes n mu mu^T as a
    rank-one term, and the result is the CPU backend's (float64) within the usual tolerances."""
    from mppca_nipype.engine.gpu.pipeline import denoise_gpu

    noisy, _ = low_rank_phantom((6, 5, 5), n_volumes=17, rank=3, sigma=5.0, baseline=1000.0, seed=13)
    data, mask, finite, plan, options = prepared(noisy, extent=3, stride=1, estimator="exp2",
                                                 aggregation="center", demean="none")
    cpu = denoise_cpu(data, finite, plan, options, nprocs=1)
    gpu = denoise_gpu(data, finite, plan, options, device="cpu", eigensolver="tridiagonal")
    assert gpu.info["gram_precision"] == "float32" and gpu.info["gram_path"] == "fused"
    assert gpu.info["mean_taken_apart"]
    assert gpu.info["n_settled_in_float64"] < plan.n_windows
    assert_same_denoising(cpu, gpu, mask)


@interpreted
@pytest.mark.parametrize("aggregation, stride, demean", [("weighted", 2, "volume"), ("center", 1, "none")])
def test_pipeline_with_the_tridiagonal_eigensolver_matches_cpu_backend(kernels, aggregation, stride, demean):
    from mppca_nipype.engine.gpu.pipeline import denoise_gpu

    noisy, _ = low_rank_phantom((6, 5, 5), n_volumes=17, rank=3, sigma=5.0, seed=11)
    data, mask, finite, plan, options = prepared(noisy, extent=3, stride=stride, estimator="exp2",
                                                 aggregation=aggregation, demean=demean)
    cpu = denoise_cpu(data, finite, plan, options, nprocs=1)
    gpu = denoise_gpu(data, finite, plan, options, device="cpu", eigensolver="tridiagonal")
    assert gpu.info["eigensolver"].startswith("triton tridiagonal")
    assert_same_denoising(cpu, gpu, mask)


@interpreted
@pytest.mark.parametrize("path, aggregation, stride", [("fused", "weighted", 2), ("gather", "center", 1)])
def test_a_small_memory_budget_runs_in_slabs_with_the_same_result(kernels, path, aggregation, stride):
    """A budget that holds a quarter of the series: the run is cut into slabs and batches that fit it
    (``info`` says so) and every voxel ends with the unlimited run's values."""
    from mppca_nipype.engine.backend import GPUMemory
    from mppca_nipype.engine.gpu.pipeline import denoise_gpu

    noisy, _ = low_rank_phantom((9, 6, 5), n_volumes=14, rank=3, sigma=5.0, seed=18)
    data, mask, finite, plan, options = prepared(noisy, extent=3, stride=stride, estimator="exp2",
                                                 aggregation=aggregation, demean="volume")
    whole = denoise_gpu(data, finite, plan, options, device="cpu", path=path)
    budget = 100_000  # bytes; the whole series and its sums take 9 * 6 * 5 * (8 * 14 + 20) = 35,640
    small = denoise_gpu(data, finite, plan, options, device="cpu", path=path, gpu_memory=GPUMemory(budget / 2**30))
    assert whole.info["n_slabs"] == 1 and whole.info["gpu_memory_budget"] is None
    assert small.info["n_slabs"] == 5 and small.info["slab_planes"] == 2
    assert small.info["gpu_memory_budget"] == budget
    for got, want in ((small.image, whole.image), (small.weight, whole.weight), (small.sigma, whole.sigma),
                      (small.rank, whole.rank)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    assert np.abs(whole.image[whole.weight > 0]).min() > 100  # real values compared


@interpreted
def test_a_slab_that_runs_out_of_memory_is_redone_thinner(kernels, monkeypatch):
    """Out of memory while a slab is set up (its sums do not fit): the run starts again in slabs of half as
    many x-planes, until they fit, with the same result; at one plane the error goes up."""
    from mppca_nipype.engine.gpu import pipeline

    noisy, _ = low_rank_phantom((9, 6, 5), n_volumes=14, rank=3, sigma=5.0, seed=19)
    data, mask, finite, plan, options = prepared(noisy, extent=3, stride=2, estimator="exp2",
                                                 aggregation="weighted", demean="volume")
    whole = pipeline.denoise_gpu(data, finite, plan, options, device="cpu")
    plane = 6 * 5
    sums_class = pipeline.SlabSums

    def sums_of_at_most(limit):
        def sums(n_rows, *args, **kwargs):
            if n_rows > limit * plane:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
            return sums_class(n_rows, *args, **kwargs)
        return sums

    monkeypatch.setattr(pipeline, "SlabSums", sums_of_at_most(4))  # slabs of 2 planes and their halo of 2
    thinner = pipeline.denoise_gpu(data, finite, plan, options, device="cpu")
    assert thinner.info["slab_retries"] == 2 and thinner.info["slab_planes"] == 2
    for got, want in ((thinner.image, whole.image), (thinner.weight, whole.weight), (thinner.sigma, whole.sigma),
                      (thinner.rank, whole.rank)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    monkeypatch.setattr(pipeline, "SlabSums", sums_of_at_most(2))
    with pytest.raises(torch.OutOfMemoryError):
        pipeline.denoise_gpu(data, finite, plan, options, device="cpu")


def _fake_device(monkeypatch, free, total=None, allocated=0, fraction=1.0):
    """torch.cuda's memory queries as a device with ``free`` bytes free would answer them."""
    stats = {"allocated_bytes": {"all": {"current": allocated}}, "reserved_bytes": {"all": {"current": allocated}}}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, total or 10 * free))
    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", lambda device=None: stats)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device=None: fraction)


def test_slab_planes_follow_the_device_memory(monkeypatch):
    """All x-planes in one slab when the series and its sums take at most a quarter of what the run may take;
    else as many planes as fit (less the halo), and at least one; a budget asked for, or torch's per-process
    fraction, bounds it like the free memory; a budget too small for one plane's slab is refused."""
    from mppca_nipype.engine.backend import GPUMemory
    from mppca_nipype.engine.errors import GPUOutOfMemoryError
    from mppca_nipype.engine.gpu import plan as plan_module

    plan = plan_patches((40, 30, 20), (5, 5, 5), 2, np.ones((40, 30, 20), bool), np.ones((40, 30, 20), bool))
    whole = 40 * 30 * 20 * (8 * 100 + 20)  # bytes of series + sums at T = 100
    per_plane = 30 * 20 * (12 * 100 + 24)  # a plane's series, sums and next upload
    cuda = torch.device("cuda")
    for free, expected in ((4 * whole, 40), (2 * whole, None)):
        _fake_device(monkeypatch, free)
        planes = plan_module.slab_planes(plan_module.DeviceMemory(cuda), plan, 100)
        if expected is not None:
            assert planes == expected
        else:  # the budget over a plane's series, sums and next upload, less the halo (extent - 1)
            assert planes == int(plan_module.MEMORY_SHARE * 2 * whole / 2 // per_plane) - 4
            assert 1 < planes < 40
    # the same slabs from a budget asked for, from torch's fraction, and from memory torch holds already
    _fake_device(monkeypatch, 100 * whole, total=100 * whole)
    asked = plan_module.DeviceMemory(cuda, GPUMemory(2 * whole / 2**30))
    assert asked.budget == int(2 * whole) and plan_module.slab_planes(asked, plan, 100) == planes
    assert plan_module.DeviceMemory(cuda, GPUMemory(2.0, "%")).budget == 2 * whole
    _fake_device(monkeypatch, 100 * whole, total=100 * whole, fraction=0.02)
    assert plan_module.slab_planes(plan_module.DeviceMemory(cuda), plan, 100) == planes
    _fake_device(monkeypatch, 2 * whole - whole // 2, allocated=whole // 2)
    assert plan_module.slab_planes(plan_module.DeviceMemory(cuda), plan, 100) < planes  # (what it holds counts)
    _fake_device(monkeypatch, 9 * per_plane)  # one plane and its halo: 5 planes
    with pytest.raises(GPUOutOfMemoryError, match="too small for this series"):
        plan_module.slab_planes(plan_module.DeviceMemory(cuda), plan, 100)
    assert plan_module.slab_planes(plan_module.DeviceMemory(torch.device("cpu")), plan, 100) == 40


def test_batches_take_half_of_what_the_run_may_still_take(monkeypatch):
    """The batch size: ``MEMORY_SHARE`` of the budget left after what the process holds, over a window's
    buffers, capped by ``MAX_BATCH`` and the windows there are."""
    from mppca_nipype.engine.backend import GPUMemory
    from mppca_nipype.engine.gpu import plan as plan_module

    class Solver:
        def workspace_bytes(self, batch, m, dtype):
            return batch * 1000

    cuda = torch.device("cuda")
    per_window = plan_module._bytes_per_window(27, 20, torch.float32, True, 1000.0)
    _fake_device(monkeypatch, 2**40, total=2**40, allocated=2**20)
    memory = plan_module.DeviceMemory(cuda, GPUMemory(64 / 1024))  # 64 MiB, 1 MiB of it held
    expected = int(plan_module.MEMORY_SHARE * (64 * 2**20 - 2**20) // per_window)
    assert plan_module.batch_size(memory, 10**6, 27, 20, torch.float32, True, Solver()) == expected
    assert plan_module.batch_size(memory, 100, 27, 20, torch.float32, True, Solver()) == 100
    unlimited = plan_module.DeviceMemory(cuda)
    assert plan_module.batch_size(unlimited, 10**6, 27, 20, torch.float32, True, Solver()) == plan_module.MAX_BATCH


def test_the_switch_interval_is_short_within_and_restored_after_the_last_overlapping_use():
    """``upload.switching_often`` shortens the interpreter's switch interval (never lengthens it) and puts
    back the caller's once the last of overlapping uses ends, after an error too."""
    from mppca_nipype.engine.gpu import upload

    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(4e-3)
        with upload.switching_often():
            assert sys.getswitchinterval() == pytest.approx(upload.SWITCH_INTERVAL)
            with pytest.raises(RuntimeError):
                with upload.switching_often():
                    raise RuntimeError("inner")
            assert sys.getswitchinterval() == pytest.approx(upload.SWITCH_INTERVAL)  # the outer use goes on
        assert sys.getswitchinterval() == pytest.approx(4e-3)
        sys.setswitchinterval(1e-6)
        with upload.switching_often():
            assert sys.getswitchinterval() == pytest.approx(1e-6)
    finally:
        sys.setswitchinterval(before)


def test_the_upload_rounds_share_the_rows_equally(monkeypatch):
    """``STAGE_ROUNDS`` rounds of equal shares, the last to the end; one round when asked for none."""
    from mppca_nipype.engine.gpu import upload

    monkeypatch.setattr(upload, "STAGE_ROUNDS", 3)
    assert upload.round_bounds(1200).tolist() == [0, 400, 800, 1200]
    assert upload.round_bounds(7).tolist() == [0, 2, 4, 7]
    monkeypatch.setattr(upload, "STAGE_ROUNDS", 0)
    assert upload.round_bounds(7).tolist() == [0, 7]


def test_the_box_sums_geometry_is_kept_per_geometry_and_slab_and_the_cache_stays_small(monkeypatch):
    from mppca_nipype.engine.gpu import boxsums
    from mppca_nipype.engine.gpu.plan import plan_slabs

    monkeypatch.setattr(boxsums, "_geometries", {})
    everywhere = np.ones((14, 12, 20), bool)
    plan = plan_patches(everywhere.shape, (5, 5, 5), 3, everywhere, everywhere)
    whole, half = plan_slabs(plan, 14)[0], plan_slabs(plan, 6)[0]
    first = boxsums._geometry(plan, whole, torch.device("cpu"))
    assert boxsums._geometry(plan, whole, torch.device("cpu")) is first  # nothing uploaded again
    again = plan_patches(everywhere.shape, (5, 5, 5), 3, everywhere, everywhere)  # another plan, same geometry
    assert boxsums._geometry(again, whole, torch.device("cpu")) is first
    assert boxsums._geometry(plan, half, torch.device("cpu")) is not first
    assert first[0] == (4, 4, 6) and list(first[4]) == [5, 8, 11, 14]  # grid; x-plane after each corner's windows
    for extent in (3, 4, 6, 7, 8):
        other = plan_patches(everywhere.shape, (extent,) * 3, 3, everywhere, everywhere)
        boxsums._geometry(other, plan_slabs(other, 14)[0], torch.device("cpu"))
    assert len(boxsums._geometries) == boxsums.GEOMETRY_CACHE


def test_a_countdown_is_set_by_its_last_part_or_raises_a_parts_error():
    from mppca_nipype.engine.gpu.upload import _Countdown

    countdown = _Countdown(3)
    countdown.done()
    countdown.done()
    assert not countdown.event.is_set()
    countdown.done()
    countdown.wait()
    failing = _Countdown(2)
    failing.failed(MemoryError("copy"))
    with pytest.raises(MemoryError):
        failing.wait()


def edge_decisions_within_reach(values, n_voxels, n_volumes, estimator, delta):
    """The edge estimators' settling test (``threshold._edge_rank_of``) from its definition, one window and one
    P at a time on reference.py's numbers: every eigenvalue may move by up to ``delta`` (B,), so lambda_i and
    the mean or median of any of them by delta / q, and the test lambda_{P+1} < sigma^2(P) e, sigma^2(P) =
    scale(P) times that mean or median, e = (1 + sqrt(r / q))^2, by up to delta / q (1 + scale(P) e). The rank
    is unsettled when the smallest P surely passing differs from the smallest possibly passing, or when some
    lambda_i lies within reach of the chosen P's edge."""
    import math
    import statistics

    from reference import mp_median

    unsettled = []
    for spectrum, n, reach_of_window in zip(values.tolist(), n_voxels.tolist(), delta.reshape(-1).tolist()):
        r, q = min(n, n_volumes), max(n, n_volumes)
        lam = [max(v, 0.0) / q for v in sorted(spectrum, reverse=True)[:r]]
        spread = (1 + math.sqrt(r / q)) ** 2
        margin, reach, edge = [], [], []
        for P in range(r):
            if estimator == "olesen2023":
                bulk, scale = math.fsum(lam[P:]) / (r - P), q / (q - P)
            else:
                bulk, scale = statistics.median(lam[P:]), q / ((q - P) * mp_median((r - P) / (q - P)))
            edge.append(bulk * scale * spread)
            margin.append(lam[P] - edge[-1])
            reach.append(reach_of_window / q * (1 + scale * spread))
        surely = next((P for P in range(r) if margin[P] < -reach[P]), None)
        possibly = next((P for P in range(r) if margin[P] < reach[P]), None)
        chosen = next((P for P in range(r) if margin[P] < 0), None)
        near = chosen is not None and any(abs(v - edge[chosen]) <= reach[chosen] for v in lam)
        unsettled.append(surely != possibly or near)
    return torch.tensor(unsettled)


def spectra_near_the_edge(rng, count, m):
    """(values (count, m) ascending, voxels (count,)): the Gram spectra of ``count`` noise patches of 4m
    voxels by m volumes with a few signal components, some near the edge, and voxel counts fewer and more than
    m (the threshold's n)."""
    n_voxels = rng.integers(m // 2, 4 * m, size=count)
    x = rng.standard_normal((count, 4 * m, m)) * (rng.random((count, 1, m)) < 0.9)
    x[:, :, -3:] *= rng.uniform(1, 8, size=(count, 1, 3))
    return torch.from_numpy(np.linalg.eigvalsh(x.transpose(0, 2, 1) @ x)), torch.from_numpy(n_voxels)


@interpreted
@pytest.mark.parametrize("estimator", ["med", "olesen2023"])
@pytest.mark.parametrize("m", [12, 48])
def test_the_threshold_kernel_decides_as_the_edge_estimators_and_their_settling_test(estimator, m):
    """``threshold_on_device`` against ``marchenko_pastur_threshold`` (ranks, noise variances) and against the
    settling test's definition (``edge_decisions_within_reach``), with voxels fewer and more than m and
    windows near their threshold; a rank the test calls settled survives every move of the eigenvalues
    within delta tried (random, and all up or down, in random order of sizes)."""
    from mppca_nipype.engine.estimators import marchenko_pastur_threshold
    from mppca_nipype.engine.gpu.threshold import threshold_on_device

    rng = np.random.default_rng(m + 1)
    count = 200
    values, voxels = spectra_near_the_edge(rng, count, m)
    rank, sigma2 = marchenko_pastur_threshold(values, voxels, m - 1, estimator)
    delta = 0.002 * values[:, -1:] * torch.from_numpy(rng.random((count, 1)))
    got_rank, got_sigma2, unsettled = threshold_on_device(values, voxels, m - 1, estimator, delta)
    assert (got_rank == rank).all()
    np.testing.assert_allclose(got_sigma2.numpy(), sigma2.numpy(), rtol=1e-12, atol=0)
    expected = edge_decisions_within_reach(values, voxels, m - 1, estimator, delta)
    assert (unsettled == expected).all() and 0 < int(expected.sum()) < count
    for trial in range(40):
        if trial < 2:
            moved = values + (1 - 2 * trial) * delta
        else:
            moved = values + delta * torch.from_numpy(rng.uniform(-1, 1, size=values.shape))
        moved_rank, _ = marchenko_pastur_threshold(moved.sort(dim=1).values, voxels, m - 1, estimator)
        assert (moved_rank[~unsettled] == rank[~unsettled]).all()
    assert not threshold_on_device(values, voxels, m - 1, estimator, torch.zeros(count))[2].any()
    assert threshold_on_device(values, voxels, m - 1, estimator)[2] is None


@interpreted
@pytest.mark.parametrize("estimator", ["exp2", "exp1", "med", "olesen2023"])
def test_the_threshold_kernel_takes_eigenvalues_at_round_off_as_zeros(estimator):
    """A rank-deficient patch's null eigenvalues, round-off of either sign: the kernel's rank and noise level
    are those of exact zeros, as the CPU's estimator gives them (``estimators.exact_zeros``)."""
    from mppca_nipype.engine.estimators import marchenko_pastur_threshold
    from mppca_nipype.engine.gpu.threshold import threshold_on_device

    rng = np.random.default_rng(9)
    signal = np.sort(np.concatenate([rng.uniform(5.0, 200.0, 8), [9.9e5]]))
    null = rng.uniform(-1.0, 1.0, (30, 7)) * 16 * np.finfo(np.float64).eps * 9.9e5
    values = torch.from_numpy(np.sort(np.concatenate([null, np.tile(signal, (30, 1))], axis=1), axis=1))
    voxels = torch.full((30,), 27)
    exact = torch.from_numpy(np.tile(np.concatenate([np.zeros(7), signal]), (30, 1)))
    rank, sigma2, _ = threshold_on_device(values, voxels, 16, estimator)
    want_rank, want_sigma2 = marchenko_pastur_threshold(exact, voxels, 16, estimator)
    assert (rank == want_rank).all() and (sigma2 == want_sigma2).all()


@interpreted
@pytest.mark.parametrize("estimator", ["exp2", "exp1"])
@pytest.mark.parametrize("m", [12, 48])
def test_the_threshold_kernel_decides_as_the_estimator_and_the_settling_test(estimator, m):
    """``threshold_on_device`` (one kernel) against ``marchenko_pastur_threshold`` and ``moved_ranks_differ``:
    the same ranks, noise variances and unsettled windows, with voxels fewer and more than m, and windows
    near their threshold (a delta of a few percent flags some, a zero delta none)."""
    from mppca_nipype.engine.estimators import marchenko_pastur_threshold
    from mppca_nipype.engine.gpu.threshold import threshold_on_device

    rng = np.random.default_rng(m)
    count = 300
    values, voxels = spectra_near_the_edge(rng, count, m)
    rank, sigma2 = marchenko_pastur_threshold(values, voxels, m - 1, estimator)
    delta = 0.03 * values[:, -1:] * torch.from_numpy(rng.random((count, 1)))
    expected = moved_ranks_differ(values, voxels, m - 1, estimator, rank, delta)
    got_rank, got_sigma2, unsettled = threshold_on_device(values, voxels, m - 1, estimator, delta)
    assert (got_rank == rank).all()
    np.testing.assert_allclose(got_sigma2.numpy(), sigma2.numpy(), rtol=1e-12, atol=0)
    assert (unsettled == expected).all() and 0 < int(expected.sum()) < count
    assert not threshold_on_device(values, voxels, m - 1, estimator, torch.zeros(count))[2].any()
    assert threshold_on_device(values, voxels, m - 1, estimator)[2] is None


@interpreted
@pytest.mark.parametrize("path, aggregation, stride, demean, eigensolver, n_volumes, extent", [
    ("fused", "weighted", 2, "volume", "tridiagonal", 14, 3), ("box", "weighted", 2, "voxel", "tridiagonal", 14, 3),
    ("fused", "center", 1, "none", "auto", 14, 3), ("gather", "uniform", 3, "voxel", "xsyev", 14, 3),
    ("gather", "weighted", 3, "volume", "auto", 70, 7)])
@pytest.mark.parametrize("estimator", ["med", "olesen2023"])
def test_the_edge_estimators_give_the_cpus_denoising(kernels, path, aggregation, stride, demean, eigensolver,
                                                     n_volumes, extent, estimator):
    """``estimator`` med and olesen2023 on every path and eigensolver (the float32 Gram with the tridiagonal
    kernels, the box sums, the undemeaned patch's mean taken apart, XsyevBatched on gathered patches, and
    eigenvalues refined at both ends on a long series), with a mask and non-finite voxels where the path
    takes them: the CPU backend's denoising, noise and ranks."""
    from mppca_nipype.engine.gpu.pipeline import denoise_gpu

    noisy, _ = low_rank_phantom((9, 8, 8) if n_volumes > 14 else (8, 6, 5), n_volumes=n_volumes, rank=3,
                                sigma=5.0, seed=29)
    mask = np.ones(noisy.shape[:3], bool)
    if path != "box":  # (the box sums take every voxel finite)
        mask[0, :2] = False
        noisy[4, 3, 1, 5] = np.nan
    data, mask, finite, plan, options = prepared(noisy, mask, extent=extent, stride=stride, estimator=estimator,
                                                 aggregation=aggregation, demean=demean)
    cpu = denoise_cpu(data, finite, plan, options, nprocs=1)
    gpu = denoise_gpu(data, finite, plan, options, device="cpu", path=path, eigensolver=eigensolver)
    assert gpu.info["gram_path"] == path
    assert gpu.info["eigenvalues_refined"] == (n_volumes > 64)
    assert_same_denoising(cpu, gpu, mask)


@interpreted
@pytest.mark.parametrize("path, aggregation, stride, demean, eigensolver, noise", [
    ("fused", "weighted", 2, "volume", "tridiagonal", None), ("box", "weighted", 2, "voxel", "tridiagonal", 4.0),
    ("gather", "uniform", 3, "voxel", "xsyev", None), ("fused", "center", 1, "none", "auto", 4.0),
    ("gather", "weighted", 2, "none", "tridiagonal", None)])
@pytest.mark.parametrize("filter_name", ["optshrink", "optthresh"])
def test_the_filters_give_the_cpus_denoising(kernels, path, aggregation, stride, demean, eigensolver, noise,
                                            filter_name):
    """``filter`` optshrink and optthresh: every path and eigensolver weights each window's components as the
    CPU backend does (the projector V diag(w) V^T), with a mask and non-finite voxels where the path takes
    them, the noise level estimated or given."""
    from mppca_nipype.engine.gpu.pipeline import denoise_gpu

    noisy, _ = low_rank_phantom((8, 6, 5), n_volumes=14, rank=3, sigma=5.0, seed=19)
    mask = np.ones(noisy.shape[:3], bool)
    if path != "box":  # (the box sums take every voxel finite)
        mask[0, :2] = False
        noisy[4, 3, 1, 5] = np.nan
    data, mask, finite, plan, options = prepared(noisy, mask, extent=3, stride=stride, estimator="exp2",
                                                 aggregation=aggregation, demean=demean, noise=noise,
                                                 filter=filter_name)
    cpu = denoise_cpu(data, finite, plan, options, nprocs=1)
    gpu = denoise_gpu(data, finite, plan, options, device="cpu", path=path, eigensolver=eigensolver)
    assert gpu.info["gram_path"] == path
    assert_same_denoising(cpu, gpu, mask)
    if filter_name == "optshrink":  # (optthresh keeps the same strong components as hard here)
        hard = denoise_cpu(data, finite, plan, dataclasses.replace(options, filter="hard"), nprocs=1)
        served = (cpu.weight > 0) & mask.ravel()
        assert np.sqrt(np.mean((per_voxel(gpu, served)[0] - per_voxel(hard, served)[0]) ** 2)) > 1e-3


@interpreted
@pytest.mark.parametrize("eigensolver", ["tridiagonal", "xsyev"])
def test_weighted_projectors_are_v_diag_w_v_transposed(kernels, eigensolver):
    from mppca_nipype.engine.gpu.tridiagonal import TridiagonalEigh

    rng = np.random.default_rng(23)
    m, batch = 13, 6
    a = rng.standard_normal((batch, m, m))
    matrices = a @ a.transpose(0, 2, 1)
    ranks = np.array([0, 1, 3, 5, 13, 2])
    weights = np.zeros((batch, m))
    for b, rank in enumerate(ranks):
        weights[b, m - rank:] = rng.uniform(0.1, 1.0, size=rank)
    solver = TridiagonalEigh("cpu") if eigensolver == "tridiagonal" else BatchedEigh("cpu")
    solver.values(torch.from_numpy(matrices.copy()))
    projector = solver.projector(torch.from_numpy(ranks), torch.from_numpy(weights)).double().numpy()
    _, vectors = np.linalg.eigh(matrices)
    want = (vectors * weights[:, None, :]) @ vectors.transpose(0, 2, 1)
    np.testing.assert_allclose(projector, want, rtol=0, atol=1e-8)


@interpreted
@pytest.mark.parametrize("aggregation, stride, demean", [("weighted", 2, "none"), ("weighted", 1, "volume"),
                                                         ("center", 1, "none")])
def test_group_contrasts_match_cpu_backend(kernels, aggregation, stride, demean):
    """What ``demean="groups"`` and multi-echo series hand a backend: the group contrasts, ``none`` (or
    ``volume``), the G removed means counted in the weight 1 / (1 + P + G)."""
    from mppca_nipype.engine.groups import GroupContrasts

    labels = np.repeat([0, 1, 2], [4, 7, 6])
    noisy, _ = low_rank_phantom((7, 6, 5), n_volumes=labels.size, rank=3, sigma=5.0, seed=7)
    transform = GroupContrasts(labels)
    contrasts = transform.forward(noisy.reshape(-1, labels.size).astype(np.float64))[0]
    contrasts = contrasts.reshape(noisy.shape[:3] + (transform.n_contrasts,)).astype(np.float32)
    cpu, gpu, mask = run_both(contrasts, extent=3, stride=stride, estimator="exp2", aggregation=aggregation,
                              demean=demean, removed_means=transform.n_groups)
    assert_same_denoising(cpu, gpu, mask)


def assert_same_lambda_plus(cpu, gpu, mask, tolerance=1e-4):
    """The lambda_+ maps of two backends' sums agree to ``tolerance`` in rms relative difference over the
    served voxels (the GPU sums in float32, the CPU in float64)."""
    served = (cpu.weight > 0) & mask.ravel()
    edges = [sums.lambda_plus[served] / (1.0 if sums.normalized else sums.weight[served]) for sums in (cpu, gpu)]
    assert np.all(edges[0] > 0)
    assert np.sqrt(np.mean((edges[1] - edges[0]) ** 2) / np.mean(edges[0] ** 2)) <= tolerance


@interpreted
@pytest.mark.parametrize("path, aggregation, stride, demean, planes", [
    ("auto", "weighted", 2, "voxel", None), ("fused", "uniform", 3, "volume", 2),
    ("gather", "weighted", 2, "none", None), ("fused", "center", 1, "volume", None)])
def test_lambda_plus_is_aggregated_as_the_cpu_backend_aggregates_it(kernels, path, aggregation, stride, demean,
                                                                    planes):
    """Each window's Marchenko-Pastur edge added with its weight (or written at its centre) on every path: the
    box sums', the fused kernels' in slabs with a halo, the gathered path's, and centre aggregation; with a
    mask and a non-finite voxel where the path takes them."""
    from mppca_nipype.engine.gpu.pipeline import denoise_gpu

    noisy, _ = low_rank_phantom((8, 6, 5), n_volumes=13, rank=3, sigma=5.0, seed=31)
    mask = None
    if demean != "voxel":  # (the box sums take full grids of finite voxels only)
        noisy[2, 3, 1, 5] = np.nan
        mask = np.ones(noisy.shape[:3], dtype=bool)
        mask[:2, :2] = False
    data, mask, finite, plan, options = prepared(noisy, mask, extent=3, stride=stride, estimator="exp2",
                                                 aggregation=aggregation, demean=demean)
    options = dataclasses.replace(options, lambda_plus=True)
    cpu = denoise_cpu(data, finite, plan, options, nprocs=1)
    gpu = denoise_gpu(data, finite, plan, options, device="cpu", path=path, planes=planes)
    assert gpu.info["gram_path"] == ("box" if path == "auto" else path)
    assert_same_denoising(cpu, gpu, mask & finite)
    assert_same_lambda_plus(cpu, gpu, mask & finite)
    assert denoise_gpu(data, finite, plan, dataclasses.replace(options, lambda_plus=False), device="cpu",
                       path=path, planes=planes).lambda_plus is None


@interpreted
@pytest.mark.parametrize("aggregation, stride", [("weighted", 2), ("center", 1)])
def test_lambda_plus_of_windows_redone_in_float64_and_on_the_cpu(kernels, monkeypatch, aggregation, stride):
    from mppca_nipype.engine.gpu import pipeline, plan as plan_module

    noisy, _ = low_rank_phantom((8, 6, 5), n_volumes=14, rank=3, sigma=5.0, seed=9)
    data, mask, finite, plan, options = prepared(noisy, extent=3, stride=stride, estimator="exp1",
                                                 aggregation=aggregation, demean="volume")
    options = dataclasses.replace(options, lambda_plus=True)
    cpu = denoise_cpu(data, finite, plan, options, nprocs=1)
    monkeypatch.setattr(plan_module, "BatchedEigh", _SolverThatFailsSomeWindows)
    gpu = pipeline.denoise_gpu(data, finite, plan, options, device="cpu", max_batch=7, planes=2)
    assert gpu.info["n_settled_in_float64"] >= plan.n_windows // 3 and gpu.info["n_redone_on_cpu"] >= 2
    assert_same_lambda_plus(cpu, gpu, mask)


@interpreted
def test_lambda_plus_with_the_settling_pass_chosen_on_the_device(kernels, monkeypatch):
    from mppca_nipype.engine.gpu import pipeline, threshold

    monkeypatch.setattr(threshold, "TRIDIAGONAL_SETTLE_SLACK", 3e3)  # wide: some windows, not all, redone
    noisy, _ = low_rank_phantom((9, 7, 8), n_volumes=15, rank=3, sigma=5.0, seed=21)
    data, mask, finite, plan, options = prepared(noisy, extent=(5, 3, 5), stride=2, estimator="exp2",
                                                 aggregation="uniform", demean="volume")
    options = dataclasses.replace(options, lambda_plus=True)
    cpu = denoise_cpu(data, finite, plan, options, nprocs=1)
    gpu = pipeline.denoise_gpu(data, finite, plan, options, device="cpu", eigensolver="tridiagonal", path="fused",
                               planes=2)
    assert 0 < gpu.info["n_settled_in_float64"] < plan.n_windows
    assert_same_lambda_plus(cpu, gpu, mask)


@interpreted
def test_lambda_plus_of_a_given_noise_level_on_the_gpu_path(kernels):
    from mppca_nipype.engine.gpu.pipeline import denoise_gpu

    noisy, _ = low_rank_phantom((7, 6, 5), n_volumes=14, rank=3, sigma=5.0, seed=4)
    data, mask, finite, plan, options = prepared(noisy, extent=3, stride=2, estimator="exp2",
                                                 aggregation="weighted", demean="volume", noise=5.0)
    options = dataclasses.replace(options, lambda_plus=True)
    cpu = denoise_cpu(data, finite, plan, options, nprocs=1)
    gpu = denoise_gpu(data, finite, plan, options, device="cpu")
    assert_same_lambda_plus(cpu, gpu, mask, tolerance=1e-6)


@interpreted
def test_runs_asking_for_lambda_plus_are_not_replayed_as_graphs(kernels):
    """The first pass's CUDA graphs add into the image, weight, sigma and rank sums alone."""
    from mppca_nipype.engine.gpu import graphs
    from mppca_nipype.engine.gpu.plan import GPUSettings

    noisy, _ = low_rank_phantom((7, 6, 5), n_volumes=14, rank=3, sigma=5.0, seed=2)
    data, _, finite, plan, options = prepared(noisy, extent=3, stride=2, estimator="exp2", aggregation="weighted",
                                              demean="voxel")
    assert graphs.may_replay(plan, options, finite, data.shape[3], GPUSettings())
    assert not graphs.may_replay(plan, dataclasses.replace(options, lambda_plus=True), finite, data.shape[3],
                                 GPUSettings())


@interpreted
def test_lambda_plus_counts_in_the_memory_plan_and_survives_small_slabs(kernels):
    """Its sum (4 bytes a voxel) and each batch's addend (24 bytes a window's voxel) are planned; in slabs cut
    by a small budget the map is the unlimited run's."""
    from mppca_nipype.engine.backend import GPUMemory
    from mppca_nipype.engine.gpu import plan as plan_module
    from mppca_nipype.engine.gpu.pipeline import denoise_gpu

    noisy, _ = low_rank_phantom((9, 6, 5), n_volumes=14, rank=3, sigma=5.0, seed=18)
    data, mask, finite, plan, options = prepared(noisy, extent=3, stride=2, estimator="exp2",
                                                 aggregation="weighted", demean="volume")
    options = dataclasses.replace(options, lambda_plus=True)
    assert plan_module.slab_bytes(plan, 14, 9, lambda_plus=True) - plan_module.slab_bytes(plan, 14, 9) == 9 * 6 * 5 * 4
    assert (plan_module._bytes_per_window(27, 14, torch.float32, True, 0.0, lambda_plus=True)
            - plan_module._bytes_per_window(27, 14, torch.float32, True, 0.0)) == 27 * 24
    whole = denoise_gpu(data, finite, plan, options, device="cpu", path="fused")
    small = denoise_gpu(data, finite, plan, options, device="cpu", path="fused", gpu_memory=GPUMemory(100_000 / 2**30))
    assert small.info["n_slabs"] > 1
    np.testing.assert_allclose(small.lambda_plus, whole.lambda_plus, rtol=1e-5)
    assert whole.lambda_plus[mask.ravel()].min() > 0


@interpreted
@pytest.mark.parametrize("order, planes, shape", [("C", None, "cuboid"), ("F", None, "cuboid"), ("F", 2, "cuboid"),
                                                  ("C", 3, "cuboid"), ("F", None, "sphere")])
def test_a_series_on_the_device_gives_the_sums_of_the_same_series_from_the_host(kernels, order, planes, shape):
    """A torch tensor in (either layout, in slabs or whole, spheres padded on the device): the host series'
    maps, and its image as an (X, Y, Z, T) tensor on the device in the series' own layout."""
    from mppca_nipype.engine.gpu.pipeline import denoise_gpu

    noisy, _ = low_rank_phantom((8, 7, 6), n_volumes=13, rank=3, sigma=5.0, seed=6)
    data, mask, finite, plan, resolved = prepared(np.asarray(noisy, order=order), None, extent=3, stride=2,
                                                  estimator="exp2", aggregation="weighted", demean="volume",
                                                  shape=shape)
    from_host = denoise_gpu(data, finite, plan, resolved, device="cpu", planes=planes)
    on_device = denoise_gpu(torch.from_numpy(data), finite, plan, resolved, planes=planes)
    assert isinstance(on_device.image, torch.Tensor) and on_device.image.shape == data.shape
    image = on_device.image.numpy()
    assert image.flags.f_contiguous == (order == "F") and image.flags.c_contiguous == (order == "C")
    np.testing.assert_array_equal(image, np.asarray(from_host.image).reshape(data.shape))
    for name in ("weight", "sigma", "rank"):
        np.testing.assert_array_equal(getattr(on_device, name), getattr(from_host, name))


@interpreted
@pytest.mark.filterwarnings("ignore:.*NaN or Inf")
@pytest.mark.parametrize("order, nan", [("C", False), ("F", True)])
def test_denoise_of_a_series_on_the_device_leaves_its_result_there(kernels, order, nan):
    """``denoise`` of a torch tensor: the GPU engine on the tensor's device, the denoised series a tensor there
    in the series' layout, equal to the host series' run; with NaN in the series, its host run put there."""
    import mppca_nipype.engine as engine
    from mppca_nipype.engine import MPPCAInputError, denoise
    from mppca_nipype.engine.gpu.pipeline import denoise_gpu

    noisy, _ = low_rank_phantom((8, 7, 6), n_volumes=13, rank=3, sigma=5.0, seed=7)
    noisy = np.asarray(noisy, order=order)
    if nan:
        noisy[3, 2, 1, 4] = np.nan
    mask = np.ones(noisy.shape[:3], bool)
    mask[0] = False
    options = dict(extent=3, stride=2, demean="volume", maps="lambda_plus")
    on_device = denoise(torch.from_numpy(noisy.copy(order="K")), mask, device="cuda", **options)
    with pytest.MonkeyPatch.context() as patch:  # the same engine from the host
        patch.setattr(engine, "check_device", lambda device: "cuda")
        patch.setattr(engine, "_backend", lambda device: lambda *a, **k: denoise_gpu(*a, device="cpu", **k))
        from_host = denoise(noisy, mask, device="cuda", **options)
    assert isinstance(on_device.denoised, torch.Tensor) and on_device.denoised.device.type == "cpu"
    denoised = on_device.denoised.numpy()
    assert denoised.flags.f_contiguous == (order == "F")
    np.testing.assert_array_equal(denoised, from_host.denoised)
    for name in ("sigma", "rank", "lambda_plus"):
        np.testing.assert_array_equal(getattr(on_device, name), getattr(from_host, name))
    assert on_device.info["n_nonfinite_voxels"] == int(nan)
    with pytest.raises(MPPCAInputError, match="GPU engine alone"):
        denoise(torch.from_numpy(noisy), device="cpu")
    with pytest.raises(MPPCAInputError, match="4D float32"):
        denoise(torch.from_numpy(noisy).double(), device="cuda")


@interpreted
@pytest.mark.parametrize("order, pipeline", [("C", "hann"), ("F", "hann"), ("F", "mppca"), ("C", "rician"),
                                             ("F", "rician")])
def test_the_steps_around_the_engine_keep_their_series_on_the_device(kernels, monkeypatch, order, pipeline):
    """With the steps around the engine on the device (here torch on the CPU) and the GPU engine, the series go
    from step to engine to step as tensors (complex data: R to the engine and R_hat on to the remodulation,
    and for ``mppca`` the first pass's parts and their denoised copy; a noise floor: the magnitude to the
    first pass, its result to the noise level, the transformed series to the second pass and its result to the
    inverse): the same outputs as with every series copied through the host."""
    import mppca_nipype.engine as engine
    from mppca_nipype import denoise, denoise_complex
    from mppca_nipype.engine.gpu import pipeline as gpu_pipeline, series_steps
    from mppca_nipype.phantoms import complex_dwi_phantom

    magnitude, phase, truth = (np.asarray(a, order=order) for a in complex_dwi_phantom((12, 10, 8), 16, sigma=60.0,
                                                                                        seed=4)[:3])
    mask = truth[..., 0] > 0
    monkeypatch.setattr(engine, "steps_device", lambda *args, **kwargs: "cuda")
    monkeypatch.setattr(series_steps, "torch_device", lambda device: torch.device("cpu"))
    series_in = []
    real_gpu = gpu_pipeline.denoise_gpu

    def engine_on_the_cpu(data, *args, **kwargs):
        series_in.append(type(data))
        return real_gpu(data, *args, **({} if isinstance(data, torch.Tensor) else dict(device="cpu")), **kwargs)

    monkeypatch.setattr(engine, "check_device", lambda device: "cuda")
    monkeypatch.setattr(engine, "_backend", lambda device: engine_on_the_cpu)

    def run():
        if pipeline == "rician":
            return denoise(magnitude, mask, device="cuda", nprocs=1, noise_floor="rician")
        return denoise_complex(magnitude, phase, mask=mask, device="cuda", nprocs=1, phase_method=pipeline)

    kept = run()
    monkeypatch.setattr(series_steps, "stays_on_device", lambda nbytes, device: False)
    through_the_host = run()
    passes = 1 if pipeline == "hann" else 2
    assert series_in == [torch.Tensor] * passes + [np.ndarray] * passes
    for name in ("denoised", "sigma", "rank") + (() if pipeline == "rician" else ("phase",)):
        got, want = getattr(kept, name), getattr(through_the_host, name)
        assert isinstance(got, np.ndarray) and got.flags.f_contiguous == want.flags.f_contiguous
        np.testing.assert_array_equal(got, want)
    assert kept.info.get("imaginary_sd_ratio") == through_the_host.info.get("imaginary_sd_ratio")
