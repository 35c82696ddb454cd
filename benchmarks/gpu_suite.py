"""One run on one GPU: check and time every variant of the GPU engine (issue 3), write JSON, print a table.

    python benchmarks/gpu_suite.py [--out DIR] [--quick] [--skip-torch-eigh]

(a) the seed ladder on the seed's problem: 96x96x48, T = 48, patch 11^3, stride 3 plus the flush corner
    (12,600 patches), rank-5 phantom on a baseline near 1000, noise sigma 4, weighted aggregation with voxel
    demeaning: NumPy one patch at a time on 1 BLAS thread (estimated from a subset), batched Gram +
    torch.linalg.eigh, batched Gram + XsyevBatched, the fused kernels + XsyevBatched at batch 2048 (the
    article's final step), ours (batch from free memory); plus ``denoise()`` itself, host to host.
(b) dwidenoise mode (5^3, stride 1, centre, no demeaning, exp2) on 96x96x48x48; what ``auto`` picks (also
    with the opt-in 16-lane projector launch and the threshold kernel), float64 and float32 (the mean taken
    apart as a rank-one term with the tridiagonal kernels, at several limits on the projector's gap; and
    plainly with XsyevBatched).
(c) defaults on a DWI-like (T = 300) and an fMRI-like (T = 1000) phantom, GPU and our CPU path on this
    machine's cores; ``--full`` runs the issue's full sizes (96x96x60x300, 64x64x40x1000), else crops of them.
(d) peak GPU memory of each.
(v) demean "volume" (the patch's mean time course) in the default call ``denoise(noisy, device="cuda")``
    (the package's defaults) on the seed's problem and on the DWI-like crop, against our CPU path with the
    same options; the backend alone (float32 alone, and with its float64 settling pass) and the whole call,
    each next to the same with voxel demeaning; the fused Gram kernel alone for both.
(5) issue 5's eigen step alone: XsyevBatched, its eigenvalues alone, the tridiagonal Triton kernels, and
    tridiagonal eigenvalues with a Newton-Schulz projector, on 12,600 Gram matrices for T in 32..128 (and
    clustered and rank-deficient ones), timed and checked against XsyevBatched in float64.
(k) the seed's problem quickly (a minute or two on a fresh machine): ours (``auto``), variants of it and the
    article's final step side by side, best of 7 each in 3 interleaved blocks (the best kept), with each one's
    timeline (``info["timeline_ms"]``), against the GPU's own float64 run (no CPU reference).
(p) the seed's problem (with each eigensolver) and dwidenoise's mode on the same phantom under torch's
    profiler: device time per stage and kernel.
(r) long series (T = 300, 1000; windows of (c)'s phantoms): the float32 eigensolve's eigenvalue errors, the
    float64 Rayleigh quotients of its eigenvectors, the ranks and the windows each settling criterion flags.
(w) the tridiagonal kernels' time (values with and without the shrinking Householder blocks, and with twice
    the warps; Householder alone; projector), float32 at m = 48, 64 and float64 at m = 48 (a settling pass's
    sizes: 1,500 and 437 matrices).
(q) the seed's windows: the tridiagonal kernels' float32 eigenvalue errors and what each settling slack
    flags (and misses).
(g) the fused kernels' tile products in float32 ("ieee") or as three TF32 products ("tf32x3"): each kernel
    alone, the Gram's error, and the seed's problem end to end with each.
(h) the host side of ``denoise_gpu`` on the seed's problem: page-locking, staging (compared), pinned outputs,
    downloads.
(u) what the driver serialises on the host: the host's memory copy by threads, a staged upload, page-locking
    beside a running kernel, small CUDA calls beside page-locking (for the upload's design).
(o) the caller's thread in the seed's run under cProfile (20 runs).
(s) the CPU path's scaling on this machine (no GPU): ``nproc``, the cgroup's CPU quota and affinity, and
    ``denoise(low_rank_phantom((64, 64, 40), 48)[0], device="cpu", nprocs=k)`` for k = 1, 4, 16 in fresh
    processes (and k = 16 after CUDA was initialised, as inside this suite), with the cgroup's CPU time and
    throttling; next to a control that runs the same NumPy work in k processes without our code.

Every time is host to host (NumPy in, NumPy out), best of 5 after a warm-up; errors are relative rms
differences of the denoised series from a float64 reference (our CPU path) and RMSE to the ground truth.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time
import traceback

import numpy as np
import torch

from mppca_nipype.engine import DEFAULTS, check_data, denoise, plan_patches, resolve_options
from mppca_nipype.engine.cpu import denoise_cpu
from mppca_nipype.engine.estimators import aggregation_weights, marchenko_pastur_threshold, signal_projector
from mppca_nipype.engine.gpu import usable
from mppca_nipype.engine.gpu.eigh import BatchedEigh
from mppca_nipype.engine.gpu.pipeline import denoise_gpu
from mppca_nipype.phantoms import dwi_phantom, low_rank_phantom

SEED_OPTIONS = dict(extent=11, stride=3, estimator="exp2", aggregation="weighted", demean="voxel")
VOLUME_OPTIONS = dict(DEFAULTS)  # the package's defaults: volume demeaning
DWIDENOISE_OPTIONS = dict(extent=5, stride=1, estimator="exp2", aggregation="center", demean="none")


def prepare(noisy, options):
    """What ``denoise`` hands a backend: float32 data with non-finite voxels zeroed, the plan, the options."""
    data, mask = check_data(noisy, None)
    resolved = resolve_options(data.shape, **options)
    finite = np.isfinite(data).all(axis=3)
    plan = plan_patches(data.shape[:3], resolved.extent, resolved.stride, mask, finite)
    return data, finite, plan, resolved


def finish(sums, shape):
    """Denoised series and rank map from a backend's sums (already divided when ``sums.normalized``)."""
    weight = np.ones_like(sums.weight) if sums.normalized else np.where(sums.weight > 0, sums.weight, 1)
    return ((sums.image / weight[:, None]).reshape(shape).astype(np.float32),
            (sums.rank / weight).reshape(shape[:3]))


def best_of(run, repeats=5, warmup=1):
    """Best wall time of ``repeats`` calls after ``warmup``; the last result and the peak GPU memory."""
    for _ in range(warmup):
        result = run()
    times = []
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    for _ in range(repeats):
        started = time.perf_counter()
        result = run()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return min(times), result, torch.cuda.max_memory_allocated()


def best_on_copies(work, run, repeats):
    """Best time (ms) of ``run(copy)`` on fresh copies of ``work`` (the kernels overwrite their input), the
    first left out; and the last result."""
    copies = [work.clone() for _ in range(repeats)]
    times = []
    for copy in copies:
        torch.cuda.synchronize()
        started = time.perf_counter()
        result = run(copy)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return min(times[1:]) * 1e3, result


def householder_alone(matrices, d, e, v, warps, count=None):
    """The tridiagonal values kernel without its bisection (Householder's reduction alone) on the (B, m, m)
    ``matrices``, d, e and v its (B, m) outputs; ``count``: a counted launch (the first ``count`` only)."""
    from mppca_nipype.engine.gpu.tridiagonal import _block, _householder_phases, _values_kernel

    batch, m = matrices.shape[0], matrices.shape[-1]
    _values_kernel[(batch,)](matrices, d, e, v, d, d, d if count is None else count, m, BLOCK=_block(m),
                             FP64=matrices.dtype == torch.float64, BISECTIONS=0, RANK_ONE=False,
                             COUNTED=count is not None, PHASES=_householder_phases(m), num_warps=warps)


def errors(denoised, reference, truth):
    d, r = denoised.astype(np.float64), reference.astype(np.float64)
    return dict(rel_to_float64=float(np.sqrt(np.mean((d - r) ** 2) / np.mean(r**2))),
                rmse_to_truth=float(np.sqrt(np.mean((d - truth) ** 2))) if truth is not None else None)


def numpy_one_patch_at_a_time(data, finite, plan, options, n_patches=300):
    """The seed ladder's first step: one patch at a time, 1 BLAS thread; seconds per patch."""
    from threadpoolctl import threadpool_limits

    volume = data.reshape(-1, data.shape[3]).astype(np.float64)
    n_volumes = data.shape[3]
    picks = np.linspace(0, plan.n_windows - 1, n_patches).astype(int)
    with threadpool_limits(limits=1):
        started = time.perf_counter()
        for w in picks:
            x = volume[plan.window_base([w])[0] + plan.voxel_offsets]
            mean = x.mean(axis=1, keepdims=True)
            x = x - mean
            values, vectors = np.linalg.eigh(x.T @ x)
            rank, _ = marchenko_pastur_threshold(values[None], np.array([len(x)]), n_volumes - 1, "exp2")
            restored = x @ signal_projector(vectors[None], rank)[0] + mean
            aggregation_weights(rank, True, "weighted")
            del restored
        return (time.perf_counter() - started) / n_patches


def eigensolver_alone(count=12_600, m=48):
    """XsyevBatched alone on ``count`` m x m matrices, float32 and float64, with eigenvectors and with the
    eigenvalues alone (ms); and on the 442,368 matrices of dwidenoise's mode on 96x96x48x48."""
    solver = BatchedEigh("cuda")
    rows = {}
    for count in (count, 442_368):
        for dtype in (torch.float32, torch.float64):
            for vectors in (True, False):
                chunk = min(count, 16_384)  # XsyevBatched fails (INTERNAL_ERROR) on 65,536 at once
                a = torch.randn(chunk, m, 2 * m, device="cuda", dtype=dtype)
                matrices = a @ a.mT
                work = matrices.clone()
                solver(work, vectors=vectors)  # warm-up: workspace
                times = []
                for _ in range(3 if count > chunk else 5):
                    torch.cuda.synchronize()
                    started = time.perf_counter()
                    for _ in range(0, count, chunk):
                        work.copy_(matrices)
                        _, _, info = solver(work, vectors=vectors)
                    torch.cuda.synchronize()
                    times.append(time.perf_counter() - started)
                assert int((info != 0).sum()) == 0
                key = f"{count}x{m}_{str(dtype).replace('torch.', '')}_{'vectors' if vectors else 'values_only'}"
                rows[key] = min(times) * 1e3
                del a, matrices, work
                solver.release_workspaces()
                print(key, rows[key], flush=True)
    return rows


