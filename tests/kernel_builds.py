"""Compile every Triton kernel variant the GPU engine launches for NVIDIA GPUs, on a machine without one.

    python tests/kernel_builds.py [CAPABILITY ...]      (default: 80 90)

The launchers (``gram.gram``, ``TridiagonalEigh.values``, ...) run on CPU tensors with Triton's launch
replaced by a recorder; each recorded launch (kernel, arguments, compile-time constants, warps) is then
compiled by Triton's own compiler (to PTX and, with the ptxas Triton ships, to a cubin) for each capability.
The interpreter, which runs the kernels' arithmetic in CI, accepts programs the compiler refuses; this is
the check that the compiled path still builds. Must run where TRITON_INTERPRET is unset (the interpreter
replaces the kernels when triton is imported). Prints one line per build; exits 1 if any fails.
"""

from __future__ import annotations

import os
import sys
import traceback

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

POINTER_TYPES = {torch.float32: "*fp32", torch.float64: "*fp64", torch.int8: "*i8", torch.int32: "*i32",
                 torch.int64: "*i64", torch.bool: "*i1"}


def recorded_launches(call):
    """The launches ``call()`` makes, as (kernel, arguments by name, launch options), none of them run."""
    launches = []
    original = JITFunction.run

    def record(self, *args, grid, warmup, **kwargs):
        values = dict(zip(self.arg_names, args))
        values.update({name: value for name, value in kwargs.items() if name in self.arg_names})
        options = {name: value for name, value in kwargs.items() if name not in self.arg_names}
        launches.append((self, values, options))

    JITFunction.run = record
    try:
        call()
    finally:
        JITFunction.run = original
    return launches


