"""``estimator``, by every entry point: ``denoise`` and ``resolve_options`` take the four estimators and refuse
anything else in one sentence; ``mppca-denoise``, ``mppca-noise`` and ``mppca-nipype`` take ``--estimator``
and list its choices; the Nipype interface and the workflows take it, record it and cite its paper."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from mppca_nipype import MPPCAInputError, denoise
from mppca_nipype.engine import MPPCAWarning, resolve_options
from mppca_nipype.engine.estimators import ESTIMATORS
from test_engine_cpu import case_data

NEW = ["med", "olesen2023"]


def test_the_estimators_are_the_four_documented():
    assert ESTIMATORS == ("exp2", "exp1", "med", "olesen2023")


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_resolve_options_takes_every_estimator(estimator):
    options = resolve_options((9, 8, 7, 16), extent=3, stride=2, estimator=estimator, aggregation="weighted",
                              demean="volume")
    assert options.estimator == estimator


@pytest.mark.parametrize("estimator", ["exp3", "median", "olesen", "MED", ""])
def test_an_unknown_estimator_is_refused_in_one_sentence_naming_the_choices(estimator):
    data, _, _ = case_data("time-side")
    with pytest.raises(MPPCAInputError) as raised:
        denoise(data, estimator=estimator, device="cpu", nprocs=1)
    message = str(raised.value)
    assert message.startswith("estimator must be one of exp2, exp1, med, olesen2023")
    assert "\n" not in message


@pytest.mark.parametrize("estimator", NEW)
def test_denoise_records_the_estimator_and_differs_from_exp2(estimator):
    data, _, _ = case_data("time-side", seed=5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MPPCAWarning)
        result = denoise(data, estimator=estimator, device="cpu", nprocs=1)
        exp2 = denoise(data, estimator="exp2", device="cpu", nprocs=1)
    assert result.info["estimator"] == estimator
    assert not np.array_equal(result.sigma, exp2.sigma)


@pytest.mark.parametrize("estimator", NEW)
def test_mppca_denoise_takes_the_estimator_and_writes_what_denoise_computes(tmp_path, estimator):
    import nibabel as nib

    from test_cli_denoise import run_cli, save

    data, _, _ = case_data("time-side", seed=6)
    save(data, tmp_path / "in.nii")
    out, noise = tmp_path / "out.nii", tmp_path / "noise.nii"
    result = run_cli(tmp_path / "in.nii", out, "--noise", noise, "--estimator", estimator, "--nprocs", "1",
                     "--device", "cpu", "--quiet")
    assert result.returncode == 0, result.stderr
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MPPCAWarning)
        expected = denoise(data, estimator=estimator, device="cpu", nprocs=1)
    np.testing.assert_array_equal(nib.load(out).get_fdata(dtype=np.float32), expected.denoised)
    np.testing.assert_array_equal(nib.load(noise).get_fdata(dtype=np.float32), expected.sigma)


def test_mppca_denoise_lists_the_estimators_and_refuses_another(tmp_path):
    from test_cli_denoise import run_cli

    assert "exp2,exp1,med,olesen2023" in run_cli("--help").stdout
    result = run_cli(tmp_path / "in.nii", tmp_path / "out.nii", "--estimator", "exp3")
    assert result.returncode == 2 and "--estimator: invalid choice: 'exp3'" in result.stderr


@pytest.mark.parametrize("estimator", NEW)
def test_mppca_noise_takes_the_estimator(tmp_path, estimator):
    import nibabel as nib

    from mppca_nipype import estimate_noise
    from mppca_nipype.cli import noise as noise_command
    from test_cli_denoise import save

    data, _, _ = case_data("time-side", seed=7)
    save(data, tmp_path / "in.nii")
    noise_command.main([str(tmp_path / "in.nii"), str(tmp_path / "sigma.nii"), "--estimator", estimator,
                        "--nprocs", "1", "--quiet"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MPPCAWarning)
        expected = estimate_noise(data, estimator=estimator, nprocs=1)
    np.testing.assert_array_equal(nib.load(tmp_path / "sigma.nii").get_fdata(dtype=np.float32), expected.sigma)


def test_mppca_nipype_takes_the_estimator(tmp_path):
    from mppca_nipype.cli.bids_app import AppError, build_parser

    def parse(*extra):
        return build_parser().parse_args([str(tmp_path), str(tmp_path / "out"), "participant", *extra])

    assert parse().estimator == "olesen2023"
    for estimator in ESTIMATORS:
        assert parse("--estimator", estimator).estimator == estimator
    with pytest.raises(AppError, match="--estimator: invalid choice: 'exp3'"):
        parse("--estimator", "exp3")


def test_the_interface_takes_the_estimators_and_refuses_another():
    from traits.api import TraitError

    from mppca_nipype.interfaces import MPPCADenoise

    assert MPPCADenoise().inputs.estimator == "olesen2023"
    for estimator in ESTIMATORS:
        assert MPPCADenoise(estimator=estimator).inputs.estimator == estimator
    with pytest.raises(TraitError):
        MPPCADenoise(estimator="exp3")


def test_the_interface_passes_the_estimator_and_the_provenance_records_it(tmp_path):
    import nibabel as nib

    from bids_helpers import read_json
    from mppca_nipype.demo import write_series
    from mppca_nipype.interfaces import MPPCADenoise
    from mppca_nipype.phantoms import dwi_phantom
    from test_interfaces import run_in

    noisy = dwi_phantom((10, 10, 8), 30, sigma=20.0, seed=3)[0]
    series = write_series(tmp_path / "in" / "dwi.nii.gz", noisy)
    result = run_in(tmp_path / "node", MPPCADenoise(in_file=str(series), estimator="olesen2023", use_gpu=False,
                                                     num_threads=1))
    provenance = read_json(result.outputs.provenance_file)
    assert provenance["Parameters"]["estimator"] == "olesen2023"
    assert provenance["EngineInfo"]["estimator"] == "olesen2023"
    expected = denoise(nib.load(series).get_fdata(dtype=np.float32), estimator="olesen2023", device="cpu",
                       nprocs=1)
    np.testing.assert_allclose(nib.load(result.outputs.noise_file).get_fdata(), expected.sigma, rtol=0,
                               atol=1e-4)


@pytest.mark.parametrize("estimator, doi, named", [
    ("med", "10.1109/TIT.2014.2323359", "median of the Marchenko-Pastur distribution"),
    ("olesen2023", "10.1002/mrm.29478", "degrees of freedom the signal components leave")])
def test_the_methods_text_describes_the_estimator_and_cites_its_paper(estimator, doi, named):
    from mppca_nipype.workflows import citation_text, init_mppca_wf

    workflow = init_mppca_wf(estimator=estimator, use_gpu=False)
    assert named in workflow.__desc__ and "dwidenoise" not in workflow.__desc__
    assert doi in workflow.__postdesc__
    assert "[@" not in citation_text(workflow)
    # the same paper once, also where the filter cites it
    both = init_mppca_wf(estimator=estimator, filter="optthresh", use_gpu=False)
    assert both.__postdesc__.count("10.1109/TIT.2014.2323359") == 1
    assert doi not in init_mppca_wf(estimator="exp2", use_gpu=False).__postdesc__
