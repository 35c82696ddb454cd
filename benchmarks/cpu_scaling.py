"""CPU engine scaling: wall time of one run at nprocs = 1, 2, 4, 8, 16 (each in a fresh process).

    python benchmarks/cpu_scaling.py --shape 96,96,60 --volumes 100 --workers 1,2,4,8,16

Prints a Markdown table (workers, wall s, speedup, efficiency) and writes JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CHILD = """
import sys, time, numpy as np
from mppca_nipype import denoise
from mppca_nipype.phantoms import dwi_phantom
shape = tuple(int(s) for s in sys.argv[1].split(",")); volumes = int(sys.argv[2]); workers = int(sys.argv[3])
noisy = dwi_phantom(shape, volumes, sigma=20.0)[0]
denoise(noisy[:16, :16, :16], device="cpu", nprocs=workers)  # warm-up: imports, pool start
started = time.perf_counter()
result = denoise(noisy, device="cpu", nprocs=workers)
print(time.perf_counter() - started, result.info["eigensolver"], result.info["n_windows"])
"""


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="96,96,60")
    parser.add_argument("--volumes", type=int, default=100)
    parser.add_argument("--workers", default="1,2,4,8,16")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "cpu_scaling.json"))
    args = parser.parse_args()
    rows = []
    for workers in (int(w) for w in args.workers.split(",")):
        done = subprocess.run([sys.executable, "-c", CHILD, args.shape, str(args.volumes), str(workers)],
                              capture_output=True, text=True, check=True)
        seconds, eigensolver, windows = done.stdout.split()[-4], " ".join(done.stdout.split()[-3:-1]), \
            done.stdout.split()[-1]
        rows.append(dict(workers=workers, seconds=float(seconds), eigensolver=eigensolver, windows=int(windows)))
    base = rows[0]["seconds"] * rows[0]["workers"]
    with open(args.out, "w") as handle:
        json.dump(dict(shape=args.shape, volumes=args.volumes, cpus=os.cpu_count(), rows=rows), handle, indent=2)
    print(f"{args.shape} x {args.volumes}, defaults, {rows[0]['windows']} windows, {rows[0]['eigensolver']}")
    print("| workers | wall s | speedup | efficiency |\n| --- | --- | --- | --- |")
    for row in rows:
        speedup = base / row["seconds"]
        print(f"| {row['workers']} | {row['seconds']:.2f} | {speedup:.2f} | {speedup / row['workers']:.0%} |")


if __name__ == "__main__":
    main()
