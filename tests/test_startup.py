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
import threading

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


def test_device_auto_where_no_gpu_can_be_loads_no_torch(monkeypatch):
    """``auto`` imports torch to ask CUDA only where a GPU may be present; ``CUDA_VISIBLE_DEVICES=""`` rules
    it out first."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    code = ("import numpy as np\n"
            "from mppca_nipype import denoise\n"
            "data = (np.random.default_rng(0).standard_normal((12, 12, 10, 20)) + 10).astype(np.float32)\n"
            "assert denoise(data, device='auto', nprocs=1).info['backend'] == 'cpu'")
    assert heavy(loaded_by(code)) == []

def test_the_command_on_the_cpu_loads_nothing_heavy(tmp_path):
    data = (np.random.default_rng(0).standard_normal((12, 12, 10, 20)) + 10).astype(np.float32)
    nib.save(nib.Nifti1Image(data, np.eye(4)), tmp_path / "in.nii")
    code = ("from mppca_nipype.cli.denoise import main\n"
            f"main([{str(tmp_path / 'in.nii')!r}, {str(tmp_path / 'out.nii')!r}, '--device', 'cpu', '--quiet'])")
    loaded = loaded_by(code)
    assert (tmp_path / "out.nii").exists()
    assert heavy(loaded) == []



@pytest.mark.gpu
def test_nvmath_is_loaded_only_when_cusolver_solves():
    """A run of 48 volumes takes the tridiagonal Triton kernels and leaves nvmath-python (cuSOLVER) unloaded;
    one of 65 takes XsyevBatched, through nvmath when it is installed."""
    from mppca_nipype.engine.gpu import usable

    reason = usable()
    if reason is not None:
        pytest.skip(reason)
    for n_volumes, nvmath_loaded in ((48, False), (65, importlib.util.find_spec("nvmath") is not None)):
        code = ("import sys\n"
                "from mppca_nipype import denoise\n"
                "from mppca_nipype.phantoms import low_rank_phantom\n"
                f"noisy, _ = low_rank_phantom((24, 24, 20), {n_volumes})\n"
                "print(denoise(noisy, device='cuda').info['eigensolver'])\n"
                "print('nvmath' in sys.modules)")
        child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
        assert child.returncode == 0, child.stderr[-3000:]
        eigensolver, loaded = child.stdout.splitlines()[-2:]
        assert eigensolver.startswith("triton tridiagonal" if n_volumes <= 64 else "cusolverDnXsyevBatched" if
                                      nvmath_loaded else "torch.linalg.eigh"), eigensolver
        assert loaded == str(nvmath_loaded)

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
    # what the warm-up reports it compiled, read from the folder as Triton laid it out
    from mppca_nipype.cli.denoise import _compiled_kernels

    assert list(_compiled_kernels(Path(folder)).values()) == ["_divide_rows_kernel"]


# -- the warm-up ---------------------------------------------------------------------------------------------

def test_the_warm_up_runs_each_T_in_both_modes_on_grids_of_both_divisibilities():
    """Per T and mode, the patch a full-size series of that T takes (not capped by the small grid), on a grid
    whose voxel and window counts are multiples of 16 and on one whose counts are odd (Triton specialises
    integer arguments on divisibility by 16)."""
    from mppca_nipype.engine import DEFAULTS, DWIDENOISE_MODE
    from mppca_nipype.engine.gpu.warmup import warm_up_runs
    from mppca_nipype.engine.patches import plan_patches, resolve_extent

    runs = warm_up_runs((48, 65, 300))
    assert len(runs) == 3 * 2 * 2
    patch_sizes = {}
    for run in runs:
        assert run.options in (DEFAULTS, dict(DEFAULTS, **DWIDENOISE_MODE))
        extent = resolve_extent(run.options["extent"], run.shape, run.n_volumes)
        assert extent == resolve_extent(run.options["extent"], (256, 256, 256), run.n_volumes)
        everywhere = np.ones(run.shape, dtype=bool)
        n_windows = plan_patches(run.shape, extent, run.options["stride"], everywhere, everywhere).n_windows
        n_voxels = int(np.prod(run.shape))
        patch_sizes.setdefault((run.n_volumes, run.mode), []).append(
            (int(np.prod(extent)), n_voxels % 16 == 0 and n_windows % 16 == 0, n_voxels % 2 == n_windows % 2 == 1))
        series = run.series()
        assert series.shape == (*run.shape, run.n_volumes) and series.dtype == np.float32
    assert patch_sizes == {
        (48, "the defaults"): [(343, True, False), (343, False, True)],
        (48, "dwidenoise's mode"): [(125, True, False), (125, False, True)],
        (65, "the defaults"): [(343, True, False), (343, False, True)],
        (65, "dwidenoise's mode"): [(125, True, False), (125, False, True)],
        (300, "the defaults"): [(343, True, False), (343, False, True)],
        (300, "dwidenoise's mode"): [(343, True, False), (343, False, True)],
    }


def test_the_warm_up_takes_the_options_mode_and_dwidenoise_s():
    from mppca_nipype.engine import DWIDENOISE_MODE
    from mppca_nipype.engine.gpu.warmup import warm_up_runs

    runs = warm_up_runs((48,), dict(demean="voxel", extent=11, estimator="exp1"))
    assert [(run.mode, run.options["demean"], run.options["extent"], run.options["estimator"],
             run.options["filter"]) for run in runs] == [
        ("the options given", "voxel", 11, "exp1", "optshrink")] * 2 + [
        ("dwidenoise's mode", "none", "auto", "exp1", "hard")] * 2
    assert all(min(run.shape) >= 11 for run in runs[:2])
    dwidenoise_only = warm_up_runs((48,), DWIDENOISE_MODE)
    assert {run.mode for run in dwidenoise_only} == {"the options given"} and len(dwidenoise_only) == 2


def warm_up_command(*args, **env):
    command = [sys.executable, "-m", "mppca_nipype.cli.denoise", "--warm-up", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, CUDA_VISIBLE_DEVICES="", **env))


def test_the_warm_up_without_a_gpu_says_so_in_one_sentence_and_exits_0():
    result = warm_up_command()
    assert result.returncode == 0
    assert result.stderr.splitlines() == [
        "mppca-denoise: nothing to warm up: CUDA_VISIBLE_DEVICES hides every device"]
    assert warm_up_command("65,300").returncode == 0


def test_the_warm_up_fails_as_the_command_does_when_asked_for_what_it_cannot_do():
    cuda = warm_up_command("--device", "cuda")
    assert cuda.returncode == 1 and cuda.stderr.splitlines() == [
        "mppca-denoise: error: device 'cuda' was asked for but CUDA_VISIBLE_DEVICES hides every device"]
    for args, said in ((["--device", "cpu"], "cannot run with --device cpu"),
                       (["in.nii", "out.nii"], "must be numbers of volumes"),
                       (["48", "in.nii"], "takes no files (IN)"),
                       (["48", "--noise", "noise.nii"], "takes no files (--noise)"),
                       (["2"], "at least 3"),
                       (["48", "--aggregation", "center"], "needs stride 1")):
        result = warm_up_command(*args)
        assert result.returncode == 2 and len(result.stderr.splitlines()) == 1 and said in result.stderr, args
    missing = subprocess.run([sys.executable, "-m", "mppca_nipype.cli.denoise", "in.nii"], capture_output=True,
                             text=True, timeout=120)
    assert missing.returncode == 2 and "required: IN, OUT" in missing.stderr


@pytest.mark.gpu
def test_runs_after_the_warm_up_compile_nothing(tmp_path):
    """``mppca-denoise --warm-up 20`` into an empty kernel cache, then ``mppca-denoise`` on a 40x44x30 series
    of 20 volumes with the defaults and in dwidenoise's mode: the runs add nothing to the cache."""
    from mppca_nipype.engine import DWIDENOISE_MODE
    from mppca_nipype.engine.gpu import usable
    from mppca_nipype.phantoms import low_rank_phantom

    reason = usable()
    if reason is not None:
        pytest.skip(reason)
    cache = tmp_path / "kernels"
    env = dict(os.environ, TRITON_CACHE_DIR=str(cache))
    command = [sys.executable, "-m", "mppca_nipype.cli.denoise"]
    warm = subprocess.run([*command, "--warm-up", "20"], capture_output=True, text=True, env=env, timeout=900)
    assert warm.returncode == 0, warm.stderr[-3000:]
    assert "kernel variants compiled" in warm.stderr.splitlines()[-1], warm.stderr
    warmed = set(cache.glob("*/__grp__*.json"))
    assert warmed
    noisy, _ = low_rank_phantom((40, 44, 30), 20, seed=1)
    nib.save(nib.Nifti1Image(noisy, np.eye(4)), tmp_path / "in.nii")
    dwidenoise_mode = [word for name, value in DWIDENOISE_MODE.items() for word in (f"--{name}", str(value))]
    for options in ([], dwidenoise_mode):
        run = subprocess.run([*command, str(tmp_path / "in.nii"), str(tmp_path / "out.nii"), "--device", "cuda",
                              *options], capture_output=True, text=True, env=env, timeout=900)
        assert run.returncode == 0, run.stderr[-3000:]
    compiled_by_the_runs = sorted(path.name for path in set(cache.glob("*/__grp__*.json")) - warmed)
    assert compiled_by_the_runs == []



