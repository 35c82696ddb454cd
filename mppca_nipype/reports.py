"""QC reports: what MP-PCA removed, the noise and rank it found, and whether the residuals look like noise.

Four figures per run (Matplotlib, Agg, no pyplot state), and one HTML page per subject:

``slices``
    One volume of the input, the denoised series and the residual (input - denoised) in three planes.
``maps``
    The noise map (sigma) and the rank map in three planes, each with its histogram.
``residuals``
    The histogram of the residuals, each divided by the standard deviation pure noise would leave after
    the projection (sigma * sqrt(1 - (P + d) / T), d = 1 when a mean was removed), over the standard
    normal density: linear and logarithmic.
``spectra``
    The eigenvalue spectrum of three patches (lowest, median and highest rank among a sample), with the
    Marchenko-Pastur density fitted by the estimator (its sigma^2 and gamma) and the cut-off.

The spectra are recomputed for a few sampled patches with the CPU engine's own ``fit_windows`` (the same
gather, centring and ``marchenko_pastur_threshold``), so the figure shows exactly what the run decided.

Python users call :func:`write_run_figures` on arrays; the BIDS app runs :class:`RunReport` per run and
:func:`write_subject_report` per subject (names from :mod:`mppca_nipype.bids`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
import html
import json
from pathlib import Path
import time

import numpy as np
from threadpoolctl import threadpool_limits

from nipype.interfaces.base import BaseInterfaceInputSpec, File, SimpleInterface, TraitedSpec, isdefined, traits

from .bids import report_names, subject_report_name
from .engine import DEFAULTS
from .io import write_text_atomic

#: The figures of a run, in page order: kind (``bids.FIGURE_KINDS``, which names the files) -> (title, how
#: to read it).
FIGURES = {
    "slices": ("Input, denoised, residual",
               "One volume (named in the title) through the centre of the image in three planes, neurological "
               "convention (the subject's left on the left of the axial and coronal views). Input and denoised "
               "share one grey scale; the residual (input minus denoised) is shown from -3 to +3 times the "
               "median noise level. A good residual looks like noise everywhere: no edges, no anatomy."),
    "maps": ("Noise and rank maps",
             "The noise standard deviation estimated by MP-PCA (same units as the input) and the number of "
             "signal components kept, in three planes, with their histograms. The noise map should be smooth "
             "(coil geometry, not anatomy); with magnitude data it drops where the signal is near zero "
             "(Rician bias). A rank map that follows anatomy is normal; one that rises to the patch's "
             "limit means the noise was not found there (too few voxels or volumes, or structured artefacts)."),
    "residuals": ("Residuals against the expected Gaussian",
                  "Every residual divided by the standard deviation pure noise would leave after the "
                  "projection, sigma * sqrt(1 - (P + d)/T) (P: the rank, d = 1 when a mean was removed, T: "
                  "volumes), over the standard normal density. Width near 1: the noise estimate is right; "
                  "narrower: sigma is overestimated; heavy tails (right panel, log scale): signal was "
                  "removed, or the noise is not Gaussian (Rician background, artefacts)."),
    "spectra": ("Eigenvalue spectra of three patches",
                "For three sampled patches (lowest, median and highest rank of a sample): top, the "
                "eigenvalues of the patch's Gram matrix divided by max(voxels, volumes), as a histogram "
                "scaled so that the noise eigenvalues integrate to 1, over the Marchenko-Pastur density with "
                "the estimated sigma^2 and ratio gamma; the dashed line is the cut-off, the largest eigenvalue "
                "the estimator's test still calls noise (exp1, exp2: the smallest eigenvalue plus the width of "
                "the Marchenko-Pastur support, 4 sqrt(gamma) sigma^2; med, olesen2023: the support's upper edge "
                "for the whole patch, sigma^2 (1 + sqrt(r/q))^2). Bottom, all eigenvalues in decreasing order "
                "(log scale): those above the cut-off (red) are kept as signal."),
}

#: Colours: noise grey, signal red, theory blue.
NOISE_COLOUR, SIGNAL_COLOUR, THEORY_COLOUR = "0.55", "#c0392b", "#1f4e9c"
DPI = 90


# --------------------------------------------------------------------------------------------- sampling

@dataclass
class PatchSpectrum:
    """One patch's spectrum and what the estimator made of it.

    ``eigenvalues``: the ``r`` usable eigenvalues of the Gram matrix divided by ``q`` (descending),
    ``rank`` (P) and ``sigma2`` from ``marchenko_pastur_threshold``, ``gamma`` = gamma(P) of the estimator,
    ``corner`` the window's corner voxel, ``n_voxels``/``n_volumes`` the degrees of freedom used, and the
    ``estimator``.
    """

    eigenvalues: np.ndarray
    rank: int
    sigma2: float
    gamma: float
    corner: tuple
    n_voxels: int
    n_volumes: int
    estimator: str = DEFAULTS["estimator"]

    @property
    def spread_test(self) -> bool:
        """Whether the estimator tests the noise eigenvalues' spread (exp1, exp2), not their upper edge."""
        from .engine.estimators import SPREAD_ESTIMATORS

        return self.estimator in SPREAD_ESTIMATORS

    @property
    def mean(self) -> float:
        """Mean of the noise eigenvalues under the fitted law: sigma^2, or for the edge estimators, which
        take them as an (r - P) x (q - P) noise matrix's, sigma^2 (q - P) / q."""
        if self.spread_test:
            return self.sigma2
        q = max(self.n_voxels, self.n_volumes)
        return self.sigma2 * (q - self.rank) / q

    @property
    def edge(self) -> float:
        """Upper edge of the fitted Marchenko-Pastur support, mean (1 + sqrt(gamma))^2."""
        return self.mean * (1 + np.sqrt(self.gamma)) ** 2

    @property
    def cutoff(self) -> float:
        """The largest eigenvalue the estimator's test calls noise at the chosen P: the smallest eigenvalue
        plus the width of the Marchenko-Pastur support, lambda_r + 4 sqrt(gamma) sigma^2 (exp1, exp2); the
        whole patch's upper edge sigma^2 (1 + sqrt(r / q))^2 (med, olesen2023)."""
        if self.spread_test:
            return float(self.eigenvalues[-1]) + 4 * np.sqrt(self.gamma) * self.sigma2
        r, q = min(self.n_voxels, self.n_volumes), max(self.n_voxels, self.n_volumes)
        return self.sigma2 * (1 + np.sqrt(r / q)) ** 2


