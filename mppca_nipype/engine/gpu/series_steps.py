"""The steps around the engine, over a whole series, on the engine's device: complex data's modulation,
background phase, demodulation and remodulation (``complex_data``), and the magnitude noise floor's
transforms and noise level (``noise_floor``).

Each function computes what its NumPy counterpart in those modules computes (named in its docstring), with
torch, a block of the series at a time: the block is uploaded, computed on the device and downloaded into
the NumPy output, so the device holds a few blocks' temporaries whatever the series' size. The blocks are
slabs along the series' slowest axis in memory (x-planes of a voxel-major series, volumes of a volume-major
one: each block one contiguous piece of memory), or slabs of z-planes where a step needs whole in-plane
images (the FFT) or whole time courses (a sum over volumes). A block goes each way through a page-locked
staging buffer, copied on threads on the host (``Transfers``; as ``upload.StagedSeries`` does, for the
same reason: a pageable copy runs at ~8 GB/s on the H200's host, a host copy scales with threads), in pieces
so that the host's copy of one piece runs while the device copies the next.
The NumPy functions stay the CPU engine's; these run where the GPU engine does, ``device`` any torch device
(the tests run them on the CPU).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..backend import available_cpus
from ..layout import COPY_MIN_VALUES, COPY_THREADS, in_parts, is_volume_major
from .upload import empty_series, series_layout

#: Values of the series in one block, at most (at least one plane of the slab's axis): 64 MB of float32; the
#: steps' temporaries (complex64, float64, int64 indices) take up to ~20 times that on the device.
BLOCK_VALUES = 1 << 24
#: A series a step's result may stay on the device as, between two steps, takes at most this share of the
#: device's memory (``stays_on_device``).
RESIDENT_SHARE = 1 / 16
#: Device bytes a step holds per value of its block at its peak (the block, its complex64 / float64 / int64
#: temporaries, the next piece's copy): the bound ``block_values_within`` sizes blocks by.
PEAK_BYTES_PER_VALUE = 96


def torch_device(device) -> torch.device:
    """``device`` ("cuda", "cpu" or a torch device) as a torch device; "cuda" is the current CUDA device."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def series_blocks(series, whole: str | None = None, block_values: int | None = None):
    """Index tuples (one slice per axis) of blocks that cover the (X, Y, Z, T) ``series`` (NumPy, or a tensor
    kept on the device), each at most ``block_values`` (default ``BLOCK_VALUES``) values or one plane of its
    axis.

    ``whole`` None: slabs along the slowest axis in memory (x, or t for a volume-major series), each block
    one contiguous piece. "time courses": each block holds its voxels' whole time courses (x-slabs, or z-slabs
    for a volume-major series). "slices": each block holds whole in-plane images and time courses (z-slabs).
    A block's index[:3] indexes the (X, Y, Z) maps of its voxels.
    """
    if whole not in (None, "time courses", "slices"):
        raise ValueError(f"a block holds whole 'time courses' or 'slices', not {whole!r}")
    volume_major = _order(series) == "F"
    if whole == "slices" or (whole == "time courses" and volume_major):
        axis = 2
    else:
        axis = 3 if volume_major and whole is None else 0
    size = series.shape[axis]
    per_plane = max(1, math.prod(series.shape) // max(1, size))
    step = max(1, (block_values or BLOCK_VALUES) // per_plane)
    blocks = []
    for start in range(0, size, step):
        index = [slice(None)] * 4
        index[axis] = slice(start, min(start + step, size))
        blocks.append(tuple(index))
    return blocks


class Transfers:
    """Copies of blocks between NumPy views and ``device``, through a staging buffer (page-locked on a GPU)
    that each copy reuses: the host's part on threads (``layout.in_parts``), the block's layout kept (a block
    of a volume-major series is staged volume-major: no transpose on the host).

    A block goes in pieces of ``CHUNK_VALUES`` along its slowest axis in memory, so that on a GPU the host's
    copy of one piece runs while the device copies another (``non_blocking`` copies from page-locked memory):
    an upload stages piece k + 1 while piece k goes up, a download copies piece k out of the buffer while
    piece k + 1 comes down. A copy takes about the longer of the two, not their sum. A download may also be
    left running (``later``): on a stream and a buffer of its own, while the next block goes up and is worked
    on, until ``finish``. On the CPU every copy is done when its call returns."""

    def __init__(self, device):
        self.device = torch_device(device)
        on_gpu = self.device.type == "cuda"
        self.buffer = torch.empty(0, dtype=torch.uint8)
        self.later_buffer = torch.empty(0, dtype=torch.uint8)  # (a download left running: ``download``)
        self.later_stream = torch.cuda.Stream(self.device) if on_gpu else None
        #: On a GPU: recorded after the last device copy out of ``buffer``; the host writes the buffer only
        #: once it is done.
        self.uploaded = None
        #: A download left running: (its pieces, their events, the staging's NumPy view, ``out``).
        self.running = None

    def _staged(self, shape, dtype, volume_major: bool, later=False):
        """(NumPy view, torch view) of the staging buffer (``later_buffer`` where ``later``) as an array of
        ``shape`` and ``dtype``, in Fortran order where ``volume_major``, once the buffer is free (no upload
        still reads it; no download left running still writes it)."""
        if later:
            self.finish()
        elif self.uploaded is not None:
            self.uploaded.synchronize()
            self.uploaded = None
        name = "later_buffer" if later else "buffer"
        dtype = np.dtype(dtype)
        size = math.prod(shape) * dtype.itemsize
        if getattr(self, name).numel() < size:
            setattr(self, name, torch.empty(size, dtype=torch.uint8, pin_memory=self.device.type == "cuda"))
        flat = getattr(self, name)[:size].view(torch.from_numpy(np.empty(0, dtype)).dtype)
        staged = flat.view(tuple(shape)[::-1]).permute(*reversed(range(len(shape)))) if volume_major \
            else flat.view(tuple(shape))
        return staged.numpy(), staged

    def _recorded_event(self):
        """A CUDA event recorded now on the device's current stream; None on the CPU, where copies are done
        when they return."""
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def upload(self, array, dtype=None, staging=None) -> torch.Tensor:
        """A copy of the NumPy ``array`` (a block's view, any layout) on the device; or, with ``staging``, of
        what ``staging(values, out)`` writes from each piece of it into ``out`` of ``dtype`` (a function of
        the values computed on the host as they are staged: fewer bytes go to the device). A block of a series
        kept on the device (a tensor) is there already: it is returned as it is."""
        if isinstance(array, torch.Tensor):
            if dtype is not None or staging is not None:
                raise ValueError("a block on the device is not staged: compute its values there")
            return array
        array = np.asarray(array)
        host, staged = self._staged(array.shape, dtype or array.dtype, _fortran_like(array))
        on_device = torch.empty_like(staged, device=self.device)  # (the staging's strides)
        threads = _copy_threads(array)
        for piece in _pieces(host):
            _copy_on_threads(host[piece], array[piece], threads, staging)
            on_device[piece].copy_(staged[piece], non_blocking=True)
        self.uploaded = self._recorded_event()
        return on_device

    def download(self, tensor: torch.Tensor, out: np.ndarray, later=False) -> None:
        """Write ``tensor`` into the NumPy view ``out`` (any layout), cast to its dtype.

        ``later``: on a GPU, the copy left running on ``later_stream`` after the work queued so far on the
        current stream (the device copies down while the caller's next block goes up); ``out`` holds the
        values once ``finish`` (or the next such download) returns."""
        later = later and self.device.type == "cuda"
        host, staged = self._staged(out.shape, out.dtype, _fortran_like(out), later)
        if tensor.shape != staged.shape or tensor.stride() != staged.stride() or tensor.dtype != staged.dtype:
            tensor = torch.empty_like(staged, device=tensor.device).copy_(tensor)  # (on the device: one memcpy)
        pieces = _pieces(host)
        if not later:
            self._copy_out(pieces, self._copied_down(tensor, staged, pieces), host, out)
            return
        self.later_stream.wait_stream(torch.cuda.current_stream(self.device))  # after the work on ``tensor``
        tensor.record_stream(self.later_stream)  # its memory not reused before the copy is done
        with torch.cuda.stream(self.later_stream):
            self.running = (pieces, self._copied_down(tensor, staged, pieces), host, out)

    def store(self, tensor: torch.Tensor, out, later=False) -> None:
        """Write ``tensor`` (a block computed on the device) into ``out``, its place in a step's result:
        copied there on the device where the result is kept there (a tensor; cast to its dtype, as a
        download casts), else downloaded (``download``, ``later`` as there)."""
        if isinstance(out, torch.Tensor):
            out.copy_(tensor)
        else:
            self.download(tensor, out, later)

    def finish(self) -> None:
        """Complete the download left running (``download``'s ``later``), if any."""
        if self.running is not None:
            running, self.running = self.running, None
            self._copy_out(*running)

    def _copied_down(self, tensor, staged, pieces) -> list:
        """The events of ``tensor``'s pieces copied into the ``staged`` view, queued on the current stream."""
        arrived = []
        for piece in pieces:
            staged[piece].copy_(tensor[piece], non_blocking=True)
            arrived.append(self._recorded_event())
        return arrived

    @staticmethod
    def _copy_out(pieces, arrived, host, out) -> None:
        """Each piece of the staging's NumPy view ``host`` into ``out`` on threads, once it has arrived."""
        threads = _copy_threads(out)
        for piece, event in zip(pieces, arrived):
            if event is not None:
                event.synchronize()
            _copy_on_threads(out[piece], host[piece], threads)


#: Values of one piece of a block's copy (``Transfers``): 16 MB of float32, a quarter of a block.
CHUNK_VALUES = 1 << 22


def _pieces(array: np.ndarray) -> list:
    """Index tuples of slabs of ``array`` along its slowest axis in memory, ``CHUNK_VALUES`` each at most (at
    least one plane): each slab one contiguous piece of a staging view."""
    if array.ndim == 0:
        return [()]
    axis = array.ndim - 1 if _fortran_like(array) else 0
    size = array.shape[axis]
    step = max(1, CHUNK_VALUES // max(1, array.size // max(1, size)))
    pieces = []
    for start in range(0, max(size, 1), step):
        pieces.append((slice(None),) * axis + (slice(start, min(start + step, size)),))
    return pieces


def _fortran_like(array: np.ndarray) -> bool:
    """Whether ``array``'s axes lie in memory fastest first (a block of a volume-major series)."""
    strides = [stride for stride, size in zip(array.strides, array.shape) if size > 1]
    return len(strides) > 1 and strides == sorted(strides) and not array.flags.c_contiguous


def _copy_threads(array: np.ndarray) -> int:
    """The threads a copy of the whole ``array`` gets (``layout.in_parts``'s rule), also for each piece."""
    return min(COPY_THREADS, available_cpus(), max(1, array.size // COPY_MIN_VALUES))


def _copy_on_threads(out: np.ndarray, values: np.ndarray, threads: int | None = None, staging=None) -> None:
    """``out[...] = values`` (same shape), or ``staging(values, out)`` (a function that writes ``out`` from
    ``values``), in slabs along the slowest axis in memory on ``threads`` threads (None: ``layout.in_parts``'s
    choice for ``out``'s size)."""
    staging = staging or (lambda values, out: np.copyto(out, values, casting="unsafe"))
    axis = out.ndim - 1 if _fortran_like(out) else 0
    if out.ndim == 0 or out.shape[axis] < 2:
        staging(values, out)
        return

    def copy(part):
        where = (slice(None),) * axis + (part,)
        staging(values[where], out[where])

    in_parts(copy, out.shape[axis], out.size, threads)


def block_values_within(budget, device) -> int:
    """Values per block (``series_blocks``) such that a step's peak stays within a GPU memory ``budget``
    (``engine.GPUMemory``; None: ``BLOCK_VALUES``): the engine holds its budget through torch's per-process
    fraction only while it runs, so the steps around it size their blocks themselves. At least one 64 x 64
    plane's worth, whatever the budget."""
    if budget is None:
        return BLOCK_VALUES
    device = torch_device(device)
    total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 0
    return int(min(BLOCK_VALUES, max(1 << 12, budget.bytes_of(total) // PEAK_BYTES_PER_VALUE)))


def stays_on_device(nbytes: int, device) -> bool:
    """Whether a series of ``nbytes`` may be kept on ``device`` between two steps (while the engine runs),
    saving its copy down and back up: at most ``RESIDENT_SHARE`` of a GPU's memory; always on the CPU."""
    device = torch_device(device)
    if device.type != "cuda":
        return True
    return nbytes <= RESIDENT_SHARE * torch.cuda.get_device_properties(device).total_memory


def series_on_device(series: np.ndarray, device, block_values=None) -> torch.Tensor:
    """A copy of the NumPy (X, Y, Z, T) float32 ``series`` on ``device``, in its layout (``upload.empty_series``),
    block by block through the page-locked staging (``Transfers``): to keep it there through several steps."""
    copies = Transfers(device)
    on_device = empty_series(series.shape, _order(series), copies.device)
    for index in series_blocks(series, block_values=block_values):
        on_device[index] = copies.upload(series[index])
    return on_device


def _table(values, device) -> torch.Tensor:
    return torch.as_tensor(np.asarray(values, np.float64), device=device)


# -- interpolation ---------------------------------------------------------------------------------------

class PiecewiseLinear:
    """``numpy.interp`` through (``knots``, ``values``) on ``device``, in float64: the knots rise (equal
    neighbours allowed: no x falls between them), and each interval's slope is NumPy's,
    (v[j+1] - v[j]) / (k[j+1] - k[j]), computed once."""

    def __init__(self, knots, values, device):
        self.knots, self.values = _table(knots, device), _table(values, device)
        self.slopes = (self.values[1:] - self.values[:-1]) / (self.knots[1:] - self.knots[:-1])

    def __call__(self, x: torch.Tensor, right=None) -> torch.Tensor:
        """``numpy.interp(x, knots, values, right=right)``: ``values[0]`` below the first knot, ``right``
        (default ``values[-1]``) above the last, NaN where x is NaN (it runs through the arithmetic)."""
        x = x.to(torch.float64)
        knots, values, last = self.knots, self.values, self.knots.numel() - 1
        below = _searched(knots, x) - 1  # knots[below] <= x < knots[below + 1]
        interval = below.clamp(0, last - 1)
        result = self.slopes[interval] * (x - knots[interval]) + values[interval]  # NumPy's arithmetic
        result = torch.where(below < 0, values[0], result)
        result = torch.where(x >= knots[last], values[last], result)
        if right is not None:
            result = torch.where(x > knots[last], torch.as_tensor(float(right), dtype=torch.float64,
                                                                   device=x.device), result)
        return result


def _searched(knots: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``torch.searchsorted(knots, x, right=True)`` in ``x``'s own layout: a block of a volume-major series is
    searched with its axes in memory order (a view, contiguous), not copied to C order first."""
    order = sorted(range(x.dim()), key=lambda axis: x.stride(axis), reverse=True)
    in_memory_order = x.permute(order)
    if not in_memory_order.is_contiguous():
        in_memory_order = in_memory_order.contiguous()
    back = sorted(range(x.dim()), key=lambda axis: order[axis])
    return torch.searchsorted(knots, in_memory_order, right=True).permute(back)


def stabilized(y: torch.Tensor, forward: PiecewiseLinear) -> torch.Tensor:
    """``noise_floor.MagnitudeStabilizer.forward`` of y = m / sigma, float64: piecewise linear through the
    table (``forward``: knots, values), straight beyond it with the end slopes."""
    y = y.to(torch.float64)
    knots, values, slopes = forward.knots, forward.values, forward.slopes
    x = forward(y)
    x = torch.where(y < knots[0], values[0] + (y - knots[0]) * slopes[0], x)
    return torch.where(y > knots[-1], values[-1] + (y - knots[-1]) * slopes[-1], x)


def unstabilized(x: torch.Tensor, inverse: PiecewiseLinear) -> torch.Tensor:
    """``noise_floor.MagnitudeStabilizer.inverse``: theta whose E[f(y) | theta] is x, float64, from the table
    ``inverse`` (expected, thetas): 0 below it, straight beyond it."""
    x = x.to(torch.float64)
    expected, thetas = inverse.knots, inverse.values
    return torch.where(x > expected[-1], thetas[-1] + (x - expected[-1]) * inverse.slopes[-1], inverse(x))


# -- the magnitude noise floor (``noise_floor``) ---------------------------------------------------------

def stabilize_series(data, scale: np.ndarray, transform, device, block_values=None):
    """x = f(``data`` / ``scale``) (float32, ``data``'s shape and order): ``denoise_magnitude``'s transform,
    ``scale`` the (X, Y, Z) float32 sigma map and ``transform`` a ``MagnitudeStabilizer``. ``data`` NumPy, or a
    series kept on the device (``series_on_device``): x is then a tensor there too."""
    copies = Transfers(device)
    forward = PiecewiseLinear(transform.knots, transform.values, copies.device)
    out = (empty_series(data.shape, _order(data), copies.device) if isinstance(data, torch.Tensor)
           else np.empty(data.shape, np.float32, order=_order(data)))
    for index in series_blocks(data, block_values=block_values):
        y = copies.upload(data[index]) / copies.upload(scale[index[:3]])[..., None]  # float32, as NumPy
        copies.store(stabilized(y, forward), out[index])
    return out


def unstabilize_series(signal, scale: np.ndarray, transform, device, block_values=None) -> np.ndarray:
    """``signal`` (the denoised x, float32) as theta * ``scale`` (float32), theta the ``transform``'s inverse
    (``denoise_magnitude``'s last step; ``scale`` 0 where the output is 0): in place for NumPy, which is
    returned; a series kept on the device is unstabilized there and comes down into a new NumPy array in its
    order, each block while the next is computed."""
    copies = Transfers(device)
    inverse = PiecewiseLinear(transform.expected, transform.thetas, copies.device)
    out = np.empty(tuple(signal.shape), np.float32, order=_order(signal)) if isinstance(signal, torch.Tensor) \
        else signal
    for index in series_blocks(signal, block_values=block_values):
        theta = unstabilized(copies.upload(signal[index]), inverse).to(torch.float32)
        copies.download(theta * copies.upload(scale[index[:3]])[..., None], out[index], later=True)
    copies.finish()
    return out


def noise_level(sigma_mp: np.ndarray, mean_magnitude: np.ndarray, means, variances, bisections: int, device,
                block_values=None) -> np.ndarray:
    """``noise_floor.noise_level_from_magnitude``'s bisection (``_bisected_noise_level``) of every voxel,
    (X, Y, Z) float64: ``sigma_mp`` MP-PCA's noise map, ``mean_magnitude`` the denoised (X, Y, Z, T) series,
    ``means`` and ``variances`` the tables of mu(theta) and s^2(theta). A block's time courses stay on the
    device through the ``bisections`` steps; the spread s^2 is rounded to float32 as the NumPy code stores
    it, and its mean over volumes summed in float64."""
    copies = Transfers(device)
    spread_of_mean = PiecewiseLinear(means, variances, copies.device)
    sigma_mp = np.asarray(sigma_mp, np.float64)
    sigma = np.zeros(sigma_mp.shape)
    for index in series_blocks(mean_magnitude, whole="time courses", block_values=block_values):
        magnitudes = copies.upload(mean_magnitude[index])
        spread_mp = copies.upload(sigma_mp[index[:3]])
        positive = spread_mp > 0
        low = torch.where(positive, spread_mp, torch.ones_like(spread_mp))
        high = low / math.sqrt(float(variances[0]))  # s(0), as NumPy computes it
        target = low**2
        for _ in range(bisections):
            middle = torch.sqrt(low * high)
            mu = magnitudes / middle.to(torch.float32)[..., None]
            # s^2 as a function of the mean: that of theta = 0 below mu(0), 1 above the table
            spread = spread_of_mean(mu, right=1.0).to(torch.float32)  # (stored as float32 by NumPy too)
            too_large = middle**2 * spread.mean(dim=-1, dtype=torch.float64) > target
            high, low = torch.where(too_large, middle, high), torch.where(too_large, low, middle)
        copies.download(torch.where(positive, torch.sqrt(low * high), torch.zeros_like(low)), sigma[index[:3]])
    return sigma


# -- complex data (``complex_data``) ---------------------------------------------------------------------

def modulated(magnitude: torch.Tensor, radians: torch.Tensor) -> torch.Tensor:
    """S = m e^{i phase}, complex64, 0 where the magnitude is NaN or Inf (``denoise_complex``'s step 1)."""
    finite_magnitude = torch.where(torch.isfinite(magnitude), magnitude, torch.zeros_like(magnitude))
    return torch.polar(finite_magnitude, radians.to(finite_magnitude.dtype))


def background_phase_of(image: torch.Tensor, window: torch.Tensor, passes: int) -> torch.Tensor:
    """``complex_data.background_phase`` of a block of whole slices, (X, Y, z, t) complex64: per slice and
    volume, the angle of the image filtered in k-space by the 2D Hann ``window`` (X, Y), ``passes`` times on
    the residual; float32, wrapped to [-pi, pi)."""
    phase = torch.zeros_like(image, dtype=torch.float32)  # (in the image's layout)
    window = window[:, :, None, None]
    for _ in range(passes):
        spectrum = torch.fft.fft2(image * torch.polar(torch.ones_like(phase), -phase), dim=(0, 1))
        phase += torch.angle(torch.fft.ifft2(spectrum * window, dim=(0, 1)))
    return wrapped(phase)


def wrapped(phase: torch.Tensor) -> torch.Tensor:
    """The angle ``phase`` wrapped to [-pi, pi), as NumPy's mod(phase + pi, 2 pi) - pi."""
    return torch.remainder(phase + math.pi, 2 * math.pi) - math.pi


def _window(shape, width, device):
    from ..complex_data import hann_window

    window = hann_window(shape[0], width)[:, None] * hann_window(shape[1], width)[None, :]
    return torch.as_tensor(window, dtype=torch.float32, device=device)


def complex_parts(magnitude: np.ndarray, radians: np.ndarray | None = None, image: np.ndarray | None = None, *,
                  device, keep=False, block_values=None):
    """The real and imaginary parts of S = ``magnitude`` e^{i ``radians``} (or of the complex64 ``image``) as
    one (X, Y, Z, 2T) float32 series in ``magnitude``'s order, real parts first: the series that
    ``phase_method="mppca"`` denoises first. NumPy, or with ``keep`` a tensor kept on the device."""
    copies = Transfers(device)
    n_volumes = magnitude.shape[3]
    shape, order = magnitude.shape[:3] + (2 * n_volumes,), _order(magnitude)
    parts = empty_series(shape, order, copies.device) if keep else np.empty(shape, np.float32, order=order)
    for index in series_blocks(magnitude, block_values=block_values):
        block_image = (copies.upload(image[index]) if image is not None
                       else modulated(copies.upload(magnitude[index]), copies.upload(radians[index])))
        first, last, _ = index[3].indices(n_volumes)
        copies.store(block_image.real, parts[index[:3] + (slice(first, last),)])
        copies.store(block_image.imag, parts[index[:3] + (slice(first + n_volumes, last + n_volumes),)])
    return parts


def demodulate_series(magnitude: np.ndarray, radians: np.ndarray | None = None, image: np.ndarray | None = None,
                      smoothed: np.ndarray | None = None, *, width: float, passes: int, device, keep_phase=False,
                      keep_real=False, block_values=None):
    """``denoise_complex``'s steps 1-3 on the device, slab by slab of z-planes.

    S = ``magnitude`` e^{i ``radians``} (or the complex64 ``image`` itself, its non-finite values 0); phi its
    background phase (``background_phase_of``), or that of ``smoothed`` (the (X, Y, Z, 2T) first pass of
    ``phase_method="mppca"``: real parts, then imaginary; NumPy or kept on the device); R = Re(S e^{-i phi})
    (the magnitude where it is NaN or Inf), I = Im(S e^{-i phi}). Returns (R, phi, the mean over volumes of
    I^2 per voxel (X, Y, Z) float64): R and phi float32 in ``magnitude``'s order; phi as a tensor on the device
    where ``keep_phase`` (for ``remodulated_phase``, which takes either), R where ``keep_real`` (for
    ``engine.denoise``, which takes a series on the device).
    """
    copies = Transfers(device)
    window = _window(magnitude.shape, width, copies.device)
    n_volumes = magnitude.shape[3]
    order = "F" if is_volume_major(magnitude) else "C"
    real = (empty_series(magnitude.shape, order, copies.device) if keep_real
            else np.empty(magnitude.shape, np.float32, order=order))
    phase = (empty_series(magnitude.shape, order, copies.device) if keep_phase
             else np.empty(magnitude.shape, np.float32, order=order))
    # (X, Y, Z): kept on the device and downloaded once, so that no block waits for its work to finish
    imaginary_power = torch.empty(magnitude.shape[:3], dtype=torch.float64, device=copies.device)
    for index in series_blocks(magnitude, whole="slices", block_values=block_values):
        block_magnitude = copies.upload(magnitude[index])
        block_image = (copies.upload(image[index]) if image is not None
                       else modulated(block_magnitude, copies.upload(radians[index])))
        if smoothed is None:
            phi = background_phase_of(block_image, window, passes)
        else:
            slab = index[:3]
            first = torch.complex(copies.upload(smoothed[slab + (slice(0, n_volumes),)]),
                                  copies.upload(smoothed[slab + (slice(n_volumes, None),)]))
            phi = background_phase_of(first, window, passes)
        demodulated = block_image * torch.polar(torch.ones_like(phi), -phi)
        # NaN/Inf stay where the engine expects them; R comes down while the next block goes up
        block_real = torch.where(torch.isfinite(block_magnitude), demodulated.real, block_magnitude)
        copies.store(block_real, real[index], later=True)
        copies.store(phi, phase[index])
        imaginary_power[index[:3]] = torch.square(demodulated.imag.to(torch.float64)).mean(dim=-1)
    power = np.empty(magnitude.shape[:3])
    copies.download(imaginary_power, power)
    copies.finish()
    return real, phase, power


def remodulated_phase(denoised, background, mask: np.ndarray, device, block_values=None) -> np.ndarray:
    """``denoise_complex``'s step 5, the phase: that of R_hat e^{i phi} (phi = ``background``, a NumPy series
    or one kept on the device; phi + pi where R_hat = ``denoised``, a NumPy series or one on the device, is
    negative), wrapped to [-pi, pi), 0 outside the (X, Y, Z) ``mask``; float32 in ``denoised``'s order."""
    copies = Transfers(device)
    phase = np.empty(tuple(denoised.shape), np.float32, order=_order(denoised))
    for index in series_blocks(phase, block_values=block_values):
        if isinstance(denoised, torch.Tensor):
            not_negative = denoised[index] >= 0  # (False at NaN, True at -0)
        else:  # found as R_hat is staged: a quarter of its bytes go up
            not_negative = copies.upload(denoised[index], bool, _not_negative)
        phi = background[index] if isinstance(background, torch.Tensor) else copies.upload(background[index])
        inside = copies.upload(mask[index[:3]])[..., None]
        turned = wrapped(torch.where(not_negative, phi, phi + np.float32(math.pi)))
        copies.download(torch.where(inside, turned, torch.zeros_like(turned)), phase[index], later=True)
    copies.finish()
    return phase


def denoised_magnitude(denoised: torch.Tensor, magnitude_out: str, device, block_values=None) -> np.ndarray:
    """``complex_data._denoised_magnitude`` of R_hat = ``denoised`` on the device: max(R_hat, 0) (``"clip"``)
    or |R_hat| (``"abs"``), downloaded into float32 NumPy in its order."""
    copies = Transfers(device)
    magnitude = np.empty(tuple(denoised.shape), np.float32, order=_order(denoised))
    for index in series_blocks(magnitude, block_values=block_values):
        block = denoised[index]
        copies.download(block.abs() if magnitude_out == "abs" else block.clamp(min=0), magnitude[index], later=True)
    copies.finish()
    return magnitude


def finite_voxels(series: torch.Tensor) -> np.ndarray:
    """(X, Y, Z) bool: the voxels whose whole time course in the series on the device is finite."""
    return torch.isfinite(series).all(dim=3).cpu().numpy()


def _order(series) -> str:
    """"F" for a volume-major series (NumPy, or a tensor on the device), else "C"."""
    return series_layout(series) if isinstance(series, torch.Tensor) else ("F" if is_volume_major(series) else "C")


def _not_negative(values: np.ndarray, out: np.ndarray) -> None:
    """``out`` (bool) = ``values`` >= 0, quietly False at NaN (run on the copy's threads)."""
    with np.errstate(invalid="ignore"):
        np.greater_equal(values, 0, out=out)
