"""Demeaning by groups of volumes (b-value shells, echoes, any labels) and multi-echo series.

Removing each voxel's mean over the volumes of each of G groups leaves every voxel's series in the
orthogonal complement of the G group indicator vectors, a space of T - G dimensions. An orthonormal basis
Q ((T - G) x T) of that complement maps a voxel's series x onto its *contrasts* y = Q x and back through
x = Q^T y + (the group means), exactly. ``denoise`` then runs unchanged, ``demean="none"``, on the contrasts:
the patch matrix Y = X Q^T has the Gram Y^T Y = Q X_c^T X_c Q^T, with X_c the group-demeaned patch, so its
eigenvalues are the T - G non-null ones of X_c^T X_c, the Marchenko-Pastur law sees T - G volumes, and
white noise stays white of the same sigma (Q has orthonormal rows). The projection Y V_P V_P^T mapped back
by Q is X_c's own projection onto its P leading components: nothing of either engine changes.

Q is the Helmert basis within each group: for a group of m volumes x_0 .. x_{m-1}, contrast k = 1 .. m-1 is
y_k = (x_0 + ... + x_{k-1} - k x_k) / sqrt(k (k + 1)), so both directions take cumulative sums, O(T) per
voxel (Lancaster HO. The Helmert matrices. Am Math Monthly 72(1):4-12 (1965)).

``demean="voxel"`` is the case G = 1, with the same degrees of freedom and aggregation weight
(``tests/test_groups.py`` compares the numbers).
"""

from __future__ import annotations

import time

import numpy as np

from .errors import MPPCAInputError
from .layout import in_parts

#: The ``demean`` modes that remove each voxel's mean per group of volumes (``denoise_by_groups``):
#: ``shells`` takes the groups from the b-values (``shell_labels``), ``groups`` from labels given per volume.
GROUP_DEMEANING = ("shells", "groups")

#: MRtrix3's BZeroThreshold: a b-value at most this is a b = 0 volume.
BZERO_THRESHOLD = 10.0
#: MRtrix3's BValueEpsilon (3.0's default): b-values closer than this are neighbours in a shell.
BVALUE_EPSILON = 80.0
#: MRtrix3's DWI_SHELLS_MIN_LINKAGE: a shell grows only from b-values with at least this many neighbours.
MIN_LINKAGE = 3

#: Bytes of float64 rows each thread of the transforms holds at once (a slab of the series along x).
SLAB_BYTES = 16 << 20


def shell_labels(bvals) -> np.ndarray:
    """The shell of each volume, as MRtrix3 clusters b-values (``DWI::Shells``): an int label per volume,
    0 for b = 0, then 1, 2, ... by increasing mean b-value.

    Every b <= ``BZERO_THRESHOLD`` is one b = 0 shell. The others are clustered by density (DBSCAN in one
    dimension): two b-values are neighbours when they differ by less than ``BVALUE_EPSILON`` (the b-value
    itself counts), a b-value with at least ``MIN_LINKAGE`` neighbours starts or extends a shell, and the
    shell takes in every neighbour of its members. A b-value left in no shell (MRtrix3 warns and leaves it
    out) joins the shell whose mean b-value is nearest. b-values are taken as given (no scaling by the
    gradients' norms: give the b-values MRtrix3's ``-bvalue_scaling`` would use).
    """
    b = np.asarray(bvals, dtype=np.float64).ravel()
    if b.size == 0 or not np.isfinite(b).all() or (b < 0).any():
        raise MPPCAInputError("the b-values must be finite numbers, none negative")
    cluster = np.zeros(b.size, dtype=np.int64)  # 0: not yet in a shell
    zero = b <= BZERO_THRESHOLD
    cluster[zero] = 1
    visited = zero.copy()
    n_clusters = int(zero.any())

    def neighbours(value):
        return list(np.flatnonzero((b > BZERO_THRESHOLD) & (np.abs(b - value) < BVALUE_EPSILON)))

    for i in range(b.size):
        if visited[i]:
            continue
        visited[i] = True
        found = neighbours(b[i])
        if len(found) < MIN_LINKAGE:
            continue
        n_clusters += 1
        cluster[i] = n_clusters
        for j in found:  # ``found`` grows as the shell reaches further (MRtrix3's expansion)
            if not visited[j]:
                visited[j] = True
                more = neighbours(b[j])
                if len(more) >= MIN_LINKAGE:
                    found.extend(more)
            if cluster[j] == 0:
                cluster[j] = n_clusters
    if n_clusters == 0:
        raise MPPCAInputError("the b-values form no shell (no b = 0 volume and no b-value shared by "
                              f"{MIN_LINKAGE} volumes within {BVALUE_EPSILON:g})")
    means = np.array([b[cluster == c].mean() for c in range(1, n_clusters + 1)])
    alone = np.flatnonzero(cluster == 0)
    cluster[alone] = 1 + np.argmin(np.abs(b[alone, None] - means[None, :]), axis=1)
    # relabel 0 .. G-1 by increasing mean b-value (b = 0 first)
    by_mean = np.argsort(means, kind="stable")
    relabel = np.empty(n_clusters, dtype=np.int64)
    relabel[by_mean] = np.arange(n_clusters)
    return relabel[cluster - 1]


