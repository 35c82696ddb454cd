"""MPPCADenoise and init_mppca_wf: what the interface writes, and that it behaves inside a user's workflow."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
from nipype import Function, Node, Workflow
from nipype.interfaces.io import DataSink

from bids_helpers import N_DWI, SHAPE, read_json
from mppca_nipype import denoise
from mppca_nipype.demo import write_series
from mppca_nipype.interfaces import MPPCADenoise, gpu_probably_usable
from mppca_nipype.phantoms import dwi_phantom
from mppca_nipype.workflows import init_mppca_wf

SIGMA = 20.0


@pytest.fixture
def series(tmp_path):
    noisy, _, _, _ = dwi_phantom(SHAPE, N_DWI, sigma=SIGMA, seed=3)
    return write_series(tmp_path / "in" / "dwi.nii.gz", noisy)


def run_in(folder, interface):
    folder.mkdir(parents=True, exist_ok=True)
    cwd = os.getcwd()
    os.chdir(folder)
    try:
        return interface.run()
    finally:
        os.chdir(cwd)


def test_interface_writes_what_the_engine_computes(series, tmp_path):
    result = run_in(tmp_path / "node", MPPCADenoise(in_file=str(series), use_gpu=False, stride=1))
    out = result.outputs
    expected = denoise(nib.load(series).get_fdata(dtype=np.float32), stride=1, device="cpu", nprocs=1)
    np.testing.assert_allclose(nib.load(out.out_file).get_fdata(), expected.denoised, rtol=0, atol=1e-3)
    np.testing.assert_allclose(nib.load(out.noise_file).get_fdata(), expected.sigma, rtol=0, atol=1e-4)
    np.testing.assert_allclose(nib.load(out.rank_file).get_fdata(), expected.rank, rtol=0, atol=1e-4)
    assert nib.load(out.noise_file).shape == SHAPE
    assert all(Path(f).parent == tmp_path / "node" for f in (out.out_file, out.noise_file, out.rank_file))
    np.testing.assert_array_equal(nib.load(out.out_file).affine, nib.load(series).affine)


def test_provenance_records_parameters_backend_versions_and_checksum(series, tmp_path):
    result = run_in(tmp_path / "node", MPPCADenoise(in_file=str(series), use_gpu=False, estimator="exp1",
                                                     extent="auto", stride=2, demean="voxel", num_threads=1))
    provenance = read_json(result.outputs.provenance_file)
    assert provenance["Parameters"] == dict(extent="auto", stride=2, shape="cuboid", estimator="exp1",
                                            aggregation="gaussian",
                                            demean="voxel", filter="optshrink", noise_floor="none", coils=1,
                                            use_gpu=False,
                                            num_threads=1)
    assert provenance["Backend"] == "cpu" and provenance["Device"] == "cpu"
    assert provenance["EngineInfo"]["extent"] == [3, 3, 3]
    assert set(provenance["SoftwareVersions"]) == {"mppca-nipype", "numpy", "torch", "triton",
                                                   "nvmath-python", "nipype", "pybids", "nibabel"}
    assert provenance["SoftwareVersions"]["numpy"] == np.__version__
    assert all(v for v in provenance["SoftwareVersions"].values())  # a version or 'not installed'
    assert provenance["InputSHA256"] == hashlib.sha256(series.read_bytes()).hexdigest()
    assert provenance["WallTimeSeconds"] > 0
    timings = provenance["Timings"]  # seconds by phase, the engine's parts within "denoise"
    assert list(timings) == ["read", "denoise", "write", "total"]
    assert set(timings["denoise"]["parts"]) == {"input check", "plan", "backend", "output"}
    # each figure is rounded to the ms: a sum of k of them may pass the rounded whole by (k + 1) / 2 ms
    assert sum(timings["denoise"]["parts"].values()) <= timings["denoise"]["seconds"] + 2.5e-3
    assert timings["read"] + timings["denoise"]["seconds"] + timings["write"] <= timings["total"] + 2e-3
    # the phantom's noise is 20: the median estimate inside the image must be near it
    assert 10 < provenance["NoiseMedian"] < 30
    assert 0 <= provenance["RankMedian"] <= N_DWI


def test_shape_sphere_reaches_the_engine_and_the_provenance(series, tmp_path):
    result = run_in(tmp_path / "node", MPPCADenoise(in_file=str(series), use_gpu=False, shape="sphere",
                                                     extent=3, num_threads=1))
    expected = denoise(nib.load(series).get_fdata(dtype=np.float32), extent=3, shape="sphere", device="cpu",
                       nprocs=1)
    np.testing.assert_allclose(nib.load(result.outputs.out_file).get_fdata(), expected.denoised, rtol=0, atol=1e-3)
    provenance = read_json(result.outputs.provenance_file)
    assert provenance["Parameters"]["shape"] == "sphere"
    assert provenance["EngineInfo"]["shape"] == "sphere" and provenance["EngineInfo"]["extent"] == [5, 5, 5]
    assert MPPCADenoise().inputs.shape == "cuboid"


def test_init_mppca_wf_passes_the_patch_shape_and_says_it_in_the_methods():
    workflow = init_mppca_wf(patch_shape="sphere", use_gpu=False)
    assert workflow.get_node("denoise").inputs.shape == "sphere"
    assert "spheres (the voxels within a Euclidean radius of the centre)" in workflow.__desc__
    assert "spheres" not in init_mppca_wf(use_gpu=False).__desc__


@pytest.mark.parametrize("extent", [3, [3, 3, 5], (5, 3, 3)])
def test_extent_as_one_or_three_numbers_reaches_the_engine(series, tmp_path, extent):
    result = run_in(tmp_path / "node", MPPCADenoise(in_file=str(series), use_gpu=False, extent=extent))
    resolved = read_json(result.outputs.provenance_file)["EngineInfo"]["extent"]
    assert resolved == ([extent] * 3 if isinstance(extent, int) else list(extent))


def test_mask_zeroes_outside_and_summaries_use_it(series, tmp_path):
    mask = np.zeros(SHAPE, np.uint8)
    mask[2:8, 2:8, 2:6] = 1
    image = nib.load(series)
    mask_file = tmp_path / "mask.nii.gz"
    nib.save(nib.Nifti1Image(mask, image.affine), mask_file)
    result = run_in(tmp_path / "node", MPPCADenoise(in_file=str(series), mask=str(mask_file), use_gpu=False))
    denoised = nib.load(result.outputs.out_file).get_fdata()
    noise = nib.load(result.outputs.noise_file).get_fdata()
    assert np.all(denoised[mask == 0] == 0) and np.all(noise[mask == 0] == 0)
    provenance = read_json(result.outputs.provenance_file)
    assert provenance["NoiseMedian"] == pytest.approx(np.median(noise[mask == 1]), rel=1e-5)
    assert provenance["MaskSHA256"] == hashlib.sha256(mask_file.read_bytes()).hexdigest()


def test_a_3d_input_fails_with_one_sentence(tmp_path):
    image = nib.Nifti1Image(np.ones(SHAPE, np.float32), np.eye(4))
    nib.save(image, tmp_path / "three_d.nii.gz")
    with pytest.raises(Exception, match="must be a 4D series"):
        run_in(tmp_path / "node", MPPCADenoise(in_file=str(tmp_path / "three_d.nii.gz"), use_gpu=False))


def test_use_gpu_defaults_to_the_probe_and_num_threads_does_not_change_the_hash(series):
    assert MPPCADenoise().inputs.use_gpu is gpu_probably_usable()
    one = MPPCADenoise(in_file=str(series), num_threads=1).inputs.get_hashval()[1]
    two = MPPCADenoise(in_file=str(series), num_threads=2).inputs.get_hashval()[1]
    other = MPPCADenoise(in_file=str(series), stride=1).inputs.get_hashval()[1]
    assert one == two and one != other


def test_probe_never_fails_without_a_gpu(monkeypatch):
    gpu_probably_usable.cache_clear()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    try:
        assert gpu_probably_usable() is False
    finally:
        gpu_probably_usable.cache_clear()


# --------------------------------------------------------------------------- inside a user's workflow

def _scale(in_file, factor):
    """Upstream: the user's own step (a rescaling)."""
    import os
    import nibabel as nib
    image = nib.load(in_file)
    out = os.path.abspath("scaled.nii.gz")
    nib.save(nib.Nifti1Image(image.get_fdata(dtype="float32") * factor, image.affine, image.header), out)
    return out