def sample_spectra(data, mask=None, *, extent=DEFAULTS["extent"], stride=DEFAULTS["stride"],
                   estimator=DEFAULTS["estimator"], demean=DEFAULTS["demean"], n_sampled=48, n_shown=3,
                   seed=0, shape=DEFAULTS["shape"]) -> list[PatchSpectrum]:
    """Fit ``n_sampled`` random patches of the run's layout; return ``n_shown`` of them (lowest, median and
    highest rank), each with its eigenvalues. For ``shape="sphere"``, ``extent`` is the sphere's bounding
    cube, as the run's ``info["extent"]`` records it.

    The patches are gathered, centred and thresholded by the CPU engine's ``fit_windows`` (so by the same
    code as the run); only the eigenvalues are recomputed here, from the centred patches.
    """
    from .engine import check_data, resolve_options
    from .engine.cpu import fit_windows
    from .engine.layout import padded_series, voxel_rows
    from .engine.patches import plan_patches

    data, mask = check_data(data, mask)
    options = replace(resolve_options(data.shape, extent=extent, stride=stride, estimator=estimator,
                                      aggregation="uniform", demean=demean), shape=shape)
    finite = np.isfinite(data).all(axis=3)
    plan = plan_patches(data.shape[:3], options.extent, options.stride, mask, finite, shape)
    if plan.n_windows == 0:
        return []
    rng = np.random.default_rng(seed)
    chosen = np.sort(rng.choice(plan.n_windows, size=min(n_sampled, plan.n_windows), replace=False))
    sampled = replace(plan, window_corner=plan.window_corner[chosen], multiplicity=plan.multiplicity[chosen])
    # the sampled patches' rows gathered from the series in its own order (a volume-major one: no transpose)
    # (spheres: on the series padded by their radius, as the plan's grid is)
    series, finite = padded_series(data if finite.all() else np.where(finite[..., None], data, np.float32(0)),
                                   finite, plan.padding)
    with threadpool_limits(limits=1):  # a multithreaded BLAS on a few small matrices is 100x slower
        fit = fit_windows(voxel_rows(series), finite.ravel(), sampled, options, slice(None))
        patches = fit.patches
        gram = patches.transpose(0, 2, 1) @ patches if fit.time_side else patches @ patches.transpose(0, 2, 1)
        eigenvalues = np.linalg.eigvalsh(gram)[:, ::-1]  # descending
    n_voxels = fit.took_part.sum(axis=1) - (options.demean == "volume")
    n_volumes = data.shape[3] - (options.demean == "voxel")

    order = np.argsort(fit.rank, kind="stable")
    picks = order[np.unique(np.linspace(0, len(order) - 1, n_shown).round().astype(int))]
    spectra = []
    for k in picks:
        r, q = min(n_voxels[k], n_volumes), max(n_voxels[k], n_volumes)
        rank = int(fit.rank[k])
        gamma = (r - rank) / q if options.estimator == "exp1" else (r - rank) / (q - rank)
        spectra.append(PatchSpectrum(np.clip(eigenvalues[k, :r], 0, None) / q, rank, float(fit.sigma2[k]),
                                     float(gamma), tuple(int(c) - plan.padding for c in sampled.window_corner[k]),
                                     int(n_voxels[k]), int(n_volumes), options.estimator))
    return spectra


