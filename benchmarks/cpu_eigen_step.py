"""The CPU's eigen step: LAPACK's steps with only the kept eigenvectors against a full batched ``eigh``.

    python benchmarks/cpu_eigen_step.py
    python benchmarks/cpu_eigen_step.py --quick --out /tmp/cpu_eigen_step.json      # a smoke test

One process, one BLAS thread (as each CPU worker runs), on the Gram matrices of windows drawn from the DWI
phantom (sigma 20), for dwidenoise's mode (extent auto, no demeaning) and for the defaults (extent wide,
volume demeaning). Per window, the best of ``--repeats`` over batches of the CPU engine's batch size:

- ``engine.lapack`` (``dsytrd`` + ``dsterf``, the threshold, ``dstein`` + ``dormqr`` for the kept vectors);
- NumPy's batched ``eigh`` (OpenBLAS ``dsyevd``) and the threshold;
- torch's batched ``eigh`` (MKL ``dsyevd``) and the threshold, when torch is installed.

Each is checked against NumPy's: the ranks equal, and the largest difference of the projectors onto the kept
eigenvectors. Writes JSON (stamped by ``harness.stamp()``) to ``--out`` and the Markdown table next to it.
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path
import sys
import time

import numpy as np
from threadpoolctl import threadpool_limits

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import harness  # noqa: E402

from mppca_nipype.engine import lapack  # noqa: E402
from mppca_nipype.engine.cpu import batch_size  # noqa: E402
from mppca_nipype.engine.estimators import marchenko_pastur_threshold, signal_projector  # noqa: E402
from mppca_nipype.engine.patches import auto_extent, wide_extent  # noqa: E402
from mppca_nipype.phantoms import dwi_phantom  # noqa: E402

#: (name, volumes, extent rule, demeaning)
PROBLEMS = [("dwidenoise's mode, T = 100", 100, auto_extent, "none"),
            ("dwidenoise's mode, T = 48", 48, auto_extent, "none"),
            ("defaults, T = 48", 48, wide_extent, "volume")]


def window_grams(volumes: int, extent: int, demean: str, count: int, shape, seed: int = 0):
    """(count, m, m) float64 Gram matrices of windows at random corners of the DWI phantom, the voxel counts
    and degrees of freedom the threshold takes."""
    noisy = dwi_phantom(shape, volumes, sigma=20.0, seed=seed)[0]
    rng = np.random.default_rng(seed)
    corners = [rng.integers(0, s - extent + 1, size=count) for s in shape]
    patches = np.stack([noisy[x:x + extent, y:y + extent, z:z + extent].reshape(-1, volumes)
                        for x, y, z in zip(*corners)]).astype(np.float64)
    n_voxels = patches.shape[1]
    if demean == "volume":
        patches -= patches.mean(axis=1, keepdims=True)
        n_voxels -= 1
    time_side = patches.shape[1] >= volumes
    grams = (np.matmul(patches.transpose(0, 2, 1), patches) if time_side
             else np.matmul(patches, patches.transpose(0, 2, 1)))
    return grams, np.full(count, n_voxels), volumes


def lapack_steps(grams, n_voxels, n_volumes):
    forms = lapack.eigenvalues(grams)
    rank, _ = marchenko_pastur_threshold(forms.eigenvalues, n_voxels, n_volumes)
    return rank, lapack.leading_eigenvectors(forms, rank)


def full_eigh(solve):
    def run(grams, n_voxels, n_volumes):
        values, vectors = solve(grams)
        rank, _ = marchenko_pastur_threshold(values, n_voxels, n_volumes)
        return rank, vectors
    return run


def torch_eigh(grams):
    import torch

    values, vectors = torch.linalg.eigh(torch.from_numpy(grams))
    return values.numpy(), vectors.numpy()


def measure(problem, args):
    name, volumes, rule, demean = problem
    extent = rule(volumes)
    grams, n_voxels, n_volumes = window_grams(volumes, extent, demean, args.windows, args.shape)
    step = batch_size(extent**3, volumes)
    variants = {"LAPACK steps (ours)": lapack_steps, "NumPy eigh": full_eigh(np.linalg.eigh)}
    if importlib.util.find_spec("torch") is not None:
        import torch

        torch.set_num_threads(1)
        variants["torch eigh"] = full_eigh(torch_eigh)
    expected_rank, expected_vectors = full_eigh(np.linalg.eigh)(grams, n_voxels, n_volumes)
    expected = signal_projector(expected_vectors, expected_rank)
    row = dict(problem=name, m=grams.shape[1], windows=len(grams), batch=step,
               mean_rank=float(expected_rank.mean()), variants={})
    for label, run in variants.items():
        best = np.inf
        for _ in range(args.repeats):
            started = time.perf_counter()
            for a in range(0, len(grams), step):
                run(grams[a:a + step], n_voxels[a:a + step], n_volumes)
            best = min(best, time.perf_counter() - started)
        rank, vectors = run(grams, n_voxels, n_volumes)
        row["variants"][label] = dict(
            us_per_window=1e6 * best / len(grams), ranks_equal=float(np.mean(rank == expected_rank)),
            projector_max_diff=float(np.abs(signal_projector(vectors, rank) - expected).max()))
    return row


def table(result: dict) -> str:
    labels = list(result["rows"][0]["variants"])
    lines = ["| problem | m | mean rank | " + " | ".join(f"{label} us" for label in labels)
             + " | ranks equal to NumPy's | projectors' largest difference |",
             "| --- | ---: | ---: | " + " | ".join("---:" for _ in labels) + " | ---: | ---: |"]
    for row in result["rows"]:
        ours = row["variants"][labels[0]]
        times = [row["variants"][label]["us_per_window"] for label in labels]
        cells = [f"**{times[0]:.0f}**"] + [f"{t:.0f} ({t / times[0]:.2f}x)" for t in times[1:]]
        lines.append(f"| {row['problem']} | {row['m']} | {row['mean_rank']:.1f} | " + " | ".join(cells)
                     + f" | {ours['ranks_equal']:.2%} | {ours['projector_max_diff']:.1e} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=None, help="windows per problem (default 2000; --quick: 200)")
    parser.add_argument("--repeats", type=int, default=None, help="timed passes, best kept (default 3; --quick: 1)")
    parser.add_argument("--quick", action="store_true", help="fewer windows, one pass: a smoke test")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "cpu_eigen_step.json",
                        help="JSON output; the Markdown goes next to it as .md")
    args = parser.parse_args(argv)
    args.windows = args.windows or (200 if args.quick else 2000)
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.shape = (64, 64, 40)

    run = harness.stamp()
    with threadpool_limits(limits=1):
        rows = [measure(problem, args) for problem in PROBLEMS]
    result = dict(stamp=run, shape=list(args.shape), rows=rows)
    harness.finish(run)
    markdown = (table(result) + "\n\n" + harness.stamp_markdown(run) + "\n\n" + harness.load_note(run))
    harness.write_result(args.out, result, markdown)
    print(markdown)


if __name__ == "__main__":
    main()
