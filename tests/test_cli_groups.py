"""``mppca-denoise --demean shells|groups:FILE`` and ``--echo``, and the Nipype interface's ``demean``
``shells``/``groups`` and ``echo_files``: they write what ``denoise()`` computes from the same labels, b-values
and echoes; the command refuses bad label or b-value files with one sentence before reading the series,
writing nothing."""

from __future__ import annotations

import subprocess
import sys

import nibabel as nib
import numpy as np
import pytest

from mppca_nipype.engine import denoise
from mppca_nipype.engine.groups import shell_labels
from test_groups import echo_phantom, grouped_series

BVALS = np.array([0, 5, 995, 1000, 1005, 2000, 1990, 2010, 1000, 10, 2005, 995] * 2)
OPTIONS = ("--extent", "3", "--stride", "2", "--device", "cpu", "--nprocs", "1")


def run_cli(*args, cwd):
    command = [sys.executable, "-m", "mppca_nipype.cli.denoise", *map(str, args), *OPTIONS]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=cwd)


def save(array, path):
    nib.save(nib.Nifti1Image(np.asarray(array, np.float32), np.diag([2.0, 2.0, 2.5, 1.0])), path)


@pytest.fixture
def dwi(tmp_path):
    data = grouped_series((7, 6, 5), shell_labels(BVALS), seed=1)
    save(data, tmp_path / "dwi.nii.gz")
    (tmp_path / "dwi.bval").write_text(" ".join(f"{b:g}" for b in BVALS) + "\n")
    return data


def read(path):
    return np.asarray(nib.load(path).dataobj, dtype=np.float32)


def test_shells_from_the_bval_beside_the_input(tmp_path, dwi):
    result = run_cli("dwi.nii.gz", "out.nii.gz", "--demean", "shells", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    expected = denoise(dwi, extent=3, stride=2, device="cpu", nprocs=1, demean="shells", bvals=BVALS)
    np.testing.assert_array_equal(read(tmp_path / "out.nii.gz"), expected.denoised)
    assert "3 groups of volumes (21 usable)" in result.stderr


def test_groups_from_a_file_of_labels_and_shells_from_bval(tmp_path, dwi):
    (tmp_path / "labels.txt").write_text("\n".join(str(label) for label in shell_labels(BVALS) * 7) + "\n")
    (tmp_path / "other.bval").write_text(" ".join(f"{b:g}" for b in BVALS))
    (tmp_path / "dwi.bval").unlink()
    grouped = run_cli("dwi.nii.gz", "groups.nii.gz", "--demean", "groups:labels.txt", cwd=tmp_path)
    shells = run_cli("dwi.nii.gz", "shells.nii.gz", "--demean", "shells", "--bval", "other.bval", cwd=tmp_path)
    assert grouped.returncode == 0 and shells.returncode == 0, grouped.stderr + shells.stderr
    np.testing.assert_array_equal(read(tmp_path / "groups.nii.gz"), read(tmp_path / "shells.nii.gz"))


@pytest.mark.parametrize("labels,message", [
    ("0 1 2\n", "the labels of the group file labels.txt must be one integer per volume (24), not 3 values"),
    ("0 1 x" + " 1" * 21, "the group file labels.txt must hold numbers only, not 'x'"),
    ("0 1.5" + " 1" * 22, "the labels of the group file labels.txt must be integers, but volume 1 has 1.5"),
])
def test_a_bad_group_file_fails_with_one_sentence_and_writes_nothing(tmp_path, dwi, labels, message):
    (tmp_path / "labels.txt").write_text(labels)
    result = run_cli("dwi.nii.gz", "out.nii.gz", "--demean", "groups:labels.txt", cwd=tmp_path)
    assert result.returncode == 1
    assert result.stderr.splitlines() == [f"mppca-denoise: error: {message}"]
    assert not (tmp_path / "out.nii.gz").exists()


def test_shells_without_a_bval_fail_with_one_sentence(tmp_path, dwi):
    (tmp_path / "dwi.bval").unlink()
    result = run_cli("dwi.nii.gz", "out.nii.gz", "--demean", "shells", cwd=tmp_path)
    assert result.returncode == 1
    assert result.stderr.splitlines() == ["mppca-denoise: error: --demean shells needs the b-values: there is no "
                                          "dwi.bval beside IN; give --bval FILE"]


def test_echoes_are_denoised_jointly_one_output_each(tmp_path):
    noisy, _ = echo_phantom(shape=(7, 6, 5), n_volumes=10)
    for e in range(3):
        save(noisy[:, :, :, e], tmp_path / f"echo-{e + 1}.nii.gz")
    result = run_cli("echo-1.nii.gz", "den-1.nii.gz", "--echo", "echo-2.nii.gz", "den-2.nii.gz",
                     "--echo", "echo-3.nii.gz", "den-3.nii.gz", "--noise", "sigma.nii.gz", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    expected = denoise(noisy, extent=3, stride=2, device="cpu", nprocs=1)
    for e in range(3):
        np.testing.assert_array_equal(read(tmp_path / f"den-{e + 1}.nii.gz"), expected.denoised[:, :, :, e])
    np.testing.assert_array_equal(read(tmp_path / "sigma.nii.gz"), expected.sigma)
    assert "3 echoes denoised jointly" in result.stderr


def test_an_echo_of_another_shape_fails_before_anything_is_written(tmp_path, dwi):
    save(dwi[..., :12], tmp_path / "echo-1.nii.gz")
    result = run_cli("echo-1.nii.gz", "den-1.nii.gz", "--echo", "dwi.nii.gz", "den-2.nii.gz", cwd=tmp_path)
    assert result.returncode == 1
    assert result.stderr.splitlines() == ["mppca-denoise: error: the echo dwi.nii.gz has shape (7, 6, 5, 24), but "
                                          "IN's is (7, 6, 5, 12)"]
    assert not list(tmp_path.glob("den-*"))


def test_the_interface_takes_shells_groups_and_echoes(tmp_path, dwi, monkeypatch):
    from mppca_nipype.interfaces import MPPCADenoise

    monkeypatch.chdir(tmp_path)
    options = dict(extent=3, stride=2, use_gpu=False, num_threads=1)
    shells = MPPCADenoise(in_file=str(tmp_path / "dwi.nii.gz"), demean="shells", bval_file=str(tmp_path / "dwi.bval"),
                          **options).run().outputs
    expected = denoise(dwi, extent=3, stride=2, device="cpu", nprocs=1, demean="shells", bvals=BVALS)
    np.testing.assert_array_equal(read(shells.out_file), expected.denoised)
    labels = [int(label) for label in shell_labels(BVALS)]
    groups = MPPCADenoise(in_file=str(tmp_path / "dwi.nii.gz"), demean="groups", volume_groups=labels,
                          **options).run().outputs
    np.testing.assert_array_equal(read(groups.out_file), expected.denoised)

    noisy, _ = echo_phantom(shape=(7, 6, 5), n_volumes=10)
    for e in range(3):
        save(noisy[:, :, :, e], tmp_path / f"echo-{e + 1}.nii.gz")
    echoes = MPPCADenoise(in_file=str(tmp_path / "echo-1.nii.gz"),
                          echo_files=[str(tmp_path / f"echo-{e}.nii.gz") for e in (2, 3)], **options).run().outputs
    joint = denoise(noisy, extent=3, stride=2, device="cpu", nprocs=1).denoised
    for e, path in enumerate([echoes.out_file, *echoes.echo_out_files]):
        np.testing.assert_array_equal(read(path), joint[:, :, :, e])
