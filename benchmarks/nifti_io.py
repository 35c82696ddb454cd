"""Reading and writing a series as NIfTI: nibabel's own gzip against the package's (ISA-L), and plain .nii.

    python benchmarks/nifti_io.py [--shape 96,96,60] [--volumes 100] [--repeats 3] [--out FILE]

A DWI-like phantom (float32) written and read back, best of ``--repeats`` each: ``nib.save`` and
``get_fdata`` (nibabel's gzip: zlib at nibabel's level 1) against ``io.write_nifti`` and ``io.read_data``
(``isal``: ISA-L's gzip at ``io.GZIP_LEVEL``, compressed on up to ``io.GZIP_THREADS`` threads), and the same
for an uncompressed .nii; with the files' sizes. A read ends with the values in memory (a copy of a .nii's
memory map). Every file written is read back and compared. JSON (and
Markdown beside it) to ``--out``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
import sys
import tempfile
import time

import numpy as np

from harness import REPO, stamp, stamp_markdown, write_result

if str(REPO) not in sys.path:  # benchmark the package of this tree, installed or not
    sys.path.insert(0, str(REPO))

import nibabel as nib  # noqa: E402

from mppca_nipype import io  # noqa: E402
from mppca_nipype.engine.backend import available_cpus  # noqa: E402
from mppca_nipype.phantoms import dwi_phantom  # noqa: E402


def best_s(call, repeats):
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        result = call()
        times.append(time.perf_counter() - started)
    return round(min(times), 3), result


def measure(shape, volumes, repeats):
    series = dwi_phantom(shape, n_volumes=volumes, sigma=20.0, seed=2)[0]
    image = nib.Nifti1Image(series, np.diag([2.0, 2.0, 2.0, 1.0]))
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for name, suffix, write, read in (
                ("nibabel (zlib)", ".nii.gz", nib.save, lambda path: nib.load(path).get_fdata(dtype=np.float32)),
                ("ours (ISA-L)", ".nii.gz", io.write_nifti, lambda path: io.read_data(nib.load(path), path)),
                ("uncompressed", ".nii", io.write_nifti, lambda path: io.read_data(nib.load(path), path))):
            path = Path(folder) / f"series{suffix}"
            write_s, _ = best_s(lambda: write(image, path), repeats)
            # (copied: a .nii is memory-mapped, and would be read only where it is used)
            read_s, back = best_s(lambda: np.array(read(path)), repeats)
            assert np.array_equal(back, series), name
            rows.append(dict(method=name, file=suffix, write_s=write_s, read_s=read_s,
                             megabytes=round(path.stat().st_size / 1e6, 1)))
            print(rows[-1], file=sys.stderr, flush=True)
    return dict(series=f"{'x'.join(map(str, shape))}x{volumes} float32", megabytes=round(series.nbytes / 1e6, 1),
                gzip_level=io.GZIP_LEVEL, gzip_threads=min(io.GZIP_THREADS, available_cpus()), rows=rows)


def markdown(result):
    lines = [f"{result['series']} ({result['megabytes']} MB); ours at ISA-L level {result['gzip_level']} on "
             f"{result['gzip_threads']} threads.", "",
             "| method | file | write s | read s | MB |", "| --- | --- | ---: | ---: | ---: |"]
    lines += [f"| {row['method']} | {row['file']} | {row['write_s']:.2f} | {row['read_s']:.2f} | {row['megabytes']} |"
              for row in result["rows"]]
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="96,96,60")
    parser.add_argument("--volumes", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "nifti_io.json"))
    args = parser.parse_args()
    run = stamp()
    result = dict(stamp=run, **measure(tuple(int(s) for s in args.shape.split(",")), args.volumes, args.repeats))
    table = markdown(result)
    write_result(args.out, result, markdown=stamp_markdown(run) + "\n\n" + table)
    print(table)


if __name__ == "__main__":
    main()
