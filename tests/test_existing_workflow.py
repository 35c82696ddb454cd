"""workflows/existing_workflow.py, the recipe for adding MPPCADenoise to someone's workflow, run as users run it.

DWI: denoise -> DIPY's tensor fit (through Nipype) -> DataSink; BOLD: denoise -> a temporal mean. The
denoised series must be the engine's, and the downstream step must have read it.
"""

from __future__ import annotations

import os
from pathlib import Path
import subprocess
import sys

import nibabel as nib
import numpy as np
import pytest

from mppca_nipype import denoise
from mppca_nipype.demo import write_gradients, write_series
from mppca_nipype.phantoms import dwi_phantom, low_rank_phantom

RECIPE = Path(__file__).resolve().parents[1] / "workflows" / "existing_workflow.py"


def run_recipe(cwd, *args):
    env = dict(os.environ, NIPYPE_NO_ET="1")
    done = subprocess.run([sys.executable, str(RECIPE), *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return done


def test_dwi_is_denoised_before_the_tensor_fit(tmp_path):
    pytest.importorskip("dipy")
    noisy, _, bvals, bvecs = dwi_phantom((12, 12, 8), 20, sigma=20.0, seed=3)
    write_series(tmp_path / "dwi.nii.gz", noisy)
    write_gradients(tmp_path / "dwi", bvals, bvecs)
    run_recipe(tmp_path, "dwi.nii.gz", "dwi.bval", "dwi.bvec", "out")
    denoised = nib.load(tmp_path / "out" / "denoised" / "dwi_denoised.nii.gz").get_fdata(dtype=np.float32)
    expected = denoise(nib.load(tmp_path / "dwi.nii.gz").get_fdata(dtype=np.float32), device="cpu").denoised
    np.testing.assert_allclose(denoised, expected, rtol=0, atol=1e-3)
    tensor = list((tmp_path / "out" / "tensor").glob("*dwi_denoised*"))
    assert len(tensor) == 1  # the fit read the denoised series (nipype names its output after its input)
    assert np.isfinite(nib.load(tensor[0]).get_fdata()).all()


def test_bold_is_denoised_before_the_first_preprocessing_step(tmp_path):
    noisy, _ = low_rank_phantom((10, 10, 8), 20, seed=5)
    write_series(tmp_path / "bold.nii.gz", noisy, repetition_time=2.0)
    run_recipe(tmp_path, "bold.nii.gz", "out")
    denoised = nib.load(tmp_path / "out" / "denoised" / "bold_denoised.nii.gz").get_fdata(dtype=np.float32)
    mean = nib.load(tmp_path / "out" / "mean" / "mean.nii.gz").get_fdata(dtype=np.float32)
    np.testing.assert_allclose(mean, denoised.mean(axis=3), rtol=1e-5, atol=1e-3)
    assert not np.allclose(mean, noisy.mean(axis=3), atol=1e-3)  # it did read the denoised series