FIRST_RUN = """\
import json, sys
import numpy as np
from mppca_nipype import denoise
from mppca_nipype.phantoms import low_rank_phantom
noisy, _ = low_rank_phantom((30, 28, 26), 22, seed=3)
result = denoise(noisy, device="cuda", {options})
np.save(sys.argv[1], result.denoised)
print(json.dumps(result.info.get("kernels_compiled_ahead", 0)))
"""


@pytest.mark.gpu
@pytest.mark.parametrize("options", ['extent=7, stride=2, demean="voxel"',  # the box sums, settled on the device
                                     'noise=np.full(noisy.shape[:3], 5.0), maps=("lambda_plus",)'])
def test_a_first_run_compiles_its_kernels_ahead_and_equals_a_warm_run(tmp_path, options):
    """A new process on an empty kernel cache queues its run's kernels for compilation side by side
    (``warmup.compile_ahead``) and records them compiled; the next process queues none, compiles nothing, and
    gives the same series. With a noise map and lambda_+, whose settling pass indexes by the windows it
    chooses on the device, the run that only compiles must choose none (not uninitialised ones)."""
    from mppca_nipype.engine.gpu import usable

    reason = usable()
    if reason is not None:
        pytest.skip(reason)
    pytest.importorskip("triton.runtime._async_compile")
    cache = tmp_path / "kernels"
    env = dict(os.environ, TRITON_CACHE_DIR=str(cache))
    runs = []
    for number in range(2):
        out = tmp_path / f"denoised{number}.npy"
        child = subprocess.run([sys.executable, "-c", FIRST_RUN.format(options=options), str(out)],
                               capture_output=True, text=True, env=env, timeout=600)
        assert child.returncode == 0, child.stderr[-3000:]
        runs.append((json.loads(child.stdout.splitlines()[-1]), np.load(out), set(cache.glob("*/__grp__*.json"))))
    (queued, first, compiled), (queued_again, second, compiled_again) = runs
    assert queued >= 6 and queued_again == 0
    assert len(list((cache / "mppca-nipype-compiled").iterdir())) == 1
    assert sorted(path.name for path in compiled_again - compiled) == []
    np.testing.assert_allclose(second, first, rtol=0, atol=1e-5 * float(np.abs(first).max()))


