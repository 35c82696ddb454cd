"""Runs that survive faults: killed at any point (SIGTERM, SIGKILL), run twice at once into one OUTPUT_DIR,
a GPU that cannot be used or runs out of memory. Each fault is injected for real: the app runs as its own
process and is killed; only the out-of-memory error is raised by a stand-in for the GPU engine."""

from __future__ import annotations

import json
import os
from pathlib import Path
import signal
import subprocess
import sys
import threading
import time

import nibabel as nib
import numpy as np
import pytest

from bids_helpers import make_dataset, read_json
from mppca_nipype import denoise
from mppca_nipype.bids import derivative_names

ONE = ["--participant-label", "01"]  # three runs: a DWI and two BOLD
APP = [sys.executable, "-m", "mppca_nipype.cli.bids_app"]
FAST = ["--nprocs", "1", "--device", "cpu", "--skip-bids-validation"]
RUNS = ["sub-01/ses-1/dwi/sub-01_ses-1_dwi.nii.gz",
        "sub-01/ses-1/func/sub-01_ses-1_task-rest_run-1_bold.nii.gz",
        "sub-01/ses-1/func/sub-01_ses-1_task-rest_run-2_bold.nii.gz",
        "sub-02/ses-1/dwi/sub-02_ses-1_dwi.nii.gz",
        "sub-02/ses-1/func/sub-02_ses-1_task-rest_run-1_bold.nii.gz",
        "sub-02/ses-1/func/sub-02_ses-1_task-rest_run-2_bold.nii.gz"]


@pytest.fixture(scope="module")
def bids_dir(tmp_path_factory):
    return make_dataset(tmp_path_factory.mktemp("raw") / "bids")


SUB01 = [run for run in RUNS if run.startswith("sub-01/")]
DWI = [run for run in RUNS if "/dwi/" in run]


def complete_runs(output_dir):
    """The runs whose derivatives are all there; fails on a run with some but not all of them, on a
    visible file that does not read, and on a temporary file left visible."""
    done = []
    for source in RUNS:
        names = derivative_names(source)
        present = {key: (output_dir / name).exists() for key, name in names.items()}
        if present["denoised"]:
            assert all(present.values()), f"{source}: the series is there without {present}"
            nib.load(output_dir / names["denoised"]).get_fdata()
            json.loads((output_dir / names["denoised_json"]).read_text())
            done.append(source)
    for path in output_dir.rglob("*"):
        if path.is_file() and ".mppca-work" not in path.parts and path.suffix == ".json":
            json.loads(path.read_text())  # never half-written
    return done


def visible_temporaries(output_dir):
    return [p for p in output_dir.rglob(".*") if p.is_file() and ".mppca-work" not in p.parts
            and p.name != ".bidsignore"]


def denoise_results(work_dir):
    """mtime of each run's cached denoising result: which runs were computed, and when."""
    return {p.parent.parent.name: p.stat().st_mtime_ns
            for p in Path(work_dir).rglob("denoise/result_denoise.pklz")}


class Watcher(threading.Thread):
    """Checks the derivative dataset every few milliseconds while a run writes it: a denoised series is
    never visible without all of its run's files."""

    def __init__(self, output_dir):
        super().__init__(daemon=True)
        self.output_dir, self.stop, self.problems, self.looks = output_dir, False, [], 0

    def run(self):
        while not self.stop:
            for source in RUNS:
                names = derivative_names(source)
                if (self.output_dir / names["denoised"]).exists():
                    missing = [k for k, n in names.items() if not (self.output_dir / n).exists()]
                    if missing:
                        self.problems.append((source, missing))
            self.looks += 1
            time.sleep(0.01)


def start_app(bids_dir, output_dir, *extra):
    return subprocess.Popen([*APP, str(bids_dir), str(output_dir), "participant", *FAST, *extra],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, start_new_session=True)


def wait_for_line(app, marker, timeout=90):
    """Read the app's stderr until a line holds ``marker``; return everything read."""
    lines, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = app.stderr.readline()
        if not line:
            break
        lines.append(line)
        if marker in line:
            return "".join(lines)
    raise AssertionError(f"the app never printed {marker!r}: {''.join(lines)}")


def group_gone(pgid, timeout=10):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


# ------------------------------------------------------------------------------------- killed, then rerun

