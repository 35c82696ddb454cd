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
