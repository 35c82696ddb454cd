"""Plot ``benchmarks/quality.py``'s phantom results: RMSE relative to dwidenoise's, and wall time, against T.

    python benchmarks/plot_quality.py [RESULTS.json ...] [--out docs/figures/quality.png]

Default inputs: ``benchmarks/results/quality.json`` and ``quality_t300.json`` (when present; runs at other
shapes are plotted side by side, their T tells them apart). One panel per phantom family (low-rank phantoms
by rank and noise, the DWI phantom by noise), RMSE in the mask divided by dwidenoise's on the same phantom;
the last panel the median wall time over the phantoms of each T (log scale). Ratios above ``CLIP`` are
drawn at it with their value. The figure's footer names the commit and date of each input (its ``stamp``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
import re

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

HERE = Path(__file__).resolve().parent
#: Ratios above this are drawn at it, labelled with their value (a failing peer would flatten the others).
CLIP = 1.5
DEFAULT_INPUTS = [HERE / "results" / "quality.json", HERE / "results" / "quality_t300.json"]
STYLE = {"ours (defaults)": ("C0", "o", "-"), "ours (dwidenoise mode)": ("C0", "s", ":"),
         "dwidenoise": ("k", "x", "--"), "dipy mppca": ("C2", "^", "-"), "patch-denoise": ("C3", "v", "-")}


def family(phantom: str) -> str:
    """'lowrank r3 s5 T32' -> 'lowrank r3 s5'."""
    return re.sub(r"\s*T\d+$", "", phantom)


def load(paths):
    """The phantom rows of every input that exists, and one line per input saying where it came from."""
    rows, sources = [], []
    for path in map(Path, paths):
        if path.exists():
            result = json.loads(path.read_text())
            rows += result["phantoms"]
            sources.append(source_line(path, result))
    if not rows:
        raise SystemExit(f"plot_quality: none of {', '.join(map(str, paths))} exists")
    return rows, sources


def source_line(path: Path, result: dict) -> str:
    """'quality.json: commit 1a2b3c4d5e6f, 2026-12-01' from the result's stamp (or its older "machine")."""
    stamp = result.get("stamp") or {}
    machine = result.get("machine") or {}
    commit = stamp.get("commit") or machine.get("git_commit")
    dirty = stamp.get("dirty", machine.get("package_modified"))
    date = stamp.get("date") or machine.get("date")
    text = f"{path.name}: commit {commit[:12] if commit else 'unknown'}{' (modified)' if dirty else ''}"
    return text + (f", {date[:10]}" if date else "")


def plot(rows, out: Path, sources=()):
    families = sorted({family(r["phantom"]) for r in rows}, key=lambda f: (not f.startswith("lowrank"), f))
    dwidenoise = {r["phantom"]: r["rmse_mask"] for r in rows if r["method"] == "dwidenoise"}
    methods = [m for m in STYLE if any(r["method"] == m for r in rows)]
    columns = 4
    panels = len(families) + 1
    fig, axes = plt.subplots((panels + columns - 1) // columns, columns, figsize=(13, 6.2), squeeze=False)
    for ax, name in zip(axes.flat, families):
        for method in methods:
            points = sorted((r["volumes"], r["rmse_mask"] / dwidenoise[r["phantom"]]) for r in rows
                            if r["method"] == method and family(r["phantom"]) == name and r["phantom"] in dwidenoise)
            if points:
                colour, marker, line = STYLE[method]
                shown = [(t, min(ratio, CLIP)) for t, ratio in points]
                ax.plot(*zip(*shown), color=colour, marker=marker, linestyle=line, label=method)
                for t, ratio in points:  # off the scale: drawn at its top, with the value
                    if ratio > CLIP:
                        ax.annotate(f"{ratio:.1f}", (t, CLIP), textcoords="offset points", xytext=(-4, -12),
                                    ha="right", fontsize=8, color=colour)
        ax.axhline(1.0, color="0.7", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("volumes T")
        ax.set_ylabel("RMSE / dwidenoise's")
    ax = axes.flat[len(families)]
    for method in methods:
        by_volumes = {}
        for r in rows:
            if r["method"] == method:
                by_volumes.setdefault(r["volumes"], []).append(r["seconds"])
        points = sorted((t, float(np.median(s))) for t, s in by_volumes.items())
        colour, marker, line = STYLE[method]
        ax.plot(*zip(*points), color=colour, marker=marker, linestyle=line, label=method)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_title("wall time (median over phantoms)", fontsize=10)
    ax.set_xlabel("volumes T")
    ax.set_ylabel("seconds")
    for extra in list(axes.flat)[panels:]:
        extra.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower right", fontsize=9, frameon=False,
               bbox_to_anchor=(0.98, 0.05) if panels < axes.size else (0.98, 0.0))
    fig.suptitle("MP-PCA on phantoms with a known truth (benchmarks/quality.py)", fontsize=12)
    fig.tight_layout()
    if sources:
        fig.text(0.01, 0.005, "; ".join(sources), fontsize=7, color="0.4", ha="left", va="bottom")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("inputs", nargs="*", type=Path, default=DEFAULT_INPUTS)
    parser.add_argument("--out", type=Path, default=HERE.parent / "docs" / "figures" / "quality.png")
    args = parser.parse_args(argv)
    rows, sources = load(args.inputs)
    print(plot(rows, args.out, sources))


if __name__ == "__main__":
    main()