@pytest.mark.parametrize("how, marker", [
    ("SIGTERM", "denoising 3 runs"),        # the workflow is starting: nothing denoised yet
    ("SIGTERM", "[1/3] denoised"),          # one run done, the next being denoised
    ("SIGKILL", "denoising 3 runs"),
    ("SIGKILL", "[2/3] denoised"),
], ids=["term-at-start", "term-mid-run", "kill-at-start", "kill-mid-run"])
def test_a_killed_run_leaves_no_partial_derivative_and_the_rerun_does_only_what_is_missing(
        bids_dir, tmp_path, how, marker):
    output_dir = tmp_path / "out"
    watcher = Watcher(output_dir)
    watcher.start()
    app = start_app(bids_dir, output_dir, *ONE)
    said = wait_for_line(app, marker)
    if how == "SIGTERM":  # what scancel, a time limit or `kill PID` sends to the app
        app.send_signal(signal.SIGTERM)
    else:  # what a scheduler does to the whole job after its grace period
        os.killpg(app.pid, signal.SIGKILL)
    said += app.stderr.read()
    status = app.wait(timeout=30)
    assert group_gone(app.pid), "a process of the killed run is still running"
    watcher.stop = True
    watcher.join()
    assert watcher.looks > 10 and watcher.problems == []

    if how == "SIGTERM":
        assert status == 143, said
        assert "terminated" in said and "Traceback" not in said
        assert visible_temporaries(output_dir) == [], "SIGTERM cleans up its temporary files"
    else:
        assert status == -signal.SIGKILL
    before = complete_runs(output_dir)
    computed = denoise_results(output_dir / ".mppca-work")
    if marker.startswith("["):
        assert len(computed) >= int(marker[1]), said
    if (output_dir / "dataset_description.json").exists():  # written after "denoising 6 runs"
        assert read_json(output_dir / "dataset_description.json")["DatasetType"] == "derivative"

    rerun = subprocess.run([*APP, str(bids_dir), str(output_dir), "participant", *FAST, *ONE],
                           capture_output=True, text=True, timeout=120)
    assert rerun.returncode == 0, rerun.stderr
    assert complete_runs(output_dir) == SUB01
    assert set(before) <= set(SUB01)
    assert visible_temporaries(output_dir) == [], "the rerun removes what a SIGKILL left"
    after = denoise_results(output_dir / ".mppca-work")
    assert len(after) == len(SUB01)
    assert {run: after[run] for run in computed} == computed, "a run finished before the kill was redone"


# --------------------------------------------------------------------------------- two runs, one OUTPUT_DIR

def test_two_runs_into_one_output_dir_corrupt_nothing(bids_dir, tmp_path):
    """Two participants at once (an array job's tasks), then the same participant twice at once."""
    output_dir = tmp_path / "out"
    apps = [start_app(bids_dir, output_dir, "--participant-label", label, "--datatype", "dwi")
            for label in ("01", "02")]
    results = [(app.wait(timeout=120), app.stderr.read()) for app in apps]
    assert [status for status, _ in results] == [0, 0], results
    assert complete_runs(output_dir) == DWI
    description = read_json(output_dir / "dataset_description.json")
    assert description["DatasetType"] == "derivative" and description["GeneratedBy"][0]["Name"] == "mppca-nipype"
    assert (output_dir / ".bidsignore").read_text().count("logs/") == 1

    twins = [start_app(bids_dir, output_dir, "--participant-label", "01", "--datatype", "dwi")
             for _ in range(2)]
    results = [(app.wait(timeout=120), app.stderr.read()) for app in twins]
    assert [status for status, _ in results] == [0, 0], results
    assert complete_runs(output_dir) == DWI
    assert visible_temporaries(output_dir) == []
    source = bids_dir / RUNS[0]
    expected = denoise(nib.load(source).get_fdata(dtype=np.float32), device="cpu", nprocs=1)
    written = nib.load(output_dir / derivative_names(RUNS[0])["denoised"]).get_fdata()
    np.testing.assert_allclose(written, expected.denoised, rtol=0, atol=1e-3)


# -------------------------------------------------------------------------------- GPU unusable or too small

def run_node(tmp_path, series, **inputs):
    from mppca_nipype.interfaces import MPPCADenoise

    node_dir = tmp_path / "node"
    node_dir.mkdir()
    cwd = os.getcwd()
    os.chdir(node_dir)
    try:
        outputs = MPPCADenoise(in_file=str(series), num_threads=1, **inputs).run().outputs
    finally:
        os.chdir(cwd)
    return outputs, read_json(outputs.provenance_file)


def test_no_usable_gpu_runs_on_the_cpu_and_says_so_in_the_provenance(bids_dir, tmp_path, monkeypatch):
    from mppca_nipype.engine import MPPCAInputError, check_device

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # as a node without a GPU, or with a broken driver
    with pytest.raises(MPPCAInputError):
        check_device("cuda")
    outputs, provenance = run_node(tmp_path, bids_dir / RUNS[0], use_gpu=True)
    assert provenance["Backend"] == "cpu" and provenance["GPUAsked"] is True
    assert provenance["CPUFallback"].startswith("no usable GPU: ")
    assert any("a GPU was asked for, but no usable GPU" in w for w in provenance["Warnings"])
    expected = denoise(nib.load(bids_dir / RUNS[0]).get_fdata(dtype=np.float32), device="cpu", nprocs=1)
    np.testing.assert_allclose(nib.load(outputs.out_file).get_fdata(), expected.denoised, rtol=0, atol=1e-3)


