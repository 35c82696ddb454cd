"""The cluster recipes in workflows/ against a real SLURM (``bash .ci/slurm-up``), node sizing, GPU slots.

The SLURM tests submit for real (``sbatch --wait``, Nipype's SLURM plugin); without ``sbatch`` or a cluster
that answers they skip, except in CI (MPPCA_REQUIRE_PEERS=1), where they fail.
"""

from __future__ import annotations

import os
from pathlib import Path
import re
import shutil
import subprocess
import sys

import pytest

from bids_helpers import make_dataset, read_json
from conftest import require
from mppca_nipype.bids import derivative_names
from mppca_nipype.interfaces import gpu_slot, visible_gpus
from mppca_nipype.workflows import init_mppca_wf, node_resources, sbatch_resources

ROOT = Path(__file__).resolve().parents[1]
DWI = {"01": "sub-01/ses-1/dwi/sub-01_ses-1_dwi.nii.gz", "02": "sub-02/ses-1/dwi/sub-02_ses-1_dwi.nii.gz"}


@pytest.fixture(scope="module")
def cluster():
    """A SLURM that answers; skip (fail under MPPCA_REQUIRE_PEERS=1) without one."""
    require("sbatch")
    ping = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True)
    if ping.returncode != 0 or not ping.stdout.strip():
        message = f"sbatch is here but no SLURM answers ({ping.stderr.strip()}); run: bash .ci/slurm-up"
        if os.environ.get("MPPCA_REQUIRE_PEERS") == "1":
            pytest.fail(message)
        pytest.skip(message)


@pytest.fixture(scope="module")
def dwi_dataset(tmp_path_factory):
    """Two participants, a DWI run each (the BOLD runs removed to keep the jobs short)."""
    root = make_dataset(tmp_path_factory.mktemp("raw") / "bids")
    for func in root.glob("sub-*/ses-*/func"):
        shutil.rmtree(func)
    return root


def assert_denoised(output_dir, participants):
    for label in participants:
        names = derivative_names(DWI[label])
        assert all((output_dir / name).exists() for name in names.values()), label
        provenance = read_json(output_dir / names["denoised_json"])["MPPCADenoising"]
        assert provenance["Backend"] == "cpu" and provenance["NoiseMedian"] > 0
    assert read_json(output_dir / "dataset_description.json")["DatasetType"] == "derivative"


# ------------------------------------------------------------------------------------------- real SLURM

def test_slurm_array_job_denoises_one_participant_per_task(cluster, dwi_dataset, tmp_path):
    output_dir = tmp_path / "derivatives"
    done = subprocess.run(
        ["sbatch", "--wait", "--array=1-2", "--cpus-per-task=1", "--mem=1G", f"--output={tmp_path}/task-%a.out",
         str(ROOT / "workflows" / "slurm_array.sbatch"), str(dwi_dataset), str(output_dir),
         "--skip-bids-validation", "--datatype", "dwi"],
        capture_output=True, text=True, timeout=150, cwd=tmp_path)
    logs = {a: (tmp_path / f"task-{a}.out").read_text() for a in (1, 2) if (tmp_path / f"task-{a}.out").exists()}
    assert done.returncode == 0, (done.stdout, done.stderr, logs)
    assert re.fullmatch(r"Submitted batch job \d+\n", done.stdout)
    assert_denoised(output_dir, ("01", "02"))
    assert "sub-01_ses-1_dwi" in logs[1] and "sub-02_ses-1_dwi" in logs[2]
    for label in ("01", "02"):  # each task used the one CPU SLURM gave it (SLURM_CPUS_PER_TASK)
        sidecar = read_json(output_dir / derivative_names(DWI[label])["denoised_json"])
        assert sidecar["MPPCADenoising"]["EngineInfo"]["nprocs"] == 1


