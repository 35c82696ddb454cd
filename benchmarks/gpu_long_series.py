"""Long series with the defaults on one GPU: a DWI-like T = 300 and an fMRI-like T = 1000 series.

    python benchmarks/gpu_long_series.py [--repeats 3] [--out FILE]

Past T = 128 the fused kernels do not take the patch: the gathered path runs, its float32 eigensolve's
spectrum refined in float64 at both ends (``cusolver.ProjectorFromVectors.refine``) and the windows it
leaves open redone in float64. For each series: ``denoise_gpu`` host to host (best of ``--repeats`` after a
warm-up), the windows redone, the peak of device memory; and the agreement with the CPU backend (float64,
all of this machine's cores) on a crop of the series, where the CPU takes seconds rather than minutes.
JSON (and Markdown beside it) to ``--out``.
"""

from __future__ import annotations

import numpy as np

from gpu_timing import Backend, best_ms, load_package, peak_gib, relative_rms, run_benchmark
from mppca_nipype.engine import DEFAULTS
from mppca_nipype.phantoms import dwi_phantom, low_rank_phantom

#: (name, full shape, crop shape for the CPU comparison, T)
SERIES = (("DWI-like", (96, 96, 60), (40, 40, 24), 300), ("fMRI-like", (64, 64, 40), (28, 28, 18), 1000))


def phantom(name, shape, n_volumes):
    if name == "DWI-like":
        return dwi_phantom(shape, n_volumes=n_volumes, sigma=20.0, seed=2)[0]
    return low_rank_phantom(shape, n_volumes=n_volumes, rank=8, sigma=10.0, seed=3)[0]


def measure(repeats):
    package = load_package()
    rows = []
    for name, shape, crop, n_volumes in SERIES:
        backend = Backend(package, phantom(name, shape, n_volumes), DEFAULTS)
        backend.run()  # warm-up: the kernels compiled, the workspaces allocated
        ms, sums = best_ms(backend.run, repeats)
        peak, _ = peak_gib(backend.run)
        small = phantom(name, crop, n_volumes)
        gpu = package.denoise(small, device="cuda")
        cpu = package.denoise(small, device="cpu")
        rows.append(dict(series=f"{name} {'x'.join(map(str, shape))}x{n_volumes}", n_windows=backend.plan.n_windows,
                         patch=f"{backend.plan.patch_size} x {n_volumes}", best_ms=round(ms, 1),
                         n_settled_in_float64=sums.info["n_settled_in_float64"], gram_path=sums.info["gram_path"],
                         eigenvalues_refined=sums.info["eigenvalues_refined"], peak_gib=round(peak, 2),
                         crop=f"{'x'.join(map(str, crop))}x{n_volumes}",
                         crop_relative_rms_to_cpu=relative_rms(gpu.denoised, cpu.denoised),
                         crop_rank_equal=float(np.mean(np.abs(gpu.rank - cpu.rank) < 1e-3)),
                         crop_cpu_processes=cpu.info["nprocs"]))
        print(rows[-1], flush=True)
    return dict(options=DEFAULTS, rows=rows)


def markdown(result):
    lines = ["| series | windows (patch) | GPU ms | windows settled | peak GiB | on a crop: rel. rms to the CPU | "
             "rank maps equal |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row in result["rows"]:
        lines.append(f"| {row['series']} | {row['n_windows']} ({row['patch']}) | {row['best_ms']:.0f} | "
                     f"{row['n_settled_in_float64']} | {row['peak_gib']:.1f} | {row['crop_relative_rms_to_cpu']:.1e} "
                     f"({row['crop']}) | {row['crop_rank_equal']:.4f} |")
    return "\n".join(lines)


def main():
    run_benchmark(__doc__, "gpu_long_series", measure, markdown, ("--repeats", dict(type=int, default=3)))


if __name__ == "__main__":
    main()
