"""io: staged files (all destinations or none, and an earlier run's files as they were when a commit fails),
atomic JSON, file locks."""

import json
import os
from pathlib import Path
import subprocess
import sys

import numpy as np
import pytest

from mppca_nipype import io
from mppca_nipype.engine.errors import MPPCAInputError


def write_all(staged, text):
    for destination, tmp in staged.items():
        tmp.write_text(f"{text} {os.path.basename(destination)}")


def test_every_destination_is_written_together(tmp_path):
    destinations = [tmp_path / "a.nii.gz", tmp_path / "b.json"]
    with io.staged_files(destinations) as staged:
        assert all(not d.exists() for d in destinations)
        write_all(staged, "new")
    assert [d.read_text() for d in destinations] == ["new a.nii.gz", "new b.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.nii.gz", "b.json"]  # no temporary left


def test_a_failing_block_leaves_the_earlier_files_untouched(tmp_path):
    destinations = [tmp_path / "a.nii.gz", tmp_path / "b.json"]
    for d in destinations:
        d.write_text("old")
    with pytest.raises(RuntimeError):
        with io.staged_files(destinations) as staged:
            write_all(staged, "new")
            raise RuntimeError("the work failed")
    assert [d.read_text() for d in destinations] == ["old", "old"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.nii.gz", "b.json"]


@pytest.mark.parametrize("hard_links", [True, False])
def test_a_rename_failing_midway_puts_back_what_was_there(tmp_path, monkeypatch, hard_links):
    """The second of three renames fails: the first destination gets its earlier file back (it had one),
    the third keeps its own, a destination that did not exist before does not appear; nothing is left
    beside them. Also where the file system has no hard links (the earlier file is renamed aside)."""
    first, second, third = tmp_path / "a.nii.gz", tmp_path / "b.nii.gz", tmp_path / "c.json"
    first.write_text("earlier a")
    third.write_text("earlier c")
    real_replace = os.replace

    def replace(source, destination):
        if str(destination) == str(second):
            raise OSError(28, "No space left on device")
        return real_replace(source, destination)

    if not hard_links:
        def no_link(*args):
            raise OSError(1, "Operation not permitted")
        monkeypatch.setattr(io.os, "link", no_link)
    with pytest.raises(OSError):
        with io.staged_files([first, second, third]) as staged:
            write_all(staged, "new")
            monkeypatch.setattr(io.os, "replace", replace)
    assert first.read_text() == "earlier a" and third.read_text() == "earlier c" and not second.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.nii.gz", "c.json"]


def test_an_unwritable_destination_fails_before_the_work_with_its_label(tmp_path):
    missing = tmp_path / "no-such-folder" / "out.nii.gz"
    ran = []
    with pytest.raises(MPPCAInputError, match="cannot write the noise map .*out.nii.gz"):
        with io.staged_files([missing], what={missing: "noise map"}):
            ran.append(True)
    assert not ran


def test_json_is_written_atomically_with_numpy_values_and_paths_converted(tmp_path):
    destination = tmp_path / "provenance.json"
    destination.write_text("earlier")
    io.write_json_atomic(destination, {"sigma": np.float32(2.5), "rank": np.arange(3), "file": Path("a/b.nii"),
                                       "extent": (7, 7, 7)})
    assert json.loads(destination.read_text()) == {"sigma": 2.5, "rank": [0, 1, 2], "file": "a/b.nii",
                                                   "extent": [7, 7, 7]}
    assert [p.name for p in tmp_path.iterdir()] == ["provenance.json"]  # no temporary left


def test_a_held_lock_refuses_another_process_that_will_not_wait(tmp_path):
    """fcntl locks belong to a process: the second holder must be another one."""
    lock = tmp_path / "locks" / "dataset.lock"
    other = [sys.executable, "-c", "import sys; from mppca_nipype.io import file_lock\n"
             "try:\n    with file_lock(sys.argv[1], wait=False): pass\nexcept BlockingIOError: sys.exit(3)",
             str(lock)]
    with io.file_lock(lock):
        assert subprocess.run(other).returncode == 3
    assert subprocess.run(other).returncode == 0, "the lock must go with the block's end"


def test_compressed_outputs_are_standard_gzip_with_the_references_geometry(tmp_path):
    """``save_like`` to .nii.gz (ISA-L on threads): Python's own gzip decompresses it to the NIfTI nibabel
    writes, and MRtrix3 reads it; the values, affine and units are the reference's."""
    import gzip

    import nibabel as nib

    from conftest import require

    rng = np.random.default_rng(3)
    values = (1000 + 30 * rng.standard_normal((23, 19, 11, 7))).astype(np.float32)
    reference = nib.Nifti1Image(values, np.diag([2.0, 2.5, 3.0, 1.0]))
    reference.header.set_xyzt_units("mm", "sec")
    path = io.save_like(values, reference, tmp_path / "out.nii.gz")
    unpacked = nib.Nifti1Image.from_bytes(gzip.decompress(path.read_bytes()))
    np.testing.assert_array_equal(np.asarray(unpacked.dataobj), values)
    np.testing.assert_array_equal(unpacked.affine, reference.affine)
    assert unpacked.header.get_xyzt_units() == ("mm", "sec")
    size = subprocess.run([require("mrinfo"), str(path), "-size"], capture_output=True, text=True, check=True)
    assert size.stdout.split() == ["23", "19", "11", "7"]


@pytest.mark.parametrize("dtype, slope, inter", [(np.float32, 1.0, 0.0), (">f4", 1.0, 0.0), (np.int16, 2.5, 10.0),
                                                 (np.float32, 2.0, 0.0)])
def test_compressed_inputs_read_as_nibabel_reads_them(tmp_path, dtype, slope, inter, monkeypatch):
    """``read_data`` of a .nii.gz written by nibabel's own gzip (ISA-L decompresses it): nibabel's values,
    scaling applied, in NIfTI's (Fortran) order; float32 without scaling (either byte order) decompressed
    straight into the array, in reads smaller than the series."""
    monkeypatch.setattr(io, "READ_BYTES", 1000)
    import nibabel as nib

    rng = np.random.default_rng(4)
    stored = rng.integers(0, 3000, size=(13, 11, 9, 5)).astype(dtype)
    image = nib.Nifti1Image(stored, np.eye(4))
    image.header.set_slope_inter(slope, inter)
    nib.save(image, tmp_path / "in.nii.gz")
    loaded = nib.load(tmp_path / "in.nii.gz")
    got = io.read_data(loaded, tmp_path / "in.nii.gz")
    np.testing.assert_array_equal(got, loaded.get_fdata(dtype=np.float32))
    assert got.dtype == np.float32 and np.abs(got).max() > 1000
    assert got.flags.f_contiguous and got.flags.writeable
    direct = io._decompressed(loaded, io._isal("igzip").open(tmp_path / "in.nii.gz", "rb"), np.float32)
    assert (direct is not None) == (np.dtype(dtype).kind == "f" and slope == 1.0)


def test_a_truncated_compressed_input_fails_with_one_sentence(tmp_path):
    import nibabel as nib

    values = np.random.default_rng(5).standard_normal((19, 18, 17, 6)).astype(np.float32)
    nib.save(nib.Nifti1Image(values, np.eye(4)), tmp_path / "in.nii.gz")
    data = (tmp_path / "in.nii.gz").read_bytes()
    (tmp_path / "cut.nii.gz").write_bytes(data[:len(data) // 2])
    image = io.load_image(tmp_path / "cut.nii.gz")  # the header is there, half the voxels are not
    with pytest.raises(MPPCAInputError, match="corrupt or truncated"):
        io.read_data(image, tmp_path / "cut.nii.gz")


@pytest.mark.parametrize("dtype, slope", [(np.float32, 1.0), (np.float32, 2.0), (np.int16, 1.0)])
def test_a_compressed_series_read_ahead_by_a_child_equals_read_data(tmp_path, dtype, slope, monkeypatch):
    """``read_ahead`` decompresses a float32 .nii.gz without scaling in a forked child, into memory this
    process then reads: ``read_data``'s values, in Fortran order, the child reaped; anything else (a scaling,
    integers) is left to ``read_data`` (None, nothing started)."""
    import nibabel as nib

    if not sys.platform.startswith("linux") or io._isal("igzip") is None:
        pytest.skip("the read-ahead forks (Linux) and inflates with ISA-L")
    monkeypatch.setattr(io, "READ_BYTES", 1000)
    stored = np.random.default_rng(6).integers(0, 3000, size=(13, 11, 9, 5)).astype(dtype)
    image = nib.Nifti1Image(stored, np.eye(4))
    image.header.set_slope_inter(slope, 0.0)
    nib.save(image, tmp_path / "in.nii.gz")
    ahead = io.read_ahead(tmp_path / "in.nii.gz")
    if not (np.dtype(dtype) == np.float32 and slope == 1.0):
        assert ahead is None
        return
    child = ahead.child
    got = ahead.result()
    np.testing.assert_array_equal(got, io.read_data(io.load_image(tmp_path / "in.nii.gz"), tmp_path / "in.nii.gz"))
    assert got.flags.f_contiguous and got.flags.writeable and ahead.child is None
    with pytest.raises(ProcessLookupError):  # reaped
        os.kill(child, 0)


def test_a_truncated_series_read_ahead_gives_none_and_a_cancelled_one_leaves_no_child(tmp_path, monkeypatch):
    """A child that meets the file's end early fails: ``result`` is None (``read_data`` then says what is
    wrong); ``cancel`` kills a child still reading (one byte a read: minutes) and reaps it at once."""
    import time

    import nibabel as nib

    if not sys.platform.startswith("linux") or io._isal("igzip") is None:
        pytest.skip("the read-ahead forks (Linux) and inflates with ISA-L")
    values = np.random.default_rng(7).standard_normal((40, 40, 30, 40)).astype(np.float32)
    nib.save(nib.Nifti1Image(values, np.eye(4)), tmp_path / "in.nii.gz")
    data = (tmp_path / "in.nii.gz").read_bytes()
    (tmp_path / "cut.nii.gz").write_bytes(data[:len(data) // 2])
    assert io.read_ahead(tmp_path / "cut.nii.gz").result() is None
    monkeypatch.setattr(io, "READ_BYTES", 1)
    ahead = io.read_ahead(tmp_path / "in.nii.gz")
    child, started = ahead.child, time.perf_counter()
    ahead.cancel()
    assert time.perf_counter() - started < 5
    assert ahead.child is None and ahead.values is None
    with pytest.raises(ProcessLookupError):
        os.kill(child, 0)
