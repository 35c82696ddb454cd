"""What a new process pays before it works: the packages ``import mppca_nipype``, ``denoise(device="cpu")``
and ``mppca-denoise --device cpu`` load (each checked in a new interpreter, counting only what they add to
what the interpreter had loaded at its start); where Triton keeps the kernels it compiles, so that they are
compiled once per machine, also where home is read-only."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
import shutil
import stat
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


# -- where Triton keeps the compiled kernels ----------------------------------------------------------------

def test_kernel_cache_is_in_the_user_cache_folder(tmp_path):
    from mppca_nipype.engine.gpu import kernel_cache_dir

    home = tmp_path / "home"
    assert kernel_cache_dir({"HOME": str(home)}) == str(home / ".cache" / "mppca-nipype" / "triton")
    xdg = tmp_path / "xdg"
    assert kernel_cache_dir({"HOME": str(home), "XDG_CACHE_HOME": str(xdg)}) == str(
        xdg / "mppca-nipype" / "triton")
    assert (xdg / "mppca-nipype" / "triton").is_dir()
    # a relative XDG_CACHE_HOME is to be ignored (XDG Base Directory specification)
    assert kernel_cache_dir({"HOME": str(home), "XDG_CACHE_HOME": "cache"}).startswith(str(home))


def test_kernel_cache_falls_back_to_a_private_temporary_folder(tmp_path, monkeypatch):
    from mppca_nipype.engine.gpu import kernel_cache_dir

    home = tmp_path / "home"
    home.mkdir()
    (home / ".cache").write_text("")  # no folder can be made there, whoever runs the test (root too)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    folder = Path(kernel_cache_dir({"HOME": str(home)}))
    own = tmp_path / "tmp" / f"mppca-nipype-{os.getuid()}"
    assert folder == own / "triton" and folder.is_dir()
    assert stat.S_IMODE(own.stat().st_mode) == 0o700
    assert Path(kernel_cache_dir({"HOME": str(home)})) == folder  # the same folder from run to run


def test_kernel_cache_avoids_a_temporary_folder_others_may_write(tmp_path, monkeypatch):
    from mppca_nipype.engine.gpu import kernel_cache_dir

    home = tmp_path / "home"
    home.mkdir()
    (home / ".cache").write_text("")
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    own = tmp_path / "tmp" / f"mppca-nipype-{os.getuid()}"
    own.mkdir(parents=True)
    own.chmod(0o777)  # someone could have put kernels (shared libraries Triton loads) there
    folder = Path(kernel_cache_dir({"HOME": str(home)}))
    assert not folder.is_relative_to(own)
    assert folder.parent == tmp_path / "tmp" and folder.name.startswith("mppca-nipype-triton-")
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700


def test_a_cache_folder_the_user_set_is_kept(tmp_path):
    from mppca_nipype.engine.gpu import use_kernel_cache

    environ = {"HOME": str(tmp_path / "home"), "TRITON_CACHE_DIR": str(tmp_path / "mine")}
    assert use_kernel_cache(environ) == str(tmp_path / "mine")
    assert environ["TRITON_CACHE_DIR"] == str(tmp_path / "mine")
    environ = {"HOME": str(tmp_path / "home"), "TRITON_HOME": str(tmp_path / "triton-home")}
    assert use_kernel_cache(environ) == str(tmp_path / "triton-home" / ".triton" / "cache")
    assert "TRITON_CACHE_DIR" not in environ


def read_only_home(tmp_path):
    """(command prefix, HOME): a home folder nothing can be written in, for a child process. A read-only
    file system mounted in a user namespace of its own where ``unshare`` may make one (root included), else
    a folder without write permission (not for root, who may write anywhere)."""
    home = tmp_path / "home"
    home.mkdir()
    if shutil.which("unshare") and subprocess.run(
            ["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o ro tmpfs {home}"], capture_output=True).returncode == 0:
        return ["unshare", "-rm", "sh", "-c", f'mount -t tmpfs -o ro tmpfs {home} && exec "$@"', "sh"], home
    if os.geteuid() == 0:
        pytest.skip("no user namespace for a read-only file system, and root may write into any folder")
    home.chmod(0o555)
    return [], home


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_with_a_read_only_home_kernels_compile_into_the_private_temporary_folder(tmp_path):
    """A kernel compiled (for sm_90, no GPU needed) by a process whose home is read-only lands in
    ``$TMPDIR/mppca-nipype-<uid>/triton``."""
    prefix, home = read_only_home(tmp_path)
    (tmp_path / "tmp").mkdir()
    env = {name: value for name, value in os.environ.items()
           if name not in ("TRITON_INTERPRET", "TRITON_CACHE_DIR", "TRITON_HOME", "XDG_CACHE_HOME")}
    env.update(HOME=str(home), TMPDIR=str(tmp_path / "tmp"))
    script = ("import os, sys\n"
              "import mppca_nipype.engine.gpu\n"  # before triton is imported
              f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
              "import kernel_builds\n"
              "for name, call in kernel_builds.cases():\n"
              "    if name == 'divide rows':\n"
              "        for kernel, values, options in kernel_builds.recorded_launches(call):\n"
              "            kernel_builds.build(kernel, values, options, 90)\n"
              "print(os.getuid(), os.environ['TRITON_CACHE_DIR'])\n")
    child = subprocess.run([*prefix, sys.executable, "-c", script], capture_output=True, text=True, env=env,
                           timeout=300)
    assert child.returncode == 0, child.stderr[-3000:]
    uid, folder = child.stdout.split()[-2:]
    assert folder == str(tmp_path / "tmp" / f"mppca-nipype-{uid}" / "triton")
    assert list(Path(folder).glob("*/_divide_rows_kernel.cubin"))
    assert not any(home.iterdir())
