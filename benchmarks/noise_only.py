"""The noise map alone (``estimate_noise``, ``mppca-noise``) against the noise map of a full ``denoise``.

For each phantom: ``denoise`` with its defaults (stride 3), then ``estimate_noise`` at each stride of
``--strides`` (same extent, estimator, aggregation and demeaning), each timed in this process (best of
``--repeats`` runs after a warm-up call) on ``--threads`` worker processes. Reported per stride: the time and
the speed-up over the full ``denoise``; how far the noise map lies from ``denoise``'s in the mask (median and
99th percentile of |sigma_noise / sigma_denoise - 1|); and both maps' error against the true sigma (median
and rms of sigma_hat / sigma - 1 in the mask, as ``cpu_peers.py`` measures it). At stride 3 the two maps are
the same function: the script checks that they are bit-identical.

With ``--files``, the same comparison as commands run as a user runs them, each a new process, file to
file: ``mppca-denoise IN OUT --noise SIGMA --device cpu`` against ``mppca-noise IN SIGMA`` (default stride),
both ``--nprocs N``, on the first phantom written as ``.nii``.

Usage (from the repository root)::

    python benchmarks/noise_only.py --threads 2 --shape 96,96,60 --volumes 100 --files
    python benchmarks/noise_only.py --quick

Writes JSON to ``--out`` (default benchmarks/results/noise_only.json) and the Markdown table next to it,
stamped by ``harness.stamp()``; prints the table last.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from cpu_peers import add_run_options, log, make_phantom, markdown_table, rms, start_run, timed, timing_note
import harness
from mppca_nipype import denoise
from mppca_nipype.engine import NOISE_STRIDE, estimate_noise

STRIDES = (3, 4, 5, 6, 7)


def sigma_errors(sigma, phantom) -> dict:
    relative = np.asarray(sigma, np.float64)[phantom.mask] / phantom.sigma - 1
    return dict(median_rel=float(np.median(relative)), rms_rel=rms(relative))


def measure_phantom(phantom, strides, threads, repeats, single_above) -> dict:
    log(f"{phantom.name}: denoise (stride 3)")
    denoise(phantom.noisy, device="cpu", nprocs=threads)  # warm-up
    full, seconds = timed(lambda: denoise(phantom.noisy, device="cpu", nprocs=threads), repeats, single_above)
    entry = dict(phantom=phantom.summary(), denoise=dict(seconds=min(seconds), runs=len(seconds),
                                                         stride=full.info["stride"], extent=full.info["extent"],
                                                         truth=sigma_errors(full.sigma, phantom)),
                 strides=[])
    reference = full.sigma[phantom.mask].astype(np.float64)
    for stride in strides:
        log(f"{phantom.name}: estimate_noise stride {stride}")
        noise, seconds = timed(lambda: estimate_noise(phantom.noisy, stride=stride, nprocs=threads), repeats,
                               single_above)
        deviation = np.abs(noise.sigma[phantom.mask] / reference - 1)
        entry["strides"].append(dict(
            stride=stride, n_windows=noise.info["n_windows"], seconds=min(seconds), runs=len(seconds),
            speedup=entry["denoise"]["seconds"] / min(seconds),
            identical=bool(np.array_equal(noise.sigma, full.sigma)),
            deviation_median=float(np.median(deviation)), deviation_p99=float(np.percentile(deviation, 99)),
            truth=sigma_errors(noise.sigma, phantom)))
    entry["denoise"]["n_windows"] = full.info["n_windows"]
    return entry


def command_times(phantom, threads, repeats) -> dict:
    """``mppca-denoise IN OUT --noise SIGMA`` and ``mppca-noise IN SIGMA`` as new processes, file to file."""
    from mppca_nipype.demo import write_series

    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        series = folder / "series.nii"
        write_series(series, phantom.noisy)
        common = ["--nprocs", str(threads), "--quiet"]
        commands = {
            "mppca-denoise IN OUT --noise SIGMA": [sys.executable, "-m", "mppca_nipype.cli.denoise", str(series),
                                                   str(folder / "out.nii"), "--noise", str(folder / "s1.nii"),
                                                   "--device", "cpu", *common],
            "mppca-noise IN SIGMA": [sys.executable, "-m", "mppca_nipype.cli.noise", str(series),
                                     str(folder / "s2.nii"), *common],
        }
        times = {}
        for label, command in commands.items():
            seconds = []
            for _ in range(max(repeats, 1)):
                started = time.perf_counter()
                subprocess.run(command, check=True, cwd=harness.REPO)
                seconds.append(time.perf_counter() - started)
            times[label] = min(seconds)
            log(f"{label}: {times[label]:.2f} s")
    return times


def table(result) -> str:
    rows = []
    for entry in result["phantoms"]:
        full = entry["denoise"]
        name = entry["phantom"]["name"]
        rows.append([name, f"`denoise` (stride {full['stride']})", f"{full['n_windows']:,}", f"{full['seconds']:.2f}",
                     "1", "", "", f"{100 * full['truth']['median_rel']:+.2f}%",
                     f"{100 * full['truth']['rms_rel']:.2f}%"])
        for row in entry["strides"]:
            bold = "**" if row["stride"] == NOISE_STRIDE else ""
            rows.append([name, f"{bold}`estimate_noise` stride {row['stride']}{bold}", f"{row['n_windows']:,}",
                         f"{row['seconds']:.2f}", f"{row['speedup']:.1f}x",
                         "identical" if row["identical"] else f"{100 * row['deviation_median']:.2f}%",
                         "identical" if row["identical"] else f"{100 * row['deviation_p99']:.2f}%",
                         f"{100 * row['truth']['median_rel']:+.2f}%", f"{100 * row['truth']['rms_rel']:.2f}%"])
    text = markdown_table(["phantom", "run", "windows", "engine s", "speed-up", "|Δσ| vs denoise, median",
                           "|Δσ| vs denoise, p99", "σ vs truth, median", "σ vs truth, rms"], rows)
    if result.get("commands"):
        times = result["commands"]
        (slow_label, slow), (fast_label, fast) = times.items()
        text += (f"\n\nFile to file ({result['phantoms'][0]['phantom']['name']} as .nii, new processes, best of "
                 f"{result['settings']['repeats']}): `{slow_label}` {slow:.2f} s, `{fast_label}` {fast:.2f} s: "
                 f"{slow / fast:.1f}x.")
    return text


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_options(parser, threads_help="worker processes for both (default 2)",
                    repeats_help="timed runs each, best kept (default 3; --quick: 1)", single_above=60.0,
                    out_name="noise_only.json")
    parser.add_argument("--strides", default=",".join(map(str, STRIDES)),
                        help=f"estimate_noise's strides (default {','.join(map(str, STRIDES))})")
    parser.add_argument("--files", action="store_true",
                        help="also time the two commands file to file on the first phantom")
    args = parser.parse_args(argv)
    shape, volumes, run, settings = start_run(args, parser)
    strides = [int(s) for s in args.strides.split(",")]
    result = dict(stamp=run, settings=dict(settings, strides=strides, noise_stride=NOISE_STRIDE), phantoms=[])
    phantoms = [make_phantom(spec, shape, volumes) for spec in args.phantoms.split(",")]
    for phantom in phantoms:
        result["phantoms"].append(measure_phantom(phantom, strides, args.threads, args.repeats, args.single_above))
    if args.files:
        result["commands"] = command_times(phantoms[0], args.threads, args.repeats)
    harness.finish(run)
    text = (harness.stamp_markdown(run) + "\n\n" + f"Times: {timing_note(args.repeats, args.single_above)}, "
            f"after a warm-up call, {args.threads} worker processes.\n\n" + table(result))
    harness.write_result(args.out, result, markdown=text)
    print(table(result))


if __name__ == "__main__":
    main()
