"""``mppca-denoise``: the command run as a user runs it, on tiny NIfTI files.

What it must do: write what ``denoise()`` computes, with the input's affine and header, in float32; read
scaled integers as their values; write noise and rank maps. What it must never do: fail with a traceback or
more than one sentence, leave a file behind after a failure, or touch its input.
"""

from __future__ import annotations

import hashlib
import os
import signal
import stat
import subprocess
import sys
import time

import nibabel as nib
import numpy as np
import pytest

from mppca_nipype import io as nifti_io
from mppca_nipype.cli import denoise as cli
from mppca_nipype.engine import DEFAULTS, MIN_VOLUMES, denoise
from mppca_nipype.phantoms import low_rank_phantom

SHAPE = (9, 8, 7)
N_VOLUMES = 16  # with voxel demeaning 15 usable volumes: no few-samples warning in the normal runs
AFFINE = np.array([[-1.8, 0.1, 0.0, 90.0],
                   [0.1, 1.9, 0.2, -126.0],
                   [0.0, -0.2, 2.5, -72.0],
                   [0.0, 0.0, 0.0, 1.0]])
PROG = "mppca-denoise"


def run_cli(*args, **popen):
    command = [sys.executable, "-m", "mppca_nipype.cli.denoise", *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, **popen)


def stderr_lines(result):
    return result.stderr.splitlines()


def save(array, path, dtype=np.float32):
    """A NIfTI file with a header worth keeping: units, TR, codes, a description.

    ``array`` is stored as ``dtype``; for an integer dtype nibabel scales the values to fit it
    (scl_slope, scl_inter).
    """
    image = nib.Nifti1Image(np.asarray(array, dtype=np.float32), AFFINE)
    image.set_data_dtype(dtype)
    image.header.set_xyzt_units("mm", "sec")
    image.header.set_qform(AFFINE, code=1)
    image.header.set_sform(AFFINE, code=4)
    zooms = image.header.get_zooms()
    if len(zooms) == 4:
        image.header.set_zooms(zooms[:3] + (2.5,))
    image.header["descrip"] = b"mppca-denoise test"
    nib.save(image, path)
    return path