def check_groups(groups, n_volumes: int, what: str = "the group labels") -> np.ndarray:
    """The labels as ints 0 .. G-1 in order of first appearance; one sentence when they are not one integer
    per volume."""
    labels = np.asarray(groups)
    if labels.ndim != 1 or labels.size != n_volumes:
        raise MPPCAInputError(f"{what} must be one integer per volume ({n_volumes}), not {labels.size} "
                              f"value{'s' if labels.size != 1 else ''}")
    numeric = np.issubdtype(labels.dtype, np.integer) or np.issubdtype(labels.dtype, np.floating)
    if labels.dtype == bool or not numeric:
        raise MPPCAInputError(f"{what} must be integers, not {labels.dtype} values")
    if np.issubdtype(labels.dtype, np.floating):
        whole = np.isfinite(labels) & (labels == np.round(labels))
        if not whole.all():
            first = int(np.flatnonzero(~whole)[0])
            raise MPPCAInputError(f"{what} must be integers, but volume {first} has {float(labels[first]):g}")
    _, first_seen, inverse = np.unique(labels.astype(np.int64), return_index=True, return_inverse=True)
    order = np.argsort(first_seen, kind="stable")
    relabel = np.empty(order.size, dtype=np.int64)
    relabel[order] = np.arange(order.size)
    return relabel[inverse.ravel()]


class GroupContrasts:
    """The orthonormal map between a voxel's T values and (its T - G Helmert contrasts within the groups, its
    G group means), and back; rows of float64 (V, T) at a time.

    The contrasts come group after group (groups by label), each group's in the order of its volumes.
    """

    def __init__(self, labels):
        labels = np.asarray(labels, dtype=np.int64)
        self.n_volumes = labels.size
        self.size = np.bincount(labels)
        self.n_groups = self.size.size
        self.n_contrasts = self.n_volumes - self.n_groups
        #: the volumes of each group, and where its contrasts go: (volumes, slice of the contrasts)
        self.members = []
        first = 0
        for g in range(self.n_groups):
            volumes = np.flatnonzero(labels == g)
            # a run of volumes is a slice: no gather (a group of shells or echoes is often one run)
            if volumes[-1] - volumes[0] + 1 == volumes.size:
                volumes = slice(int(volumes[0]), int(volumes[-1]) + 1)
            self.members.append((volumes, slice(first, first + self.size[g] - 1)))
            first += self.size[g] - 1

    @staticmethod
    def _weights(m):
        """(k, 1 / sqrt(k (k + 1))) for the contrasts k = 1 .. m-1 of a group of m volumes."""
        k = np.arange(1, m, dtype=np.float64)
        return k, 1.0 / np.sqrt(k * (k + 1.0))

    def forward(self, rows):
        """(contrasts (V, T - G), means (V, G)) of rows (V, T) float64: y_k = (x_0 + ... + x_{k-1} - k x_k)
        / sqrt(k (k + 1)) within each group."""
        contrasts = np.empty((rows.shape[0], self.n_contrasts))
        means = np.empty((rows.shape[0], self.n_groups))
        for g, (volumes, out) in enumerate(self.members):
            x = rows[:, volumes]
            k, scale = self._weights(x.shape[1])
            before = np.cumsum(x[:, :-1], axis=1)  # x_0 + ... + x_{k-1}
            means[:, g] = ((before[:, -1] if k.size else 0.0) + x[:, -1]) / x.shape[1]
            before -= k * x[:, 1:]
            contrasts[:, out] = before * scale
        return contrasts, means

    def inverse(self, contrasts, means):
        """Rows (V, T) float64 with these contrasts and group means: x_j = mean + sum_{k > j} z_k - j z_j,
        z_k = y_k / sqrt(k (k + 1)) (the transpose of the Helmert rows)."""
        rows = np.empty((contrasts.shape[0], self.n_volumes))
        for g, (volumes, out) in enumerate(self.members):
            k, scale = self._weights(self.size[g])
            z = contrasts[:, out] * scale  # z_1 .. z_{m-1}
            x = np.empty((contrasts.shape[0], self.size[g]))
            x[:, -1] = 0.0
            np.cumsum(z[:, :0:-1], axis=1, out=x[:, -2:0:-1])  # x_j = z_{j+1} + ... + z_{m-1}, j = 1 .. m-2
            if k.size:
                x[:, 0] = (x[:, 1] if k.size > 1 else 0.0) + z[:, 0]  # x_0 = z_1 + ... + z_{m-1}
            x[:, 1:] -= k * z
            x += means[:, g:g + 1]
            rows[:, volumes] = x
        return rows


