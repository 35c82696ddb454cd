"""The GPU worker: one process that runs the nodes' series, as each node would have run them itself.

Served here on the CPU engine (``--device cpu``): the protocol, the shared memory and the errors are the same
as on the GPU, where the BIDS app starts it (``benchmarks/end_to_end.py``'s ``bids:`` rows time that).
"""

from __future__ import annotations

import os
from pathlib import Path
import signal
import time
import warnings

import nibabel as nib
import numpy as np
import pytest

from mppca_nipype.engine import GPUOutOfMemoryError, MPPCAInputError, MPPCAWarning, denoise
from mppca_nipype.engine.complex_data import denoise_complex
from mppca_nipype.gpu_worker import ADDRESS_VARIABLE, GPUWorker, KEY_VARIABLE, denoise_remote, serve_one
from mppca_nipype.phantoms import complex_dwi_phantom, low_rank_phantom


@pytest.fixture(scope="module")
def worker():
    started = GPUWorker.start(device="cpu")
    assert started.wait_ready() is None
    yield started
    started.stop()


@pytest.fixture
def served(worker, monkeypatch):
    for variable, value in worker.environment().items():
        monkeypatch.setenv(variable, value)
    return worker


@pytest.mark.parametrize("order", ["C", "F"])
def test_the_worker_returns_what_the_engine_computes_here(served, order, monkeypatch):
    noisy, _ = low_rank_phantom((21, 17, 13), n_volumes=30, rank=4, sigma=5.0, seed=41)
    noisy = np.asarray(noisy, order=order)
    mask = np.zeros(noisy.shape[:3], bool)
    mask[2:19, 1:16, :] = True
    options = dict(extent=5, stride=2, demean="voxel")
    from mppca_nipype import gpu_worker

    seen, block = [], gpu_worker._block  # every block this process makes or opens: inputs and results
    monkeypatch.setattr(gpu_worker, "_block",
                        lambda *args, **kwargs: seen.append(block(*args, **kwargs)) or seen[-1])
    remote = denoise_remote(noisy, mask, options)
    here = denoise(noisy, mask, **options, device="cpu")
    for name in ("denoised", "sigma", "rank"):
        np.testing.assert_array_equal(getattr(remote, name), getattr(here, name))
    assert remote.denoised.flags.f_contiguous == (order == "F")
    assert remote.info["gpu_worker"] == served.process.pid and remote.info["backend"] == "cpu"
    assert len(seen) == 5 and not any(Path("/dev/shm", b.name).exists() for b in seen)  # all unlinked


def test_the_maps_asked_for_come_back_too(served):
    noisy, _ = low_rank_phantom((14, 12, 10), n_volumes=20, rank=3, sigma=5.0, seed=47)
    options = dict(extent=5, maps=("lambda_plus", "variance_removed"))
    remote = denoise_remote(noisy, None, options)
    here = denoise(noisy, **options, device="cpu")
    np.testing.assert_array_equal(remote.lambda_plus, here.lambda_plus)
    np.testing.assert_array_equal(remote.variance_removed, here.variance_removed)


def test_complex_data_go_through_the_worker(served):
    magnitude, phase = complex_dwi_phantom((16, 14, 10), n_volumes=20, sigma=60.0, seed=42)[:2]
    remote = denoise_remote(magnitude, None, dict(phase_method="hann"), phase=phase)
    here = denoise_complex(magnitude, phase, phase_method="hann", device="cpu")
    np.testing.assert_array_equal(remote.denoised, here.denoised)
    np.testing.assert_array_equal(remote.phase, here.phase)


def test_the_echoes_of_a_multi_echo_series_go_through_the_worker(served):
    echoes = [low_rank_phantom((12, 11, 10), n_volumes=16, rank=3, sigma=5.0, seed=46 + e)[0] for e in range(3)]
    remote = denoise_remote(echoes, None, {})
    here = denoise(echoes, device="cpu")
    assert remote.denoised.shape == (12, 11, 10, 3, 16)
    np.testing.assert_array_equal(remote.denoised, here.denoised)


def test_the_engines_errors_and_warnings_come_back_to_the_caller(served):
    noisy, _ = low_rank_phantom((12, 12, 10), n_volumes=20, rank=3, sigma=5.0, seed=43)
    with pytest.raises(MPPCAInputError, match="extent must be odd"):
        denoise_remote(noisy, None, dict(extent=4))
    noisy[3, 4, 5, 6] = np.nan
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        denoise_remote(noisy, None, {})
    assert any(issubclass(w.category, MPPCAWarning) and "1 voxels hold NaN" in str(w.message) for w in caught)


