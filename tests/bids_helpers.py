"""Tiny generated BIDS datasets and checks shared by the interface and BIDS-app tests."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from mppca_nipype.bids import validate
from mppca_nipype.demo import write_gradients, write_raw_description, write_series
from mppca_nipype.io import write_json_atomic
from mppca_nipype.phantoms import dwi_phantom, low_rank_phantom

SHAPE = (10, 10, 8)
N_DWI = 16
N_BOLD = 14


def make_dataset(root, subjects=("01", "02"), session="1"):
    """Two subjects, each with one session holding a DWI run and two runs of task ``rest``.

    The gradient table sits at the top (``dwi.bval``/``dwi.bvec``) so that it is found only through BIDS
    inheritance; ``task-rest_bold.json`` at the top carries TaskName and RepetitionTime the same way.
    """
    root = Path(root)
    write_raw_description(root, "tiny test dataset", subjects)
    noisy, _, bvals, bvecs = dwi_phantom(SHAPE, N_DWI, sigma=20.0, seed=1)
    write_gradients(root / "dwi", bvals, bvecs)
    write_json_atomic(root / "task-rest_bold.json", {"TaskName": "rest", "RepetitionTime": 2.0})
    for k, subject in enumerate(subjects):
        folder = root / f"sub-{subject}" / f"ses-{session}"
        stem = f"sub-{subject}_ses-{session}"
        noisy, _, _, _ = dwi_phantom(SHAPE, N_DWI, sigma=20.0, seed=10 + k)
        write_series(folder / "dwi" / f"{stem}_dwi.nii.gz", noisy)
        for run in (1, 2):
            bold, _ = low_rank_phantom(SHAPE, N_BOLD, rank=3, sigma=5.0, seed=20 + 2 * k + run)
            write_series(folder / "func" / f"{stem}_task-rest_run-{run}_bold.nii.gz", bold,
                         repetition_time=2.0)
    return root


def checksums(root) -> dict:
    """sha256 and mtime of every file under ``root``, and the list of folders: what 'unchanged' means."""
    found = {}
    for folder, subfolders, files in os.walk(root):
        found[os.path.relpath(folder, root) + "/"] = None
        for name in files:
            path = os.path.join(folder, name)
            found[os.path.relpath(path, root)] = (hashlib.sha256(Path(path).read_bytes()).hexdigest(),
                                                  os.stat(path).st_mtime_ns)
    return found


def validator_errors(dataset):
    """The validator's errors on ``dataset``; skips the test when it cannot run (fails under CI)."""
    errors, why_not = validate(dataset)
    if errors is None:
        if os.environ.get("MPPCA_REQUIRE_PEERS") == "1":
            pytest.fail(f"MPPCA_REQUIRE_PEERS=1 but {why_not}")
        pytest.skip(why_not)
    return errors


def read_json(path):
    return json.loads(Path(path).read_text())
