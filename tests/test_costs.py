"""The cost model behind ``device="auto"``: window counts as the plan lays them out, the crossing where the
GPU's start pays off, and a small series that never imports torch."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from mppca_nipype.engine import choose_device, costs, denoise, resolve_options
from mppca_nipype.engine.patches import plan_patches


@pytest.mark.parametrize("shape, extent, stride", [((96, 96, 48), (11, 11, 11), 3), ((17, 9, 13), (5, 3, 7), 1),
                                                   ((20, 21, 22), (7, 7, 7), 4), ((9, 9, 9), (9, 9, 9), 2)])
def test_window_count_is_the_plans_on_a_full_mask(shape, extent, stride):
    everywhere = np.ones(shape, bool)
    assert costs.window_count(shape, extent, stride) == plan_patches(shape, extent, stride, everywhere,
                                                                     everywhere).n_windows


def test_the_seeds_problem_runs_on_16_cpus_and_long_series_on_the_gpu(monkeypatch):
    monkeypatch.setattr(costs, "gpu_started", lambda: False)
    seed = costs.estimate((96, 96, 48), 48, (11, 11, 11), 3, nprocs=16)
    assert seed.device == "cpu" and 1.0 < seed.cpu_seconds < seed.gpu_seconds  # measured: 2.2 s vs 3.5 s
    # the engine alone on 16 CPUs, 1.6-2.1 s, ends before the GPU's start (~3 s)
    assert costs.estimate((96, 96, 60), 100, (7, 7, 7), 3, nprocs=16).device == "cpu"
    long_series = costs.estimate((96, 96, 60), 300, (7, 7, 7), 3, nprocs=16)
    assert long_series.device == "cuda" and long_series.gpu_seconds < long_series.cpu_seconds / 3
    # on 2 CPUs the seed's problem is worth the GPU's start; with the GPU started, everything but the tiny is
    assert costs.estimate((96, 96, 48), 48, (11, 11, 11), 3, nprocs=2).device == "cuda"
    monkeypatch.setattr(costs, "gpu_started", lambda: True)
    assert costs.estimate((96, 96, 48), 48, (11, 11, 11), 3, nprocs=16).device == "cuda"
    assert costs.estimate((8, 8, 8), 10, (3, 3, 3), 3, nprocs=1).device == "cpu"


def test_auto_says_why_it_chose_the_cpu():
    noisy = np.random.default_rng(0).standard_normal((9, 8, 7, 16)).astype(np.float32)
    result = denoise(noisy, device="auto", nprocs=1)
    assert result.info["backend"] == "cpu"
    assert result.info["device_choice"].startswith("auto: the CPU (")
    assert "device_choice" not in denoise(noisy, device="cpu", nprocs=1).info


def test_choose_device_for_cpu_and_explicit_devices_gives_no_reason():
    options = resolve_options((9, 8, 7, 12), extent="wide", stride=3, estimator="exp2", aggregation="weighted",
                              demean="volume")
    assert choose_device("cpu", (9, 8, 7, 12), options) == ("cpu", None)


def test_a_small_series_on_auto_never_imports_torch():
    script = ("import sys, numpy as np\n"
              "from mppca_nipype import denoise\n"
              "r = denoise(np.random.default_rng(0).standard_normal((12, 11, 10, 16)).astype(np.float32), "
              "device='auto', nprocs=1)\n"
              "print(r.info['backend'], 'torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["cpu", "False"]


def test_the_calibration_recovers_the_constants_that_made_its_times(monkeypatch):
    """``benchmarks/auto_costs.py``'s fit, on engine times made by known constants, gives them back."""
    from pathlib import Path

    benchmarks = Path(__file__).resolve().parents[1] / "benchmarks"
    monkeypatch.syspath_prepend(str(benchmarks))
    import auto_costs

    truth = dict(product=1.3e-10, eigen=6.0e-10, window=2.0e-4, serial=0.08)
    rows = []
    for case in auto_costs.CASES:
        terms, windows = auto_costs.features(case)
        rows.append(dict(case=case.label, windows=windows, terms=terms.tolist(),
                         one_worker=auto_costs.model_seconds(terms, truth, 1),
                         workers=auto_costs.model_seconds(terms, truth, 16) - costs.CPU_START_SECONDS))
    fitted = auto_costs.fit(rows, 16)
    for name in truth:
        assert fitted[name] == pytest.approx(truth[name], rel=1e-6), name
    assert "| the seed's problem | 12,600 |" in auto_costs.table(dict(rows=rows, workers=16, fitted=fitted,
                                                                         current=auto_costs.current_constants()))
