"""The GPU pipeline: upload, batches of windows through Gram -> eigensolver -> estimator -> reconstruction,
download. Same contract and same function as ``cpu.denoise_cpu``.

Per batch, with no host synchronisation:

1. Gram matrices of the windows: the fused Triton kernel (time side, n >= T, T up to
   ``kernels.MAX_FUSED_VOLUMES``), or for other shapes (voxel side when n < T, long series) the patches
   gathered into a (B, n, T) batch and multiplied by torch (cuBLAS, IEEE float32/float64).
2. ``eigh.BatchedEigh``: cusolverDnXsyevBatched on torch's current stream; ``info`` stays on the device.
3. ``estimators.marchenko_pastur_threshold`` and ``signal_projector`` (the CPU's own code, on torch tensors,
   in float64 for the threshold), ``aggregation_weights`` times the window's multiplicity.
4. Reconstruction added into (V, T) image and (V,) weight/sigma/rank sums on the device (atomics), or for
   ``center`` each centre row written to its voxel.

Demeaning: ``voxel`` removes each voxel's temporal mean (T - 1 volumes go to the estimator); ``volume``
removes the patch's mean time course over its finite voxels (n_eff - 1 voxels go to the estimator; the
Gram kernel returns the means, (B, T), and the reconstruction adds them back: (x - mu) P + mu), as
``cpu.fit_windows`` does.

Precision: with voxel or volume demeaning everything runs in float32 (the Gram of a centred patch is well
conditioned; the centring happens before the products, never as X^T X - n mu mu^T). Without it
(dwidenoise's mode) a baseline near 1000 makes the Gram's top eigenvalue ~1e6 times its noise eigenvalues;
float32 eigenvalues then lose the noise bulk (MRtrix3's own float32 mode differs from its float64 mode by
2.6e-4), so the Gram and the eigensolver run in float64 there.

Settling: the rank test is a comparison, and a window whose margin is below float32's error on its Gram
(~eps lambda_max) can land on either side of it; one such flip in a small phantom is 1e-4 of rms difference
from the float64 CPU path. A float32 run therefore flags, on the device, the windows whose rank would change
if the eigenvalues moved by ``SETTLE_SLACK`` float32 roundings of the largest (``unsettled_ranks``), gives
them weight 0, and after the first pass (one synchronisation) redoes them, with any failed eigensolves, in
float64 on the device.

Windows whose eigensolve did not converge in the last pass are redone on the CPU with the CPU backend's own
functions and added to the sums.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from ..estimators import aggregation_weights, marchenko_pastur_threshold, signal_projector
from . import kernels
from .eigh import BatchedEigh

#: Upper bound on windows per batch (beyond it XsyevBatched gains nothing and workspaces grow linearly).
MAX_BATCH = 16384
#: Share of the free device memory that one batch's buffers may take.
MEMORY_SHARE = 0.5
#: How far (in float32 roundings of the largest eigenvalue) the eigenvalues may move before a window's rank
#: counts as unsettled in float32 and is redone in float64 (see ``unsettled_ranks``).
SETTLE_SLACK = 10.0


def gram_precision(options, precision: str = "auto") -> torch.dtype:
    """float32 with voxel or volume demeaning, float64 without (see the module's note); or as asked."""
    if precision == "auto":
        return torch.float32 if options.demean in ("voxel", "volume") else torch.float64
    return {"float32": torch.float32, "float64": torch.float64}[precision]


def _bytes_per_window(n_voxels, n_volumes, dtype, fused, workspace_per_window):
    m = min(n_voxels, n_volumes)
    size = torch.empty((), dtype=dtype).element_size()
    per_window = m * m * (2 * size + 4) + 16 * m * 8 + 4 * n_volumes + workspace_per_window
    if not fused:  # gathered patches (float32 and compute precision), restored, indices
        per_window += n_voxels * n_volumes * (4 + 2 * size) + n_voxels * 16
    return int(per_window)


def batch_size(device, n_windows, n_voxels, n_volumes, dtype, fused, solver, max_batch=None) -> int:
    """Windows per batch: what ``MEMORY_SHARE`` of the free device memory holds, at most ``MAX_BATCH``."""
    cap = min(max_batch or MAX_BATCH, max(n_windows, 1))
    if device.type != "cuda":
        return cap
    probe = 256
    workspace = solver.workspace_bytes(probe, min(n_voxels, n_volumes), dtype) / probe
    per_window = _bytes_per_window(n_voxels, n_volumes, dtype, fused, workspace)
    free, _ = torch.cuda.mem_get_info(device)
    return int(max(1, min(cap, MEMORY_SHARE * free // per_window)))


def _upload(array, device):
    """Host -> device. A NumPy array is pinned in place for the copy (no CPU copy into a staging buffer);
    returns the device tensor and a function to call once the copy is done."""
    host = torch.from_numpy(array)
    if device.type != "cuda":
        return host, lambda: None
    try:
        cudart = torch.cuda.cudart()
        code = cudart.cudaHostRegister(host.data_ptr(), host.numel() * host.element_size(), 0)
        registered = int(getattr(code, "value", code)) == 0
    except Exception:
        registered = False
    on_device = host.to(device, non_blocking=registered)
    if not registered:
        return on_device, lambda: None
    return on_device, lambda: cudart.cudaHostUnregister(host.data_ptr())


def _download(tensor):
    """Device -> pinned host memory (25x faster than into pageable memory); returns the NumPy view."""
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)
    host.copy_(tensor, non_blocking=tensor.is_cuda)
    return host


def _gather_gram(volume, finite, window_base, voxel_offsets, demean, dtype, time_side):
    """The non-fused path: patches gathered into (B, n, T), centred, and their Gram by a batched product.

    ``means`` is (B, n, 1) for voxel demeaning, (B, 1, T) for volume demeaning (over the finite voxels;
    left-out voxels stay rows of zeros), else None: X_hat = X_c P + means, as in ``cpu.fit_windows``.
    """
    voxels = window_base[:, None] + voxel_offsets[None, :].to(torch.int64)
    patches = volume[voxels].to(dtype)
    took_part = finite[voxels]
    means = None
    if demean == "voxel":
        means = patches.mean(dim=2, keepdim=True)
        patches = patches - means
    elif demean == "volume":  # in place: the gathered patches are this function's own copy
        took = took_part.to(dtype)[:, :, None]
        patches.mul_(took)
        means = patches.sum(dim=1, keepdim=True) / took.sum(dim=1, keepdim=True).clamp(min=1)
        patches.addcmul_(took, means, value=-1)
    gram = patches.mT @ patches if time_side else patches @ patches.mT
    return gram.contiguous(), patches, means, took_part, voxels


def unsettled_ranks(values, n_voxels, n_volumes, estimator, rank, slack):
    """Windows whose rank a float32 eigensolve cannot settle: the rank changes when the eigenvalues move by
    ``slack`` times the float32 rounding of the largest one (all up, all down, spread apart, drawn together).

    ``values`` (B, m) float64 (ascending), ``rank`` the estimator's answer for them. The threshold test is a
    comparison; a window whose margin is below float32's error on its Gram (~eps lambda_max) can land either
    side (about 1 window in 1000 on the test phantoms, each worth 1e-4 of rms difference on small ones).
    """
    delta = slack * torch.finfo(torch.float32).eps * values[:, -1:].clamp(min=0)
    ramp = torch.linspace(-1.0, 1.0, values.shape[1], dtype=values.dtype, device=values.device)[None, :]
    unsettled = torch.zeros(rank.shape, dtype=torch.bool, device=rank.device)
    for moved in (values + delta, values - delta, values + delta * ramp, values - delta * ramp):
        unsettled |= marchenko_pastur_threshold(moved, n_voxels, n_volumes, estimator)[0] != rank
    return unsettled


def denoise_gpu(data, finite, plan, options, *, nprocs=None, progress=None, device=None, path="auto",
                eigensolver="auto", precision="auto", max_batch=None, normalize=True, settle=True):
    """Run the plan on a CUDA device and return the per-voxel values (``engine.PatchSums``).

    With ``normalize`` (the default) the sums are divided by the weights on the device and come back
    ``normalized`` (the engine's host-side division of the (V, T) sums cost more than this whole backend);
    not when windows had to be redone on the CPU (their sums are added on the host), or with
    ``normalize=False``.

    A float32 run (voxel or volume demeaning) ends with a second pass in float64 over the windows whose rank
    float32 could not settle (``unsettled_ranks``: 2-11% of the windows of low-rank phantoms, 31-54% of a
    DWI-like T = 300 crop, on the H200) and those whose eigensolve failed; ``settle=False`` leaves it out
    (to measure float32 alone).

    Parameters beyond ``cpu.denoise_cpu``'s (all optional; for tests and benchmarks):
    ``device`` (default "cuda"; "cpu" runs the same kernels under TRITON_INTERPRET=1), ``path``
    ("auto", "fused" or "gather": how the Gram and reconstruction are computed), ``eigensolver`` ("auto" or
    "torch"), ``precision`` ("auto", "float32", "float64": of the Gram and eigensolver), ``max_batch``.
    ``nprocs`` is used only for CPU redos of failed eigensolves.
    """
    from .. import PatchSums

    started = time.perf_counter()
    device = torch.device(device or "cuda")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    n_voxels_total = int(np.prod(data.shape[:3]))
    n_volumes = data.shape[3]
    n_voxels = plan.patch_size
    demean = options.demean
    center = options.aggregation == "center"
    dtype = gram_precision(options, precision)
    time_side = n_voxels >= n_volumes
    fused = path == "fused" or (path == "auto" and kernels.fused_fits(n_voxels, n_volumes, dtype))
    if fused and not kernels.fused_fits(n_voxels, n_volumes, dtype):
        raise ValueError(f"the fused kernels do not take n={n_voxels}, T={n_volumes} in {dtype}")
    settle = settle and dtype == torch.float32

    volume, release_volume = _upload(np.ascontiguousarray(data.reshape(n_voxels_total, n_volumes)), device)
    finite_flat = torch.from_numpy(finite.reshape(n_voxels_total).astype(np.float32)).to(device)
    window_base = torch.from_numpy(plan.window_base()).to(device)
    voxel_offsets = torch.from_numpy(plan.voxel_offsets.astype(np.int32)).to(device)
    multiplicity = torch.from_numpy(plan.multiplicity.astype(np.float64)).to(device)
    if center:
        centre_voxel = torch.from_numpy(plan.centre_voxel.astype(np.int64)).to(device)
        centre_window = torch.from_numpy(plan.centre_window.astype(np.int32)).to(device)
        centre_position = torch.from_numpy(plan.centre_position.astype(np.int64)).to(device)

    image = torch.zeros((n_voxels_total, n_volumes), dtype=torch.float32, device=device)
    weight = torch.zeros(n_voxels_total, dtype=torch.float32, device=device)
    sigma = torch.zeros_like(weight)
    rank = torch.zeros_like(weight)
    solver = BatchedEigh(device) if eigensolver == "auto" else _TorchEigh(device)

    def run_batch(windows, dtype, fused, settle):
        """Gram -> eigensolver -> threshold -> reconstruction of a batch of windows: a slice of the plan's
        (first pass) or a sorted array of their indices (second pass). Returns the solver's ``info`` and, with
        ``settle``, the windows left unsettled (given weight 0 here); all on the device, no synchronisation."""
        if isinstance(windows, slice):
            base, batch_multiplicity = window_base[windows], multiplicity[windows]
            if center:
                a, b = np.searchsorted(plan.centre_window, [windows.start, windows.stop])
                centres = (centre_voxel[a:b], centre_window[a:b] - windows.start, centre_position[a:b])
        else:
            index = torch.from_numpy(windows).to(device)
            base, batch_multiplicity = window_base[index], multiplicity[index]
            if center:
                chosen = np.flatnonzero(np.isin(plan.centre_window, windows))
                own = np.searchsorted(windows, plan.centre_window[chosen]).astype(np.int32)
                chosen = torch.from_numpy(chosen).to(device)
                centres = (centre_voxel[chosen], torch.from_numpy(own).to(device), centre_position[chosen])
        if fused:
            gram, n_took_part, volume_mean = kernels.gram(volume, finite_flat, base, voxel_offsets, demean=demean,
                                                          dtype=dtype)
        else:
            gram, patches, means, took_part, voxels = _gather_gram(
                volume, finite_flat, base, voxel_offsets, demean, dtype, time_side)
            n_took_part = took_part.sum(dim=1).to(torch.int32)
        values, vectors, info = solver(gram)
        # removing a mean costs one degree of freedom: along time (voxel) or along the voxels (volume)
        values = values.to(torch.float64)
        usable_voxels, usable_volumes = n_took_part - int(demean == "volume"), n_volumes - int(demean == "voxel")
        patch_rank, sigma2 = marchenko_pastur_threshold(values, usable_voxels, usable_volumes, options.estimator)
        projector = signal_projector(vectors, patch_rank)
        keep = info == 0
        unsettled = None
        if settle:
            unsettled = unsettled_ranks(values, usable_voxels, usable_volumes, options.estimator, patch_rank,
                                        SETTLE_SLACK)
            keep &= ~unsettled
        keep = keep.to(torch.float64)
        if center:
            patch_weight = keep
        else:
            patch_weight = (aggregation_weights(patch_rank, options.demeaned, options.aggregation)
                            * batch_multiplicity * keep)
        patch_weight = patch_weight.to(torch.float32)
        patch_sigma = torch.sqrt(sigma2).to(torch.float32)
        patch_rank = patch_rank.to(torch.float32)

        if fused:
            projector = projector.to(torch.float32).contiguous()
            if center:
                kernels.reconstruct_centres(volume, centres[0], centres[1], projector, patch_weight, patch_sigma,
                                            patch_rank, image, weight, sigma, rank, demean=demean,
                                            volume_mean=volume_mean)
            else:
                kernels.reconstruct_accumulate(volume, finite_flat, base, voxel_offsets, projector, patch_weight,
                                               patch_sigma, patch_rank, image, weight, sigma, rank,
                                               demean=demean, volume_mean=volume_mean)
        else:
            restored = patches @ projector if time_side else projector @ patches
            if means is not None:
                restored = restored + means
            if center:
                rows, own_window, own_position = centres
                w = patch_weight[own_window]
                image[rows] = restored[own_window, own_position].to(torch.float32) * w[:, None]
                weight[rows] = w
                sigma[rows] = w * patch_sigma[own_window]
                rank[rows] = w * patch_rank[own_window]
            else:
                voxel_weight = patch_weight[:, None] * took_part
                flat = voxels.reshape(-1)
                image.index_add_(0, flat, (restored * voxel_weight[:, :, None]).reshape(-1, n_volumes)
                                 .to(torch.float32))
                weight.index_add_(0, flat, voxel_weight.reshape(-1))
                sigma.index_add_(0, flat, (voxel_weight * patch_sigma[:, None]).reshape(-1))
                rank.index_add_(0, flat, (voxel_weight * patch_rank[:, None]).reshape(-1))
        return info, unsettled

    # first pass: every window, in the Gram precision
    step = batch_size(device, plan.n_windows, n_voxels, n_volumes, dtype, fused, solver, max_batch)
    starts = range(0, plan.n_windows, step)
    infos, unsettled = [], []
    for number, start in enumerate(starts):
        info, left = run_batch(slice(start, min(start + step, plan.n_windows)), dtype, fused, settle)
        infos.append(info)
        if settle:
            unsettled.append(left)
        if progress:
            progress(number + 1, len(starts))

    # one look at the verdicts, after all the work is queued; then the windows float32 could not settle
    # and those whose eigensolve failed, again in float64 (after that, failures go to the CPU)
    redo = torch.cat(infos) != 0 if infos else torch.zeros(0, dtype=torch.bool, device=device)
    if unsettled:
        redo |= torch.cat(unsettled)
    redo = torch.nonzero(redo).reshape(-1).cpu().numpy()
    failed = redo
    if settle and len(redo):
        fused64 = path != "gather" and kernels.fused_fits(n_voxels, n_volumes, torch.float64)
        step64 = batch_size(device, len(redo), n_voxels, n_volumes, torch.float64, fused64, solver, max_batch)
        infos = [run_batch(redo[a:a + step64], torch.float64, fused64, False)[0]
                 for a in range(0, len(redo), step64)]
        failed = redo[torch.nonzero(torch.cat(infos) != 0).reshape(-1).cpu().numpy()]
    normalized = normalize and not len(failed)
    if normalized:  # values, not sums: 0 where no patch served the voxel (its sums are 0)
        divisor = torch.where(weight > 0, weight, torch.ones_like(weight))
        image /= divisor[:, None]
        sigma /= divisor
        rank /= divisor
    sums = [_download(x) for x in (image, weight, sigma, rank)]
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
        peak = torch.cuda.max_memory_allocated(device)
        device_name = torch.cuda.get_device_name(device)
    else:
        peak, device_name = 0, "cpu (Triton interpreter)"
    release_volume()
    image, weight, sigma, rank = (x.numpy() for x in sums)
    if len(failed):
        _redo_on_cpu(data, finite, plan, options, failed, image, weight, sigma, rank)
    return PatchSums(image, weight, sigma, rank, normalized=normalized,
                     info=dict(backend="gpu", device=device_name, eigensolver=solver.backend,
                               gram_precision=str(dtype).replace("torch.", ""),
                               gram_path="fused" if fused else "gather", batch=step,
                               n_settled_in_float64=int(len(redo)) if settle else 0,
                               n_redone_on_cpu=int(len(failed)), gpu_peak_bytes=int(peak),
                               seconds_engine=time.perf_counter() - started))


class _TorchEigh:
    """``torch.linalg.eigh`` with BatchedEigh's interface (for comparisons: the seed ladder's second step)."""

    backend = "torch.linalg.eigh"

    def __init__(self, device):
        self.device = device

    def workspace_bytes(self, batch, m, dtype):
        return 0

    def __call__(self, matrices):
        values, vectors = torch.linalg.eigh(matrices)
        return values, vectors, torch.zeros(len(matrices), dtype=torch.int32, device=matrices.device)


def _redo_on_cpu(data, finite, plan, options, windows, image, weight, sigma, rank):
    """Redo the windows whose eigensolve failed with the CPU backend's functions; add them to the sums."""
    from ..cpu import fit_windows

    n_volumes = data.shape[3]
    fit = fit_windows(data.reshape(-1, n_volumes), finite.reshape(-1), plan, options, windows)
    restored = fit.reconstruct()
    if options.aggregation == "center":
        local = {int(w): k for k, w in enumerate(windows)}
        for centre in np.flatnonzero(np.isin(plan.centre_window, windows)):
            k, v = local[int(plan.centre_window[centre])], plan.centre_voxel[centre]
            image[v] = restored[k, plan.centre_position[centre]]
            weight[v] = 1.0
            sigma[v] = np.sqrt(fit.sigma2[k])
            rank[v] = fit.rank[k]
        return
    w = aggregation_weights(fit.rank, options.demeaned, options.aggregation) * plan.multiplicity[windows]
    voxel_weight = w[:, None] * fit.took_part
    flat = fit.voxels.ravel()
    np.add.at(image, flat, (restored * voxel_weight[:, :, None]).reshape(-1, n_volumes))
    np.add.at(weight, flat, voxel_weight.ravel())
    np.add.at(sigma, flat, (voxel_weight * np.sqrt(fit.sigma2)[:, None]).ravel())
    np.add.at(rank, flat, (voxel_weight * fit.rank[:, None]).ravel())
