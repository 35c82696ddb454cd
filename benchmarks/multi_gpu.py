"""Two GPUs against one: the BIDS app on several participants, with MultiProc's GPU slots.

Builds a BIDS dataset of ``--subjects`` participants (one DWI run each, a head phantom of ``--shape`` x
``--volumes``), then runs ``mppca-nipype ... participant --device cuda`` twice in fresh output folders: once
with ``CUDA_VISIBLE_DEVICES`` naming one GPU, once naming all of them. Reports the wall times, the speed-up
and, from each run's provenance, the device that denoised it. JSON to ``--out`` (default: $OUT/multi_gpu.json).

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

from mppca_nipype.demo import write_gradients, write_raw_description, write_series
from mppca_nipype.phantoms import dwi_phantom


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
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=",".join(gpus))
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
    return dict(gpus=gpus, seconds=seconds, status=done.returncode, stderr=done.stderr[-3000:], runs=devices)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--subjects", type=int, default=4)
    parser.add_argument("--shape", default="96,96,60")
    parser.add_argument("--volumes", type=int, default=100)
    parser.add_argument("--nprocs", type=int, default=os.cpu_count())
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "multi_gpu.json"))
    args = parser.parse_args()
    import torch

    all_gpus = [str(i) for i in range(torch.cuda.device_count())]
    shape = tuple(int(s) for s in args.shape.split(","))
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        bids_dir = make_dataset(folder / "bids", args.subjects, shape, args.volumes)
        results = [run_app(bids_dir, folder / f"out{len(gpus)}", gpus, args.nprocs)
                   for gpus in (all_gpus[:1], all_gpus)]
    one, many = results
    summary = dict(gpus=torch.cuda.device_count(), names=[torch.cuda.get_device_name(i) for i in range(len(all_gpus))],
                   subjects=args.subjects, shape=shape, volumes=args.volumes, runs=results,
                   speedup=one["seconds"] / many["seconds"])
    Path(args.out).write_text(json.dumps(summary, indent=2))
    for result in results:
        used = sorted({r["device"] for r in result["runs"].values()})
        print(f"{len(result['gpus'])} GPU(s): {result['seconds']:.1f} s, exit {result['status']}, "
              f"{len(result['runs'])} runs denoised on {used}")
        if result["status"]:
            print(result["stderr"])
    print(f"speed-up with {len(all_gpus)} GPUs: {summary['speedup']:.2f}x")


if __name__ == "__main__":
    main()