def test_nipype_slurm_plugin_submits_each_run_with_its_resources(cluster, dwi_dataset, tmp_path):
    output_dir = tmp_path / "derivatives"
    done = subprocess.run([sys.executable, str(ROOT / "workflows" / "nipype_slurm.py"), str(dwi_dataset),
                           str(output_dir), "--participant-label", "01", "--cpus", "2"],
                          capture_output=True, text=True, timeout=150, env={**os.environ, "NIPYPE_NO_ET": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert_denoised(output_dir, ("01",))
    jobs = [re.search(r"slurm-(\d+)\.out", log.name).group(1)
            for log in (output_dir / ".mppca-work").rglob("slurm-*.out")]
    shown = [subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True).stdout
             for job in jobs]
    denoising = [text for text in shown if "JobName=denoise." in text]
    assert len(denoising) == 1, "one denoising job (the sidecar and the sink run on the submit host)"
    n_procs, mem_gb = node_resources((10, 10, 8, 16), use_gpu=False, max_procs=2)
    assert f"NumCPUs={n_procs} " in denoising[0] and f"mem={round(mem_gb * 1024)}M" in denoising[0], shown


# ---------------------------------------------------------------------------------------- node sizing

def test_node_resources_grow_with_the_input_and_respect_the_cpu_cap():
    small = node_resources((10, 10, 8, 16), use_gpu=False, max_procs=16, extent=3, stride=2)
    hcp = node_resources((145, 174, 145, 288), use_gpu=False, max_procs=16, extent=5, stride=2)
    assert small[0] == 5, "no more workers than x-planes of patch corners (ceil(7 / 2) + 1)"
    assert hcp[0] == 16 and node_resources((145, 174, 145, 288), use_gpu=False, max_procs=4)[0] == 4
    series_gb = 145 * 174 * 145 * 288 * 4 / 2**30
    assert 5 * series_gb < hcp[1] < 5 * series_gb + 4.5, "five float32 copies, the base and 16 workers"
    assert node_resources((145, 174, 145, 288), use_gpu=True, max_procs=16)[0] == 1, "one GPU slot"


def test_sbatch_arguments_follow_each_nodes_needs():
    cpu = init_mppca_wf(use_gpu=False, num_threads=8, shape=(64, 64, 40, 60)).get_node("denoise")
    gpu = init_mppca_wf(use_gpu=True, num_threads=8, shape=(64, 64, 40, 60)).get_node("denoise")
    assert cpu.n_procs == 8 and cpu.inputs.num_threads == 8 and not cpu.is_gpu_node()
    assert sbatch_resources(cpu) == f"--cpus-per-task=8 --mem={round(cpu.mem_gb * 1024)}M"
    assert gpu.n_procs == 1 and gpu.is_gpu_node()
    assert sbatch_resources(gpu) == f"--cpus-per-task=1 --mem={round(gpu.mem_gb * 1024)}M --gres=gpu:1"


# ----------------------------------------------------------------------------- GPU slots, tested on the CPU

HOLDER = """
import sys, time
from mppca_nipype.interfaces import gpu_slot
with gpu_slot(["0", "1"]) as slot:
    print(*slot, flush=True)
    time.sleep(60)
"""


def hold_slot(lock_dir):
    """A process that holds a GPU slot until killed (as a GPU node does while it runs); returns it and its
    slot as printed."""
    holder = subprocess.Popen([sys.executable, "-c", HOLDER], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "MPPCA_GPU_LOCK_DIR": str(lock_dir)})
    return holder, holder.stdout.readline().split()


def test_concurrent_gpu_nodes_each_get_their_own_device_then_share(tmp_path, monkeypatch):
    monkeypatch.setenv("MPPCA_GPU_LOCK_DIR", str(tmp_path))
    first, first_slot = hold_slot(tmp_path)
    second, second_slot = hold_slot(tmp_path)
    try:
        assert sorted([first_slot, second_slot]) == [["0", "0", "False"], ["1", "1", "False"]], \
            "two nodes at once: one device each"
        with gpu_slot(["0", "1"]) as third:
            assert third[2] is True, "all devices held: a third node shares one rather than waits"
        first.kill()  # a node killed by SIGKILL frees its device
        first.wait()
        with gpu_slot(["0", "1"]) as fourth:
            assert fourth == (int(first_slot[0]), first_slot[1], False), "the killed node's device is free"
    finally:
        for holder in (first, second):
            holder.kill()
            holder.wait()


def test_visible_gpus_follow_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")  # what SLURM sets for --gres=gpu:2
    assert visible_gpus() == ["2", "3"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert visible_gpus() == []
    with gpu_slot() as slot:
        assert slot is None