def test_an_out_of_memory_error_keeps_its_reason_on_the_way(monkeypatch):
    """The worker's GPUOutOfMemoryError reaches the node with the reason the node's CPU fallback reports."""
    import mppca_nipype.engine as engine

    def out_of_memory(*args, **kwargs):
        raise GPUOutOfMemoryError("the GPU ran out of memory even in batches of a few windows")

    import pickle
    from contextlib import ExitStack

    from mppca_nipype.gpu_worker import _shared_array

    monkeypatch.setattr(engine, "denoise", out_of_memory)
    with ExitStack() as stack:
        data = _shared_array(np.ones((4, 4, 4, 5), np.float32), stack)
        reply = serve_one(dict(data=data, mask=None, phase=None, parameters={}, gpu_memory=None), "cpu")
    error = pickle.loads(pickle.dumps(reply["error"]))
    assert isinstance(error, GPUOutOfMemoryError)
    assert error.fallback_note == ("the GPU ran out of memory even in batches of a few windows; running on the "
                                   "CPU instead")


def test_a_node_asked_for_the_gpu_runs_in_the_worker_and_says_so(served, tmp_path):
    """MPPCADenoise with ``use_gpu`` sends its series to the worker: the outputs are the engine's, and the
    provenance names the worker."""
    import json

    from mppca_nipype.demo import write_series
    from mppca_nipype.interfaces import MPPCADenoise

    noisy, _ = low_rank_phantom((14, 12, 10), n_volumes=24, rank=3, sigma=5.0, seed=44)
    series = write_series(tmp_path / "dwi.nii.gz", noisy)
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        outputs = MPPCADenoise(in_file=str(series), use_gpu=True, stride=1).run().outputs
    finally:
        os.chdir(cwd)
    expected = denoise(nib.load(series).get_fdata(dtype=np.float32), stride=1, device="cpu")
    np.testing.assert_allclose(nib.load(outputs.out_file).get_fdata(), expected.denoised, rtol=0, atol=1e-3)
    provenance = json.loads(Path(outputs.provenance_file).read_text())
    assert provenance["GPUWorker"] == served.process.pid


def test_a_node_whose_worker_is_gone_runs_without_it(monkeypatch, tmp_path):
    from mppca_nipype.interfaces import denoise_on_device

    monkeypatch.setenv(ADDRESS_VARIABLE, str(tmp_path / "no-worker.sock"))
    monkeypatch.setenv(KEY_VARIABLE, "00")
    noisy, _ = low_rank_phantom((12, 12, 10), n_volumes=20, rank=3, sigma=5.0, seed=45)
    result, notes, placement = denoise_on_device(noisy, None, {}, use_gpu=True, nprocs=1)
    assert "cannot be reached" in notes[0] and "GPUWorker" not in placement
    np.testing.assert_array_equal(result.denoised, denoise(noisy, device="cpu", nprocs=1).denoised)


def test_the_worker_ends_with_the_process_that_started_it(tmp_path):
    """A worker whose app was killed ends by itself (it polls its parent)."""
    import subprocess
    import sys

    script = ("import sys, time; from mppca_nipype.gpu_worker import GPUWorker; w = GPUWorker.start('cpu'); "
              "assert w.wait_ready() is None; print(w.process.pid, flush=True); time.sleep(60)")
    app = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    pid = int(app.stdout.readline())
    app.send_signal(signal.SIGKILL)
    app.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the worker outlived its app")


def test_a_worker_that_cannot_start_says_why():
    """Where no GPU is usable, the worker ends at once and ``wait_ready`` gives the reason (the app then
    warns, and each GPU run starts the GPU itself)."""
    from mppca_nipype.engine.gpu import usable

    if usable() is None:
        pytest.skip("a GPU is usable here: the worker starts")
    worker = GPUWorker.start(device="cuda")
    try:
        why_not = worker.wait_ready(timeout=60)
    finally:
        worker.stop()
    assert why_not is not None and why_not.startswith("MPPCAInputError: device 'cuda' was asked for but")
    assert not worker.folder.exists()