def _gpu_backend_out_of_memory(monkeypatch):
    """Make the engine see a usable GPU whose backend runs out of memory at every batch size (the GPU
    pipeline's own retries with smaller batches are tested in test_gpu_kernels); returns the calls made."""
    import mppca_nipype.engine as engine
    from mppca_nipype.engine.cpu import denoise_cpu

    torch = pytest.importorskip("torch")
    tried = []

    def denoise_gpu(data, finite, plan, options, **kwargs):
        tried.append(plan.n_windows)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(engine, "check_device", lambda device: "cpu" if device == "cpu" else "cuda")
    monkeypatch.setattr(engine, "_backend", lambda device: denoise_cpu if device == "cpu" else denoise_gpu)
    monkeypatch.setattr(engine.costs, "GPU_START_SECONDS", 0.0)  # auto: the GPU, even for a tiny series
    return tried


def test_gpu_out_of_memory_goes_on_on_the_cpu_with_a_warning_or_fails_in_one_sentence(monkeypatch):
    from mppca_nipype.engine import MPPCAInputError, MPPCAWarning, denoise
    from mppca_nipype.phantoms import low_rank_phantom

    tried = _gpu_backend_out_of_memory(monkeypatch)
    noisy, _ = low_rank_phantom((8, 8, 6), n_volumes=16, rank=2, sigma=5.0, seed=1)
    with pytest.warns(MPPCAWarning, match="the GPU ran out of memory even in batches of a few windows .*CUDA "
                                          "out of memory.*; running on the CPU instead"):
        result = denoise(noisy, device="auto", nprocs=1)
    assert len(tried) == 1 and result.info["backend"] == "cpu"
    assert result.info["cpu_fallback"].startswith("the GPU ran out of memory")
    expected = denoise(noisy, device="cpu", nprocs=1)
    np.testing.assert_array_equal(result.denoised, expected.denoised)
    with pytest.raises(MPPCAInputError, match="ran out of memory.*; free the GPU or use device 'cpu'$"):
        denoise(noisy, device="cuda", nprocs=1)


def test_gpu_out_of_memory_falls_back_to_the_cpu_with_a_warning(bids_dir, tmp_path, monkeypatch):
    tried = _gpu_backend_out_of_memory(monkeypatch)
    outputs, provenance = run_node(tmp_path, bids_dir / RUNS[0], use_gpu=True)
    assert len(tried) == 1
    assert provenance["Backend"] == "cpu"
    assert provenance["CPUFallback"].startswith("the GPU ran out of memory even in batches of a few windows "
                                                "(CUDA out of memory.")
    assert any("running on the CPU instead" in w for w in provenance["Warnings"])
    expected = denoise(nib.load(bids_dir / RUNS[0]).get_fdata(dtype=np.float32), device="cpu", nprocs=1)
    np.testing.assert_allclose(nib.load(outputs.out_file).get_fdata(), expected.denoised, rtol=0, atol=1e-3)


def test_the_cpu_run_after_gpu_out_of_memory_gives_the_gpu_slot_back_first(bids_dir, tmp_path, monkeypatch):
    """The node holds its GPU's lock while the GPU runs out of memory, and has let it go when the CPU run
    starts (another node may use the GPU meanwhile): another process probes the lock at both moments."""
    import mppca_nipype.engine as engine
    import mppca_nipype.interfaces as interfaces
    from mppca_nipype.engine.cpu import denoise_cpu

    torch = pytest.importorskip("torch")
    locks = tmp_path / "locks"
    monkeypatch.setenv("MPPCA_GPU_LOCK_DIR", str(locks))
    monkeypatch.setattr(interfaces, "visible_gpus", lambda: ["GPU-fake"])
    free = {}

    def lock_is_free():
        probe = ("import fcntl, sys; f = open(sys.argv[1], 'a'); "
                 "fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB)")
        return subprocess.run([sys.executable, "-c", probe, str(locks / "gpu-GPU-fake.lock")],
                              capture_output=True).returncode == 0

    def denoise_gpu(*args, **kwargs):
        free["during the GPU run"] = lock_is_free()
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    def cpu_backend(*args, **kwargs):
        free["during the CPU run"] = lock_is_free()
        return denoise_cpu(*args, **kwargs)

    monkeypatch.setattr(engine, "check_device", lambda device: "cpu" if device == "cpu" else "cuda")
    monkeypatch.setattr(engine, "_backend", lambda device: cpu_backend if device == "cpu" else denoise_gpu)
    outputs, provenance = run_node(tmp_path, bids_dir / RUNS[0], use_gpu=True)
    assert free == {"during the GPU run": False, "during the CPU run": True}
    assert provenance["Backend"] == "cpu" and provenance["GPUSlot"]["Device"] == "GPU-fake"
    assert provenance["CPUFallback"].startswith("the GPU ran out of memory")


def test_other_gpu_errors_are_not_hidden(bids_dir, tmp_path, monkeypatch):
    import mppca_nipype.engine as engine

    def broken(data, mask=None, *, device="auto", **options):
        raise RuntimeError("an illegal memory access was encountered")

    monkeypatch.setattr(engine, "check_device", lambda device: "cpu" if device == "cpu" else "cuda")
    monkeypatch.setattr(engine, "denoise", broken)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        run_node(tmp_path, bids_dir / RUNS[0], use_gpu=True)