def variant(kernel, values):
    """The signature and compile-time constants Triton specialises ``kernel`` on for these arguments."""
    signature, constants = {}, {}
    for param in kernel.params:
        value = values[param.name]
        if param.is_constexpr:
            signature[param.name], constants[param.name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[param.name] = POINTER_TYPES[value.dtype]
        else:
            signature[param.name] = "i64" if abs(int(value)) >= 2**31 else "i32"
    return signature, constants


def build(kernel, values, options, capability):
    """Compile one recorded launch for ``capability`` (e.g. 90)."""
    signature, constants = variant(kernel, values)
    source = ASTSource(fn=kernel, signature=signature, constexprs=constants)
    return triton.compile(source, target=GPUTarget("cuda", capability, 32), options=options)


def cases():
    """(name, call) for each kernel variant the pipeline launches: every demeaning and Gram precision of the
    fused kernels, the reconstruction with and without a weight per patch voxel; the tridiagonal kernels in
    float32 and float64, with and without the rank-one term, at m = 48 (a 16-lane projector launch and a full
    one) and 128; the threshold kernel for each estimator, with and without the settling test; the box sums'
    kernels; the float64 Gram and tridiagonal kernels with a count (the settling pass chosen on the device) and
    the reconstruction reading its float64 projectors; the division of the sums by their weights; the choice
    of the windows a settling pass redoes."""
    from mppca_nipype.engine.estimators import ESTIMATORS
    from mppca_nipype.engine.gpu import boxsums, gram, reconstruction, settling, sums as slab_sums
    from mppca_nipype.engine.gpu.plan import plan_slabs
    from mppca_nipype.engine.gpu.threshold import threshold_on_device
    from mppca_nipype.engine.gpu.tridiagonal import TridiagonalEigh
    from mppca_nipype.engine.patches import plan_patches

    n_rows, n_voxels, n_volumes, batch = 4000, 343, 48, 8
    volume, finite = torch.zeros((n_rows, n_volumes)), torch.ones(n_rows)
    base = torch.zeros(batch, dtype=torch.int64)
    offsets = torch.arange(n_voxels, dtype=torch.int32)
    sums = (torch.zeros((n_rows, n_volumes)), torch.zeros(n_rows), torch.zeros(n_rows), torch.zeros(n_rows))
    patch = [torch.ones(batch) for _ in range(3)]
    projector = torch.zeros((batch, n_volumes, n_volumes))
    mean = torch.zeros((batch, n_volumes))
    for demean in ("none", "voxel", "volume"):
        volume_mean = mean if demean == "volume" else None
        for dtype in (torch.float32, torch.float64):
            yield (f"gram {demean} {str(dtype)[6:]}",
                   lambda d=demean, t=dtype: gram.gram(volume, finite, base, offsets, demean=d, dtype=t))
        yield (f"gram {demean} float64 counted",  # the settling pass chosen on the device
               lambda d=demean: gram.gram(volume, finite, base, offsets, demean=d, dtype=torch.float64,
                                          count=torch.tensor(3)))
        for precision in (torch.float32, torch.float64):  # float64: a settling pass's projectors
            yield (f"reconstruct_accumulate {demean} {str(precision)[6:]} projector",
                   lambda d=demean, v=volume_mean, p=precision: reconstruction.reconstruct_accumulate(
                       volume, finite, base, offsets, projector.to(p), *patch, *sums, demean=d, volume_mean=v))
        yield (f"reconstruct_accumulate {demean} with a weight per patch voxel",  # the gaussian aggregation
               lambda d=demean, v=volume_mean: reconstruction.reconstruct_accumulate(
                   volume, finite, base, offsets, projector, *patch, *sums, demean=d, volume_mean=v,
                   voxel_scale=torch.ones(n_voxels)))
        yield (f"reconstruct_centres {demean}",
               lambda d=demean, v=volume_mean: reconstruction.reconstruct_centres(
                   volume, torch.zeros(batch, dtype=torch.int64), torch.arange(batch, dtype=torch.int32),
                   projector, *patch, *sums, demean=d, volume_mean=v))
    tridiagonal = ((48, torch.float32, False, False), (48, torch.float32, True, False),
                   (48, torch.float64, False, False), (128, torch.float32, False, False),
                   (48, torch.float64, False, True))  # m, dtype, rank-one term, counted
    for m, dtype, rank_one, counted in tridiagonal:
        def eigen_step(m=m, dtype=dtype, rank_one=rank_one, counted=counted):
            solver = TridiagonalEigh("cpu")
            extra = dict(rank_one=(torch.zeros((batch, m)), torch.zeros(batch))) if rank_one else {}
            if counted:
                extra["count"] = torch.tensor(3)
            solver.values(torch.zeros((batch, m, m), dtype=dtype), **extra)
            solver.projector(torch.ones(batch, dtype=torch.int32))
        yield f"tridiagonal m={m} {str(dtype)[6:]} rank_one={rank_one} counted={counted}", eigen_step
    yield "divide rows", lambda: slab_sums.divide_rows(*sums, slice(5, n_rows))
    yield "choose windows", lambda: settling.choose_windows(torch.zeros(40, dtype=torch.int32),
                                                            torch.zeros(40, dtype=torch.bool),
                                                            torch.zeros(50, dtype=torch.int64),
                                                            torch.ones(50, dtype=torch.float64), 3)
    shape = (14, 12, 20)
    everywhere = torch.ones(shape, dtype=torch.bool).numpy()
    plan = plan_patches(shape, (11, 11, 11), 3, everywhere, everywhere)
    box_volume = torch.zeros((14 * 12 * 20, n_volumes))
    box_sums = (torch.zeros((14 * 12 * 20, n_volumes)),) + tuple(torch.zeros(14 * 12 * 20) for _ in range(3))

    def box():
        windows = boxsums.BoxSums(plan, plan_slabs(plan, 14)[0], n_volumes, "cpu")
        windows.gram(box_volume)
        windows.accumulate(box_volume, *box_sums)
    yield "box sums", box

    values, voxels = torch.zeros((batch, 48), dtype=torch.float64), torch.full((batch,), 343)
    for estimator in ESTIMATORS:
        for delta in (None, torch.zeros(batch, dtype=torch.float64)):
            yield (f"threshold {estimator} settle={delta is not None}",
                   lambda e=estimator, d=delta: threshold_on_device(values, voxels, 47, e, d))


def main(capabilities):
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("TRITON_INTERPRET=1 replaces the kernels by the interpreter; unset it")
    failed, seen = 0, set()
    for name, call in cases():
        for kernel, values, options in recorded_launches(call):
            key = (kernel.__name__, repr(variant(kernel, values)), repr(sorted(options.items())))
            if key in seen:  # launched again with the same specialisation: the same build
                continue
            seen.add(key)
            for capability in capabilities:
                label = f"{name}: {kernel.__name__} sm_{capability} {options}"
                try:
                    build(kernel, values, options, capability)
                    print("built", label, flush=True)
                except Exception:  # noqa: BLE001 - report every failure, then fail
                    failed += 1
                    print("FAILED", label, traceback.format_exc(), sep="\n", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main([int(c) for c in sys.argv[1:]] or [80, 90]))
