"""Two GPUs against one: the BIDS app on several participants, with MultiProc's GPU slots.

Builds a BIDS dataset of ``--subjects`` participants (one DWI run each, a head phantom of ``--shape`` x
``--volumes``), then runs ``mppca-nipype ... participant --device cuda`` twice in fresh output folders: once
with ``CUDA_VISIBLE_DEVICES`` naming one GPU, once naming all of them. Reports the wall times, the speed-up
and, from each run's provenance, the device that denoised it. JSON to ``--out`` (default
benchmarks/results/multi_gpu.json), stamped by ``harness.stamp()`` (commit, date, hardware with the GPUs,
load average at start and end, versions, command), and the summary as Markdown next to it.

    python benchmarks/multi_gpu.py --subjects 4 --shape 96,96,60 --volumes 100
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
import subprocess
import sys
import tempfile
import time

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import harness  # noqa: E402

if str(harness.REPO) not in sys.path:  # benchmark the package of this tree, installed or not
    sys.path.insert(0, str(harness.REPO))

from mppca_nipype.demo import write_gradients, write_raw_description, write_series  # noqa: E402
from mppca_nipype.phantoms import dwi_phantom  # noqa: E402


def make_dataset(root: Path, subjects: int, shape, volumes: int) -> Path:
    labels = [f"{i:02d}" for i in range(1, subjects + 1)]
    write_raw_description(root, "multi-GPU benchmark", labels)
    for i, label in enumerate(labels):
        noisy, _, bvals, bvecs = dwi_phantom(shape, volumes, sigma=20.0, seed=i)
        stem = root / f"sub-{label}" / "dwi" / f"sub-{label}_dwi"
        write_series(f"{stem}.nii.gz", noisy)
        write_gradients(stem, bvals, bvecs)
    return root


def run_app(bids_dir: Path, output_dir: Path, gpus: list[str], nprocs: int) -> dict:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=",".join(gpus),
               PYTHONPATH=os.pathsep.join(filter(None, [str(harness.REPO), os.environ.get("PYTHONPATH")])))
    command = [sys.executable, "-m", "mppca_nipype.cli.bids_app", str(bids_dir), str(output_dir), "participant",
               "--device", "cuda", "--nprocs", str(nprocs), "--skip-bids-validation", "--no-reports"]
    started = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    devices = {}
    for sidecar in sorted(output_dir.rglob("*_desc-denoised_dwi.json")):
        provenance = json.loads(sidecar.read_text())["MPPCADenoising"]
        devices[sidecar.name] = dict(device=provenance.get("Device"), backend=provenance.get("Backend"),
                                     wall=provenance.get("WallTimeSeconds"))
    return dict(gpus=gpus, seconds=seconds, status=done.returncode, stderr=done.stderr[-3000:], runs=devices,
                command=" ".join(command[2:]))


def summary_lines(summary: dict) -> list[str]:
    lines = []
    for result in summary["runs"]:
        used = sorted({str(r["device"]) for r in result["runs"].values()})
        lines.append(f"{len(result['gpus'])} GPU(s): {result['seconds']:.1f} s, exit {result['status']}, "
                     f"{len(result['runs'])} runs denoised on {used}")
    lines.append(f"speed-up with {summary['gpus']} GPUs: {summary['speedup']:.2f}x")
    return lines


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--subjects", type=int, default=4)
    parser.add_argument("--shape", default="96,96,60")
    parser.add_argument("--volumes", type=int, default=100)
    parser.add_argument("--nprocs", type=int, default=os.cpu_count())
    parser.add_argument("--out", type=Path, default=HERE / "results" / "multi_gpu.json",
                        help="JSON output; the Markdown summary goes next to it as .md")
    args = parser.parse_args(argv)

    run = harness.stamp()
    gpu = run["hardware"]["gpu"]
    names = [g["name"] for g in gpu["gpus"]] if gpu else []
    if not names:
        raise SystemExit("multi_gpu.py needs torch with at least one CUDA GPU; torch sees none here")
    all_gpus = [str(i) for i in range(len(names))]
    shape = tuple(int(s) for s in args.shape.split(","))
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        bids_dir = make_dataset(folder / "bids", args.subjects, shape, args.volumes)
        results = [run_app(bids_dir, folder / f"out{len(gpus)}", gpus, args.nprocs)
                   for gpus in (all_gpus[:1], all_gpus)]
    one, many = results
    summary = dict(stamp=run, gpus=len(all_gpus), names=names, subjects=args.subjects, shape=shape,
                   volumes=args.volumes, nprocs=args.nprocs, runs=results, speedup=one["seconds"] / many["seconds"])
    harness.finish(run)
    text = summary_lines(summary)
    markdown = "\n".join([f"{args.subjects} participants, one DWI run each ({'x'.join(map(str, shape))} x "
                           f"{args.volumes} volumes), `mppca-nipype ... participant --device cuda --nprocs "
                           f"{args.nprocs}` on one GPU, then on all:", ""] + [f"- {line}" for line in text]
                          + ["", harness.stamp_markdown(run), "", harness.load_note(run)])
    harness.write_result(args.out, summary, markdown)
    for result in results:
        if result["status"]:
            print(result["stderr"])
    print(markdown)


if __name__ == "__main__":
    main()