def _median_noise(noise_file):
    """Downstream: the user's own step (a summary of the noise map)."""
    import nibabel as nib
    import numpy as np
    data = nib.load(noise_file).get_fdata()
    return float(np.median(data[data > 0]))


def user_workflow(base_dir, in_file, sink_dir):
    workflow = Workflow(name="user_wf", base_dir=str(base_dir))
    upstream = Node(Function(input_names=["in_file", "factor"], output_names=["out_file"], function=_scale),
                    name="upstream")
    upstream.inputs.in_file = str(in_file)
    upstream.inputs.factor = 2.0
    mppca = Node(MPPCADenoise(use_gpu=False, num_threads=1), name="mppca")
    downstream = Node(Function(input_names=["noise_file"], output_names=["median"], function=_median_noise),
                      name="downstream")
    sink = Node(DataSink(base_directory=str(sink_dir)), name="sink")
    workflow.connect([
        (upstream, mppca, [("out_file", "in_file")]),
        (mppca, downstream, [("noise_file", "noise_file")]),
        (mppca, sink, [("out_file", "denoised"), ("noise_file", "maps.@noise"), ("rank_file", "maps.@rank"),
                       ("provenance_file", "provenance")]),
    ])
    return workflow


@pytest.mark.parametrize("plugin", ["Linear", "MultiProc"])
def test_node_in_a_user_workflow_and_the_cache_serves_the_second_run(series, tmp_path, plugin):
    args = dict(n_procs=2) if plugin == "MultiProc" else {}
    workflow = user_workflow(tmp_path / "work", series, tmp_path / "sink")
    graph = workflow.run(plugin=plugin, plugin_args=args)
    median = next(n for n in graph.nodes() if n.name == "downstream").result.outputs.median
    assert 2 * SIGMA * 0.5 < median < 2 * SIGMA * 1.5  # the upstream scaling doubled the noise
    sunk = sorted(str(p.relative_to(tmp_path / "sink")) for p in (tmp_path / "sink").rglob("*") if p.is_file())
    assert sunk == ["denoised/scaled_denoised.nii.gz", "maps/scaled_noise.nii.gz", "maps/scaled_rank.nii.gz",
                    "provenance/provenance.json"]

    node_out = tmp_path / "work" / "user_wf" / "mppca" / "scaled_denoised.nii.gz"
    first = node_out.stat().st_mtime_ns
    user_workflow(tmp_path / "work", series, tmp_path / "sink").run(plugin=plugin, plugin_args=args)
    assert node_out.stat().st_mtime_ns == first, "same inputs: the result must come from the cache"

    changed = user_workflow(tmp_path / "work", series, tmp_path / "sink")
    changed.get_node("mppca").inputs.stride = 1
    changed.run(plugin=plugin, plugin_args=args)
    assert node_out.stat().st_mtime_ns != first, "a changed parameter must run the node again"