def marchenko_pastur_density(x, sigma2, gamma):
    """Density of the Marchenko-Pastur law with mean ``sigma2`` and ratio ``gamma`` (<= 1) at ``x``."""
    x = np.asarray(x, dtype=float)
    low, high = sigma2 * (1 - np.sqrt(gamma)) ** 2, sigma2 * (1 + np.sqrt(gamma)) ** 2
    inside = (x > low) & (x < high)
    density = np.zeros_like(x)
    density[inside] = np.sqrt((high - x[inside]) * (x[inside] - low)) / (2 * np.pi * sigma2 * gamma * x[inside])
    return density


# ---------------------------------------------------------------------------------------------- figures

def _figure(width, height, **margins):
    """A Figure outside pyplot (no global state; saved through Agg). Margins are set by hand: Matplotlib's
    constrained layout would double the drawing time, and the report must stay under 2 s a run."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=DPI)
    fig.subplots_adjust(**margins)
    return fig


def _planes(volume, centre):
    """Sagittal, coronal and axial slices of a RAS-ordered 3D array through ``centre``, ready for imshow
    (rows up the screen with ``origin='lower'``)."""
    x, y, z = centre
    return [("sagittal", volume[x, :, :].T), ("coronal", volume[:, y, :].T), ("axial", volume[:, :, z].T)]


_SUPERSCRIPT = str.maketrans("-0123456789", "\u207b\u2070\u00b9\u00b2\u00b3\u2074\u2075\u2076\u2077\u2078\u2079")


def _power_of_ten(value, _position=None) -> str:
    """A log axis label without mathtext (whose first use costs a quarter of a second): 10 with a Unicode
    superscript for powers of ten, the plain number otherwise."""
    if value <= 0:
        return ""
    exponent = np.log10(value)
    if abs(exponent - round(exponent)) < 1e-9:
        return "10" + str(int(round(exponent))).translate(_SUPERSCRIPT)
    return f"{value:g}"


def _log_axis(axis, span):
    """Major ticks only (minor log ticks cost a third of the drawing time), labelled without mathtext; 1, 2
    and 5 of each decade when ``span`` (max / min) is under two decades."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullLocator

    axis.set_minor_locator(NullLocator())
    if span < 100:
        axis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(_power_of_ten))


def _width_ratios(shape, zooms):
    """Physical widths of the sagittal (y), coronal (x) and axial (x) views."""
    return [shape[1] * zooms[1], shape[0] * zooms[0], shape[0] * zooms[0]]


def _aspects(zooms):
    zx, zy, zz = zooms
    return {"sagittal": zz / zy, "coronal": zz / zx, "axial": zy / zx}


