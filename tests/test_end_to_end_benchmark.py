"""benchmarks/end_to_end.py at its tiniest: the rows asked for run as new processes, interleaved, and their
phases come back from what the commands print."""

from __future__ import annotations

import json
import os
from pathlib import Path
import subprocess
import sys

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_the_end_to_end_benchmark_times_each_row_and_reads_its_phases(tmp_path):
    out = tmp_path / "end_to_end.json"
    command = [sys.executable, str(REPO / "benchmarks" / "end_to_end.py"), "--series", "16,16,12,20",
               "--seed-series", "16,16,12,16", "--subjects", "1", "--dwi", "12,12,10,16", "--bold", "12,12,10,16",
               "--repeats", "2", "--rows", "nii:*,seed:cpu,bids:cpu,-nii:cuda*,-nii:auto*,-*:dwidenoise",
               "--work", str(tmp_path), "--out", str(out)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]

    report = json.loads(out.read_text())
    assert report["settings"]["rows"] == ["nii:cpu", "seed:cpu", "bids:cpu"] and report["rounds"] == 2
    rows = {row["name"]: row for row in report["rows"]}
    for row in rows.values():
        walls = [run["wall_s"] for run in row["runs"]]
        assert len(walls) == 2 and "error" not in row
        assert 0 < row["best_s"] == min(walls) <= row["median_s"] == pytest.approx(sum(walls) / 2, abs=0.001)
    for name in ("nii:cpu", "seed:cpu"):
        timeline = rows[name]["timeline"]
        phases = timeline["phases"]
        assert list(phases) == ["start-up", "checks", "read", "denoise", "write", "total"]
        inside = sum(value["seconds"] if isinstance(value, dict) else value
                     for phase, value in phases.items() if phase != "total")
        assert 0 < inside <= phases["total"] + 0.05 and phases["total"] <= timeline["wall_s"] + 0.05
        assert timeline["ran_on"].startswith("cpu")
    bids = rows["bids:cpu"]["timeline"]
    assert bids["denoised_runs"] == 2 and bids["ran_on"] == "cpu (2 runs)"  # the subject's DWI and BOLD runs
    assert bids["phases"]["denoise"] > 0 and bids["app_done_s"] <= bids["wall_s"]

    markdown = out.with_suffix(".md").read_text()
    assert report["stamp"]["commit"] in markdown
    assert "| 16x16x12x20, .nii -> .nii | — | — | — | — | " in markdown and "`--device cpu`" in markdown
    assert not list(tmp_path.glob("mppca-end-to-end-*")), "the inputs and outputs are removed at the end"


def test_a_baseline_checkout_runs_beside_this_one_in_every_round(tmp_path):
    import shutil

    baseline = tmp_path / "baseline"
    shutil.copytree(REPO / "mppca_nipype", baseline / "mppca_nipype",
                    ignore=shutil.ignore_patterns("__pycache__"))
    marker = tmp_path / "baseline-imported"
    with open(baseline / "mppca_nipype" / "__init__.py", "a") as init:  # (proof that its package ran)
        init.write(f"\nopen({str(marker)!r}, 'a').write('x')\n")
    out = tmp_path / "end_to_end.json"
    command = [sys.executable, str(REPO / "benchmarks" / "end_to_end.py"), "--seed-series", "16,16,12,16",
               "--subjects", "1", "--dwi", "12,12,10,16", "--bold", "12,12,10,16",
               "--repeats", "2", "--rows", "seed:cpu,bids:cpu", "--baseline", str(baseline), "--work", str(tmp_path),
               "--out", str(out)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               BASELINE_COMMIT="0123abc")
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]

    report = json.loads(out.read_text())
    assert report["settings"]["rows"] == ["seed:cpu", "seed:cpu@baseline", "bids:cpu", "bids:cpu@baseline"]
    assert report["settings"]["baseline"] == {"path": str(baseline), "commit": "0123abc"}
    assert [len(row["runs"]) for row in report["rows"]] == [2, 2, 2, 2]
    assert all("error" not in row for row in report["rows"])
    # the baseline's four timed runs (two of each row), and no other run, imported its package
    assert marker.read_text() == "xxxx"
    assert report["rows"][3]["timeline"]["denoised_runs"] == 2
    markdown = out.with_suffix(".md").read_text()
    assert "**Against the baseline** (commit 0123abc" in markdown
    against = markdown.split("**Against the baseline**")[1].split("**Where")[0]
    assert "| `seed:cpu` |" in against and "| `bids:cpu` |" in against
    assert "| `--device cpu` (the baseline) |" in markdown