def checksum(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


@pytest.fixture(scope="module")
def noisy():
    series, _ = low_rank_phantom(SHAPE, N_VOLUMES, rank=3, sigma=5.0, seed=3)
    return series


@pytest.fixture(scope="module")
def expected(noisy):
    return denoise(noisy, device="cpu", nprocs=1)


@pytest.fixture
def series_path(tmp_path, noisy):
    return save(noisy, tmp_path / "dwi.nii.gz")


# --- what a run writes ------------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".nii", ".nii.gz"])
def test_output_is_denoise_of_the_same_array_in_float32(tmp_path, noisy, expected, suffix):
    source = save(noisy, tmp_path / f"dwi{suffix}")
    out = tmp_path / f"out{suffix}"
    result = run_cli(source, out, "--nprocs", "1", "--device", "cpu")
    assert result.returncode == 0, result.stderr
    written = nib.load(out)
    assert written.get_data_dtype() == np.float32
    np.testing.assert_array_equal(np.asarray(written.dataobj), expected.denoised)
    assert (open(out, "rb").read(2) == b"\x1f\x8b") == (suffix == ".nii.gz")


def test_a_compressed_input_is_read_by_a_child_beside_the_gpu_checks(tmp_path, noisy, expected, monkeypatch):
    """Where a GPU may run (here made to seem so), a .nii.gz IN is decompressed by a child process beside the
    checks (``io.read_ahead``), whose values the run takes: the output is the engine's."""
    from mppca_nipype.engine import gpu

    monkeypatch.setattr(gpu, "absent_reason", lambda: None)
    started, read_ahead = [], nifti_io.read_ahead

    def recorded(path, *args, **kwargs):
        started.append(read_ahead(path, *args, **kwargs))
        return started[-1]

    monkeypatch.setattr(nifti_io, "read_ahead", recorded)
    source = save(noisy, tmp_path / "dwi.nii.gz")
    cli.main([str(source), str(tmp_path / "out.nii"), "--nprocs", "1", "--device", "auto", "--quiet"])
    if nifti_io._isal("igzip") is not None and sys.platform.startswith("linux"):  # (a cancelled one has no values)
        assert len(started) == 1 and started[0].child is None and started[0].values is not None
    np.testing.assert_array_equal(np.asarray(nib.load(tmp_path / "out.nii").dataobj), expected.denoised)


def test_input_file_is_left_unchanged(tmp_path, series_path):
    before = checksum(series_path)
    result = run_cli(series_path, tmp_path / "out.nii.gz", "--noise", tmp_path / "noise.nii.gz",
                     "--nprocs", "1")
    assert result.returncode == 0, result.stderr
    assert checksum(series_path) == before


def test_outputs_get_the_permissions_of_any_new_file(tmp_path, series_path):
    umask = os.umask(0o027)
    try:
        result = run_cli(series_path, tmp_path / "out.nii.gz", "--rank", tmp_path / "rank.nii",
                         "--nprocs", "1")
    finally:
        os.umask(umask)
    assert result.returncode == 0, result.stderr
    for name in ("out.nii.gz", "rank.nii"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o640


def test_affine_and_header_are_kept(tmp_path, series_path):
    out = tmp_path / "out.nii.gz"
    assert run_cli(series_path, out, "--nprocs", "1").returncode == 0
    source, written = nib.load(series_path).header, nib.load(out).header
    np.testing.assert_array_equal(written.get_best_affine(), source.get_best_affine())
    assert written.get_qform(coded=True)[1] == 1 and written.get_sform(coded=True)[1] == 4
    np.testing.assert_array_equal(written.get_qform(), source.get_qform())
    assert written.get_zooms() == source.get_zooms()  # voxel sizes and TR
    assert written.get_xyzt_units() == ("mm", "sec")
    assert written["descrip"] == source["descrip"]


def test_noise_and_rank_maps_are_3d_on_the_input_grid(tmp_path, series_path, expected):
    noise, rank = tmp_path / "noise.nii.gz", tmp_path / "rank.nii"
    result = run_cli(series_path, tmp_path / "out.nii.gz", "--noise", noise, "--rank", rank, "--nprocs", "1")
    assert result.returncode == 0, result.stderr
    for path, values in ((noise, expected.sigma), (rank, expected.rank)):
        image = nib.load(path)
        assert image.shape == SHAPE and image.get_data_dtype() == np.float32
        np.testing.assert_array_equal(image.affine, nib.load(series_path).affine)
        np.testing.assert_array_equal(np.asarray(image.dataobj), values)
    # the phantom's noise is 5 and its rank 3: the maps mean what they say
    assert abs(np.median(expected.sigma) - 5.0) < 0.75
    assert np.median(expected.rank) == pytest.approx(3, abs=1)


def test_options_reach_the_engine(tmp_path, series_path, noisy):
    out = tmp_path / "out.nii"
    options = dict(extent=(3, 5, 3), stride=1, estimator="exp1", aggregation="center", demean="none")
    result = run_cli(series_path, out, "--extent", "3,5,3", "--stride", "1", "--estimator", "exp1",
                     "--aggregation", "center", "--demean", "none", "--nprocs", "1")
    assert result.returncode == 0, result.stderr
    np.testing.assert_array_equal(nib.load(out).get_fdata(dtype=np.float32),
                                  denoise(noisy, **options, nprocs=1).denoised)


def test_shape_sphere_reaches_the_engine(tmp_path, series_path, noisy):
    out = tmp_path / "out.nii"
    result = run_cli(series_path, out, "--shape", "sphere", "--extent", "3", "--stride", "2", "--nprocs", "1")
    assert result.returncode == 0, result.stderr
    sphere = denoise(noisy, extent=3, stride=2, shape="sphere", nprocs=1).denoised
    np.testing.assert_array_equal(nib.load(out).get_fdata(dtype=np.float32), sphere)
    # (and not the cuboid's)
    assert np.abs(sphere - denoise(noisy, extent=3, stride=2, nprocs=1).denoised).max() > 1e-2


def test_mask_limits_the_denoised_voxels(tmp_path, series_path, noisy):
    mask = np.zeros(SHAPE, dtype=np.uint8)
    mask[2:7, 1:6, 1:6] = 1
    mask_path = save(mask, tmp_path / "mask.nii.gz", dtype=np.uint8)
    out = tmp_path / "out.nii.gz"
    assert run_cli(series_path, out, "--mask", mask_path, "--nprocs", "1").returncode == 0
    written = nib.load(out).get_fdata(dtype=np.float32)
    np.testing.assert_array_equal(written, denoise(noisy, mask, nprocs=1).denoised)
    assert not written[mask == 0].any()


@pytest.mark.parametrize("given", ["number", "map", "map with a trailing axis"])
def test_a_given_noise_level_decides_the_rank_and_fills_the_noise_map(tmp_path, series_path, noisy, given):
    if given == "number":
        noise_in, noise = "5", 5.0
    else:
        noise = np.random.default_rng(4).uniform(4.0, 6.0, size=SHAPE)
        stored = noise if given == "map" else noise[..., None]
        noise_in = save(stored, tmp_path / "sigma.nii.gz")
        noise = nib.load(noise_in).get_fdata()[..., 0] if given != "map" else nib.load(noise_in).get_fdata()
    out, noise_out = tmp_path / "out.nii.gz", tmp_path / "noise.nii.gz"
    result = run_cli(series_path, out, "--noise-in", noise_in, "--noise", noise_out, "--nprocs", "1")
    assert result.returncode == 0, result.stderr
    want = denoise(noisy, noise=noise, device="cpu", nprocs=1)
    np.testing.assert_array_equal(np.asarray(nib.load(out).dataobj), want.denoised)
    written = np.asarray(nib.load(noise_out).dataobj)
    np.testing.assert_array_equal(written, want.sigma)
    if given == "number":
        np.testing.assert_allclose(written, 5.0, rtol=1e-6)
    else:  # patch means of the map's sigma^2: inside its range, and not the estimate
        assert np.all((written >= 4.0) & (written <= 6.0))


def test_scaled_int16_input_gives_the_result_of_its_float_values(tmp_path, noisy):
    scaled = tmp_path / "scaled.nii.gz"
    save(noisy, scaled, dtype=np.int16)  # nibabel picks scl_slope/scl_inter to fit int16
    assert nib.load(scaled).dataobj.slope != 1
    values = nib.load(scaled).get_fdata(dtype=np.float32)
    floats = save(values, tmp_path / "floats.nii.gz")
    out_scaled, out_floats = tmp_path / "out_scaled.nii.gz", tmp_path / "out_floats.nii.gz"
    assert run_cli(scaled, out_scaled, "--nprocs", "1").returncode == 0
    assert run_cli(floats, out_floats, "--nprocs", "1").returncode == 0
    denoised = nib.load(out_scaled)
    assert denoised.get_data_dtype() == np.float32 and denoised.dataobj.slope == 1
    np.testing.assert_array_equal(np.asarray(denoised.dataobj), np.asarray(nib.load(out_floats).dataobj))
    np.testing.assert_array_equal(np.asarray(denoised.dataobj), denoise(values, nprocs=1).denoised)


# --- what a run says --------------------------------------------------------------------------------------


def test_a_run_ends_with_one_summary_line(tmp_path, series_path):
    result = run_cli(series_path, tmp_path / "out.nii.gz", "--nprocs", "1", "--device", "cpu")
    assert result.returncode == 0
    lines = stderr_lines(result)
    assert len(lines) == 1 and lines[0].startswith(f"{PROG}: denoised 9x8x7x16 in ")
    assert "cpu" in lines[0] and "median noise" in lines[0] and "median rank" in lines[0]
    assert result.stdout == ""


def test_timings_give_each_phase_of_the_command_and_their_total(tmp_path, series_path):
    """``--timings`` (with ``--quiet``, alone): one line, the phases in order, each number a time, the
    engine's parts within denoise, and a total that is at least their sum (start-up from the process's
    start, on Linux)."""
    import re

    result = run_cli(series_path, tmp_path / "out.nii.gz", "--nprocs", "1", "--device", "cpu", "--quiet",
                     "--timings")
    assert result.returncode == 0
    (line,) = stderr_lines(result)
    match = re.fullmatch(rf"{PROG}: timings: start-up (\S+) s, checks (\S+) s, read (\S+) s, denoise (\S+) s "
                         r"\(input check (\S+), plan (\S+), backend (\S+), output (\S+)\), write (\S+) s; "
                         r"total (\S+) s", line)
    assert match, line
    start_up, checks, read, denoise_s, *parts, write, total = map(float, match.groups())
    assert 0 < start_up < 60 and sum(parts) <= denoise_s + 0.01
    assert start_up + checks + read + denoise_s + write <= total + 0.01


def test_quiet_prints_nothing(tmp_path, series_path):
    result = run_cli(series_path, tmp_path / "out.nii.gz", "--nprocs", "1", "--quiet")
    assert result.returncode == 0 and result.stderr == "" and result.stdout == ""


def test_nan_voxels_give_one_warning_line_and_stay_nan(tmp_path, noisy):
    holed = noisy.copy()
    holed[4, 4, 3, 5] = np.nan
    out = tmp_path / "out.nii.gz"
    result = run_cli(save(holed, tmp_path / "holed.nii.gz"), out, "--nprocs", "1", "--quiet")
    assert result.returncode == 0
    assert stderr_lines(result) == [
        f"{PROG}: warning: 1 voxels hold NaN or Inf; they are left out of every patch and left as they were"]
    assert np.isnan(nib.load(out).get_fdata()[4, 4, 3, 5])


def test_help_gives_dwidenoise_mode_and_the_defaults():
    result = run_cli("--help")
    assert result.returncode == 0
    text = " ".join(result.stdout.split())
    assert "--extent auto --stride 1 --aggregation center --demean none --estimator exp2 --filter hard" in text
    for option in ("extent", "stride", "aggregation", "demean", "estimator"):
        assert f"(default: {DEFAULTS[option]})" in text, option


def test_version_is_the_package_version():
    from mppca_nipype import __version__
    result = run_cli("--version")
    assert result.returncode == 0 and result.stdout.strip() == f"{PROG} {__version__}"


# --- what a bad input does: one sentence, an exit status, nothing written -----------------------------------


def _not_4d(tmp_path, noisy):
    return [save(noisy[..., 0], tmp_path / "b0.nii.gz"), tmp_path / "out.nii.gz"]


def _too_few_volumes(tmp_path, noisy):
    return [save(noisy[..., :MIN_VOLUMES - 1], tmp_path / "short.nii.gz"), tmp_path / "out.nii.gz"]


def _missing(tmp_path, noisy):
    return [tmp_path / "absent.nii.gz", tmp_path / "out.nii.gz"]


def _a_folder(tmp_path, noisy):
    (tmp_path / "folder.nii.gz").mkdir()
    return [tmp_path / "folder.nii.gz", tmp_path / "out.nii.gz"]


def _corrupt(tmp_path, noisy):
    (tmp_path / "noise.nii").write_bytes(np.random.default_rng(0).bytes(4000))
    return [tmp_path / "noise.nii", tmp_path / "out.nii.gz"]


def _truncated_gz(tmp_path, noisy):
    whole = save(noisy, tmp_path / "whole.nii.gz").read_bytes()
    (tmp_path / "whole.nii.gz").unlink()
    (tmp_path / "cut.nii.gz").write_bytes(whole[: len(whole) // 2])
    return [tmp_path / "cut.nii.gz", tmp_path / "out.nii.gz"]


def _truncated_nii(tmp_path, noisy):
    whole = save(noisy, tmp_path / "whole.nii").read_bytes()
    (tmp_path / "whole.nii").unlink()
    (tmp_path / "cut.nii").write_bytes(whole[: len(whole) // 2])
    return [tmp_path / "cut.nii", tmp_path / "out.nii.gz"]


def _mask_of_another_shape(tmp_path, noisy):
    mask = save(np.ones((9, 8, 6), np.uint8), tmp_path / "mask.nii.gz", dtype=np.uint8)
    return [save(noisy, tmp_path / "dwi.nii.gz"), tmp_path / "out.nii.gz", "--mask", mask]


def _noise_map_of_another_shape(tmp_path, noisy):
    sigma = save(np.full((9, 8, 6), 5.0), tmp_path / "sigma.nii.gz")
    return [save(noisy, tmp_path / "dwi.nii.gz"), tmp_path / "out.nii.gz", "--noise-in", sigma]


def _noise_map_with_a_zero(tmp_path, noisy):
    values = np.full(SHAPE, 5.0)
    values[1, 2, 3] = 0
    sigma = save(values, tmp_path / "sigma.nii.gz")
    return [save(noisy, tmp_path / "dwi.nii.gz"), tmp_path / "out.nii.gz", "--noise-in", sigma]


def _with(*options, output="out.nii.gz"):
    def case(tmp_path, noisy):
        return [save(noisy, tmp_path / "dwi.nii.gz"), tmp_path / output,
                *(str(o).replace("TMP", str(tmp_path)) for o in options)]
    return case


BAD_INPUTS = {
    "not 4D": (_not_4d, 1, "must be a 4D series"),
    "too few volumes": (_too_few_volumes, 1, f"needs at least {MIN_VOLUMES}"),
    "missing file": (_missing, 1, "does not exist"),
    "a folder, not a file": (_a_folder, 1, "cannot be read"),
    "corrupt file": (_corrupt, 1, "cannot be read"),
    "truncated .nii.gz": (_truncated_gz, 1, "corrupt or truncated"),
    "truncated .nii": (_truncated_nii, 1, "corrupt or truncated"),
    "mask of another shape": (_mask_of_another_shape, 1, "the mask"),
    "even extent": (_with("--extent", "4"), 2, "--extent"),
    "two extents": (_with("--extent", "3,5"), 2, "--extent"),
    "stride 0": (_with("--stride", "0"), 2, "--stride"),
    "center needs stride 1": (_with("--aggregation", "center", "--stride", "2"), 2, "needs stride 1"),
    "unknown estimator": (_with("--estimator", "exp3"), 2, "--estimator"),
    "unknown shape": (_with("--shape", "ball"), 2, "--shape"),
    "sphere larger than the image": (_with("--shape", "sphere"), 2,
                                     "a sphere of radius 5 (515 voxels, at least the 343 of extent 7,7,7) needs 11 "
                                     "voxels along every axis, and the image is 9x8x7"),
    "missing output folder": (_with(output="absent/out.nii.gz"), 1, "does not exist"),
    "output not NIfTI": (_with(output="out.mif"), 1, ".nii or .nii.gz"),
    "noise map where no file can be created": (_with("--noise", "/proc/mppca-noise.nii.gz"), 1,
                                               "the noise map /proc/mppca-noise.nii.gz"),
    "rank map in a missing folder": (_with("--rank", "TMP/absent/rank.nii.gz"), 1, "does not exist"),
    "output over the input": (_with(output="dwi.nii.gz"), 2, "would overwrite the input"),
    "noise map over the output": (_with("--noise", "TMP/out.nii.gz"), 2, "also given as another output"),
    "negative noise level": (_with("--noise-in", "-2"), 2, "--noise-in: must be a positive number"),
    "zero noise level": (_with("--noise-in", "0"), 2, "--noise-in: must be a positive number"),
    "noise level as text": (_with("--noise-in", "five"), 1, "--noise-in five is neither a positive number"),
    "missing noise level file": (_with("--noise-in", "TMP/absent.nii.gz"), 1, "nor an existing file"),
    "noise level map of another grid": (_noise_map_of_another_shape, 1, "has shape (9, 8, 6)"),
    "noise level map with a zero": (_noise_map_with_a_zero, 1, "not a positive finite number at 1 voxels"),
}


@pytest.mark.parametrize("case", BAD_INPUTS.values(), ids=BAD_INPUTS.keys())
def test_bad_input_fails_with_one_sentence_and_writes_nothing(tmp_path, noisy, case):
    make_args, status, phrase = case
    args = make_args(tmp_path, noisy)
    before = {p.name: checksum(p) for p in tmp_path.iterdir() if p.is_file()}
    result = run_cli(*args, "--nprocs", "1")
    assert result.returncode == status
    lines = stderr_lines(result)
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"{PROG}: error: ") and phrase in lines[0]
    assert "Traceback" not in result.stderr and result.stdout == ""
    after = {p.name: checksum(p) for p in tmp_path.iterdir() if p.is_file()}
    assert after == before  # no output, no temporary file, inputs untouched


@pytest.mark.skipif(os.geteuid() == 0, reason="root can read and write regardless of permissions")
@pytest.mark.parametrize("what", ["unreadable input", "read-only output folder"])
def test_permissions_fail_with_one_sentence(tmp_path, series_path, what):
    locked = tmp_path / "locked"
    locked.mkdir()
    if what == "unreadable input":
        source, out = save(nib.load(series_path).get_fdata(), locked / "dwi.nii.gz"), tmp_path / "out.nii.gz"
        source.chmod(0)
    else:
        source, out = series_path, locked / "out.nii.gz"
        locked.chmod(0o555)
    try:
        result = run_cli(source, out, "--nprocs", "1")
    finally:
        source.chmod(0o644)
        locked.chmod(0o755)
    assert result.returncode == 1 and len(stderr_lines(result)) == 1
    assert stderr_lines(result)[0].startswith(f"{PROG}: error: ")
    assert not out.exists()


def test_options_and_outputs_are_checked_before_the_data_are_read(tmp_path, noisy):
    # a truncated series whose header is fine: any error about it would mean its values were read
    args = _truncated_gz(tmp_path, noisy)
    mask = save(np.ones((9, 8, 6), np.uint8), tmp_path / "mask.nii.gz", dtype=np.uint8)
    for extra, phrase in ((["--mask", mask], "the mask"),
                          (["--rank", tmp_path / "absent" / "rank.nii"], "does not exist"),
                          (["--aggregation", "center"], "needs stride 1"),
                          (["--noise-in", "absent.nii"], "nor an existing file")):
        lines = stderr_lines(run_cli(*args, *extra, "--nprocs", "1"))
        assert len(lines) == 1 and phrase in lines[0]


def test_a_failed_noise_map_write_leaves_no_output(tmp_path, series_path, monkeypatch, capsys):
    real_save_like = nifti_io.save_like

    def disk_full_for_the_noise_map(array, reference, path, *args, **kwargs):
        if array.ndim == 3:
            raise OSError(28, "No space left on device")
        return real_save_like(array, reference, path, *args, **kwargs)

    monkeypatch.setattr(nifti_io, "save_like", disk_full_for_the_noise_map)
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(SystemExit) as exit_info:
        cli.main([str(series_path), str(tmp_path / "out.nii.gz"), "--noise", str(tmp_path / "noise.nii.gz"),
                  "--nprocs", "1", "--quiet"])
    assert exit_info.value.code == 1
    noise = tmp_path / "noise.nii.gz"
    message = f"{PROG}: error: cannot write the noise map {noise}: No space left on device"
    assert capsys.readouterr().err == message + "\n"
    assert sorted(os.listdir(tmp_path)) == before


@pytest.mark.parametrize("signum, status, message", [(signal.SIGINT, 130, "interrupted"),
                                                      (signal.SIGTERM, 143, "terminated")])
def test_an_interrupted_run_exits_with_its_status_and_leaves_no_output(tmp_path, signum, status, message):
    series, _ = low_rank_phantom((30, 30, 20), 32, rank=3, sigma=5.0, seed=4)
    source = save(series, tmp_path / "large.nii")
    before = sorted(os.listdir(tmp_path))
    command = [sys.executable, "-m", "mppca_nipype.cli.denoise", str(source), str(tmp_path / "out.nii.gz"),
               "--stride", "1", "--aggregation", "center", "--nprocs", "1", "--quiet"]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    # the temporary output appears once every check has passed: the work is about to start
    while not any(name.startswith(".out.nii.gz") for name in os.listdir(tmp_path)):
        assert process.poll() is None and time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(0.2)
    process.send_signal(signum)
    stderr = process.communicate(timeout=60)[1]
    assert process.returncode == status
    assert stderr.splitlines() == [f"{PROG}: error: {message}"]
    assert sorted(os.listdir(tmp_path)) == before


def test_cuda_without_a_usable_gpu_fails_before_reading_with_the_reason(tmp_path, noisy):
    args = _truncated_gz(tmp_path, noisy)  # reading it would fail: the device must be checked first
    before = sorted(os.listdir(tmp_path))
    result = run_cli(*args, "--device", "cuda", "--nprocs", "1")
    if "corrupt or truncated" in result.stderr:
        pytest.skip("a usable GPU: the device check passed")
    assert result.returncode == 1
    lines = stderr_lines(result)
    assert len(lines) == 1 and lines[0].startswith(f"{PROG}: error: device 'cuda' was asked for but ")
    assert sorted(os.listdir(tmp_path)) == before


def test_the_command_ends_at_once_after_a_gpu_run_its_output_flushed(tmp_path):
    """After CUDA was started, ``console`` ends the process without Python's teardown (no atexit handler
    runs), with what it printed flushed and status 0; without CUDA it returns as usual."""
    script = tmp_path / "script.py"
    script.write_text(
        "import atexit, sys, types\n"
        "from mppca_nipype.cli import common\n"
        "atexit.register(lambda: print('teardown ran'))\n"
        "common.leave_now_after_the_gpu()\n"
        "print('returned without CUDA', end=' ')\n"
        "sys.modules['torch'] = types.SimpleNamespace(cuda=types.SimpleNamespace(is_initialized=lambda: True))\n"
        "common.leave_now_after_the_gpu()\n"
        "print('not reached')\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout == "returned without CUDA ", done.stdout + done.stderr