def _centre(mask):
    points = np.argwhere(mask)
    if len(points) == 0:
        return tuple(s // 2 for s in mask.shape)
    return tuple(int(round(c)) for c in points.mean(axis=0))


def _row(fig, axes, images, zooms, label, colorbar_label, colorbar_axes=None, colorbar_for=None, **style):
    """Three planes in ``axes`` with a colour bar (in ``colorbar_axes``, else taken from the space of the
    axes ``colorbar_for``, by default the row's; an empty ``colorbar_for`` draws none)."""
    aspects = _aspects(zooms)
    shown = None
    for ax, (plane, image) in zip(axes, images):
        shown = ax.imshow(image, origin="lower", aspect=aspects[plane], interpolation="nearest", **style)
        ax.set_xticks([])
        ax.set_yticks([])
    axes[0].set_ylabel(label, fontsize=11)
    if colorbar_for is not None and len(colorbar_for) == 0:
        return shown
    if colorbar_axes is None:
        bar = fig.colorbar(shown, ax=list(axes if colorbar_for is None else colorbar_for), fraction=0.025,
                           pad=0.015, aspect=12 * (1 if colorbar_for is None else 2))
    else:
        bar = fig.colorbar(shown, cax=colorbar_axes)
    bar.set_label(colorbar_label)
    return shown


def _median_volume(series, served) -> int:
    """The volume of median mean intensity over the ``served`` voxels (every voxel where none is): each
    volume's sum over them as one weighted sum in the series' own layout (``einsum``), without gathering their
    time courses into a copy (a 96x96x60x100 series: 0.08 s against 0.33 s on one core)."""
    weights = (served if served.any() else np.ones(served.shape, bool)).astype(series.dtype)
    sums = np.einsum("xyzt,xyz->t", series, weights)
    return int(np.argsort(sums)[len(sums) // 2])


def plot_slices(noisy, denoised, sigma, zooms=(1, 1, 1), volume=None, title=""):
    """Input, denoised and residual of one volume in three planes (a 3 x 3 grid)."""
    served = sigma > 0
    if volume is None:
        volume = _median_volume(noisy, served)
    centre = _centre(served)
    before, after = noisy[..., volume], denoised[..., volume]
    residual = np.where(served, before - after, 0)
    low, high = np.percentile(before[served] if served.any() else before, [0.5, 99.5])
    spread = 3 * float(np.median(sigma[served])) if served.any() else float(np.abs(residual).max() or 1)

    fig = _figure(10, 8.4, left=0.04, right=0.93, bottom=0.02, top=0.91, wspace=0.04, hspace=0.08)
    axes = fig.subplots(3, 3, width_ratios=_width_ratios(noisy.shape, zooms))
    _row(fig, axes[0], _planes(before, centre), zooms, "input", "intensity", colorbar_for=[], cmap="gray",
         vmin=low, vmax=high)
    _row(fig, axes[1], _planes(after, centre), zooms, "denoised", "intensity (input and denoised)",
         colorbar_for=[*axes[0], *axes[1]], cmap="gray", vmin=low, vmax=high)
    _row(fig, axes[2], _planes(residual, centre), zooms, "residual", "input - denoised", cmap="RdBu_r",
         vmin=-spread, vmax=spread)
    for ax, (plane, _) in zip(axes[0], _planes(before, centre)):
        ax.set_title(plane)
    fig.suptitle(f"{title}volume {volume} of {noisy.shape[3]}, slices through voxel {centre}", fontsize=12)
    return fig


def plot_maps(sigma, rank, zooms=(1, 1, 1), title=""):
    """Noise and rank maps in three planes, with their histograms over the denoised voxels."""
    served = sigma > 0
    centre = _centre(served)
    fig = _figure(11, 5.6, left=0.035, right=0.935, bottom=0.1, top=0.88, wspace=0.06, hspace=0.3)
    widths = _width_ratios(sigma.shape, zooms)
    unit = float(np.mean(widths))
    # three planes, the colour bar, a spacer for the histogram's labels, the histogram
    grid = fig.add_gridspec(2, 6, width_ratios=[*widths, 0.06 * unit, 0.3 * unit, 1.2 * unit])
    axes = [[fig.add_subplot(grid[row, column]) for column in (0, 1, 2, 3, 5)] for row in range(2)]
    values = [("noise sigma", sigma, "magma"), ("rank", rank, "viridis")]
    for row, (label, image, cmap) in zip(axes, values):
        inside = image[served] if served.any() else image.ravel()
        # the noise map on the range of its values (its variations are what matter), the rank from 0
        low, high = np.percentile(inside, [0.5, 99.5]) if inside.size else (0.0, 1.0)
        low = 0.0 if label == "rank" else float(low)
        _row(fig, row[:3], _planes(np.where(served, image, np.nan), centre), zooms, label, label,
             colorbar_axes=row[3], cmap=cmap, vmin=low, vmax=max(float(high), low + 1e-6))
        hist = row[4]
        hist.hist(inside, bins=40, histtype="stepfilled", color=NOISE_COLOUR if label != "rank" else THEORY_COLOUR)
        median = float(np.median(inside)) if inside.size else 0.0
        hist.axvline(median, color="k", linestyle="--", linewidth=1)
        hist.set_xlabel(f"{label} (median {median:.3g})")
        hist.set_ylabel("voxels")
        hist.yaxis.tick_right()  # clear of the colour bar's label
        hist.yaxis.set_label_position("right")
    for ax, plane in zip(axes[0][:3], ("sagittal", "coronal", "axial")):
        ax.set_title(plane)
    fig.suptitle(f"{title}noise and rank maps, slices through voxel {centre}", fontsize=12)
    return fig


def expected_residual_sd(sigma, rank, n_volumes, demeaned):
    """What pure noise of level ``sigma`` leaves after projecting out ``rank`` (+1 mean) of ``n_volumes``
    dimensions: sigma * sqrt(1 - (rank + demeaned) / n_volumes)."""
    return sigma * np.sqrt(np.clip(1 - (rank + demeaned) / n_volumes, 0, None))


def scaled_residuals(noisy, denoised, sigma, rank, demeaned, max_values=400_000, seed=0) -> np.ndarray:
    """(input - denoised) / ``expected_residual_sd`` at the voxels served with a positive expected SD, at most
    ``max_values`` of them: every one, or as many (voxel, volume) pairs drawn at random without replacement
    (``seed``), float64."""
    served = sigma > 0
    n_volumes = noisy.shape[3]
    voxels = np.flatnonzero(served)
    expected = expected_residual_sd(sigma.ravel()[voxels], rank.ravel()[voxels], n_volumes, demeaned)
    usable = expected > 0
    voxels, expected = voxels[usable], expected[usable]
    # at most max_values (voxel, volume) pairs drawn first, and only their residuals computed: the whole
    # series' residuals would be two gathered copies of it and their arithmetic (seconds on a DWI run)
    n_values = voxels.size * n_volumes
    drawn = (np.random.default_rng(seed).choice(n_values, max_values, replace=False) if n_values > max_values
             else np.arange(n_values))
    voxel, volume = np.divmod(drawn, n_volumes)
    where = np.unravel_index(voxels[voxel], served.shape) + (volume,)
    return (noisy[where] - denoised[where]) / expected[voxel]


def plot_residuals(noisy, denoised, sigma, rank, demeaned, title="", max_values=400_000, seed=0):
    """Histogram of the scaled residuals over N(0, 1) (``scaled_residuals``), on linear and logarithmic density
    axes."""
    served = sigma > 0
    z = scaled_residuals(noisy, denoised, sigma, rank, demeaned, max_values, seed)
    sd = float(z.std()) if z.size else float("nan")
    beyond = float(np.mean(np.abs(z) > 4)) if z.size else float("nan")

    fig = _figure(10, 3.8, left=0.07, right=0.98, bottom=0.14, top=0.83, wspace=0.18)
    axes = fig.subplots(1, 2)
    grid = np.linspace(-6, 6, 401)
    normal = np.exp(-grid**2 / 2) / np.sqrt(2 * np.pi)
    for ax, log in zip(axes, (False, True)):
        ax.hist(np.clip(z, -6, 6), bins=121, range=(-6, 6), density=True, histtype="stepfilled", color=NOISE_COLOUR,
                label=f"residuals (SD {sd:.3f})")
        ax.plot(grid, normal, color=THEORY_COLOUR, linewidth=1.8, label="N(0, 1): pure noise")
        ax.set_xlabel("residual / (sigma sqrt(1 - (P + d)/T))")
        ax.set_xlim(-6, 6)
        if log:
            ax.set_yscale("log")
            _log_axis(ax.yaxis, 1e6)
            ax.set_ylim(max(1e-6, 0.5 / max(z.size, 1) / 0.1), 1)
            ax.set_title(f"log scale: {100 * beyond:.3g}% beyond 4 SD (pure noise: 0.0063%)", fontsize=10)
        else:
            ax.set_ylabel("density")
            ax.set_title(f"{z.size:,} residuals of {int(served.sum()):,} voxels", fontsize=10)
    axes[0].legend(loc="upper right", fontsize=9, frameon=False)
    fig.suptitle(f"{title}residuals against the expected Gaussian", fontsize=12)
    return fig


def plot_spectra(spectra, title=""):
    """Per patch: eigenvalue histogram over the fitted Marchenko-Pastur density, and the scree plot."""
    count = max(len(spectra), 1)
    fig = _figure(4.2 * count, 7.0, left=0.08, right=0.98, bottom=0.08, top=0.83, wspace=0.25, hspace=0.42)
    axes = fig.subplots(2, count, squeeze=False)
    for column, spectrum in enumerate(spectra):
        top, bottom = axes[0, column], axes[1, column]
        lam, rank = spectrum.eigenvalues, spectrum.rank
        noise, signal = lam[rank:], lam[:rank]
        edge = max(spectrum.edge, spectrum.cutoff)
        x_max = max(1.6 * edge, float(noise.max()) * 1.1 if noise.size else 0.0)
        near = signal[signal <= 3 * edge]
        if near.size:
            x_max = max(x_max, float(near.max()) * 1.08)
        bins = np.linspace(0, x_max, int(np.clip(np.sqrt(max(noise.size, 1)) * 2.5, 12, 60)) + 1)
        scale = 1.0 / max(noise.size, 1) / (bins[1] - bins[0])  # the noise eigenvalues integrate to 1
        top.hist([noise, near], bins=bins, weights=[np.full(noise.size, scale), np.full(near.size, scale)],
                 stacked=True, histtype="stepfilled", color=[NOISE_COLOUR, SIGNAL_COLOUR],
                 label=["noise eigenvalues", "signal eigenvalues"])
        grid = np.linspace(1e-9, x_max, 600)
        if spectrum.sigma2 > 0 and spectrum.gamma > 0:
            top.plot(grid, marchenko_pastur_density(grid, spectrum.mean, spectrum.gamma),
                     color=THEORY_COLOUR, linewidth=1.8, label="Marchenko-Pastur density (fitted)")
        top.axvline(spectrum.cutoff, color=SIGNAL_COLOUR, linestyle="--", linewidth=1.2, label="cut-off")
        far = signal[signal > x_max]
        if far.size:
            top.annotate(f"+{far.size} signal beyond\n(largest {far.max():.3g})", xy=(0.98, 0.42),
                         xycoords="axes fraction", ha="right", fontsize=9, color=SIGNAL_COLOUR)
        top.set_xlim(0, x_max)
        top.set_xlabel("eigenvalue / max(n, T)")
        top.set_title(f"patch at {spectrum.corner}: P = {rank} of {lam.size} kept\n"
                      f"n = {spectrum.n_voxels}, T = {spectrum.n_volumes}; sigma^2 = {spectrum.sigma2:.3g}, "
                      f"gamma = {spectrum.gamma:.2f}", fontsize=10)

        index = np.arange(1, lam.size + 1)
        positive = np.maximum(lam, np.finfo(float).tiny)
        bottom.semilogy(index[rank:], positive[rank:], "o", color=NOISE_COLOUR, markersize=3.5)
        if rank:
            bottom.semilogy(index[:rank], positive[:rank], "o", color=SIGNAL_COLOUR, markersize=4.5)
        bottom.axhline(spectrum.cutoff, color=SIGNAL_COLOUR, linestyle="--", linewidth=1.2)
        _log_axis(bottom.yaxis, positive.max() / positive.min())
        bottom.set_xlabel("component (decreasing eigenvalue)")
    if spectra:
        entries = {}
        for ax in axes[0]:
            entries.update(zip(*reversed(ax.get_legend_handles_labels())))
        order = ["noise eigenvalues", "signal eigenvalues", "Marchenko-Pastur density (fitted)", "cut-off"]
        labels = [label for label in order if label in entries]
        fig.legend([entries[label] for label in labels], labels, loc="upper center", bbox_to_anchor=(0.5, 0.955), ncol=len(labels),
                   fontsize=9, frameon=False)
    axes[0, 0].set_ylabel("density")
    axes[1, 0].set_ylabel("eigenvalue / max(n, T)")
    fig.suptitle(f"{title}eigenvalue spectra and the Marchenko-Pastur fit", fontsize=12)
    return fig


def write_run_figures(noisy, result, out_dir, *, mask=None, zooms=(1, 1, 1), title="", options=None,
                      seed=0) -> dict:
    """Make the four figures of a run and save them as ``out_dir/<kind>.png``; return {kind: path}.

    Parameters
    ----------
    noisy : (X, Y, Z, T) array
        The input series (RAS voxel order gives the usual views; see ``load_for_report``).
    result : DenoiseResult
        What ``denoise`` returned for it (``info`` holds the resolved options).
    out_dir : path
        Where the PNGs go (created).
    mask : (X, Y, Z) array, optional
        The mask given to ``denoise``.
    zooms : three floats
        Voxel sizes, for the aspect ratio of the slices.
    options : dict, optional
        extent, stride, estimator, demean, shape (default: from ``result.info``).
    """
    info = dict(result.info)
    options = dict(options or {})
    for key in ("extent", "stride", "estimator", "demean"):
        options.setdefault(key, info.get(key))
    options.setdefault("shape", info.get("shape", DEFAULTS["shape"]))
    noisy = np.asarray(noisy, dtype=np.float32)
    sigma, rank, denoised = np.asarray(result.sigma), np.asarray(result.rank), np.asarray(result.denoised)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    prefix = f"{title}: " if title else ""
    spectra = sample_spectra(noisy, mask, extent=tuple(options["extent"]), stride=int(options["stride"]),
                             estimator=options["estimator"], demean=options["demean"], seed=seed,
                             shape=options["shape"])
    figures = {
        "slices": plot_slices(noisy, denoised, sigma, zooms, title=prefix),
        "maps": plot_maps(sigma, rank, zooms, title=prefix),
        "residuals": plot_residuals(noisy, denoised, sigma, rank, options["demean"] != "none", title=prefix),
        "spectra": plot_spectra(spectra, title=prefix),
    }
    paths = {}
    for kind, fig in figures.items():
        paths[kind] = str(out_dir / f"{kind}.png")
        fig.savefig(paths[kind], dpi=DPI)
    return paths


def load_for_report(path):
    """A NIfTI image's data in RAS voxel order (float32) and its voxel sizes: what
    ``nibabel.as_closest_canonical`` gives, with the values read by ``io.read_data`` (ISA-L for .nii.gz, several
    times nibabel's gzip) and the axes turned as a view."""
    import nibabel as nib
    from nibabel.orientations import apply_orientation, io_orientation

    from .io import read_data

    image = nib.load(str(path))
    turn = io_orientation(image.affine)  # (the input axis of each RAS axis, its flip)
    data = apply_orientation(read_data(image, path, "report's"), turn)
    zooms = np.asarray(image.header.get_zooms()[:3], dtype=float)
    return data, tuple(float(zooms[int(axis)]) for axis in np.argsort(turn[:, 0]))


# ---------------------------------------------------------------------------------------- Nipype node

class _RunReportInputSpec(BaseInterfaceInputSpec):
    in_file = File(exists=True, mandatory=True, desc="the input series (NIfTI)")
    denoised_file = File(exists=True, mandatory=True, desc="the denoised series")
    noise_file = File(exists=True, mandatory=True, desc="the noise map")
    rank_file = File(exists=True, mandatory=True, desc="the rank map")
    provenance_file = File(exists=True, mandatory=True,
                           desc="provenance JSON (MPPCADenoise's, or a sidecar holding it under MPPCADenoising)")
    mask = File(exists=True, desc="the mask given to the denoising")
    title = traits.Str("", usedefault=True, desc="a name for the figures' titles (e.g. the run's file name)")


class _RunReportOutputSpec(TraitedSpec):
    figures = traits.List(File(exists=True), desc="the PNGs, named <kind>.png (kinds: reports.FIGURES)")
    seconds = traits.Float(desc="wall time taken")
    cpu_seconds = traits.Float(desc="CPU time taken (the wall time on an idle core: drawing is single-threaded)")


class RunReport(SimpleInterface):
    """The QC figures of one run (``write_run_figures``), in the node's directory."""

    input_spec = _RunReportInputSpec
    output_spec = _RunReportOutputSpec

    def _run_interface(self, runtime):
        from .engine import DenoiseResult

        started, cpu_started = time.perf_counter(), time.process_time()
        noisy, zooms = load_for_report(self.inputs.in_file)
        denoised, _ = load_for_report(self.inputs.denoised_file)
        sigma, _ = load_for_report(self.inputs.noise_file)
        rank, _ = load_for_report(self.inputs.rank_file)
        mask = load_for_report(self.inputs.mask)[0] != 0 if isdefined(self.inputs.mask) else None
        provenance = json.loads(Path(self.inputs.provenance_file).read_text())
        provenance = provenance.get("MPPCADenoising", provenance)
        result = DenoiseResult(denoised, sigma, rank, info=provenance.get("EngineInfo", {}))
        try:
            paths = write_run_figures(noisy, result, Path(runtime.cwd) / "figures", mask=mask, zooms=zooms,
                                      title=self.inputs.title)
        except Exception as err:  # a figure must never cost the run its derivatives
            from nipype import logging

            logging.getLogger("nipype.interface").warning(
                "QC report of %s failed: %s", Path(self.inputs.in_file).name, err)
            paths = {}
        self._results.update(figures=[paths[kind] for kind in FIGURES if kind in paths],
                             seconds=time.perf_counter() - started,
                             cpu_seconds=time.process_time() - cpu_started)
        return runtime


# --------------------------------------------------------------------------------------- subject page

def _summary_rows(provenance) -> list[tuple[str, str]]:
    info = provenance.get("EngineInfo", {})
    extent = info.get("extent")
    where = provenance.get("Backend") or "?"
    if provenance.get("Device") not in (None, where):
        where += f" ({provenance['Device']})"
    return [
        ("median noise (sigma)", f"{provenance.get('NoiseMedian', float('nan')):.4g}"),
        ("median rank", f"{provenance.get('RankMedian', float('nan')):.3g}"),
        ("patch", ("x".join(map(str, extent)) if extent else "?")
         + (" (sphere)" if info.get("shape") == "sphere" else "") + f", stride {info.get('stride', '?')}"),
        ("estimator / aggregation / demean",
         f"{info.get('estimator', '?')} / {info.get('aggregation', '?')} / {info.get('demean', '?')}"),
        ("patches", f"{info.get('n_windows', '?')}"),
        ("ran on", f"{where}, {provenance.get('WallTimeSeconds', float('nan')):.2f} s"),
        ("input sha256", f"{provenance.get('InputSHA256', '?')[:16]}..."),
    ]


PAGE_STYLE = """
body { font-family: system-ui, sans-serif; max-width: 1250px; margin: 1.5em auto; padding: 0 1em; color: #222; }
h1 { font-size: 1.6em; } h2 { border-top: 2px solid #ccc; padding-top: 0.6em; margin-top: 2em; }
h3 { font-size: 1.05em; margin-bottom: 0.2em; }
table { border-collapse: collapse; margin: 0.5em 0 1em; } td { padding: 0.15em 1em 0.15em 0; }
td:first-child { color: #555; } figure { margin: 0.5em 0 1.5em; } img { max-width: 100%; }
figcaption { color: #444; font-size: 0.92em; max-width: 62em; } .warning { color: #a94400; }
nav a { margin-right: 1em; }
"""


def subject_report_html(subject, runs, *, generated_by="mppca-nipype") -> str:
    """The HTML page of one subject.

    ``runs``: a list of dicts with ``name`` (the derivative's file name), ``provenance`` (the sidecar's
    MPPCADenoising block) and ``figures`` ({kind: path relative to the page}).
    """
    escape = html.escape
    parts = [f"<!DOCTYPE html>\n<html lang='en'>\n<head><meta charset='utf-8'>"
             f"<title>sub-{escape(subject)}: MP-PCA denoising report</title>"
             f"<style>{PAGE_STYLE}</style></head>\n<body>",
             f"<h1>sub-{escape(subject)}: MP-PCA denoising report</h1>",
             f"<p>{len(runs)} run{'s' if len(runs) != 1 else ''}, denoised by {escape(generated_by)} "
             f"(Marchenko-Pastur PCA). Methods text and references: "
             f"<a href='logs/CITATION.md'>logs/CITATION.md</a>.</p>",
             "<nav>" + "".join(f"<a href='#run-{k}'>{escape(run['name'])}</a>" for k, run in enumerate(runs))
             + "</nav>"]
    for k, run in enumerate(runs):
        provenance = run["provenance"]
        parts.append(f"<h2 id='run-{k}'>{escape(run['name'])}</h2>")
        parts.append("<table>" + "".join(f"<tr><td>{escape(key)}</td><td>{escape(value)}</td></tr>"
                                         for key, value in _summary_rows(provenance)) + "</table>")
        for text in provenance.get("Warnings", []):
            parts.append(f"<p class='warning'>warning: {escape(text)}</p>")
        for kind, (heading, caption) in FIGURES.items():
            if kind not in run["figures"]:
                continue
            source = escape(run["figures"][kind], quote=True)
            parts.append(f"<figure><h3>{escape(heading)}</h3><a href='{source}'><img src='{source}' "
                         f"alt='{escape(heading, quote=True)}'></a><figcaption>{escape(caption)}"
                         f"</figcaption></figure>")
    parts.append("</body>\n</html>\n")
    return "\n".join(parts)


def write_subject_report(output_dir, subject) -> Path | None:
    """Write ``OUTPUT_DIR/sub-<subject>.html`` from what the derivative dataset holds for the subject: every
    denoised run's sidecar and the figures that exist for it. Returns its path (None when no run has
    figures)."""
    from . import __version__

    output_dir = Path(output_dir)
    runs = []
    for sidecar in sorted((output_dir / f"sub-{subject}").rglob("*_desc-denoised_*.json")):
        try:
            content = json.loads(sidecar.read_text())
            source = content["Sources"][0].removeprefix("bids:raw:")
            provenance = content["MPPCADenoising"]
        except (OSError, ValueError, KeyError, IndexError, TypeError, AttributeError):
            continue
        figures = {kind: path for kind, path in report_names(source).items() if (output_dir / path).exists()}
        if figures:
            runs.append(dict(name=sidecar.name.removesuffix(".json"), provenance=provenance, figures=figures))
    if not runs:
        return None
    page = output_dir / subject_report_name(subject)
    write_text_atomic(page, subject_report_html(subject, runs, generated_by=f"mppca-nipype {__version__}"))
    return page
