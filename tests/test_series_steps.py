"""The steps around the engine on the device (``engine.gpu.series_steps``) against their NumPy code: complex
data's modulation, background phase, demodulation and remodulation, the noise floor's transforms and noise
level. Run here with torch on the CPU, on series in either memory order, in blocks smaller than the series
(a block boundary inside it); the marked ``gpu`` tests run the whole pipelines on a CUDA device against
``device="cpu"``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from mppca_nipype import denoise, denoise_complex  # noqa: E402
from mppca_nipype.engine import steps_device  # noqa: E402
from mppca_nipype.engine.complex_data import _demodulated, _remodulated_phase  # noqa: E402
from mppca_nipype.engine.gpu import series_steps  # noqa: E402
from mppca_nipype.engine.noise_floor import noise_level_from_magnitude, stabilizer  # noqa: E402
from mppca_nipype.phantoms import complex_dwi_phantom, dwi_phantom  # noqa: E402

CPU = torch.device("cpu")
#: Small blocks: the series below run in several, one boundary inside a slab axis.
BLOCK = 2 * 7 * 5 * 3
#: pi rounded to float32 (above pi): a float32 phase wrapped to [-pi, pi) lies within +-PI.
PI = float(np.float32(math.pi))


def in_order(array, order):
    return np.asarray(array, order=order)


def wrapped_difference(a, b):
    return np.angle(np.exp(1j * (a.astype(np.float64) - b)))


def smooth_complex(shape, seed, order):
    """A magnitude (positive, with a NaN and an Inf value) and a smooth phase in radians with a little noise:
    its filtered image is far from 0 everywhere, so the background phase is well defined."""
    rng = np.random.default_rng(seed)
    x, y, z, t = np.meshgrid(*(np.arange(n) for n in shape), indexing="ij")
    magnitude = (1 + rng.uniform(0, 1, shape)).astype(np.float32)
    phase = np.angle(np.exp(1j * (0.4 * x - 0.3 * y + 0.2 * z + 0.5 * t + 0.05 * rng.standard_normal(shape))))
    magnitude[1, 2, 0, 0] = np.nan
    magnitude[-1, -1, -1, -1] = np.inf
    return in_order(magnitude, order), in_order(phase.astype(np.float32), order)


# -- blocks ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("order", ["C", "F"])
@pytest.mark.parametrize("whole", [None, "time courses", "slices"])
def test_the_blocks_cover_the_series_once_within_their_size(order, whole):
    series = in_order(np.zeros((7, 5, 4, 3), np.float32), order)
    counts = np.zeros(series.shape, int)
    blocks = series_steps.series_blocks(series, whole, block_values=BLOCK)
    for index in blocks:
        counts[index] += 1
        block = series[index]
        assert block.size <= BLOCK
        if whole is None:  # one contiguous piece of memory
            assert block.flags.c_contiguous or block.flags.f_contiguous
        if whole is not None:
            assert block.shape[3] == 3
        if whole == "slices":
            assert block.shape[:2] == (7, 5)
    assert len(blocks) > 1 and (counts == 1).all()


def round_trip(series, whole, device, later=False):
    """``series`` * 2, its blocks uploaded to ``device``, doubled there and downloaded (``later``: each
    download left running while the next block goes up)."""
    back = np.full_like(series, np.nan)
    copies = series_steps.Transfers(device)
    for index in series_steps.series_blocks(series, whole, block_values=BLOCK):
        block = copies.upload(series[index])
        assert block.shape == series[index].shape
        copies.download(block.contiguous() * 2, back[index], later=later)  # (another layout than the staging's)
    copies.finish()
    return back


@pytest.mark.parametrize("order", ["C", "F"])
@pytest.mark.parametrize("whole", [None, "slices"])
@pytest.mark.parametrize("chunk_values", [series_steps.CHUNK_VALUES, 7])
@pytest.mark.parametrize("later", [False, True])
def test_blocks_go_to_the_device_and_back_in_their_layout(monkeypatch, order, whole, chunk_values, later):
    """In one piece per block, and in pieces of a plane (7 values: fewer than a plane of any block); the
    downloads left running or not (on the CPU, done at once either way)."""
    monkeypatch.setattr(series_steps, "CHUNK_VALUES", chunk_values)
    series = in_order(np.random.default_rng(9).standard_normal((7, 5, 4, 3)).astype(np.float32), order)
    np.testing.assert_array_equal(round_trip(series, whole, CPU, later), 2 * series)


@pytest.mark.parametrize("order", ["C", "F"])
@pytest.mark.parametrize("chunk_values", [20, 1000])
def test_the_pieces_of_a_copy_are_contiguous_slabs_that_cover_it_once(monkeypatch, order, chunk_values):
    """Slabs along the slowest axis in memory, each a contiguous piece of a staging view, at most
    ``CHUNK_VALUES`` values or one plane."""
    monkeypatch.setattr(series_steps, "CHUNK_VALUES", chunk_values)
    staged = np.zeros((7, 5, 4, 3), np.float32, order=order)
    plane = 5 * 4 * 3 if order == "C" else 7 * 5 * 4
    counts = np.zeros(staged.shape, int)
    pieces = series_steps._pieces(staged)
    for piece in pieces:
        counts[piece] += 1
        assert staged[piece].flags.c_contiguous or staged[piece].flags.f_contiguous
        assert staged[piece].size <= max(chunk_values, plane)
    assert (counts == 1).all() and (len(pieces) > 1) == (chunk_values < staged.size)


# -- interpolation and the noise floor's transforms ----------------------------------------------------------

def test_interpolation_is_numpys_at_the_knots_between_them_beyond_them_and_at_nan():
    knots = np.array([0.5, 1.0, 1.0, 2.0, 4.0])
    values = np.array([0.0, 1.0, 1.5, 1.7, 3.0])
    x = np.array([-np.inf, -1, 0.5, 0.7, 1.0, 1.5, 2.0, 3.9, 4.0, 4.1, np.inf, np.nan])
    table = series_steps.PiecewiseLinear(knots, values, CPU)
    for right in (None, 9.0):
        np.testing.assert_array_equal(table(torch.as_tensor(x), right=right).numpy(),
                                      np.interp(x, knots, values, right=right))


@pytest.mark.parametrize("order", ["C", "F"])
@pytest.mark.parametrize("coils", [1, 4])
def test_the_transform_and_its_inverse_on_the_device_are_numpys(order, coils):
    """x = f(m / sigma) and theta * sigma from the inverse: at 0, inside the tables, beyond their ends, at NaN
    and Inf, in blocks: equal to the NumPy transforms to float32 rounding."""
    transform = stabilizer(coils)
    rng = np.random.default_rng(1)
    data = rng.uniform(0, 80, (7, 5, 4, 3)).astype(np.float32)  # sigma ~1.2: y up to ~160, the table ends at ~40
    data[0, 0, 0, :] = [0.0, 1e-3, 1e4]
    data[1, 1, 1, 1], data[2, 2, 2, 2] = np.nan, np.inf
    data = in_order(data, order)
    scale = rng.uniform(0.5, 2, data.shape[:3]).astype(np.float32)
    stabilized = series_steps.stabilize_series(data, scale, transform, CPU, block_values=BLOCK)
    expected = transform.forward(data / scale[..., None]).astype(np.float32)
    np.testing.assert_allclose(stabilized, expected, rtol=1e-6, atol=1e-6)
    assert stabilized.flags.f_contiguous == (order == "F")
    denoised = stabilized - 0.7  # some below E[f | 0]: theta 0 there
    denoised[3, 3, 3, 0] = -50.0
    signal = denoised.copy(order="K")
    series_steps.unstabilize_series(signal, scale, transform, CPU, block_values=BLOCK)
    expected = transform.inverse(denoised).astype(np.float32) * scale[..., None]
    np.testing.assert_allclose(signal, expected, rtol=1e-6, atol=1e-6)
    assert signal[3, 3, 3, 0] == 0 and np.isnan(signal[1, 1, 1, 1]) and np.isinf(signal[2, 2, 2, 2])
    # a series kept on the device: x stays there, and the inverse comes down in the series' order
    kept = series_steps.stabilize_series(series_steps.series_on_device(data, CPU, BLOCK), scale, transform, CPU,
                                         block_values=BLOCK)
    assert isinstance(kept, torch.Tensor)
    np.testing.assert_array_equal(kept.numpy(), stabilized)
    down = series_steps.unstabilize_series(torch.from_numpy(denoised.copy(order="K")), scale, transform, CPU,
                                           block_values=BLOCK)
    assert isinstance(down, np.ndarray) and down.flags.f_contiguous == (order == "F")
    np.testing.assert_array_equal(down, signal)


@pytest.mark.parametrize("order", ["C", "F"])
@pytest.mark.parametrize("coils", [1, 4])
def test_the_noise_level_on_the_device_is_numpys(order, coils):
    rng = np.random.default_rng(5)
    means = in_order(rng.uniform(0, 30, (13, 7, 5, 11)).astype(np.float32), order)
    means[4, 2, 1, :5] = 0  # a background voxel: mu below mu(0)
    spread = rng.uniform(0.5, 3, (13, 7, 5))
    spread[2, 3, 4] = 0  # stays 0
    on_host = noise_level_from_magnitude(spread, means, coils, threads=1)
    blocks = len(series_steps.series_blocks(means, "time courses", block_values=3 * 7 * 5 * 11))
    assert blocks > 1
    from mppca_nipype.engine import noise_floor

    thetas = np.arange(0, noise_floor.THETA_MAX + noise_floor.THETA_STEP / 2, noise_floor.THETA_STEP)
    on_device = series_steps.noise_level(spread, means, noise_floor.magnitude_mean(thetas, coils),
                                         np.square(noise_floor.magnitude_sd(thetas, coils)),
                                         noise_floor.SIGMA_BISECTIONS, CPU, block_values=3 * 7 * 5 * 11)
    np.testing.assert_allclose(on_device, on_host, rtol=1e-5)
    assert on_device[2, 3, 4] == 0
    np.testing.assert_allclose(noise_level_from_magnitude(spread, means, coils, device=CPU), on_host, rtol=1e-5)


# -- complex data ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("order", ["C", "F"])
@pytest.mark.parametrize("n_volumes", [1, 3])
def test_the_demodulation_on_the_device_is_numpys(order, n_volumes):
    """S = m e^{i phase} built on the device, its background phase (complex64 there, complex128 in NumPy),
    R and the mean square of I per voxel: the phase within 1e-5 rad rms, R within 1e-5 of the magnitude."""
    magnitude, radians = smooth_complex((7, 5, 4, n_volumes), seed=2, order=order)
    real, phase, imaginary = _demodulated(magnitude, radians, None, phase_method="hann", width=0.375, passes=3,
                                          threads=1, first_pass=None, lap=None)
    two_slices = 2 * 7 * 5 * n_volumes  # a block of two z-planes: two blocks
    on_device = series_steps.demodulate_series(magnitude, radians, width=0.375, passes=3, device=CPU,
                                               block_values=two_slices)
    assert len(series_steps.series_blocks(magnitude, "slices", block_values=two_slices)) == 2
    device_real, device_phase, device_power = on_device
    assert device_real.flags.f_contiguous == device_phase.flags.f_contiguous == (order == "F")
    kept = series_steps.demodulate_series(magnitude, radians, width=0.375, passes=3, device=CPU, keep_phase=True,
                                          block_values=two_slices)[1]
    assert isinstance(kept, torch.Tensor)
    np.testing.assert_array_equal(kept.numpy(), device_phase)
    assert kept.numpy().flags.f_contiguous == (order == "F")
    difference = wrapped_difference(device_phase, phase)
    assert np.sqrt(np.mean(difference**2)) < 1e-5
    assert device_phase.min() >= -PI and device_phase.max() <= PI
    finite = np.isfinite(magnitude)
    np.testing.assert_allclose(device_real[finite], real[finite], atol=1e-5 * 2)
    np.testing.assert_array_equal(device_real[~finite], magnitude[~finite])  # NaN/Inf kept for the engine
    np.testing.assert_allclose(device_power, np.mean(np.square(imaginary, dtype=np.float64), axis=3),
                               rtol=1e-4, atol=1e-10)


@pytest.mark.parametrize("order", ["C", "F"])
def test_a_complex_series_and_a_first_pass_demodulate_on_the_device_as_with_numpy(order):
    """The complex series given (not built from magnitude and phase), and the background phase taken from a
    smoothed (X, Y, Z, 2T) series of real and imaginary parts (``phase_method="mppca"``)."""
    magnitude, radians = smooth_complex((9, 7, 3, 4), seed=3, order=order)
    finite = np.isfinite(magnitude)
    image = in_order(np.where(finite, magnitude, 0) * np.exp(1j * radians), order).astype(np.complex64)
    parts = series_steps.complex_parts(magnitude, radians, device=CPU, block_values=BLOCK)
    np.testing.assert_allclose(parts, np.concatenate([image.real, image.imag], axis=3), atol=1e-6)
    np.testing.assert_allclose(series_steps.complex_parts(magnitude, image=image, device=CPU), parts, atol=1e-6)
    smoothed = parts * np.float32(0.9)  # (a stand-in for the first pass's denoised parts)
    real, phase, _ = _demodulated(magnitude, None, image.copy(order="K"), phase_method="mppca", width=0.5,
                                  passes=2, threads=1, first_pass=lambda _: smoothed, lap=lambda _: None)
    device_real, device_phase, _ = series_steps.demodulate_series(magnitude, image=image, smoothed=smoothed,
                                                                  width=0.5, passes=2, device=CPU,
                                                                  block_values=BLOCK)
    assert np.sqrt(np.mean(wrapped_difference(device_phase, phase) ** 2)) < 1e-5
    np.testing.assert_allclose(device_real[finite], real[finite], atol=2e-5)


@pytest.mark.parametrize("order", ["C", "F"])
def test_the_remodulated_phase_on_the_device_is_numpys(order):
    rng = np.random.default_rng(4)
    denoised = in_order(rng.standard_normal((7, 5, 4, 3)).astype(np.float32), order)
    denoised[0, 1, 2, 1] = np.nan
    denoised[0, 1, 2, 2] = -0.0  # (R_hat >= 0: phi)
    background = in_order(rng.uniform(-math.pi, math.pi, denoised.shape).astype(np.float32), order)
    background[0, 0, 0, :] = [-math.pi, np.nextafter(np.float32(math.pi), 0), 0]
    mask = rng.uniform(size=denoised.shape[:3]) < 0.7
    phase = series_steps.remodulated_phase(denoised, background, mask, CPU, block_values=BLOCK)
    expected = _remodulated_phase(denoised, background.copy(order="K"), mask, threads=1)
    assert np.abs(wrapped_difference(phase, expected)).max() < 1e-6
    kept_on_device = torch.from_numpy(background.copy(order="K"))  # (phi kept on the device between the steps)
    np.testing.assert_array_equal(series_steps.remodulated_phase(denoised, kept_on_device, mask, CPU,
                                                                 block_values=BLOCK), phase)
    assert (phase[~mask] == 0).all() and phase.min() >= -PI and phase.max() <= PI
    assert phase.flags.f_contiguous == (order == "F")


# -- the pipelines with their steps in torch ----------------------------------------------------------------

def torch_steps_on_the_cpu(monkeypatch):
    """From here on, the pipelines take their steps' path for a GPU engine, with torch on the CPU."""
    from mppca_nipype import engine

    monkeypatch.setattr(engine, "steps_device", lambda *args, **kwargs: "cuda")
    monkeypatch.setattr(series_steps, "torch_device", lambda device: CPU)