def _series_of(data):
    """(the series as an array (X, Y, Z, T) or (X, Y, Z, E, T), the number of echoes or None)."""
    if isinstance(data, (list, tuple)):
        if len(data) < 2:
            raise MPPCAInputError(f"a multi-echo series needs at least two echoes, not {len(data)}")
        echoes = [np.asarray(echo) for echo in data]
        shapes = {echo.shape for echo in echoes}
        if len(shapes) != 1:
            raise MPPCAInputError(f"the echoes must share one shape, not {' and '.join(map(str, sorted(shapes)))}")
        if echoes[0].ndim != 4:
            raise MPPCAInputError(f"each echo must be a 4D series (X, Y, Z, T), not {echoes[0].ndim}D")
        return np.stack(echoes, axis=3), len(echoes)
    data = np.asarray(data)
    if data.ndim == 5:
        if data.shape[3] < 2:
            raise MPPCAInputError(f"a 5D series (X, Y, Z, E, T) needs at least two echoes, not {data.shape[3]}")
        return data, data.shape[3]
    return data, None


def plan_groups(n_volumes: int, n_echoes, demean, groups=None, bvals=None):
    """(the ``GroupContrasts`` of the series, the ``demean`` mode ``denoise`` runs on its contrasts), from the
    series' T volumes per echo and its number of echoes (None: one 4D series); one sentence when the
    labels or the mode cannot be used. Needs no voxel: the command checks it before reading the series.

    The echoes are always groups, crossed with the ``groups``/``shells`` labels of the T volumes; with
    echoes, ``volume`` also removes each patch's mean time course of the contrasts, ``voxel`` nothing more.
    """
    from . import MIN_VOLUMES

    if n_echoes is not None and demean == "none":
        raise MPPCAInputError("a multi-echo series always has each voxel's mean per echo removed; give demean "
                              "'volume', 'voxel', 'groups' or 'shells', not 'none'")
    labels = _volume_labels(n_volumes, n_echoes, demean, groups, bvals)
    transform = GroupContrasts(labels)
    if transform.n_contrasts < MIN_VOLUMES:
        raise MPPCAInputError(f"{transform.n_groups} groups of {labels.size} volumes leave {transform.n_contrasts} "
                              f"after their means are removed; MP-PCA needs at least {MIN_VOLUMES}")
    return transform, "volume" if n_echoes is not None and demean == "volume" else "none"


def _volume_labels(n_volumes, n_echoes, demean, groups, bvals):
    """The group label (0 .. G-1) of each of the series' volumes (T, or E * T echo-major for E echoes)."""
    if demean == "shells":
        if bvals is None:
            raise MPPCAInputError("demean 'shells' needs the b-values (bvals=, one per volume)")
        if np.size(bvals) != n_volumes:
            raise MPPCAInputError(f"the b-values must be one per volume ({n_volumes}), not {np.size(bvals)}")
        labels = shell_labels(bvals)
    elif demean == "groups":
        if groups is None:
            raise MPPCAInputError("demean 'groups' needs a label per volume (groups=)")
        labels = check_groups(groups, n_volumes)
    else:
        labels = np.zeros(n_volumes, dtype=np.int64)
    if n_echoes is None:
        return labels
    n_labels = int(labels.max()) + 1
    return (np.arange(n_echoes)[:, None] * n_labels + labels[None, :]).ravel()


