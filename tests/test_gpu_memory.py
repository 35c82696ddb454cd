"""The GPU memory budget as users give it: ``denoise(gpu_memory=...)``, ``MPPCA_GPU_MEMORY``, ``--gpu-memory``
of both commands, the interface's ``gpu_memory`` and the workflows' (the engine's plan inside a budget is
tested in test_gpu_kernels.py and, on a GPU, test_gpu.py)."""

import numpy as np
import pytest

from mppca_nipype import MPPCAInputError, denoise
from mppca_nipype.engine import GPU_MEMORY_VARIABLE, resolve_gpu_memory
from mppca_nipype.engine.backend import GIB, GPUMemory
from mppca_nipype.phantoms import low_rank_phantom
from test_cli_denoise import run_cli, save


@pytest.mark.parametrize("value, amount, unit", [(8, 8.0, "GiB"), (0.5, 0.5, "GiB"), ("8", 8.0, "GiB"),
                                                 ("12GiB", 12.0, "GiB"), (" 6 G", 6.0, "GiB"),
                                                 ("50%", 50.0, "%"), ("12.5 %", 12.5, "%")])
def test_a_budget_is_read_in_gib_or_as_a_share(value, amount, unit):
    budget = resolve_gpu_memory(value, environ={})
    assert budget == GPUMemory(amount, unit)
    assert budget.bytes_of(80 * GIB) == int(amount * (0.8 * GIB if unit == "%" else GIB))


@pytest.mark.parametrize("value", [0, -2, "0%", "150%", "lots", "8 GB", float("nan"), True, ""])
def test_a_budget_that_is_not_a_positive_amount_is_refused_in_one_sentence(value):
    if value == "":  # (the environment's empty value means: not set)
        assert resolve_gpu_memory(None, environ={GPU_MEMORY_VARIABLE: value}) is None
        return
    with pytest.raises(MPPCAInputError, match="must be a positive number of GiB .* or a share"):
        resolve_gpu_memory(value, environ={})


def test_the_environment_gives_the_budget_where_the_call_does_not():
    environ = {GPU_MEMORY_VARIABLE: "25%"}
    assert resolve_gpu_memory(None, environ) == GPUMemory(25.0, "%")
    assert resolve_gpu_memory(4, environ) == GPUMemory(4.0)  # the call's own wins
    assert resolve_gpu_memory(None, {}) is None
    with pytest.raises(MPPCAInputError, match=f"^{GPU_MEMORY_VARIABLE} must be"):
        resolve_gpu_memory(None, {GPU_MEMORY_VARIABLE: "half"})


def test_the_cpu_engine_takes_a_budget_and_ignores_it():
    noisy, _ = low_rank_phantom((8, 7, 6), n_volumes=20, rank=3, sigma=5.0, seed=3)
    plain = denoise(noisy, device="cpu", nprocs=1)
    budgeted = denoise(noisy, device="cpu", nprocs=1, gpu_memory="1%")
    assert np.array_equal(plain.denoised, budgeted.denoised) and "gpu_memory_budget" not in budgeted.info
    with pytest.raises(MPPCAInputError, match="GPU memory budget must be"):
        denoise(noisy, device="cpu", gpu_memory="-1")


def test_the_command_refuses_a_bad_budget_before_reading_anything(tmp_path):
    noisy, _ = low_rank_phantom((8, 7, 6), n_volumes=20, rank=3, sigma=5.0, seed=3)
    save(noisy, tmp_path / "in.nii")
    done = run_cli(tmp_path / "in.nii", tmp_path / "out.nii", "--gpu-memory", "0")
    assert done.returncode == 2 and not (tmp_path / "out.nii").exists()
    assert "argument --gpu-memory: must be a positive number of GiB" in done.stderr.splitlines()[-1]
    done = run_cli(tmp_path / "in.nii", tmp_path / "out.nii", "--gpu-memory", "2", "--device", "cpu", "--quiet")
    assert done.returncode == 0 and (tmp_path / "out.nii").exists() and done.stderr == ""


def test_the_interface_and_workflows_hand_the_budget_on(monkeypatch, tmp_path):
    from nipype.interfaces.base import isdefined

    from mppca_nipype import interfaces
    from mppca_nipype.cli.bids_app import build_parser
    from mppca_nipype.workflows import init_mppca_wf

    node = init_mppca_wf(use_gpu=False, gpu_memory="50%").get_node("denoise")
    assert node.inputs.gpu_memory == "50%"
    assert not isdefined(init_mppca_wf(use_gpu=False).get_node("denoise").inputs.gpu_memory)
    args = build_parser().parse_args(["in", "out", "participant", "--gpu-memory", "6"])
    assert args.gpu_memory == GPUMemory(6.0)
    seen = {}

    def fake_denoise(data, mask, **kwargs):
        seen.update(kwargs)
        return denoise(data, mask, **dict(kwargs, device="cpu"))

    monkeypatch.setattr("mppca_nipype.engine.denoise", fake_denoise)
    noisy, _ = low_rank_phantom((8, 7, 6), n_volumes=20, rank=3, sigma=5.0, seed=3)
    interfaces.denoise_on_device(noisy, None, {}, use_gpu=False, nprocs=1, gpu_memory="6")
    assert seen["gpu_memory"] == "6"