def relative_rms(a, b, where=Ellipsis):
    a, b = a[where].astype(np.float64), b[where].astype(np.float64)
    return np.sqrt(np.mean((a - b) ** 2)) / np.sqrt(np.mean(b**2))


@pytest.mark.filterwarnings("ignore:.*NaN or Inf")
@pytest.mark.parametrize("order", ["C", "F"])
@pytest.mark.parametrize("phase_method, given", [("hann", "phase"), ("mppca", "phase"), ("hann", "complex")])
def test_complex_denoising_with_the_torch_steps_is_the_numpy_steps(monkeypatch, order, phase_method, given):
    """On the same engine, the denoised magnitude within 1e-5 (relative rms), the phase within 1e-5 rad rms
    where the signal is strong, and the same noise and rank maps, with a mask and a NaN voxel."""
    magnitude, phase, truth = (in_order(a, order) for a in complex_dwi_phantom((17, 15, 9), 16, sigma=60.0,
                                                                                seed=4)[:3])
    magnitude[8, 7, 4, 6] = np.nan  # (inside the head)
    mask = truth[..., 0] > 0
    inputs = ((magnitude, phase) if given == "phase"
              else (in_order(magnitude * np.exp(1j * phase), order).astype(np.complex64),))
    options = dict(device="cpu", nprocs=1, phase_method=phase_method)
    numpy_steps = denoise_complex(*inputs, mask=mask, **options)
    torch_steps_on_the_cpu(monkeypatch)
    torch_steps = denoise_complex(*inputs, mask=mask, **options)
    assert numpy_steps.info["steps_device"] == "cpu" and torch_steps.info["steps_device"] == "cuda"
    finite = np.isfinite(numpy_steps.denoised)
    np.testing.assert_array_equal(np.isfinite(torch_steps.denoised), finite)
    assert relative_rms(torch_steps.denoised, numpy_steps.denoised, finite) <= 1e-5
    strong = numpy_steps.denoised > 5 * 60.0
    assert np.sqrt(np.mean(wrapped_difference(torch_steps.phase, numpy_steps.phase)[strong] ** 2)) <= 1e-5
    assert (torch_steps.phase[~mask] == 0).all()
    np.testing.assert_allclose(torch_steps.sigma, numpy_steps.sigma, rtol=1e-4)
    assert np.mean(torch_steps.rank == numpy_steps.rank) >= 0.995
    assert torch_steps.info["imaginary_sd_ratio"] == pytest.approx(numpy_steps.info["imaginary_sd_ratio"],
                                                                   rel=1e-4)