# -- a script that calls denoise() from its top level --------------------------------------------------------

SCRIPT = """\
import hashlib
import numpy as np
import torch
torch.cuda.is_initialized = lambda: True  # as after a GPU run in this process: workers cannot be forked
from mppca_nipype import denoise

{call}
"""
CALL = """\
data = (np.random.default_rng(0).standard_normal((20, 20, 10, 30)) + 10).astype(np.float32)
result = denoise(data, device="cpu", nprocs=2)
print(result.info["nprocs"], hashlib.sha256(result.denoised.tobytes()).hexdigest())
"""


def run_script(tmp_path, name, call):
    pytest.importorskip("torch")
    script = tmp_path / f"{name}.py"
    script.write_text(SCRIPT.format(call=call))
    child = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path,
                           timeout=300)
    assert child.returncode == 0, child.stderr[-3000:]
    nprocs, checksum = child.stdout.split()
    return int(nprocs), checksum, child.stderr


def test_a_script_without_a_main_guard_runs_in_one_process_and_says_why(tmp_path):
    """Workers that cannot be forked (a CUDA context is live) import the main script again; a call from its
    top level outside ``if __name__ == "__main__":`` would run again in each and break the pool. It runs in
    the calling process instead, with one warning; with the guard it runs on 2 workers, to the same bits."""
    unguarded = run_script(tmp_path, "unguarded", CALL)
    assert unguarded[0] == 1
    warning = [line for line in unguarded[2].splitlines() if "MPPCAWarning" in line]
    assert len(warning) == 1 and "runs in 1 process instead of 2" in warning[0]
    assert "unguarded.py again, which calls denoise() outside an 'if __name__ == \"__main__\":'" in warning[0]
    called_from_a_function = run_script(tmp_path, "in_function", "def main():\n" + "".join(
        "    " + line + "\n" for line in CALL.splitlines()) + "\nmain()\n")
    assert called_from_a_function[0] == 1
    guarded = run_script(tmp_path, "guarded", 'if __name__ == "__main__":\n' + "".join(
        "    " + line + "\n" for line in CALL.splitlines()))
    assert guarded[0] == 2 and "MPPCAWarning" not in guarded[2]
    assert unguarded[1] == called_from_a_function[1] == guarded[1]


