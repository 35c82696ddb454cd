"""What a new process pays before it works: the packages ``import mppca_nipype``, ``denoise(device="cpu")``
and ``mppca-denoise --device cpu`` load (each checked in a new interpreter, counting only what they add to
what the interpreter had loaded at its start)."""

from __future__ import annotations

import json
import subprocess
import sys

import nibabel as nib
import numpy as np
import pytest

#: Packages the CPU path must not load: Nipype and pybids (the interface and the BIDS app), matplotlib (the
#: reports), and the GPU engine's torch, triton and nvmath (2-3 s of torch's import alone).
HEAVY = ("nipype", "bids", "matplotlib", "torch", "triton", "nvmath")


def loaded_by(code: str) -> set[str]:
    """The top-level packages (and ``array_api_compat.numpy``) that running ``code`` in a new interpreter
    adds to those loaded at its start."""
    script = ("import sys, json\n"
              "before = set(sys.modules)\n"
              f"{code}\n"
              "print(json.dumps(sorted(set(sys.modules) - before)))\n")
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert child.returncode == 0, child.stderr[-3000:]
    modules = json.loads(child.stdout.splitlines()[-1])
    return {name.split(".")[0] for name in modules} | {name for name in modules if name.startswith("array_api")}


def heavy(modules) -> list[str]:
    return sorted(set(HEAVY) & set(modules))


def test_importing_the_package_loads_nothing_heavy():
    loaded = loaded_by("import mppca_nipype\nfrom mppca_nipype import denoise")
    assert heavy(loaded) == []
    assert "nibabel" not in loaded  # the engine reads no file


def test_denoising_on_the_cpu_loads_nothing_heavy():
    code = ("import numpy as np\n"
            "from mppca_nipype import denoise\n"
            "data = (np.random.default_rng(0).standard_normal((12, 12, 10, 20)) + 10).astype(np.float32)\n"
            "denoise(data, device='cpu', nprocs=1)")
    loaded = loaded_by(code)
    assert heavy(loaded) == []
    if np.lib.NumpyVersion(np.__version__) >= "2.1.0":  # NumPy is its own array API namespace
        assert "array_api_compat.numpy" not in loaded


def test_the_command_on_the_cpu_loads_nothing_heavy(tmp_path):
    data = (np.random.default_rng(0).standard_normal((12, 12, 10, 20)) + 10).astype(np.float32)
    nib.save(nib.Nifti1Image(data, np.eye(4)), tmp_path / "in.nii")
    code = ("from mppca_nipype.cli.denoise import main\n"
            f"main([{str(tmp_path / 'in.nii')!r}, {str(tmp_path / 'out.nii')!r}, '--device', 'cpu', '--quiet'])")
    loaded = loaded_by(code)
    assert (tmp_path / "out.nii").exists()
    assert heavy(loaded) == []