@pytest.mark.filterwarnings("ignore:.*NaN or Inf")
@pytest.mark.parametrize("order", ["C", "F"])
@pytest.mark.parametrize("noise_floor, coils, given", [("rician", 1, False), ("ncchi", 4, False),
                                                        ("rician", 1, True)])
def test_a_noise_floor_with_the_torch_steps_is_the_numpy_steps(monkeypatch, order, noise_floor, coils, given):
    """On the same engine, the sigma map within 1e-5 and the denoised series within 1e-5 (relative rms),
    with a mask and a NaN voxel kept as it was."""
    noisy, truth, _, _ = dwi_phantom(shape=(17, 15, 9), n_volumes=16, sigma=200.0, rician=True, seed=3)
    noisy = in_order(noisy, order)
    noisy[8, 7, 4, 5] = np.nan  # (inside the head)
    mask = truth[..., 0] > 0
    options = dict(device="cpu", nprocs=1, noise_floor=noise_floor, coils=coils, noise=200.0 if given else None)
    numpy_steps = denoise(noisy, mask, **options)
    torch_steps_on_the_cpu(monkeypatch)
    torch_steps = denoise(noisy, mask, **options)
    assert numpy_steps.info["steps_device"] == "cpu" and torch_steps.info["steps_device"] == "cuda"
    np.testing.assert_allclose(torch_steps.sigma, numpy_steps.sigma, rtol=1e-5)
    finite = np.isfinite(numpy_steps.denoised)
    np.testing.assert_array_equal(np.isfinite(torch_steps.denoised), finite)
    assert mask[8, 7, 4] and np.isnan(torch_steps.denoised[8, 7, 4, 5])
    assert relative_rms(torch_steps.denoised, numpy_steps.denoised, finite) <= 1e-5
    assert (torch_steps.denoised[~mask] == 0).all()
    assert torch_steps.denoised.flags.f_contiguous == (order == "F")