def test_triton_is_hashed_once_per_installation_and_remembered(monkeypatch, tmp_path):
    """Once ``usable()`` has found a GPU, Triton's own hash (its cache keys' first part, 0.5-0.8 s per process on
    the H200 machine) is computed on a thread and kept in the kernel cache's folder; a later process reads it
    there instead, and a Triton whose files changed is hashed anew."""
    pytest.importorskip("triton")
    from triton.runtime import cache

    from mppca_nipype.engine import gpu

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cache, "triton_key", cache.triton_key)  # (put back after the test)
    cache.triton_key.cache_clear()
    monkeypatch.setattr(gpu, "_triton_hashing", None)
    gpu._settle_triton_key()
    thread = gpu._triton_hashing
    assert thread.daemon
    gpu._settle_triton_key()  # once per process
    assert gpu._triton_hashing is thread
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert cache.triton_key.cache_info().currsize == 1
    key = cache.triton_key()
    remembered = list((tmp_path / "mppca-nipype-triton-key").iterdir())
    assert len(remembered) == 1 and remembered[0].read_text() == key  # (no temporary file left beside it)

    # a later process: the key read back, Triton's files not hashed
    monkeypatch.setattr(gpu, "_triton_hashing", None)
    cache.triton_key.cache_clear()
    gpu._settle_triton_key()
    assert gpu._triton_hashing is True
    assert cache.triton_key() == key
    assert cache.get_cache_key.__globals__["triton_key"]() == key

    # another installation (here: another fingerprint) is hashed anew, beside the first one's file
    monkeypatch.setattr(gpu, "_triton_files_fingerprint", lambda triton_dir: "0" * 32)
    monkeypatch.setattr(gpu, "_triton_hashing", None)
    gpu._settle_triton_key()
    assert isinstance(gpu._triton_hashing, threading.Thread)
    gpu._triton_hashing.join(timeout=60)
    assert (tmp_path / "mppca-nipype-triton-key" / ("0" * 32)).read_text() == key