def denoise_by_groups(data, mask, *, demean, groups=None, bvals=None, **options):
    """``denoise`` with each voxel's mean removed per group of volumes, or of a multi-echo series.

    The series is mapped onto its group contrasts (``GroupContrasts``), denoised by ``denoise`` with
    ``demean="none"`` (with echoes and ``demean="volume"``: ``volume``, the patch's mean time course of the
    contrasts), and mapped back with the group means added. ``options`` are ``denoise``'s other keywords.
    A multi-echo series, (X, Y, Z, E, T) or a list of E series (X, Y, Z, T), takes the echoes as groups
    (crossed with the ``groups``/``shells`` labels of its T volumes) and comes back as (X, Y, Z, E, T).
    """
    from . import check_data, denoise

    started = time.perf_counter()
    if options.get("noise_floor", "none") != "none":
        raise MPPCAInputError("demeaning by groups of volumes and multi-echo series do not combine with a "
                              "noise floor; give noise_floor='none'")
    series, n_echoes = _series_of(data)
    if series.ndim not in (4, 5):
        check_data(series, mask)  # its sentence for any other number of dimensions
    transform, inner = plan_groups(series.shape[-1], n_echoes, demean, groups, bvals)
    total = transform.n_volumes
    shape3 = series.shape[:3]
    if not (np.issubdtype(series.dtype, np.floating) or np.issubdtype(series.dtype, np.integer)):
        raise MPPCAInputError(f"the input must hold real numbers, not {series.dtype}")

    contrasts = np.empty(shape3 + (transform.n_contrasts,), np.float32)
    means = np.empty(shape3 + (transform.n_groups,), np.float64)

    def to_contrasts(x0, x1):
        rows = np.asarray(series[x0:x1], dtype=np.float64).reshape(-1, total)
        with np.errstate(invalid="ignore", over="ignore"):
            y, mean = transform.forward(rows)
        contrasts[x0:x1] = y.reshape(contrasts[x0:x1].shape)
        means[x0:x1] = mean.reshape(means[x0:x1].shape)

    _by_slabs(to_contrasts, shape3, total)
    transform_seconds = time.perf_counter() - started

    result = denoise(contrasts, mask, demean=inner, _removed_means=transform.n_groups, **options)
    del contrasts
    mask = np.ones(shape3, bool) if mask is None else np.asarray(mask) != 0  # (checked by ``denoise``)

    started = time.perf_counter()
    volume_major = series.flags.f_contiguous and not series.flags.c_contiguous
    denoised = np.empty(series.shape, np.float32, order="F" if volume_major else "C")

    def from_contrasts(x0, x1):
        mean = means[x0:x1].reshape(-1, transform.n_groups)
        rows = transform.inverse(np.asarray(result.denoised[x0:x1], np.float64).reshape(-1, transform.n_contrasts),
                                 mean)
        inside, finite = mask[x0:x1].reshape(-1), np.isfinite(mean).all(axis=1)
        rows[~inside] = 0
        keep = inside & ~finite  # NaN/Inf in the mask: left as they were
        if keep.any():
            rows[keep] = np.asarray(series[x0:x1], np.float64).reshape(-1, total)[keep]
        denoised[x0:x1] = rows.reshape(denoised[x0:x1].shape)

    _by_slabs(from_contrasts, shape3, total)
    transform_seconds += time.perf_counter() - started

    result.denoised = denoised
    info = result.info
    info["seconds"] = dict(info.get("seconds", {}), groups=round(transform_seconds, 4))
    info.update(demean=demean, n_groups=int(transform.n_groups), group_sizes=transform.size.tolist(),
                usable_volumes=int(transform.n_contrasts))
    if n_echoes is not None:
        info["echoes"] = int(n_echoes)
    return result


def _by_slabs(work, shape3, n_volumes):
    """``work(x0, x1)`` for slabs of the series along x, each about ``SLAB_BYTES`` of float64 rows, the slabs
    spread over threads (``layout.in_parts``; each slab writes its own part of the outputs)."""
    per_plane = max(1, shape3[1] * shape3[2] * n_volumes * 8)
    step = max(1, SLAB_BYTES // per_plane)

    def slabs(numbers):
        for number in range(numbers.start, numbers.stop):
            work(number * step, min((number + 1) * step, shape3[0]))

    in_parts(slabs, -(-shape3[0] // step), shape3[0] * shape3[1] * shape3[2] * n_volumes)