def test_a_gpu_memory_budget_sizes_the_steps_blocks():
    from mppca_nipype.engine import GPUMemory

    assert series_steps.block_values_within(None, CPU) == series_steps.BLOCK_VALUES
    assert series_steps.block_values_within(GPUMemory(1.0), CPU) == 2**30 // series_steps.PEAK_BYTES_PER_VALUE
    assert series_steps.block_values_within(GPUMemory(1e-9), CPU) == 1 << 12
    assert series_steps.block_values_within(GPUMemory(1000.0), CPU) == series_steps.BLOCK_VALUES


@pytest.mark.parametrize("pipeline", ["hann", "mppca", "rician"])
def test_the_pipelines_steps_keep_within_a_gpu_memory_budget(monkeypatch, pipeline):
    """With a budget (the engine holds it only while it runs) every step's blocks are sized by it, and the
    results are those of the unlimited run."""
    magnitude, phase, truth = complex_dwi_phantom((17, 15, 9), 16, sigma=60.0, seed=4)[:3]
    torch_steps_on_the_cpu(monkeypatch)
    sizes = []
    series_blocks = series_steps.series_blocks

    def recorded(series, whole=None, block_values=None):
        sizes.append(block_values)
        return series_blocks(series, whole, block_values)

    monkeypatch.setattr(series_steps, "series_blocks", recorded)

    def run(**budget):
        if pipeline == "rician":
            return denoise(magnitude, device="cpu", nprocs=1, noise_floor="rician", **budget)
        return denoise_complex(magnitude, phase, device="cpu", nprocs=1, phase_method=pipeline, **budget)

    unlimited = run()
    assert sizes and set(sizes) == {series_steps.BLOCK_VALUES}
    sizes.clear()
    budgeted = run(gpu_memory=0.0005)  # GiB: 5,592 values a block, a few z-planes of 17 x 15
    assert sizes and set(sizes) == {int(0.0005 * 2**30) // series_steps.PEAK_BYTES_PER_VALUE}
    np.testing.assert_allclose(budgeted.denoised, unlimited.denoised, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(budgeted.sigma, unlimited.sigma)


# -- where they run ----------------------------------------------------------------------------------------

def test_the_steps_run_on_the_host_with_the_cpu_engine():
    options = dict(extent="wide", stride=3, estimator="exp2", aggregation="weighted", demean="volume",
                   filter="hard")
    assert steps_device("cpu", (12, 12, 10, 20), options) == "cpu"
    magnitude, phase = complex_dwi_phantom((12, 12, 8), 16, sigma=50.0, seed=1)[:2]
    assert denoise_complex(magnitude, phase, device="cpu", nprocs=1).info["steps_device"] == "cpu"


# -- on a CUDA device: the whole pipelines against the CPU's ----------------------------------------------

@pytest.fixture
def cuda():
    from mppca_nipype.engine.gpu import usable

    reason = usable()
    if reason is not None:
        pytest.skip(reason)


@pytest.mark.gpu
@pytest.mark.parametrize("order", ["C", "F"])
@pytest.mark.parametrize("whole", [None, "slices"])
@pytest.mark.parametrize("later", [False, True])
def test_blocks_in_pieces_go_to_a_gpu_and_back_unchanged(cuda, monkeypatch, order, whole, later):
    """The pieces' copies overlap the host's, and a download left running overlaps the next upload: no piece
    of a staging buffer is written before its copy to the device is done, nor read before its copy from the
    device is, nor a block's memory on the device reused before it has come down."""
    monkeypatch.setattr(series_steps, "CHUNK_VALUES", 7)
    series = in_order(np.random.default_rng(9).standard_normal((7, 5, 4, 3)).astype(np.float32), order)
    np.testing.assert_array_equal(round_trip(series, whole, torch.device("cuda"), later), 2 * series)
    large = in_order(np.random.default_rng(10).standard_normal((96, 96, 18, 40)).astype(np.float32), order)
    monkeypatch.setattr(series_steps, "CHUNK_VALUES", 1 << 18)
    back = np.full_like(large, np.nan)
    copies = series_steps.Transfers("cuda")
    for index in series_steps.series_blocks(large, whole, block_values=1 << 21):
        copies.download(copies.upload(large[index]) * 2, back[index], later=later)
    copies.finish()
    np.testing.assert_array_equal(back, 2 * large)


def assert_agree(gpu, cpu):
    """The engines' tolerances (tests/test_gpu.py): the denoised series within 1e-4 rms (relative), the noise
    map within 1e-3, the rank maps within 0.5 at >= 99.5% of the voxels."""
    finite = np.isfinite(cpu.denoised)
    np.testing.assert_array_equal(np.isfinite(gpu.denoised), finite)
    assert relative_rms(gpu.denoised, cpu.denoised, finite) <= 1e-4
    assert relative_rms(gpu.sigma, cpu.sigma) <= 1e-3
    assert np.mean(np.abs(gpu.rank - cpu.rank) < 0.5) >= 0.995


@pytest.mark.gpu
@pytest.mark.parametrize("order", ["C", "F"])
@pytest.mark.parametrize("phase_method", ["hann", "mppca"])
def test_complex_denoising_on_the_gpu_agrees_with_the_cpu(cuda, order, phase_method):
    magnitude, phase = (in_order(a, order) for a in complex_dwi_phantom((40, 36, 20), 30, sigma=100.0,
                                                                         seed=6)[:2])
    gpu = denoise_complex(magnitude, phase, device="cuda", phase_method=phase_method)
    cpu = denoise_complex(magnitude, phase, device="cpu", nprocs=4, phase_method=phase_method)
    assert gpu.info["steps_device"] == "cuda" and cpu.info["steps_device"] == "cpu"
    assert gpu.denoised.flags.f_contiguous == gpu.phase.flags.f_contiguous == (order == "F")
    assert_agree(gpu, cpu)
    strong = cpu.denoised > 4 * 100.0  # where the phase is defined well
    assert np.sqrt(np.mean(wrapped_difference(gpu.phase, cpu.phase)[strong] ** 2)) <= 1e-3
    assert gpu.info["imaginary_sd_ratio"] == pytest.approx(cpu.info["imaginary_sd_ratio"], rel=5e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("order", ["C", "F"])
@pytest.mark.parametrize("noise_floor, coils", [("rician", 1), ("ncchi", 4)])
def test_a_noise_floor_on_the_gpu_agrees_with_the_cpu(cuda, order, noise_floor, coils):
    noisy = in_order(dwi_phantom(shape=(40, 36, 20), n_volumes=30, sigma=200.0, rician=True, seed=3)[0], order)
    gpu = denoise(noisy, device="cuda", noise_floor=noise_floor, coils=coils)
    cpu = denoise(noisy, device="cpu", nprocs=4, noise_floor=noise_floor, coils=coils)
    assert gpu.info["steps_device"] == "cuda" and cpu.info["steps_device"] == "cpu"
    assert gpu.denoised.flags.f_contiguous == (order == "F")
    assert_agree(gpu, cpu)
# -- the input checks' reductions -------------------------------------------------------------------------

@pytest.mark.parametrize("order", ["C", "F"])
@pytest.mark.parametrize("masked", [False, True])
def test_negative_values_are_counted_inside_the_mask_on_any_number_of_threads(order, masked):
    from mppca_nipype.engine import count_negative

    rng = np.random.default_rng(7)
    data = in_order(rng.standard_normal((9, 6, 5, 4)).astype(np.float32), order)
    data[0, 0, 0, 0] = np.nan
    mask = rng.uniform(size=data.shape[:3]) < (0.6 if masked else 2)
    with np.errstate(invalid="ignore"):
        expected = int(np.count_nonzero(data[mask] < 0))
    assert count_negative(data, mask, threads=1) == count_negative(data, mask, threads=3) == expected


def test_the_value_range_is_numpys_and_nan_where_a_value_is_nan(monkeypatch):
    from mppca_nipype import engine

    monkeypatch.setattr(engine, "RANGE_CHUNK", 7)  # many chunks
    values = np.random.default_rng(8).uniform(-3, 5, (11, 6, 4))
    assert engine.value_range(values, threads=3) == (values.min(), values.max())
    assert engine.value_range(values[:, ::2], threads=2) == (values[:, ::2].min(), values[:, ::2].max())
    values[4, 1, 2] = np.nan
    assert all(math.isnan(bound) for bound in engine.value_range(values, threads=3))