def test_the_triton_fingerprint_changes_with_any_file_triton_hashes(tmp_path):
    from mppca_nipype.engine import gpu

    for name in ("runtime/cache.py", "_C/libtriton.so", "compiler/compiler.py", "backends/nvidia/driver.py",
                 "backends/nvidia/cuda_utils.so", "language/core.py", "tools/other.py", "language/notes.txt"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(name)
    first = gpu._triton_files_fingerprint(tmp_path)
    assert gpu._triton_files_fingerprint(tmp_path) == first
    for name in ("tools/other.py", "language/notes.txt"):
        (tmp_path / name).write_text("not hashed by Triton")
        assert gpu._triton_files_fingerprint(tmp_path) == first
    seen = {first}
    for number, name in enumerate(("runtime/cache.py", "_C/libtriton.so", "backends/nvidia/driver.py",
                                   "backends/nvidia/cuda_utils.so", "language/core.py")):
        os.utime(tmp_path / name, ns=(0, 10**9 * (number + 1)))  # (as rewritten at another time)
        fingerprint = gpu._triton_files_fingerprint(tmp_path)
        assert fingerprint not in seen, name
        seen.add(fingerprint)
    (tmp_path / "compiler" / "new.py").write_text("")
    assert gpu._triton_files_fingerprint(tmp_path) not in seen
    (tmp_path / "compiler" / "new.py").unlink()
    (tmp_path / "compiler" / "compiler.py").write_text("longer than before")
    assert gpu._triton_files_fingerprint(tmp_path) not in seen


CUDA_STARTED_BESIDE_TORCH = """\
import ctypes, sys
from mppca_nipype.engine import gpu
assert "torch" not in sys.modules
assert gpu.usable() is None
gpu._cuda_start.join(timeout=60)
driver = ctypes.CDLL("libcuda.so.1")
flags, active = ctypes.c_uint(), ctypes.c_int()
assert driver.cuDevicePrimaryCtxGetState(0, ctypes.byref(flags), ctypes.byref(active)) == 0
assert active.value == 1  # (started by the thread: torch has allocated nothing yet)
import torch
torch.ones(4, device="cuda").sum().item()
current, primary = ctypes.c_void_p(), ctypes.c_void_p()
assert driver.cuCtxGetCurrent(ctypes.byref(current)) == 0
assert driver.cuDevicePrimaryCtxRetain(ctypes.byref(primary), 0) == 0
assert current.value == primary.value  # torch runs in the context the thread started
print("ok")
"""


@pytest.mark.gpu
def test_a_usable_gpu_starts_the_context_torch_uses_beside_its_import():
    from mppca_nipype.engine.gpu import absent_reason, visible_devices

    if absent_reason() is not None or len(visible_devices()) != 1:
        pytest.skip("needs exactly one visible GPU")
    result = subprocess.run([sys.executable, "-c", CUDA_STARTED_BESIDE_TORCH], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


def test_cuda_is_started_early_only_before_torch_and_with_one_visible_device(monkeypatch):
    from mppca_nipype.engine import gpu

    monkeypatch.setattr(gpu, "_cuda_start", None)
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setitem(sys.modules, "torch", sys.modules.get("torch") or object())
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    gpu._start_cuda_beside_torchs_import()  # torch imported already: nothing to overlap
    assert gpu._cuda_start is None
    monkeypatch.delitem(sys.modules, "torch")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    gpu._start_cuda_beside_torchs_import()  # a run may be given either device
    assert gpu._cuda_start is None
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-uuid")
    monkeypatch.setattr(gpu.ctypes, "CDLL", lambda name: (_ for _ in ()).throw(OSError(name)))
    gpu._start_cuda_beside_torchs_import()  # no driver library here: the thread ends quietly
    gpu._cuda_start.join(timeout=10)
    assert not gpu._cuda_start.is_alive()


def test_the_warm_up_runs_dwidenoise_mode_with_its_own_estimator_unless_one_is_given():
    """The parser gives ``--estimator`` its default; passed on, it replaced dwidenoise's mode's exp2, and runs in
    that mode compiled their threshold kernels after a warm-up (H200, ``_threshold_kernel`` x3)."""
    from mppca_nipype.cli.denoise import build_parser, warm_up_options
    from mppca_nipype.engine import DEFAULTS, DWIDENOISE_MODE
    from mppca_nipype.engine.gpu.warmup import warm_up_runs

    def estimators(*argv):
        runs = warm_up_runs([20], warm_up_options(build_parser().parse_args(["--warm-up", "20", *argv])))
        return {run.mode: run.options["estimator"] for run in runs}

    assert estimators() == {"the defaults": DEFAULTS["estimator"], "dwidenoise's mode": DWIDENOISE_MODE["estimator"]}
    assert estimators("--estimator", "med") == {"the options given": "med", "dwidenoise's mode": "med"}
    assert warm_up_options(build_parser().parse_args(["--warm-up", "20", "--extent", "9"])) == {"extent": 9}