def gram_batch(kind, count, m, seed=0):
    """(count, m, m) float64 Gram matrices on the GPU and the (n, T) of the estimator: ``patches`` are
    centred rank-5 signals on noise as in the seed's problem (n = 1331 voxels, or 4 m); ``wishart`` pure
    noise; ``clustered`` a spectrum of 1s with 5, 5, 5, 9, 20, 20 on top; ``deficient`` rank 4 plus a ridge."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    if kind in ("patches", "wishart"):
        n = 1331 if m == 48 else 4 * m
        x = 4.0 * torch.randn(count, n, m, device="cuda", dtype=torch.float64, generator=g)
        if kind == "patches":
            scores = torch.randn(count, n, 5, device="cuda", dtype=torch.float64, generator=g)
            loads = torch.randn(count, 5, m, device="cuda", dtype=torch.float64, generator=g)
            x += scores @ (loads * torch.tensor([60.0, 30, 15, 8, 5], device="cuda", dtype=torch.float64)[:, None])
        x -= x.mean(dim=1, keepdim=True)
        return x.mT @ x, n - 1, m
    if kind == "clustered":
        q, _ = torch.linalg.qr(torch.randn(count, m, m, device="cuda", dtype=torch.float64, generator=g))
        spectrum = torch.ones(m, device="cuda", dtype=torch.float64)
        spectrum[-6:] = torch.tensor([5.0, 5.0, 5.0000001, 9.0, 20.0, 20.0], device="cuda", dtype=torch.float64)
        return (q * spectrum) @ q.mT, 4 * m, m
    y = 100 * torch.randn(count, m, 4, device="cuda", dtype=torch.float64, generator=g)
    return y @ y.mT + 1e-3 * torch.eye(m, device="cuda", dtype=torch.float64), 4 * m, m


def newton_schulz_projector(matrices, values, rank, iterations):
    """The second alternative of the eigen step (eigenvalues, then matrix products only): the projector on
    the leading ``rank`` eigenvectors as (I + sign(G - tau I)) / 2, tau halfway between the last kept and
    the first dropped eigenvalue, the sign by Newton-Schulz iterations X <- X (3 I - X^2) / 2 on
    (G - tau I) / ||G - tau I||."""
    m = matrices.shape[-1]
    index = (m - rank).clamp(1, m - 1)[:, None]
    tau = 0.5 * (values.gather(1, index) + values.gather(1, index - 1))[:, 0]
    eye = torch.eye(m, device=matrices.device, dtype=matrices.dtype)
    x = matrices - tau[:, None, None] * eye
    x = x / (values[:, -1] - tau).abs().clamp(min=1e-30).maximum((values[:, 0] - tau).abs())[:, None, None]
    for _ in range(iterations):
        x = 0.5 * x @ (3 * eye - x @ x)
    return 0.5 * (eye + x) * (rank > 0).to(x.dtype)[:, None, None]


def eigen_step(count=12_600):
    """Issue 5's micro-benchmark: the eigen step (eigenvalues, the estimator's rank, the projector) on
    ``count`` Gram matrices per T, each variant timed (best of 5) and checked against XsyevBatched in
    float64: rank P as decided by the exp2 estimator (share of equal ranks) and the projector's largest
    deviation; the checks also on clustered and rank-deficient matrices at T = 48 (at fixed ranks). The
    variants: XsyevBatched, the tridiagonal kernels the engine keeps, and issue 5's two alternatives it does
    not keep (the Newton-Schulz projector, the Jacobi kernel of ``benchmarks/jacobi.py``, T <= 64)."""
    from jacobi import SWEEPS as JACOBI_SWEEPS, JacobiEigh  # (benchmarks/jacobi.py: not in the engine)
    from mppca_nipype.engine.gpu.tridiagonal import TridiagonalEigh

    xsyev, tridiagonal, jacobi = BatchedEigh("cuda"), TridiagonalEigh("cuda"), JacobiEigh("cuda")

    def threshold(values, n, m):
        """The exp2 estimator's rank; for the clustered and rank-deficient kinds, where float32 cannot
        resolve the noise bulk, the rank that splits no cluster: 6 and 4."""
        if kind in ("clustered", "deficient"):
            return torch.full((len(values),), 6 if kind == "clustered" else 4, device=values.device)
        voxels = torch.full((len(values),), n, dtype=torch.int64, device=values.device)
        return marchenko_pastur_threshold(values.to(torch.float64), voxels, m, "exp2")[0]

    def variants(work, n, m):
        def xsyev_step():
            values, info = xsyev.values(work.clone())
            rank = threshold(values, n, m)
            return values, rank, xsyev.projector(rank)

        def xsyev_values_only():
            values, _, info = xsyev(work.clone(), vectors=False)
            return values, threshold(values, n, m), None

        def tridiagonal_step():
            values, info = tridiagonal.values(work.clone())
            rank = threshold(values, n, m)
            return values, rank, tridiagonal.projector(rank)

        def newton_schulz(iterations):
            def step():
                values, info = tridiagonal.values(work.clone())
                rank = threshold(values, n, m)
                return values, rank, newton_schulz_projector(work, values, rank, iterations)
            return step

        def jacobi_step():
            values, info = jacobi.values(work)
            rank = threshold(values, n, m)
            return values, rank, jacobi.projector(rank)

        steps = {"XsyevBatched (values + vectors) + projector": xsyev_step,
                 "XsyevBatched, eigenvalues only": xsyev_values_only,
                 "tridiagonal: values, then projector by inverse iteration": tridiagonal_step,
                 "tridiagonal values + Newton-Schulz projector, 30 steps": newton_schulz(30)}
        if m <= 64:  # (at 96 and 128: a 128 x 128 block, ~16x the products of 64; by estimate ~10 s a run)
            steps[f"Jacobi, parallel order, {JACOBI_SWEEPS} sweeps: values, vectors, V_P V_P^T"] = jacobi_step
        return steps

    results = []
    for kind, sizes in (("patches", (32, 48, 64, 96, 128)), ("wishart", (48,)), ("clustered", (48,)),
                        ("deficient", (48,))):
        for m in sizes:
            batch = count if kind == "patches" else 2000
            matrices, n, m = gram_batch(kind, batch, m)
            values64, info = xsyev.values(matrices.clone())
            rank64 = threshold(values64, n, m)
            projector64 = xsyev.projector(rank64)
            work = matrices.to(torch.float32).contiguous()
            for name, run in variants(work, n, m).items():
                run()
                times = []
                for _ in range(5 if kind == "patches" else 1):
                    torch.cuda.synchronize()
                    started = time.perf_counter()
                    values, rank, projector = run()
                    torch.cuda.synchronize()
                    times.append(time.perf_counter() - started)
                scale = values64.abs().amax(dim=1)
                row = dict(kind=kind, m=m, batch=batch, variant=name, ms=min(times) * 1e3,
                           rank_equal=float((rank == rank64).double().mean()),
                           values_err=float(((values.double() - values64).abs().amax(dim=1) / scale).max()))
                if projector is not None:
                    same = rank == rank64
                    deviation = (projector.double() - projector64).abs().amax(dim=(1, 2))
                    row["projector_err_max"] = float(deviation[same].max()) if same.any() else None
                    row["projector_err_median"] = float(deviation[same].median()) if same.any() else None
                results.append(row)
                print(row, flush=True)
            del matrices, work, projector64
            xsyev.release_workspaces()
            torch.cuda.empty_cache()
    return results


def timeline_gaps(path):
    """From a chrome trace of one call: the call's span, the device's busy time (kernels and copies, merged),
    and the idle gaps on the device longer than 50 us, with the host ops running during each (ms)."""
    import json as json_module

    with open(path) as f:
        events = [e for e in json_module.load(f)["traceEvents"] if e.get("ph") == "X"]
    device = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in ("kernel", "gpu_memcpy",
                                                                                          "gpu_memset"))
    host = [e for e in events if e.get("cat") in ("cpu_op", "user_annotation", "cuda_runtime", "cuda_driver")]
    start = min(e["ts"] for e in host)
    end = max(max(e["ts"] + e["dur"] for e in host), device[-1][1])
    busy, gaps, last = 0.0, [], start
    for a, b in device:
        if a > last + 50:
            during = sorted({e["name"][:60] for e in host if e["ts"] < a and e["ts"] + e["dur"] > last})
            gaps.append(dict(at_ms=(last - start) / 1e3, ms=(a - last) / 1e3, host=during[:12]))
        busy += max(0.0, b - max(a, last))
        last = max(last, b)
    if end > last + 50:
        gaps.append(dict(at_ms=(last - start) / 1e3, ms=(end - last) / 1e3, host=["(after the device's last work)"]))
    return dict(span_ms=(end - start) / 1e3, device_busy_ms=busy / 1e3, gaps=gaps)


def profile_seed(trace_dir=None):
    """Where the seed's problem (per eigensolver) and dwidenoise's mode spend their time on the device:
    ``denoise_gpu`` under torch's profiler, device time summed by kernel into stages (Gram, eigen step,
    estimator and projector glue, reconstruction, copies); and the host-to-host wall time of the same call."""
    from torch.profiler import ProfilerActivity, profile

    seed, _ = low_rank_phantom((96, 96, 48), n_volumes=48, rank=5, sigma=4.0, baseline=1000.0, seed=0)
    stages = (("gram", ("_gram_kernel", "_slice_grams_kernel")),
              ("box sums' row sums (Gram and reconstruction)", ("_range_sums_kernel",)),
              ("threshold", ("_threshold_kernel",)), ("eigen: tridiagonal values", ("_values_kernel",)),
              ("eigen: tridiagonal projector", ("_projector_kernel",)),
              ("eigen: XsyevBatched", ("syev", "sytrd", "steqr", "stedc", "orm", "jacobi", "batched")),
              ("reconstruct", ("_reconstruct", "_apply_kernel")), ("copies", ("Memcpy", "memcpy")))
    result = {}
    for name, options, eigensolver in (("tridiagonal", SEED_OPTIONS, "tridiagonal"), ("xsyev", SEED_OPTIONS, "xsyev"),
                                       ("dwidenoise mode, auto", DWIDENOISE_OPTIONS, "auto")):
        data, finite, plan, options = prepare(seed, options)
        run = lambda: denoise_gpu(data, finite, plan, options, eigensolver=eigensolver)  # noqa: E731
        seconds, sums, _ = best_of(run, repeats=5)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run()
            torch.cuda.synchronize()
        if name == "tridiagonal" and trace_dir:  # the host and the device on one timeline
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as timeline:
                run()
                torch.cuda.synchronize()
            timeline.export_chrome_trace(os.path.join(trace_dir, "seed_timeline.json"))
            result["seed_timeline"] = timeline_gaps(os.path.join(trace_dir, "seed_timeline.json"))
        totals, kernels = {}, []
        for event in prof.key_averages():
            cuda_us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
            if not cuda_us:
                continue
            kernels.append((event.key[:90], cuda_us / 1e3, event.count))
            stage = next((name for name, keys in stages if any(k in event.key for k in keys)), "other")
            totals[stage] = totals.get(stage, 0.0) + cuda_us / 1e3
        kernels.sort(key=lambda k: -k[1])
        result[name] = dict(host_to_host_ms=seconds * 1e3, n_settled=sums.info["n_settled_in_float64"],
                            stages_ms=totals, top_kernels=kernels[:25])
        print(name, f"{seconds * 1e3:.1f} ms", {k: round(v, 2) for k, v in totals.items()}, flush=True)
        for name, ms, count in kernels[:12]:
            print(f"   {ms:8.2f} ms  x{count:<5} {name}", flush=True)
    return result


def eigensolvers_on_large_matrices():
    """XsyevBatched vs torch.linalg.eigh on long-series Gram sizes, float32 (ms per matrix)."""
    solver = BatchedEigh("cuda")
    rows = {}
    for m, count in ((128, 2048), (300, 256), (1000, 32)):
        a = torch.randn(count, m, m + 20, device="cuda")
        matrices = a @ a.mT
        for name, run in (("xsyev_batched", lambda: solver(matrices.clone())),
                          ("torch_eigh", lambda: torch.linalg.eigh(matrices))):
            run()
            torch.cuda.synchronize()
            started = time.perf_counter()
            run()
            torch.cuda.synchronize()
            rows[f"{name}_m{m}"] = (time.perf_counter() - started) * 1e3 / count
        print(m, {k: v for k, v in rows.items() if k.endswith(f"m{m}")}, flush=True)
    return rows


def hardware():
    props = torch.cuda.get_device_properties(0)
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.limit",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=30).stdout.strip()
    except Exception:
        smi = ""
    try:
        import nvmath
        nvmath_version = nvmath.__version__
    except Exception:
        nvmath_version = None
    return dict(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1), nvidia_smi=smi,
                cpu=platform.processor() or platform.machine(), cpu_count=os.cpu_count(),
                torch=torch.__version__, triton=__import__("triton").__version__, nvmath=nvmath_version,
                cuda=torch.version.cuda, numpy=np.__version__)


def seed_ladder(rows, skip_torch_eigh):
    noisy, truth = low_rank_phantom((96, 96, 48), n_volumes=48, rank=5, sigma=4.0, baseline=1000.0, seed=0)
    data, finite, plan, options = prepare(noisy, SEED_OPTIONS)
    print(f"seed problem: {plan.n_windows} patches of {plan.patch_size} x {data.shape[3]}", flush=True)
    started = time.perf_counter()
    reference, _ = finish(denoise_cpu(data, finite, plan, options), data.shape)
    cpu_seconds = time.perf_counter() - started
    rows.append(dict(problem="seed", variant=f"our CPU path, {os.cpu_count()} processes (float64 reference)",
                     ms=cpu_seconds * 1e3, **errors(reference, reference, truth), peak_gib=0.0))

    per_patch = numpy_one_patch_at_a_time(data, finite, plan, options)
    rows.append(dict(problem="seed", variant="numpy, one patch at a time, 1 BLAS thread (estimated)",
                     ms=per_patch * plan.n_windows * 1e3, rel_to_float64=None, rmse_to_truth=None, peak_gib=0.0))

    variants = [
        ("batched Gram + torch.linalg.eigh", dict(path="gather", eigensolver="torch"), 1),
        ("batched Gram + XsyevBatched", dict(path="gather", eigensolver="xsyev"), 5),
        ("fused kernels + XsyevBatched, batch 2048 (article's final step)",
         dict(path="fused", max_batch=2048, eigensolver="xsyev"), 5),
        ("ours: denoise_gpu with XsyevBatched", dict(eigensolver="xsyev"), 5),
        ("ours: denoise_gpu, fused kernels (no box sums)", dict(path="fused"), 5),
        ("ours: denoise_gpu (box sums, tridiagonal eigensolver, batch from free memory)", dict(), 5),
    ]
    for name, kwargs, repeats in variants:
        if skip_torch_eigh and kwargs.get("eigensolver") == "torch":
            continue
        seconds, sums, peak = best_of(lambda: denoise_gpu(data, finite, plan, options, **kwargs),
                                      repeats=repeats, warmup=1 if repeats > 1 else 0)
        denoised, _ = finish(sums, data.shape)
        marked = denoise_gpu(data, finite, plan, options, timeline=True, **kwargs)
        rows.append(dict(problem="seed", variant=name, ms=seconds * 1e3, **errors(denoised, reference, truth),
                         peak_gib=peak / 2**30, batch=sums.info["batch"], timeline_ms=marked.info["timeline_ms"]))
        print(rows[-1], flush=True)
    seconds, result, peak = best_of(lambda: denoise(noisy, device="cuda", **SEED_OPTIONS))
    rows.append(dict(problem="seed", variant="ours: denoise(device='cuda'), whole call", ms=seconds * 1e3,
                     **errors(result.denoised, reference, truth), peak_gib=peak / 2**30))


def seed_quick(rows, blocks=3, only=()):
    """(k) the seed's problem: ours and the article's final step, and variants of ours, each best of 7 in
    ``blocks`` rounds over all the variants (the machine drifts by ~1 ms over a minute: the best of the
    blocks is kept), with the timeline of one more run each."""
    from mppca_nipype.engine.gpu import boxsums, pipeline, tridiagonal, upload

    noisy, truth = low_rank_phantom((96, 96, 48), n_volumes=48, rank=5, sigma=4.0, baseline=1000.0, seed=0)
    data, finite, plan, options = prepare(noisy, SEED_OPTIONS)
    reference, _ = finish(denoise_gpu(data, finite, plan, options, precision="float64"), data.shape)
    result = {}
    # (name, denoise_gpu's arguments, module settings for the run)
    variants = [("fused kernels + XsyevBatched, batch 2048 (article's final step)",
                 dict(path="fused", max_batch=2048, eigensolver="xsyev"), {}),
                ("ours: denoise_gpu (auto)", dict(), {}),
                ("ours, the first pass queued by the host (no graphs)", dict(), {(pipeline, "GRAPHS"): False}),
                ("ours, settled and finished after the whole first pass (no part finishing)", dict(),
                 {(pipeline, "FINISH_BY_PART"): False}),
                ("ours, each replayed part settled after its graph (no verdict events)", dict(),
                 {(pipeline, "VERDICT_EVENTS_IN_GRAPHS"): False}),
                ("ours, final pieces 16", dict(), {(pipeline, "FINAL_PIECES"): 16}),
                ("ours, final pieces 4", dict(), {(pipeline, "FINAL_PIECES"): 4}),
                ("ours, no window unsettled (slack 0: the settling passes run empty)", dict(),
                 {(pipeline, "TRIDIAGONAL_SETTLE_SLACK"): 0.0}),
                ("ours, the side stream at the first pass's priority", dict(), {(pipeline, "SETTLE_PRIORITY"): 0}),
                ("ours, bisection from Gershgorin's interval (no multisection)", dict(),
                 {(tridiagonal, "MULTISECTION"): False}),
                ("ours, Householder on the whole block (no shrinking blocks)", dict(),
                 {(tridiagonal, "SHRINKING_BLOCKS"): False}),
                ("ours, slice grams in tf32x3", dict(),
                 {(boxsums, "DOT_PRECISION"): dict(boxsums.DOT_PRECISION, gram="tf32x3")})]
    variants += [(f"ours, staged in {rounds} rounds", dict(), {(upload, "STAGE_ROUNDS"): rounds})
                 for rounds in (2, 4, 6)]
    variants += [(f"ours, staged by {threads} threads", dict(), {(upload, "STAGE_THREADS"): threads})
                 for threads in (12, 16)]
    variants += [(f"ours, staged in shares {'/'.join(f'{share:.0%}' for share in shares)}", dict(),
                  {(upload, "STAGE_ROUNDS"): len(shares), (upload, "STAGE_SHARES"): shares})
                 for shares in ((0.15, 0.425, 0.425), (0.15, 0.85 / 3, 0.85 / 3, 0.85 / 3), (0.4, 0.4, 0.2),
                                (0.45, 0.4, 0.15), (0.3, 0.3, 0.25, 0.15))]
    variants += [(f"ours, {shifts} shifts per Sturm count in {str(dtype)[6:]}", dict(),
                  {(tridiagonal, "SHIFTS_PER_COUNT"): {**tridiagonal.SHIFTS_PER_COUNT, dtype: shifts}})
                 for dtype, shifts in ((torch.float32, 2), (torch.float64, 4))]
    variants += [("ours, IEEE's division in the tridiagonal kernels", dict(),
                  {(tridiagonal, "APPROXIMATE_RECIPROCAL"): False})]
    variants += [("ours, counted launches (settling passes) as the others (2 warps, 1 shift a count)", dict(),
                  {(tridiagonal, "COUNTED_VALUES_LAUNCH"): None})]

    variants = [variant for variant in variants if not only or any(word in variant[0] for word in only)]
    best = {}
    for block in range(blocks):
        for name, kwargs, settings in variants:
            defaults = {key: getattr(*key) for key in settings}
            for (module, attribute), value in settings.items():
                setattr(module, attribute, value)
            try:
                seconds, sums, peak = best_of(lambda: denoise_gpu(data, finite, plan, options, **kwargs), repeats=7)
                marked = (denoise_gpu(data, finite, plan, options, timeline=True, **kwargs)  # (its events cost time)
                          if block == blocks - 1 else None)
            finally:
                for (module, attribute), value in defaults.items():
                    setattr(module, attribute, value)
            best.setdefault(name, []).append(seconds * 1e3)
            if marked is None:
                continue
            denoised, _ = finish(sums, data.shape)
            rows.append(dict(problem="seed (quick)", variant=name, ms=min(best[name]),
                             **errors(denoised, reference, truth), peak_gib=peak / 2**30))
            result[name] = dict(ms=min(best[name]), ms_by_block=best[name], timeline_ms=marked.info["timeline_ms"],
                                gram_path=sums.info["gram_path"], n_settled=sums.info["n_settled_in_float64"],
                                first_pass=sums.info.get("first_pass"))
            print(rows[-1], result[name], flush=True)
    # a geometry's first runs: the first pass queued by the host (kernels built before), captured, replayed
    pipeline._FirstPassGraphs._kept.clear()
    first_runs = []
    for _ in range(4):
        started = time.perf_counter()
        sums = denoise_gpu(data, finite, plan, options)
        first_runs.append((sums.info["first_pass"], round((time.perf_counter() - started) * 1e3, 2)))
    result["a geometry's first runs (ms)"] = first_runs
    print(first_runs, flush=True)
    return result


def dwidenoise_mode(rows):
    noisy, truth = low_rank_phantom((96, 96, 48), n_volumes=48, rank=5, sigma=4.0, baseline=1000.0, seed=1)
    data, finite, plan, options = prepare(noisy, DWIDENOISE_OPTIONS)
    print(f"dwidenoise mode: {plan.n_windows} windows, {len(plan.centre_voxel)} centres", flush=True)
    started = time.perf_counter()
    cpu_sums = denoise_cpu(data, finite, plan, options)
    cpu_seconds = time.perf_counter() - started
    reference, reference_rank = finish(cpu_sums, data.shape)
    rows.append(dict(problem="dwidenoise 96x96x48x48", variant=f"our CPU path, {os.cpu_count()} processes",
                     ms=cpu_seconds * 1e3, **errors(reference, reference, truth), peak_gib=0.0))
    from mppca_nipype.engine.gpu import pipeline, tridiagonal

    rank_one = dict(precision="float32", eigensolver="tridiagonal")
    # (name, denoise_gpu's arguments, module settings for the run)
    variants = [("ours (auto)", dict(), {}),
                ("auto, projector kernel in one launch (no 16-lane launch for ranks <= 16)", dict(),
                 {(tridiagonal, "PROJECTOR_LANES"): 0}),
                ("auto, the estimator and settling test as torch launches", dict(), {(pipeline, "FUSED_THRESHOLD"): False}),
                ("auto, neither (the fifth session's default)", dict(),
                 {(tridiagonal, "PROJECTOR_LANES"): 0, (pipeline, "FUSED_THRESHOLD"): False}),
                ("float64 Gram + XsyevBatched", dict(precision="float64", eigensolver="xsyev"), {}),
                ("float64 Gram + tridiagonal eigensolver", dict(precision="float64", eigensolver="tridiagonal"), {})]
    variants += [(f"float32: demeaned Gram + the mean as a rank-one term, tridiagonal, gap limit {limit:g}",
                  rank_one, {(pipeline, "PROJECTOR_GAP_LIMIT"): limit}) for limit in (1e-5, 1e-3, float("inf"))]
    variants += [("float32 Gram + XsyevBatched", dict(precision="float32", eigensolver="xsyev"), {})]
    for name, kwargs, settings in variants:
        defaults = {key: getattr(*key) for key in settings}
        for (module, attribute), value in settings.items():
            setattr(module, attribute, value)
        try:
            seconds, sums, peak = best_of(lambda: denoise_gpu(data, finite, plan, options, **kwargs))
        finally:
            for (module, attribute), value in defaults.items():
                setattr(module, attribute, value)
        denoised, rank = finish(sums, data.shape)
        rows.append(dict(problem="dwidenoise 96x96x48x48", variant=name, ms=seconds * 1e3,
                         **errors(denoised, reference, truth), peak_gib=peak / 2**30, batch=sums.info["batch"],
                         n_settled_in_float64=sums.info["n_settled_in_float64"],
                         rank_equal=float(np.mean(np.abs(rank - reference_rank) < 1e-3)),
                         gram_precision=sums.info["gram_precision"], eigensolver=sums.info["eigensolver"]))
        print(rows[-1], flush=True)
    seconds, result, peak = best_of(lambda: denoise(noisy, device="cuda", **DWIDENOISE_OPTIONS), repeats=3)
    rows.append(dict(problem="dwidenoise 96x96x48x48", variant="ours: denoise(device='cuda'), whole call",
                     ms=seconds * 1e3, **errors(result.denoised, reference, truth), peak_gib=peak / 2**30))


def long_series(full):
    """(c)'s phantoms: (name, noisy, truth) of a DWI-like T = 300 and an fMRI-like T = 1000 series, and a
    DWI-like T = 96 one (the fused path's range, where the gathered path could refine instead of settling)."""
    for name, shape, n_volumes in (("DWI-like", (96, 96, 60) if full else (40, 40, 24), 300),
                                   ("fMRI-like", (64, 64, 40) if full else (28, 28, 18), 1000),
                                   ("DWI-like", (96, 96, 60) if full else (40, 40, 24), 96)):
        if name == "DWI-like":
            noisy, truth, _, _ = dwi_phantom(shape, n_volumes=n_volumes, sigma=20.0, seed=2)
        else:
            noisy, truth = low_rank_phantom(shape, n_volumes=n_volumes, rank=8, sigma=10.0, seed=3)
        yield f"defaults {name} {'x'.join(map(str, shape))}x{n_volumes}", noisy, truth


def defaults(rows, full, cpu=True):
    """(c): the package's defaults on long series, GPU against our CPU path on this machine's cores, with the
    eigensolver's share (XsyevBatched alone on as many T x T matrices of the problem's kind); and what the
    float64 settling pass costs and buys there: float32 alone, and float64 from the start (one pass), each
    with its error and the share of voxels whose rank map equals the CPU's. ``cpu=False`` (``--no-cpu``):
    the GPU's float64 one-pass run stands in for the CPU path as the reference (no speedups)."""
    for problem, noisy, truth in long_series(full):
        data, finite, plan, options = prepare(noisy, VOLUME_OPTIONS)
        n_volumes = data.shape[3]
        print(f"{problem}: {plan.n_windows} windows of {plan.patch_size} x {n_volumes}", flush=True)
        started = time.perf_counter()
        if cpu:
            reference, reference_rank = finish(denoise_cpu(data, finite, plan, options), data.shape)
            variant = f"our CPU path, {os.cpu_count()} processes"
        else:
            reference, reference_rank = finish(denoise_gpu(data, finite, plan, options, precision="float64"),
                                               data.shape)
            variant = "reference: GPU float64 from the start (no CPU run: --no-cpu)"
        cpu_seconds = time.perf_counter() - started if cpu else float("nan")
        rows.append(dict(problem=problem, variant=variant, ms=(time.perf_counter() - started) * 1e3,
                         **errors(reference, reference, truth), peak_gib=0.0, n_windows=plan.n_windows))
        print(rows[-1], flush=True)
        seconds, sums, peak = best_of(lambda: denoise_gpu(data, finite, plan, options), repeats=2)
        denoised, rank = finish(sums, data.shape)
        m = min(plan.patch_size, n_volumes)
        rows.append(dict(problem=problem, variant=f"ours ({sums.info['gram_path']} Gram + {sums.info['eigensolver']})",
                         ms=seconds * 1e3, **errors(denoised, reference, truth), peak_gib=peak / 2**30,
                         batch=sums.info["batch"], speedup_vs_cpu=cpu_seconds / seconds,
                         n_settled_in_float64=sums.info["n_settled_in_float64"],
                         eigenvalues_refined=sums.info.get("eigenvalues_refined"),
                         rank_map_equal=float(np.mean(np.abs(rank - reference_rank) < 1e-3)),
                         eigensolver_alone_ms=eigensolver_share(plan.n_windows, m, sums.info["batch"],
                                                                sums.info["n_settled_in_float64"])))
        print(rows[-1], flush=True)
        # the settling pass's price on long series: float32 alone, and float64 from the start (one pass)
        variants = [("float32 alone (no settling)", dict(settle=False)),
                    ("float64 from the start (one pass)", dict(precision="float64"))]
        if sums.info["gram_path"] == "fused":
            variants.append(("gathered path, refined in float64", dict(path="gather")))
        for name, kwargs in variants:
            seconds, sums, peak = best_of(lambda: denoise_gpu(data, finite, plan, options, **kwargs), repeats=1)
            denoised, rank = finish(sums, data.shape)
            rows.append(dict(problem=problem, variant=name, ms=seconds * 1e3, **errors(denoised, reference, truth),
                             peak_gib=peak / 2**30, speedup_vs_cpu=cpu_seconds / seconds,
                             n_settled_in_float64=sums.info["n_settled_in_float64"],
                             eigenvalues_refined=sums.info["eigenvalues_refined"],
                             rank_map_equal=float(np.mean(np.abs(rank - reference_rank) < 1e-3))))
            print(rows[-1], flush=True)


def long_series_refinement(full):
    """(r) issue 3 at T = 300 / 1000: what a float32 eigensolve gets wrong on the defaults' windows of (c)'s
    phantoms, and what float64 Rayleigh-Ritz on its eigenvectors at both ends repairs
    (``ProjectorFromVectors.refine``).
    On windows spread over each phantom: eigenvalue errors against float64 XsyevBatched (in float32 roundings
    of the largest eigenvalue), rank agreement, the share of windows each criterion leaves unsettled and
    the share whose rank differs yet is not flagged (must be 0), and the time of each step per window."""
    from mppca_nipype.engine.gpu.pipeline import REFINE_GUARD, _gather_gram, refine_block

    solver, results = BatchedEigh("cuda"), []
    for problem, noisy, _ in long_series(full):
        data, finite, plan, options = prepare(noisy, VOLUME_OPTIONS)
        n_volumes = data.shape[3]
        volume = torch.from_numpy(data.reshape(-1, n_volumes)).cuda()
        finite_rows = torch.from_numpy(finite.reshape(-1).astype(np.float32)).cuda()
        chosen = np.linspace(0, plan.n_windows - 1, min(512 if n_volumes >= 1000 else 2048, plan.n_windows))
        base = torch.from_numpy(plan.window_base()[chosen.astype(np.int64)]).cuda()
        offsets = torch.from_numpy(plan.voxel_offsets.astype(np.int32)).cuda()
        count, ms = len(base), {}

        def timed(key, run, repeats=3):
            result = run()
            best = float("inf")
            for _ in range(repeats):
                torch.cuda.synchronize()
                started = time.perf_counter()
                result = run()
                torch.cuda.synchronize()
                best = min(best, time.perf_counter() - started)
            ms[key] = best * 1e3 / count
            return result

        gram32 = timed("Gram float32 (gathered, cuBLAS)",
                       lambda: _gather_gram(volume, finite_rows, base, offsets, "volume", torch.float32, True)[0])
        gram64, _, _, took_part, _ = timed(
            "Gram float64 (gathered, cuBLAS)",
            lambda: _gather_gram(volume, finite_rows, base, offsets, "volume", torch.float64, True))
        usable = took_part.sum(dim=1).to(torch.int64) - 1
        rank_of = lambda values: marchenko_pastur_threshold(values, usable, n_volumes, "exp2")[0]  # noqa: E731
        values64 = timed("XsyevBatched float64 (values + vectors)", lambda: solver(gram64.clone())[0])
        values32 = timed("XsyevBatched float32 (values + vectors)", lambda: solver(gram32.clone())[0]).double()
        timed("XsyevBatched float32, values only", lambda: solver(gram32.clone(), vectors=False))
        rounded = solver.values(gram64.to(torch.float32))[0].double()
        vectors = solver._vectors
        block = refine_block(gram64.shape[-1])

        def refine():
            solver._vectors = vectors
            return solver.refine(gram64, block)

        refined, refine_info = timed("refinement in float64 (Rayleigh-Ritz at both ends)", refine)
        rank64, rank32, rank_rounded, rank_refined = (rank_of(v) for v in (values64, values32, rounded, refined))
        m = values64.shape[1]
        spread = lambda values, columns=slice(None): error_in_roundings(values, values64, columns)  # noqa: E731

        row = dict(problem=problem, windows=count, ms_per_window=ms,
                   error_in_float32_roundings=dict(
                       float32_gram=spread(values32), rounded_float64_gram=spread(rounded),
                       refined_top_block=spread(refined, slice(m - block, m)),
                       refined_smallest=spread(refined, slice(0, 1)), float32_smallest=spread(values32, slice(0, 1)),
                       refined_all=spread(refined)),
                   rank_equal_to_float64=dict(float32_gram=float((rank32 == rank64).double().mean()),
                                              rounded_float64_gram=float((rank_rounded == rank64).double().mean()),
                                              refined=float((rank_refined == rank64).double().mean())),
                   refine_failed=int((refine_info != 0).sum()),
                   rank_max=int(rank64.max()))
        row["unsettled_float32_slack10"] = flagged_by_slack(values32, rank32, rank64, usable, n_volumes, 10.0)
        for slack in (0.01, 0.03, 0.1, 0.3, 1.0):
            row[f"unsettled_refined_slack{slack:g}"] = flagged_by_slack(
                refined, rank_refined, rank64, usable, n_volumes, slack, also=rank_refined >= block - REFINE_GUARD)
        results.append(row)
        print(json.dumps(row, indent=1), flush=True)
        gram32 = gram64 = vectors = took_part = volume = None  # free the device before the next phantom
        solver.release_workspaces()
        torch.cuda.empty_cache()
    return results


def error_in_roundings(values, values64, columns=slice(None)):
    """Per window, the largest error of ``values`` against ``values64`` over ``columns``, in float32 roundings
    of the largest eigenvalue: median, 99th percentile and maximum over the windows."""
    unit = torch.finfo(torch.float32).eps * values64[:, -1:]
    error = ((values.double() - values64).abs() / unit)[:, columns].amax(dim=1).cpu().numpy()
    return dict(median=float(np.median(error)), p99=float(np.percentile(error, 99)), max=float(error.max()))


def flagged_by_slack(values, rank, rank64, usable, n_volumes, slack, also=None):
    """The settling test (``unsettled_ranks`` with ``slack`` roundings, or'ed with ``also``) on ``values``:
    the share of windows it flags, and the share whose rank differs from float64's yet is not flagged (the
    windows a run would get wrong: must be 0)."""
    from mppca_nipype.engine.gpu.pipeline import rounding_uncertainty, unsettled_ranks

    flagged = unsettled_ranks(values, usable, n_volumes, "exp2", rank, rounding_uncertainty(values, slack))
    if also is not None:
        flagged = flagged | also
    return dict(share=float(flagged.double().mean()),
                differ_unflagged=float(((rank != rank64) & ~flagged).double().mean()))


def seed_settling():
    """(q) issue 5: on every window of the seed's problem (voxel demeaning, as the article) and of the same
    phantom with the package's defaults (volume demeaning, 7^3), how far the tridiagonal kernels' float32
    eigenvalues are from float64 (XsyevBatched on the fused float64 Gram), their ranks, and for each slack
    of the settling test the share of windows flagged and the share whose rank differs but is not flagged."""
    from mppca_nipype.engine.gpu import kernels
    from mppca_nipype.engine.gpu.tridiagonal import TridiagonalEigh

    noisy, _ = low_rank_phantom((96, 96, 48), n_volumes=48, rank=5, sigma=4.0, baseline=1000.0, seed=0)
    results = []
    for problem, chosen in (("seed, voxel demeaning, 11^3", SEED_OPTIONS), ("seed phantom, defaults", VOLUME_OPTIONS)):
        data, finite, plan, options = prepare(noisy, chosen)
        n_volumes = data.shape[3]
        geometry = (torch.from_numpy(data.reshape(-1, n_volumes)).cuda(),
                    torch.from_numpy(finite.ravel().astype(np.float32)).cuda(),
                    torch.from_numpy(plan.window_base()).cuda(),
                    torch.from_numpy(plan.voxel_offsets.astype(np.int32)).cuda())
        gram32, took_part, _ = kernels.gram(*geometry, demean=options.demean)
        gram64, _, _ = kernels.gram(*geometry, demean=options.demean, dtype=torch.float64)
        values32 = TridiagonalEigh("cuda").values(gram32)[0].double()
        values64 = BatchedEigh("cuda").values(gram64)[0]
        usable = took_part.to(torch.int64) - int(options.demean == "volume")
        usable_volumes = n_volumes - int(options.demean == "voxel")
        rank32, rank64 = (marchenko_pastur_threshold(v, usable, usable_volumes, options.estimator)[0]
                          for v in (values32, values64))
        row = dict(problem=problem, windows=len(values64), error_in_float32_roundings=dict(
                       all=error_in_roundings(values32, values64),
                       smallest=error_in_roundings(values32, values64, slice(0, 1))),
                   rank_equal_to_float64=float((rank32 == rank64).double().mean()))
        for slack in (10.0, 5.0, 3.0, 2.0, 1.0, 0.5):
            row[f"slack{slack:g}"] = flagged_by_slack(values32, rank32, rank64, usable, usable_volumes, slack)
        results.append(row)
        print(json.dumps(row), flush=True)
    return results


def tridiagonal_warps(count=12_600):
    """(w) issue 5: the tridiagonal kernels on ``count`` seed-like Gram matrices (float32, m = 48, 64, one
    warp a matrix; float64, m = 48, two warps, 1,500 and 437 of them as in a settling pass): values
    (Householder + bisection) with or without the shrinking Householder blocks (and with twice the warps),
    Householder alone (no bisection step), the projector (16-lane launch for ranks <= 16
    and the rest); each checked against float64 XsyevBatched (largest eigenvalue error over the largest
    eigenvalue, largest projector deviation)."""
    from mppca_nipype.engine.gpu import tridiagonal
    from mppca_nipype.engine.gpu.tridiagonal import TridiagonalEigh

    xsyev, rows = BatchedEigh("cuda"), []
    for m, dtype, batch in ((48, torch.float32, count), (64, torch.float32, count), (48, torch.float64, 1500),
                            (48, torch.float64, 437)):
        matrices, n, _ = gram_batch("patches", batch, m)
        values64, info = xsyev.values(matrices.clone())
        voxels = torch.full((batch,), n, dtype=torch.int64, device="cuda")
        rank = marchenko_pastur_threshold(values64, voxels, m, "exp2")[0]
        projector64 = xsyev.projector(rank)
        work = matrices.to(dtype).contiguous()
        own_warps = tridiagonal._warps(m, dtype)
        d, e, v = (torch.empty((batch, m), device="cuda", dtype=dtype) for _ in range(3))

        def best(run):
            return best_on_copies(work, run, repeats=7)

        for shrinking, warps in ((False, own_warps), (True, own_warps), (True, 2 * own_warps)):
            default, tridiagonal.SHRINKING_BLOCKS = tridiagonal.SHRINKING_BLOCKS, shrinking
            try:
                solver = TridiagonalEigh("cuda", warps=warps)
                values_ms, values = best(lambda a: solver.values(a)[0])
                projector_ms, projector = best(lambda _: solver.projector(rank))
                householder_ms, _ = best(lambda a: householder_alone(a, d, e, v, warps))
            finally:
                tridiagonal.SHRINKING_BLOCKS = default
            row = dict(m=m, dtype=str(dtype).replace("torch.", ""), batch=batch, warps=warps,
                       shrinking_blocks=shrinking, values_ms=values_ms,
                       householder_alone_ms=householder_ms,
                       projector_ms=projector_ms,
                       values_err=float(((values.double() - values64).abs().amax(1) / values64[:, -1]).max()),
                       projector_err=float((projector.double() - projector64).abs().amax()))
            rows.append(row)
            print(row, flush=True)
        del matrices, work, projector64
        torch.cuda.empty_cache()
    return rows


def shifts_per_count():
    """(t) issue 5: the tridiagonal kernels on seed-like Gram matrices of 48 x 48, by warps, shifts per
    eigenvalue and Sturm count (``tridiagonal.SHIFTS_PER_COUNT``) and division (IEEE's, or the approximate
    reciprocal: ``tridiagonal.APPROXIMATE_RECIPROCAL``): float32, 12,600 (the first pass); float64, 437 and
    150 (a settling pass's, alone and as the first 150 of a launch sized for 4,200 windows, as the pipeline
    launches it) and 12,600. Values (Householder + bisection), Householder alone, the projector (rank 5);
    each checked against float64 XsyevBatched (largest eigenvalue error over the largest eigenvalue,
    largest projector deviation)."""
    from mppca_nipype.engine.gpu import tridiagonal
    from mppca_nipype.engine.gpu.tridiagonal import TridiagonalEigh

    xsyev, rows, m = BatchedEigh("cuda"), [], 48
    ieee, fast = False, True
    for dtype, batch, launched, variants in (
            (torch.float32, 12_600, 12_600, ((1, 1, ieee), (1, 1, fast))),
            (torch.float64, 437, 437, ((2, 1, ieee), (2, 1, fast), (2, 2, fast), (4, 2, fast))),
            (torch.float64, 150, 150, ((2, 1, ieee), (2, 1, fast), (4, 1, fast), (4, 2, ieee), (4, 2, fast),
                                       (8, 4, fast))),
            (torch.float64, 150, 4_200, ((2, 1, ieee), (2, 1, fast), (4, 2, ieee), (4, 2, fast))),
            (torch.float64, 12_600, 12_600, ((2, 1, ieee), (2, 1, fast)))):
        matrices, n, _ = gram_batch("patches", batch, m)
        values64, _ = xsyev.values(matrices.clone())
        rank = torch.full((launched,), 5, dtype=torch.int32, device="cuda")
        projector64 = xsyev.projector(rank[:batch])
        work = torch.zeros((launched, m, m), device="cuda", dtype=dtype)
        work[:batch] = matrices.to(dtype)
        count = torch.tensor(batch, device="cuda") if launched > batch else None
        d, e, v = (torch.empty((launched, m), device="cuda", dtype=dtype) for _ in range(3))

        def best(run):
            return best_on_copies(work, run, repeats=9)

        householder = {}
        for warps, shifts, approximate in variants:
            if warps not in householder:
                householder[warps], _ = best(lambda a: householder_alone(a, d, e, v, warps, count))
            default, tridiagonal.APPROXIMATE_RECIPROCAL = tridiagonal.APPROXIMATE_RECIPROCAL, approximate
            try:
                solver = TridiagonalEigh("cuda", warps=warps, shifts=shifts)
                values_ms, values = best(lambda a: solver.values(a, count=count)[0])
                projector_ms, projector = best(lambda _: solver.projector(rank))
            finally:
                tridiagonal.APPROXIMATE_RECIPROCAL = default
            row = dict(dtype=str(dtype).replace("torch.", ""), batch=batch, launched=launched, warps=warps,
                       shifts=shifts, approximate_reciprocal=approximate, values_ms=values_ms,
                       householder_alone_ms=householder[warps], projector_ms=projector_ms,
                       values_err=float(((values[:batch].double() - values64).abs().amax(1)
                                         / values64[:, -1]).max()),
                       projector_err=float((projector[:batch].double() - projector64).abs().amax()))
            rows.append(row)
            print(row, flush=True)
        del matrices, work
        torch.cuda.empty_cache()
    return rows


def eigensolver_share(count, m, batch, count64):
    """XsyevBatched alone on ``count`` random m x m matrices in float32 and ``count64`` in float64, in
    batches of ``batch``: the eigensolver's part of a pipeline run (ms)."""
    solver = BatchedEigh("cuda")
    total = 0.0
    for dtype, n in ((torch.float32, count), (torch.float64, count64)):
        size = min(batch, n)
        if not size:
            continue
        a = torch.randn(size, m, m + 8, device="cuda", dtype=dtype)
        matrices = a @ a.mT
        del a
        solver(matrices.clone())
        torch.cuda.synchronize()
        started = time.perf_counter()
        for start in range(0, n, size):
            solver(matrices.clone()[: min(size, n - start)].contiguous())
        torch.cuda.synchronize()
        total += time.perf_counter() - started
        del matrices
        solver.release_workspaces()
    return total * 1e3


def gram_kernel_alone(noisy, options):
    """The fused Gram kernel alone on every window of the plan, per demeaning (ms, best of 10)."""
    from mppca_nipype.engine.gpu import kernels

    data, finite, plan, _ = prepare(noisy, options)
    volume = torch.from_numpy(data.reshape(-1, data.shape[3])).cuda()
    finite = torch.from_numpy(finite.ravel().astype(np.float32)).cuda()
    base = torch.from_numpy(plan.window_base()).cuda()
    offsets = torch.from_numpy(plan.voxel_offsets.astype(np.int32)).cuda()
    times = {}
    for demean in ("voxel", "volume"):
        seconds, _, _ = best_of(lambda: kernels.gram(volume, finite, base, offsets, demean=demean), repeats=10)
        times[demean] = seconds * 1e3
    return dict(n_windows=plan.n_windows, patch=plan.patch_size, **times)


def seed_for_kernels():
    """The seed's problem as parts g and x take it: the phantom's truth, the data, finite flags, plan and
    options, the GPU's float64 run (denoised series and rank map: the reference), the series, finite flags,
    window corners and voxel offsets on the device, and the fused kernel's float64 Gram."""
    from mppca_nipype.engine.gpu import kernels

    noisy, truth = low_rank_phantom((96, 96, 48), n_volumes=48, rank=5, sigma=4.0, baseline=1000.0, seed=0)
    data, finite, plan, options = prepare(noisy, SEED_OPTIONS)
    reference, reference_rank = finish(denoise_gpu(data, finite, plan, options, precision="float64"), data.shape)
    volume = torch.from_numpy(data.reshape(-1, data.shape[3])).cuda()
    finite_rows = torch.from_numpy(finite.ravel().astype(np.float32)).cuda()
    base = torch.from_numpy(plan.window_base()).cuda()
    offsets = torch.from_numpy(plan.voxel_offsets.astype(np.int32)).cuda()
    gram64, _, _ = kernels.gram(volume, finite_rows, base, offsets, demean="voxel", dtype=torch.float64)
    return (truth, data, finite, plan, options, reference, reference_rank, volume, finite_rows, base, offsets,
            gram64)


def dot_precisions(rows):
    """(g) issue 5: the fused kernels' tile products as float32 FMAs ("ieee") or three TF32 tensor-core
    products ("tf32x3"), on the seed's problem: the Gram kernel and the reconstruction kernel alone (best of
    10), the Gram's error against float64, and ``denoise_gpu`` end to end with each for both kernels and
    with the defaults (``kernels.DOT_PRECISION``; best of 5), checked against the GPU's float64 run (fused
    float64 Gram + XsyevBatched, as exact as the CPU path)."""
    from mppca_nipype.engine.gpu import kernels

    (truth, data, finite, plan, options, reference, reference_rank, volume, finite_rows, base, offsets,
     gram64) = seed_for_kernels()
    n, m = len(base), data.shape[3]
    projector = torch.eye(m, device="cuda").expand(n, m, m).contiguous()
    ones = torch.ones(n, device="cuda")
    sums = [torch.zeros((volume.shape[0], m), device="cuda")] + [torch.zeros(volume.shape[0], device="cuda")
                                                                    for _ in range(3)]
    result, defaults = {}, dict(kernels.DOT_PRECISION)
    for precision in kernels.DOT_PRECISIONS:
        gram_seconds, (gram32, _, _), _ = best_of(lambda: kernels.gram(
            volume, finite_rows, base, offsets, demean="voxel", dot_precision=precision), repeats=10)
        reconstruct_seconds, _, _ = best_of(lambda: kernels.reconstruct_accumulate(
            volume, finite_rows, base, offsets, projector, ones, ones, ones, *sums, demean="voxel",
            dot_precision=precision), repeats=10)
        gram_error = float(((gram32.double() - gram64).norm(dim=(1, 2)) / gram64.norm(dim=(1, 2))).max())
        result[precision] = dict(gram_ms=gram_seconds * 1e3, reconstruct_ms=reconstruct_seconds * 1e3,
                                 gram_rel_error_max=gram_error)
    for name, choice in (("ieee", dict(gram="ieee", reconstruct="ieee")),
                         ("tf32x3", dict(gram="tf32x3", reconstruct="tf32x3")), ("defaults", defaults)):
        kernels.DOT_PRECISION = choice
        try:
            seconds, out, peak = best_of(lambda: denoise_gpu(data, finite, plan, options))
        finally:
            kernels.DOT_PRECISION = defaults
        denoised, rank = finish(out, data.shape)
        result.setdefault(name, {}).update(choice=choice, end_to_end_ms=seconds * 1e3,
                                           n_settled=out.info["n_settled_in_float64"],
                                           rank_map_equal=float(np.mean(np.abs(rank - reference_rank) < 1e-3)))
        rows.append(dict(problem="seed", variant=f"ours, tile products {choice}", ms=seconds * 1e3,
                         **errors(denoised, reference, truth), peak_gib=peak / 2**30))
        print(name, result[name], rows[-1], flush=True)
    return result


def box_sums(rows):
    """(x) issue 5: the box sums (``boxsums``: the Gram and reconstruction of a whole grid of windows by
    separable sums of each voxel's outer products) against the fused kernels on the seed's problem: each
    alone (best of 10) with each tile-product precision, the Gram's error against the fused float64 Gram,
    the accumulated sums against the fused kernel's for the same projectors; then ``denoise_gpu`` end to end
    (auto = box sums vs path "fused"), checked against the GPU's float64 run."""
    from mppca_nipype.engine.gpu import boxsums, kernels
    from mppca_nipype.engine.gpu.pipeline import plan_slabs

    (truth, data, finite, plan, options, reference, reference_rank, volume, finite_rows, base, offsets,
     gram64) = seed_for_kernels()
    n, m = len(base), data.shape[3]
    generator = torch.Generator(device="cuda").manual_seed(0)
    projector = torch.randn((n, m, m), device="cuda", generator=generator) / m
    projector = projector + projector.transpose(1, 2)  # symmetric, as projectors are
    weight = torch.rand(n, device="cuda", generator=generator) + 0.5
    fused_sums = [torch.zeros((volume.shape[0], m), device="cuda")] + [torch.zeros(volume.shape[0], device="cuda")
                                                                          for _ in range(3)]
    kernels.reconstruct_accumulate(volume, finite_rows, base, offsets, projector, weight, weight, weight,
                                   *fused_sums, demean="voxel")
    result = dict(fused=dict(
        gram_ms=best_of(lambda: kernels.gram(volume, finite_rows, base, offsets, demean="voxel"), repeats=10)[0] * 1e3,
        reconstruct_ms=best_of(lambda: kernels.reconstruct_accumulate(
            volume, finite_rows, base, offsets, projector, weight, weight, weight,
            *[torch.zeros_like(x) for x in fused_sums], demean="voxel"), repeats=10)[0] * 1e3))
    slab = plan_slabs(plan, data.shape[0])[0]
    for gram_dot, apply in [(gram_dot, apply) for gram_dot in kernels.DOT_PRECISIONS
                            for apply in kernels.DOT_PRECISIONS]:
        box = boxsums.BoxSums(plan, slab, m, volume.device, dict(gram=gram_dot, apply=apply))
        gram_seconds, gram, _ = best_of(lambda: box.gram(volume), repeats=10)
        box.add_windows(slice(0, n), projector, weight, weight, weight)
        sums = [torch.zeros_like(x) for x in fused_sums]
        box.accumulate(volume, *sums)
        accumulate_seconds, _, peak = best_of(lambda: box.accumulate(volume,
                                                                     *[torch.zeros_like(x) for x in fused_sums]),
                                              repeats=10)
        gram_error = float(((gram.double() - gram64).norm(dim=(1, 2)) / gram64.norm(dim=(1, 2))).max())
        name = f"gram {gram_dot}, apply {apply}"
        result[name] = dict(gram_ms=gram_seconds * 1e3, accumulate_ms=accumulate_seconds * 1e3,
                            gram_rel_error_max=gram_error, peak_gib=peak / 2**30,
                            sums_rel_to_fused=[float((a - b).norm() / b.norm()) for a, b in zip(sums, fused_sums)])
        print(name, result[name], flush=True)
    print("fused", result["fused"], flush=True)
    for name, path in (("box sums (auto)", "auto"), ("fused kernels", "fused")):
        seconds, out, peak = best_of(lambda: denoise_gpu(data, finite, plan, options, path=path), repeats=7)
        denoised, rank = finish(out, data.shape)
        result[f"end to end, {name}"] = dict(ms=seconds * 1e3, gram_path=out.info["gram_path"],
                                             n_settled=out.info["n_settled_in_float64"],
                                             rank_map_equal=float(np.mean(np.abs(rank - reference_rank) < 1e-3)))
        rows.append(dict(problem="seed", variant=f"ours, {name}", ms=seconds * 1e3,
                         **errors(denoised, reference, truth), peak_gib=peak / 2**30))
        print(rows[-1], result[f"end to end, {name}"], flush=True)
    return result


def host_pieces():
    """(h) issue 5: the host side of ``denoise_gpu`` on the seed's problem, piece by piece (ms, best of 5):
    page-locking the caller's (V, T) array in place and undoing it (the undoing alone too), the upload from
    page-locked and from pageable memory; staging through page-locked buffers (8 threads copying 4 MB
    chunks with NumPy, each chunk's copy queued when staged: the seventh session's try; part u and
    ``upload.StagedSeries`` do better); allocating the pinned outputs, the download into them; beside the
    whole backend."""
    from concurrent.futures import ThreadPoolExecutor

    noisy, _ = low_rank_phantom((96, 96, 48), n_volumes=48, rank=5, sigma=4.0, baseline=1000.0, seed=0)
    data, finite, plan, options = prepare(noisy, SEED_OPTIONS)
    host = np.ascontiguousarray(data.reshape(-1, data.shape[3]))
    on_device = torch.from_numpy(host).cuda()

    def timed(run):
        return best_of(run)[0] * 1e3

    cudart = torch.cuda.cudart()

    def pin(address, nbytes):
        code = cudart.cudaHostRegister(address, nbytes, 0)
        assert int(getattr(code, "value", code)) == 0

    def pin_and_unpin(unpin=True):
        pin(host.ctypes.data, host.nbytes)
        if unpin:
            cudart.cudaHostUnregister(host.ctypes.data)

    def upload_pinned():
        pin(host.ctypes.data, host.nbytes)
        torch.from_numpy(host).to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        cudart.cudaHostUnregister(host.ctypes.data)

    def staged_upload(threads=8, chunk=4 << 20):
        """ms until the series, staged through page-locked buffers by ``threads`` threads, is on the device"""
        staging = [torch.empty(chunk // 4, dtype=torch.float32, pin_memory=True) for _ in range(threads)]
        events = [torch.cuda.Event() for _ in range(threads)]
        out = torch.empty(host.shape, dtype=torch.float32, device="cuda")
        flat, flat_out, stream = host.reshape(-1), out.reshape(-1), torch.cuda.Stream()
        starts = range(0, flat.size, chunk // 4)

        def stage(k):
            a, b = starts[k], min(starts[k] + chunk // 4, flat.size)
            buffer, done = staging[k % threads], events[k % threads]
            done.synchronize()
            np.copyto(buffer[:b - a].numpy(), flat[a:b])
            with torch.cuda.stream(stream):
                flat_out[a:b].copy_(buffer[:b - a], non_blocking=True)
                done.record(stream)

        best = float("inf")
        with ThreadPoolExecutor(threads) as pool:
            for _ in range(6):
                torch.cuda.synchronize()
                started = time.perf_counter()
                for k0 in range(0, len(starts), threads):  # a buffer is reused only by the next round
                    list(pool.map(stage, range(k0, min(k0 + threads, len(starts)))))
                stream.synchronize()
                best = min(best, time.perf_counter() - started)
        return best * 1e3

    def unpin_alone():
        best = float("inf")
        for _ in range(5):
            pin_and_unpin(unpin=False)
            started = time.perf_counter()
            cudart.cudaHostUnregister(host.ctypes.data)
            best = min(best, time.perf_counter() - started)
        return best * 1e3

    pieces = dict(
        mb=host.nbytes / 2**20,
        pin_and_unpin_ms=timed(pin_and_unpin),
        unpin_alone_ms=unpin_alone(),
        upload_with_pinning_ms=timed(upload_pinned),
        staged_upload_ms=staged_upload(),
        upload_pageable_ms=timed(lambda: torch.from_numpy(host).to("cuda")),
        pinned_outputs_ms=timed(lambda: torch.empty(host.shape, dtype=torch.float32, pin_memory=True)),
        download_pinned_ms=timed(lambda: torch.empty(host.shape, dtype=torch.float32, pin_memory=True)
                                 .copy_(on_device, non_blocking=True)),
        download_pageable_ms=timed(lambda: on_device.cpu()),
        denoise_gpu_ms=timed(lambda: denoise_gpu(data, finite, plan, options)),
        plan_ms=timed(lambda: plan_patches(data.shape[:3], options.extent, options.stride,
                                           np.ones(data.shape[:3], bool), finite)),
    )
    print(pieces, flush=True)
    return pieces


def host_profile():
    """(o) the caller's thread in the seed's run (ours, ``auto``): ``cProfile`` over 20 runs after a warm-up,
    by own and by cumulative time (a CUDA call that waits shows as its caller's own time)."""
    import cProfile
    import io
    import pstats

    noisy, _ = low_rank_phantom((96, 96, 48), n_volumes=48, rank=5, sigma=4.0, baseline=1000.0, seed=0)
    data, finite, plan, options = prepare(noisy, SEED_OPTIONS)
    best_of(lambda: denoise_gpu(data, finite, plan, options))
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(20):
        denoise_gpu(data, finite, plan, options)
    profiler.disable()
    report = {}
    for key in ("tottime", "cumtime"):
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats(key).print_stats(45)
        report[key] = text.getvalue()
    print(report["tottime"][:7000], flush=True)
    return report


def driver_contention():
    """(u) issue 5: what the driver serialises on the H200's host, for the upload's design (ms, best of 5):
    the host's memory copy of the seed's 81 MB into a page-locked buffer by 1-16 threads (no CUDA); a
    staged upload with free-running threads (each its own pair of page-locked chunks and stream); whether
    ``cudaHostRegister`` / ``cudaHostUnregister`` of the 81 MB wait for a kernel that is still running (a
    ~10 ms ``torch.cuda._sleep``); and what 50 tiny launches, 20 small page-locked table copies
    (``upload.to_device``) and ``mem_get_info`` cost on one thread while another locks the 81 MB."""
    from concurrent.futures import ThreadPoolExecutor

    from mppca_nipype.engine.gpu.upload import to_device

    noisy, _ = low_rank_phantom((96, 96, 48), n_volumes=48, rank=5, sigma=4.0, baseline=1000.0, seed=0)
    host = np.ascontiguousarray(noisy.reshape(-1, noisy.shape[3]), dtype=np.float32)
    flat = host.reshape(-1)
    cudart = torch.cuda.cudart()
    pinned = torch.empty(flat.size, dtype=torch.float32, pin_memory=True)
    pinned.fill_(0.0)
    pinned_flat = pinned.numpy()
    result = dict(mb=host.nbytes / 2**20)

    def best(run, repeats=5):
        times = []
        for _ in range(repeats):
            torch.cuda.synchronize()
            started = time.perf_counter()
            run()
            times.append(time.perf_counter() - started)
        return round(min(times) * 1e3, 3)

    def copy_by_threads(threads, pool):
        bounds = np.linspace(0, flat.size, threads + 1).astype(int)
        list(pool.map(lambda k: np.copyto(pinned_flat[bounds[k]:bounds[k + 1]], flat[bounds[k]:bounds[k + 1]]),
                      range(threads)))

    result["host_copy_ms_by_threads"] = {}
    for threads in (1, 2, 4, 8, 16):
        with ThreadPoolExecutor(threads) as pool:
            result["host_copy_ms_by_threads"][threads] = best(lambda: copy_by_threads(threads, pool))
    print("(u) host copy", result["host_copy_ms_by_threads"], flush=True)

    out = torch.empty(flat.size, dtype=torch.float32, device="cuda")

    def staged(threads, chunk_mb, pool, rings):
        chunk = int(chunk_mb * 2**20) // 4
        starts = list(range(0, flat.size, chunk))

        def worker(k):
            buffers, events, stream = rings[k]
            for i, a in enumerate(starts[k::threads]):
                b = min(a + chunk, flat.size)
                events[i % 2].synchronize()
                np.copyto(buffers[i % 2][:b - a].numpy(), flat[a:b])
                with torch.cuda.stream(stream):
                    out[a:b].copy_(buffers[i % 2][:b - a], non_blocking=True)
                    events[i % 2].record(stream)
            stream.synchronize()

        list(pool.map(worker, range(threads)))

    result["staged_upload_ms"] = {}
    for threads in (4, 8, 16):
        for chunk_mb in (1, 4):
            rings = [([torch.empty(int(chunk_mb * 2**20) // 4, dtype=torch.float32, pin_memory=True).fill_(0)
                       for _ in range(2)], [torch.cuda.Event(), torch.cuda.Event()], torch.cuda.Stream())
                     for _ in range(threads)]
            with ThreadPoolExecutor(threads) as pool:
                ms = best(lambda: staged(threads, chunk_mb, pool, rings))
            assert torch.equal(out.cpu(), torch.from_numpy(flat))
            result["staged_upload_ms"][f"{threads} threads, {chunk_mb} MB"] = ms
    print("(u) staged", result["staged_upload_ms"], flush=True)

    def register():
        code = cudart.cudaHostRegister(host.ctypes.data, host.nbytes, 0)
        assert int(getattr(code, "value", code)) == 0

    def unregister():
        cudart.cudaHostUnregister(host.ctypes.data)

    cycles = int(torch.cuda.get_device_properties(0).clock_rate * 1e3 * 0.010) if hasattr(
        torch.cuda.get_device_properties(0), "clock_rate") else 20_000_000

    def while_busy(step):
        """ms of ``step`` right after a ~10 ms kernel is queued, and ms the kernel had left when it returned"""
        torch.cuda.synchronize()
        done = torch.cuda.Event()
        torch.cuda._sleep(cycles)
        done.record()
        started = time.perf_counter()
        step()
        took = time.perf_counter() - started
        kernel_running = not done.query()
        done.synchronize()
        return round(took * 1e3, 3), kernel_running

    idle_register = best(lambda: (register(), unregister()), repeats=3)
    busy = {}
    busy["register while a 10 ms kernel runs"] = while_busy(register)
    busy["unregister while a 10 ms kernel runs"] = while_busy(unregister)
    busy["sleep kernel alone (host ms to queue)"] = while_busy(lambda: None)
    result["register_and_unregister_idle_ms"] = idle_register
    result["while_busy_ms_and_still_running"] = busy
    print("(u) busy", idle_register, busy, flush=True)

    tiny = torch.zeros(16, device="cuda")
    tables = [np.arange(k * 100, (k + 1) * 100 + 50, dtype=np.int32) for k in range(20)]
    probes = dict(launches=lambda: [tiny.add_(1.0) for _ in range(50)],
                  tables=lambda: [to_device(t, "cuda") for t in tables],
                  mem_get_info=lambda: [torch.cuda.mem_get_info() for _ in range(5)],
                  events=lambda: [torch.cuda.Event().record() for _ in range(50)])
    contention = {}
    with ThreadPoolExecutor(1) as pool:
        for name, probe in probes.items():
            alone = best(probe)
            beside = []
            for _ in range(5):
                torch.cuda.synchronize()
                locking = pool.submit(register)
                time.sleep(0.0002)
                started = time.perf_counter()
                probe()
                beside.append((time.perf_counter() - started) * 1e3)
                locking.result()
                unregister()
            contention[name] = dict(alone_ms=alone, beside_locking_ms=round(min(beside), 3))
    result["beside_locking"] = contention
    print("(u) beside locking", contention, flush=True)
    return result


def volume_demeaning(rows):
    """(v): the default-style call with demean "volume" vs "voxel", seed problem and DWI-like crop; the
    fused Gram kernel alone for both; returns the kernel times."""
    seed, seed_truth = low_rank_phantom((96, 96, 48), n_volumes=48, rank=5, sigma=4.0, baseline=1000.0, seed=0)
    kernel_ms = {f"extent {options['extent']}, stride {options['stride']}": gram_kernel_alone(seed, options)
                 for options in (VOLUME_OPTIONS, SEED_OPTIONS)}
    print("(v) fused Gram kernel alone (ms):", kernel_ms, flush=True)
    dwi, dwi_truth, _, _ = dwi_phantom((40, 40, 24), n_volumes=300, sigma=20.0, seed=2)
    defaults = f"defaults (extent {DEFAULTS['extent']}, stride {DEFAULTS['stride']})"
    for problem, noisy, truth, repeats in ((f"seed 96x96x48x48, {defaults}", seed, seed_truth, 5),
                                           (f"DWI-like crop 40x40x24x300, {defaults}", dwi, dwi_truth, 3)):
        data, finite, plan, options = prepare(noisy, VOLUME_OPTIONS)
        print(f"(v) {problem}: {plan.n_windows} windows of {plan.patch_size} x {data.shape[3]}", flush=True)
        started = time.perf_counter()
        reference, reference_rank = finish(denoise_cpu(data, finite, plan, options), data.shape)
        rows.append(dict(problem=problem, variant=f"volume: our CPU path, {os.cpu_count()} processes",
                         ms=(time.perf_counter() - started) * 1e3, **errors(reference, reference, truth),
                         peak_gib=0.0, n_windows=plan.n_windows))
        for demean, settle in (("volume", False), ("volume", True), ("voxel", True)):
            options = resolve_options(data.shape, **dict(VOLUME_OPTIONS, demean=demean))
            seconds, sums, peak = best_of(lambda: denoise_gpu(data, finite, plan, options, settle=settle),
                                          repeats=repeats)
            denoised, rank = finish(sums, data.shape)
            row = dict(problem=problem, variant=f"{demean}: denoise_gpu ({sums.info['gram_path']} Gram"
                       + (", float32 alone)" if not settle else
                          f", {sums.info['n_settled_in_float64']} windows settled in float64)"),
                       ms=seconds * 1e3, peak_gib=peak / 2**30, batch=sums.info["batch"],
                       gram_precision=sums.info["gram_precision"], rel_to_float64=None, rmse_to_truth=None,
                       n_settled_in_float64=sums.info["n_settled_in_float64"])
            if demean == "volume":
                row.update(errors(denoised, reference, truth),
                           rank_equal=float(np.mean(np.abs(rank - reference_rank) < 1e-3)))
            rows.append(row)
            print(rows[-1], flush=True)
            if not settle:
                continue
            seconds, result, peak = best_of(lambda: denoise(noisy, device="cuda", demean=demean), repeats=repeats)
            row = dict(problem=problem, variant=f'{demean}: denoise(noisy, device="cuda", demean="{demean}"), '
                       "whole call", ms=seconds * 1e3, peak_gib=peak / 2**30,
                       backend_ms=result.info["seconds_engine"] * 1e3, rel_to_float64=None, rmse_to_truth=None)
            if demean == "volume":
                row.update(errors(result.denoised, reference, truth))
            rows.append(row)
            print(rows[-1], flush=True)
    # the seed's own options (11^3, stride 3, voxel): the backend and the whole call, to set against (a)
    data, finite, plan, options = prepare(seed, SEED_OPTIONS)
    seconds, sums, peak = best_of(lambda: denoise_gpu(data, finite, plan, options))
    rows.append(dict(problem="seed", variant=f"ours: denoise_gpu, {sums.info['n_settled_in_float64']} windows "
                     "settled in float64", ms=seconds * 1e3, peak_gib=peak / 2**30, rel_to_float64=None,
                     rmse_to_truth=None))
    seconds, result, peak = best_of(lambda: denoise(seed, device="cuda", **SEED_OPTIONS))
    rows.append(dict(problem="seed", variant="ours: denoise(device='cuda'), whole call", ms=seconds * 1e3,
                     peak_gib=peak / 2**30, backend_ms=result.info["seconds_engine"] * 1e3, rel_to_float64=None,
                     rmse_to_truth=None))
    print(rows[-2:], flush=True)
    return kernel_ms


_CPU_RUN = """
import json, os, sys, time
if sys.argv[2] == "cuda":
    import torch
    torch.cuda.init()
import mppca_nipype
from mppca_nipype.engine.cpu import _process_context
from mppca_nipype.phantoms import low_rank_phantom
noisy = low_rank_phantom((64, 64, 40), 48)[0]
k = int(sys.argv[1])
def usage():
    try:
        with open("/sys/fs/cgroup/cpu.stat") as f:
            return {a: int(b) for a, b in (line.split() for line in f)}
    except OSError:
        return {}
before, times, started = usage(), os.times(), time.perf_counter()
result = mppca_nipype.denoise(noisy, device="cpu", nprocs=k)
wall, after, times_after = time.perf_counter() - started, usage(), os.times()
delta = {key: after[key] - before.get(key, 0) for key in after}
print(json.dumps(dict(nprocs=result.info["nprocs"], wall_s=wall, start_method=_process_context().get_start_method(),
                      eigensolver=result.info["eigensolver"], n_windows=result.info["n_windows"],
                      parent_cpu_s=times_after.user - times.user + times_after.system - times.system,
                      cgroup_cpu_s=delta.get("usage_usec", 0) / 1e6, nr_throttled=delta.get("nr_throttled"),
                      throttled_s=delta.get("throttled_usec", 0) / 1e6)))
"""

_CONTROL_RUN = """
import json, multiprocessing, sys, time
import numpy as np
from threadpoolctl import threadpool_limits
def work(_):
    with threadpool_limits(1):
        a = np.random.default_rng(0).standard_normal((400, 48, 60))
        g = a @ a.transpose(0, 2, 1)
        started = time.perf_counter()
        for _ in range(12):
            np.linalg.eigh(g)
        return time.perf_counter() - started
k = int(sys.argv[1])
with multiprocessing.get_context("fork").Pool(k) as pool:
    started = time.perf_counter()
    each = pool.map(work, range(k))
    print(json.dumps(dict(processes=k, wall_s=time.perf_counter() - started, per_process_s=max(each))))
"""


def cpu_scaling():
    """(s): why the CPU path did (not) scale here: the machine's quota, or our code."""
    def read(path):
        try:
            with open(path) as f:
                return f.read().strip()
        except OSError:
            return None

    machine = dict(nproc=subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip(),
                   cpu_count=os.cpu_count(), affinity=len(os.sched_getaffinity(0)),
                   cgroup_cpu_max=read("/sys/fs/cgroup/cpu.max"),
                   cgroup_cpuset=read("/sys/fs/cgroup/cpuset.cpus.effective"), load_average=os.getloadavg())
    print("(s) machine:", machine, flush=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    runs, control = [], []
    for k, context in ((1, "plain"), (4, "plain"), (16, "plain"), (16, "cuda")):
        child = subprocess.run(["python3", "-c", _CPU_RUN, str(k), context], capture_output=True, text=True,
                               env=env, timeout=300)
        line = child.stdout.strip().splitlines()[-1] if child.stdout.strip() else child.stderr[-500:]
        runs.append(dict(context=context, **json.loads(line)) if line.startswith("{") else dict(k=k, error=line))
        print("(s) ours:", runs[-1], flush=True)
    for k in (1, 4, 16):
        child = subprocess.run(["python3", "-c", _CONTROL_RUN, str(k)], capture_output=True, text=True,
                               env=env, timeout=300)
        line = child.stdout.strip().splitlines()[-1] if child.stdout.strip() else child.stderr[-500:]
        control.append(json.loads(line) if line.startswith("{") else dict(k=k, error=line))
        print("(s) control:", control[-1], flush=True)
    return dict(machine=machine, ours=runs, control=control)


def scaling_table(scaling):
    lines = ["| CPU path, 64x64x40x48 defaults | processes | wall (s) | cgroup CPU (s) | throttled (s) |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for r in scaling["ours"]:
        if "error" in r:
            lines.append(f"| ours | {r.get('k')} | error: {r['error'].strip().splitlines()[-1][:80]} | | |")
            continue
        lines.append(f"| ours ({r['start_method']}{', CUDA initialised' if r['context'] == 'cuda' else ''}) | "
                     f"{r['nprocs']} | {r['wall_s']:.2f} | {r['cgroup_cpu_s']:.1f} | {r['throttled_s']:.2f} |")
    for r in scaling["control"]:
        if "error" not in r:
            lines.append(f"| control: same NumPy work per process | {r['processes']} | {r['wall_s']:.2f} | | |")
    return "\n".join(lines)


def table(rows):
    lines = ["| problem | variant | time (ms) | rel. to float64 | RMSE to truth | peak GPU (GiB) |",
             "| --- | --- | ---: | ---: | ---: | ---: |"]
    for r in rows:
        rel = "" if r.get("rel_to_float64") is None else f"{r['rel_to_float64']:.1e}"
        rmse = "" if r.get("rmse_to_truth") is None else f"{r['rmse_to_truth']:.3f}"
        lines.append(f"| {r['problem']} | {r['variant']} | {r['ms']:.1f} | {rel} | {rmse} | {r['peak_gib']:.2f} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--full", action="store_true", help="(c) at the issue's full sizes (minutes)")
    parser.add_argument("--skip-torch-eigh", action="store_true", help="leave out the 10-second step")
    parser.add_argument("--only", default="abcdev",
                        help="which parts to run: any of a, b, c, e, v, s, 5, k, p, r, w, t, q, g, h, u, o, x")
    parser.add_argument("--k-variants", default="",
                        help="(k) only the variants whose names contain one of these comma-separated words")
    parser.add_argument("--k-blocks", type=int, default=3, help="(k) interleaved blocks of best-of-7 runs")
    parser.add_argument("--no-cpu", action="store_true",
                        help="(c) without our CPU path (the GPU's float64 run is the reference)")
    args = parser.parse_args()
    reason = usable()
    if reason is not None:
        raise SystemExit(f"the GPU engine cannot run here: {reason}")
    report = dict(rows=[])
    if "s" in args.only:  # first, before this process touches the GPU
        report["cpu_scaling"] = cpu_scaling()
    report["hardware"] = hardware()
    print(report["hardware"], flush=True)
    rows = report["rows"]
    os.makedirs(args.out, exist_ok=True)

    def part(letter, run, key=None):
        """Run one part; a failure is reported and the others still run; the JSON is rewritten after each."""
        if letter not in args.only:
            return
        try:
            result = run()
            if key:
                report[key] = result
        except Exception:
            report.setdefault("errors", {})[letter] = traceback.format_exc()
            print(f"part {letter} failed:", report["errors"][letter], flush=True)
        with open(os.path.join(args.out, "gpu_suite.json"), "w") as f:
            json.dump(report, f, indent=1)

    part("e", eigensolver_alone, "xsyev_batched_alone_ms")
    part("e", eigensolvers_on_large_matrices, "eigensolver_ms_per_matrix")
    part("5", eigen_step, "eigen_step")
    part("x", lambda: box_sums(rows), "box_sums")
    part("k", lambda: seed_quick(rows, args.k_blocks, [word for word in args.k_variants.split(",") if word]),
         "seed_quick")
    part("p", lambda: profile_seed(args.out), "profile_seed")
    part("a", lambda: seed_ladder(rows, args.skip_torch_eigh))
    part("b", lambda: dwidenoise_mode(rows))
    part("w", tridiagonal_warps, "tridiagonal_warps")
    part("t", shifts_per_count, "shifts_per_count")
    part("q", seed_settling, "seed_settling")
    part("g", lambda: dot_precisions(rows), "dot_precisions")
    part("h", host_pieces, "host_pieces")
    part("u", driver_contention, "driver_contention")
    part("o", host_profile, "host_profile")
    part("r", lambda: long_series_refinement(args.full), "long_series_refinement")
    part("c", lambda: defaults(rows, args.full, cpu=not args.no_cpu))
    part("v", lambda: volume_demeaning(rows), "gram_kernel_ms")
    if "cpu_scaling" in report:
        print(report["cpu_scaling"]["machine"])
        print(scaling_table(report["cpu_scaling"]))
    print(table(rows))


if __name__ == "__main__":
    main()