def test_init_mppca_wf_carries_metadata_into_the_provenance(series, tmp_path):
    workflow = init_mppca_wf(name="one_run", use_gpu=False)
    workflow.base_dir = str(tmp_path / "work")
    workflow.inputs.inputnode.in_file = str(series)
    workflow.inputs.inputnode.metadata = {"RepetitionTime": 2.0, "TaskName": "rest"}
    graph = workflow.run(plugin="Linear")
    nodes = {n.name: n.result.outputs for n in graph.nodes()}  # Nipype drops the identity nodes
    sidecar = read_json(nodes["sidecar"].out_file)
    assert sidecar["RepetitionTime"] == 2.0 and sidecar["TaskName"] == "rest"
    assert sidecar["MPPCADenoising"]["InputSHA256"] == hashlib.sha256(series.read_bytes()).hexdigest()
    assert nib.load(nodes["denoise"].out_file).shape == (*SHAPE, N_DWI)
    assert nib.load(nodes["denoise"].noise_file).shape == SHAPE


def test_workflow_methods_text_cites_both_papers():
    workflow = init_mppca_wf(stride=1, aggregation="center", demean="none")
    assert "Marchenko-Pastur" in workflow.__desc__ and "centred on every voxel" in workflow.__desc__
    assert "Veraart" in workflow.__postdesc__ and "Cordero-Grande" in workflow.__postdesc__
    assert "10.1016/j.neuroimage.2016.08.016" in workflow.__postdesc__


@pytest.mark.parametrize("given", ["number", "file"])
def test_a_given_noise_level_is_used_and_its_source_recorded(series, tmp_path, given):
    image = nib.load(series)
    if given == "number":
        noise_in, noise = SIGMA, SIGMA
    else:
        noise = np.random.default_rng(5).uniform(15.0, 25.0, size=SHAPE)
        noise_in = tmp_path / "sigma.nii.gz"
        nib.save(nib.Nifti1Image(noise, image.affine), noise_in)
        noise_in = str(noise_in)
    result = run_in(tmp_path / "node", MPPCADenoise(in_file=str(series), noise_in=noise_in, use_gpu=False))
    expected = denoise(image.get_fdata(dtype=np.float32), noise=noise, device="cpu", nprocs=1)
    np.testing.assert_allclose(nib.load(result.outputs.out_file).get_fdata(), expected.denoised, rtol=0, atol=1e-3)
    written = nib.load(result.outputs.noise_file).get_fdata()
    np.testing.assert_allclose(written, expected.sigma, rtol=1e-6)
    provenance = read_json(result.outputs.provenance_file)
    assert provenance["Backend"] == "cpu" and provenance["EngineInfo"]["noise"] == "given"
    assert provenance["CPUFallback"] is None
    if given == "number":
        assert provenance["Parameters"]["noise_in"] == SIGMA
        np.testing.assert_allclose(written, SIGMA, rtol=1e-6)
        assert "NoiseInSHA256" not in provenance
    else:
        assert provenance["Parameters"]["noise_in"] == "sigma.nii.gz"
        assert provenance["NoiseInSHA256"] == hashlib.sha256(Path(noise_in).read_bytes()).hexdigest()
        assert np.all((written >= 15.0) & (written <= 25.0))


def test_without_a_given_noise_level_the_provenance_says_estimated(series, tmp_path):
    result = run_in(tmp_path / "node", MPPCADenoise(in_file=str(series), use_gpu=False))
    provenance = read_json(result.outputs.provenance_file)
    assert "noise_in" not in provenance["Parameters"] and provenance["EngineInfo"]["noise"] == "estimated"
