"""What the GPU benchmarks share: the problems, the timing method, and a second copy of the package to time
beside this one.

Timing: every figure is host to host (NumPy in, NumPy out) in a running process, after warm-up runs (the
kernels compiled, the first pass's CUDA graphs captured). The machine drifts by ~1 ms within a minute, so
the variants of a comparison run in interleaved blocks, each the best of ``repeats`` calls, and a ratio is
taken within a block.

A baseline (``--baseline DIR``): the package of another checkout (``DIR/mppca_nipype``, e.g. an older commit
from ``git worktree add``), imported under another name and timed in the same blocks, so that a change is
measured against what it replaced in one run on one machine.
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
import sys
import time

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # benchmark the package of this tree, installed or not
    sys.path.insert(0, str(REPO))

import mppca_nipype  # noqa: E402

#: The seed's problem: 96x96x48 with T = 48, 11^3 windows, stride 3 plus the flush corner (12,600 windows),
#: voxel demeaning, weighted aggregation and hard thresholding (the article's method), on a rank-5 phantom
#: with a baseline near 1000 and noise 4. The filter is named so that ``Backend.run`` and
#: ``denoise(**SEED_OPTIONS)`` run the same method: ``denoise``'s default (optshrink) is not ``resolve_options``'s.
SEED_OPTIONS = dict(extent=11, stride=3, estimator="exp2", aggregation="weighted", demean="voxel", filter="hard")
#: MRtrix3 dwidenoise's mode: 5^3 windows around every voxel, each voxel from its own window, no demeaning.
DWIDENOISE_OPTIONS = dict(extent=5, stride=1, estimator="exp2", aggregation="center", demean="none", filter="hard")
#: The article's final step on our kernels: the fused Gram and reconstruction kernels with cuSOLVER's
#: XsyevBatched, batches of 2048 windows (``denoise_gpu``'s settings).
ARTICLE_STEP = dict(path="fused", max_batch=2048, eigensolver="xsyev")


def seed_phantom(seed=0):
    """The seed's series: (noisy, truth), 96x96x48x48 float32."""
    from mppca_nipype.phantoms import low_rank_phantom

    return low_rank_phantom((96, 96, 48), n_volumes=48, rank=5, sigma=4.0, baseline=1000.0, seed=seed)


def load_package(path=None):
    """This checkout's ``mppca_nipype``, or with ``path`` the one in ``path/mppca_nipype`` under the name
    ``mppca_nipype_baseline`` (its own kernels, caches and threads)."""
    if path is None:
        return mppca_nipype
    folder = Path(path).resolve() / "mppca_nipype"
    spec = importlib.util.spec_from_file_location("mppca_nipype_baseline", folder / "__init__.py",
                                                  submodule_search_locations=[str(folder)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


class Backend:
    """A package's GPU backend on one problem: ``run(**settings)`` is ``denoise_gpu`` on the prepared series
    (what ``denoise`` hands a backend: float32, non-finite voxels zeroed, the plan, the resolved options)."""

    def __init__(self, package, noisy, options):
        engine = importlib.import_module(f"{package.__name__}.engine")
        self.denoise = package.denoise
        self.denoise_gpu = importlib.import_module(f"{package.__name__}.engine.gpu.pipeline").denoise_gpu
        data, mask = engine.check_data(noisy, None)
        self.options = engine.resolve_options(data.shape, **options)
        self.finite = np.isfinite(data).all(axis=3)
        self.data = np.where(self.finite[..., None], data, np.float32(0))
        self.plan = engine.plan_patches(data.shape[:3], self.options.extent, self.options.stride, mask,
                                        self.finite)

    def run(self, **settings):
        return self.denoise_gpu(self.data, self.finite, self.plan, self.options, **settings)

    def denoised(self, result):
        """The denoised series of a run: ``denoise_gpu``'s (normalized) sums, or ``denoise``'s result."""
        if hasattr(result, "denoised"):
            return result.denoised
        return np.asarray(result.image, dtype=np.float32).reshape(self.data.shape)


def best_ms(call, repeats, warmup=0):
    """The best of ``repeats`` calls after ``warmup`` more, in ms (the device synchronised after each), and
    the last result."""
    for _ in range(warmup):
        call()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        started = time.perf_counter()
        result = call()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - started) * 1e3)
    return min(times), result


def interleaved(variants, blocks, repeats, warmup=3):
    """``variants``: {name: call}. Each warmed up, then ``blocks`` rounds over all of them, each call timed as
    the best of ``repeats``. Returns {name: [best ms of each block]} and {name: last result}."""
    results = {}
    for name, call in variants.items():
        for _ in range(warmup):
            results[name] = call()
    by_block = {name: [] for name in variants}
    for _ in range(blocks):
        for name, call in variants.items():
            ms, results[name] = best_ms(call, repeats)
            by_block[name].append(round(ms, 3))
    return by_block, results


def relative_rms(got, want):
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    return float(np.sqrt(np.mean((got - want) ** 2) / np.mean(want**2)))


def peak_gib(call):
    """The peak of device memory one ``call()`` allocates (GiB; torch's statistics), and its result."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    result = call()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / 2**30, result


def run_benchmark(doc, name, measure, markdown, *arguments):
    """A GPU benchmark's command line: ``arguments`` ((flag, ``add_argument``'s keywords), ...) and ``--out``
    (default ``benchmarks/results/NAME.json``); ``measure(**their values)`` gives the result's fields, stamped
    (``harness.stamp``) and written with ``markdown(result)``'s table beside it, which is printed last."""
    import argparse
    import os

    from harness import stamp, stamp_markdown, write_result

    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    for flag, keywords in arguments:
        parser.add_argument(flag, **keywords)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / f"{name}.json"))
    values = vars(parser.parse_args())
    out = values.pop("out")
    run = stamp()
    result = dict(stamp=run, **measure(**values))
    table = markdown(result)
    write_result(out, result, markdown=stamp_markdown(run) + "\n\n" + table)
    print(table)


#: ``--baseline``'s keywords for ``run_benchmark``.
BASELINE = ("--baseline", dict(help="a checkout whose mppca_nipype is timed beside this one, in the same blocks"))
