"""The sweep that chooses the engine's defaults: error to the truth and speed, on phantoms, on N cores.

The rule: the default extent, stride, aggregation and demeaning are those with the lowest error to the
ground truth on phantoms among the settings that run at least 5x faster than MRtrix3's ``dwidenoise`` on the
same cores (ours timed in this process, ``dwidenoise`` as the command a user runs, file to file). This script
measures every setting of

    extent in {auto, 5, 7} x stride in {1, 2, 3} x aggregation in {weighted, uniform, center (stride 1)}
    x demean in {none, voxel, and any other mode the engine has}, estimator exp2, filter hard, cuboids,

(extents that resolve to the same patch, e.g. auto = 5 for 48 volumes, are run once, under "auto") on each
phantom, together with ``dwidenoise`` (float32, its defaults) in the same run. Then the method's options
(``METHOD_OPTIONS``: every other estimator and filter, the ``gaussian`` aggregation, spherical patches) one at a
time from that sweep's winner, and every combination of two or more of those that beat it, each at its best. The
default is the best of all these rows by the rule. The ranking is by RMSE to the truth inside the mask, as a
ratio to ``dwidenoise``'s RMSE on the same phantom, geometric mean over the phantoms; "fast" means a speed-up
of at least 5x over ``dwidenoise`` on every phantom.

Usage (from the repository root)::

    python benchmarks/choose_defaults.py --threads 2       # the reference size, 64x64x40 x 48 volumes
    python benchmarks/choose_defaults.py --quick           # tiny phantoms: a smoke test

Writes JSON to ``--out`` (default benchmarks/results/choose_defaults.json) and Markdown next to it
(``.md``: the summary and one table per phantom), both stamped by ``harness.stamp()`` (commit, date,
hardware, load average at start and end, versions, command); prints the recommendation and then the
summary table, sorted by RMSE, last.
"""

from __future__ import annotations

import argparse
import itertools
import math
import warnings

import numpy as np

from cpu_peers import (ENGINE_AGAINST_DWIDENOISE, Dwidenoise, NiftiPhantom, add_run_options, log, make_phantom,
                       markdown_table, percent, run_ours, runs_label, score, start_run, timed, timing_note,
                       warm_up_ours)
import harness
# every mode the engine has (cpu_peers put the repository on the path)
from mppca_nipype.engine.estimators import DEMEANING, ESTIMATORS, FILTERS

#: A setting qualifies as a default only if it is at least this many times faster than dwidenoise.
SPEEDUP_TARGET = 5.0
EXTENTS = ("auto", 5, 7)
STRIDES = (1, 2, 3)
AGGREGATIONS = ("weighted", "uniform", "center")
DEFAULT_PHANTOMS = "lowrank:5,dwi:5,dwi:20"
#: The options that make up a "setting".
KEYS = ("extent", "stride", "aggregation", "demean", "estimator", "filter", "shape")
#: The method's options tried one at a time from the first sweep's winner: option -> values other than the sweep's.
METHOD_OPTIONS = {"estimator": tuple(e for e in ESTIMATORS if e != "exp2"), "filter": FILTERS[1:],
                  "aggregation": ("gaussian",), "shape": ("sphere",)}


def distinct_extents(shape, n_volumes, extents=EXTENTS):
    """[(label, value passed to denoise, resolved extent)], one per distinct resolved patch."""
    from mppca_nipype.engine.patches import resolve_extent

    seen = {}
    for extent in extents:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            resolved = tuple(resolve_extent(extent, shape, n_volumes))
        if resolved in seen:
            continue
        size = "x".join(map(str, resolved)) if len(set(resolved)) > 1 else str(resolved[0])
        label = f"auto (={size})" if extent == "auto" else size
        seen[resolved] = (label, extent, resolved)
    return list(seen.values())


def settings(extents, strides=STRIDES, aggregations=AGGREGATIONS, demeaning=DEMEANING, estimator="exp2"):
    """Every setting of the sweep as a dict of ``denoise`` options plus a display label for the extent."""
    for label, extent, resolved in extents:
        for stride in strides:
            for aggregation in aggregations:
                if aggregation == "center" and stride != 1:
                    continue
                for demean in demeaning:
                    yield dict(extent=extent, stride=stride, aggregation=aggregation, demean=demean,
                               estimator=estimator, filter="hard", shape="cuboid", extent_label=label,
                               extent_resolved=list(resolved))


def setting_key(setting) -> str:
    return " ".join(f"{k}={setting[k]}" for k in KEYS)


def options_of(setting) -> dict:
    return {k: setting[k] for k in KEYS}


def measure(setting, phantoms, references, args) -> dict:
    """Run one setting on every phantom; return its scores, times and speed-ups."""
    per_phantom = {}
    for phantom in phantoms:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            (denoised, sigma, info), seconds = timed(
                lambda: run_ours(phantom, args.threads, **options_of(setting)), args.repeats,
                args.single_above)
        entry = dict(seconds=min(seconds), seconds_all=seconds, runs=runs_label(seconds),
                     **score(phantom, denoised, sigma))
        reference = references[phantom.name]
        entry["rmse_vs_dwidenoise"] = entry["rmse_mask"] / reference["rmse_mask"]
        entry["speedup_vs_dwidenoise"] = reference["seconds"] / entry["seconds"]
        entry["engine"] = {k: v for k, v in info.items() if k in ("backend", "nprocs", "eigensolver")}
        per_phantom[phantom.name] = entry
    ratios = [e["rmse_vs_dwidenoise"] for e in per_phantom.values()]
    sigma_errors = [e["sigma_rms_rel"] for e in per_phantom.values() if e["sigma_rms_rel"] is not None]
    speedups = [e["speedup_vs_dwidenoise"] for e in per_phantom.values()]
    return dict(setting={**options_of(setting), "extent_label": setting["extent_label"],
                         "extent_resolved": setting["extent_resolved"]},
                key=setting_key(setting), phantoms=per_phantom,
                rmse_ratio_geomean=float(math.exp(np.mean(np.log(ratios)))),
                sigma_rms_rel_mean=float(np.mean(sigma_errors)) if sigma_errors else None,
                speedup_min=float(min(speedups)), fast=bool(min(speedups) >= SPEEDUP_TARGET))


def is_setting(row, options) -> bool:
    """Whether a measured row is the setting ``options``; extents match by the patch they resolve to (so
    "wide" is the row of 7 when both give 7x7x7), given as ``options["extent_resolved"]``."""
    s = row["setting"]
    return (list(s["extent_resolved"]) == list(options["extent_resolved"])
            and all(str(s[k]) == str(options[k]) for k in KEYS if k != "extent"))


def method_variants(winner) -> list[dict]:
    """The first sweep's ``winner`` (a measured row) with one of ``METHOD_OPTIONS`` changed, each value once."""
    base = {**winner["setting"]}
    return [{**base, option: value} for option, values in METHOD_OPTIONS.items() for value in values]


def combinations_of_bests(winner, method_rows) -> list[dict]:
    """The winner with two or more of the method options that beat it (rows fast where the winner is), each
    at its best value: every such combination, the largest first."""
    best = {}
    for row in method_rows:
        if row["fast"] < winner["fast"] or row["rmse_ratio_geomean"] >= winner["rmse_ratio_geomean"]:
            continue
        option = next(k for k in METHOD_OPTIONS if row["setting"][k] != winner["setting"][k])
        if option not in best or row["rmse_ratio_geomean"] < best[option]["rmse_ratio_geomean"]:
            best[option] = row
    options = sorted(best)
    return [{**winner["setting"], **{option: best[option]["setting"][option] for option in chosen}}
            for size in range(len(options), 1, -1) for chosen in itertools.combinations(options, size)]


def choose(rows):
    """The fast setting with the lowest RMSE ratio, or (none fast) the lowest RMSE overall and a note."""
    fast = [r for r in rows if r["fast"]]
    pool = fast or rows
    winner = min(pool, key=lambda r: r["rmse_ratio_geomean"])
    note = ("" if fast else
            f"no setting reached {SPEEDUP_TARGET:g}x over dwidenoise; the winner is the most accurate one")
    return winner, note


# -- tables ---------------------------------------------------------------------------------------------------

def summary_table(rows, phantom_names, current, winner) -> str:
    headers = (["#", "extent", "stride", "aggregation", "demean", "estimator", "filter", "shape"]
               + [f"RMSE {name}" for name in phantom_names]
               + ["RMSE ÷ dwidenoise (geo. mean)", "σ rms rel. err (mean)", f"wall s {phantom_names[0]}",
                  "speed-up vs dwidenoise (min)", f"≥{SPEEDUP_TARGET:g}x", "note"])
    lines = []
    for rank, r in enumerate(sorted(rows, key=lambda r: r["rmse_ratio_geomean"]), 1):
        s = r["setting"]
        notes = []
        if r is winner:
            notes.append("**winner**")
        if current is not None and r is current:
            notes.append("current default")
        if s["stride"] == 1 and s["aggregation"] == "center" and s["demean"] == "none":
            notes.append("dwidenoise mode" if str(s["extent"]) == "auto" else "")
        first = r["phantoms"][phantom_names[0]]
        lines.append([rank, s["extent_label"], s["stride"], s["aggregation"], s["demean"], s["estimator"],
                      s["filter"], s["shape"]]
                     + [f"{r['phantoms'][name]['rmse_mask']:.3f}" for name in phantom_names]
                     + [f"{r['rmse_ratio_geomean']:.4f}", percent(r["sigma_rms_rel_mean"], signed=False),
                        f"{first['seconds']:.2f}", f"{r['speedup_min']:.2f}x", "✓" if r["fast"] else "",
                        ", ".join(n for n in notes if n)])
    return markdown_table(headers, lines)


def reference_table(references, phantoms) -> str:
    headers = ["phantom", "input RMSE (mask)", "dwidenoise RMSE (mask)", "dwidenoise σ rms rel. err",
               "dwidenoise wall s", "runs"]
    rows = []
    for phantom in phantoms:
        ref = references[phantom.name]
        rows.append([phantom.name, f"{phantom.summary()['input_rmse_mask']:.3f}", f"{ref['rmse_mask']:.3f}",
                     percent(ref["sigma_rms_rel"], signed=False), f"{ref['seconds']:.2f}", ref["runs"]])
    return markdown_table(headers, rows)


def phantom_detail_table(rows, name) -> str:
    headers = ["extent", "stride", "aggregation", "demean", "estimator", "filter", "shape", "RMSE mask", "RMSE all",
               "RMSE ÷ dwidenoise", "σ median rel. err", "σ rms rel. err", "wall s", "runs", "speed-up"]
    lines = []
    for r in sorted(rows, key=lambda r: r["phantoms"][name]["rmse_mask"]):
        s, e = r["setting"], r["phantoms"][name]
        lines.append([s["extent_label"], s["stride"], s["aggregation"], s["demean"], s["estimator"], s["filter"],
                      s["shape"], f"{e['rmse_mask']:.3f}", f"{e['rmse_all']:.3f}", f"{e['rmse_vs_dwidenoise']:.4f}",
                      percent(e["sigma_median_rel"]), percent(e["sigma_rms_rel"], signed=False),
                      f"{e['seconds']:.2f}",
                      e["runs"], f"{e['speedup_vs_dwidenoise']:.2f}x"])
    return markdown_table(headers, lines)


def describe(setting) -> str:
    return ", ".join(f"{k}={setting[k]!r}" for k in KEYS)


def recommendation(report) -> str:
    sweep_winner, winner = report["sweep_winner"], report["winner"]
    chosen = dict(winner["setting"])
    lines = [f"The first sweep's winner (lowest RMSE among settings >= {SPEEDUP_TARGET:g}x faster than dwidenoise "
             f"on every phantom): {describe(sweep_winner['setting'])}: RMSE "
             f"{sweep_winner['rmse_ratio_geomean']:.4f} x dwidenoise's, speed-up {sweep_winner['speedup_min']:.2f}x "
             "(min over phantoms)."]
    if report["note"]:
        lines.append("Note: " + report["note"] + ".")
    for row in report["method_rows"]:
        changed = ", ".join(f"{k}={row['setting'][k]}" for k in KEYS
                            if str(row["setting"][k]) != str(sweep_winner["setting"][k]))
        lines.append(f"- with {changed}: RMSE {row['rmse_ratio_geomean']:.4f} x dwidenoise's "
                     f"({100 * (row['rmse_ratio_geomean'] / sweep_winner['rmse_ratio_geomean'] - 1):+.2f}%), "
                     f"speed-up {row['speedup_min']:.2f}x{'' if row['fast'] else ' (under the bar)'}.")
    lines.append(f"Winner of all rows: {describe(winner['setting'])}: RMSE {winner['rmse_ratio_geomean']:.4f} x "
                 f"dwidenoise's, speed-up {winner['speedup_min']:.2f}x.")
    current = report["current_defaults"]
    current_row = report.get("current_row")
    every = report["rows"] + report["method_rows"]
    if current_row is None:
        lines.append(f"The current defaults ({describe(current)}) were not among the settings measured.")
    else:
        position = 1 + sorted(r["rmse_ratio_geomean"] for r in every).index(current_row["rmse_ratio_geomean"])
        lines.append(f"Current defaults ({describe(current)}): #{position} of {len(every)}, RMSE "
                     f"{current_row['rmse_ratio_geomean']:.4f} x dwidenoise's "
                     f"({100 * (current_row['rmse_ratio_geomean'] / winner['rmse_ratio_geomean'] - 1):+.2f}% "
                     f"against the recommendation), speed-up {current_row['speedup_min']:.2f}x "
                     f"({'fast' if current_row['fast'] else 'NOT fast enough'}).")
    same = current_row is not None and is_setting(current_row, chosen)
    lines.append("Recommendation: " + ("keep the current defaults." if same else
                                       f"DEFAULTS = dict({', '.join(f'{k}={chosen[k]!r}' for k in KEYS)})."))
    return "\n".join(lines)


def report_markdown(report, phantoms) -> str:
    names = [p.name for p in phantoms]
    out = [harness.stamp_markdown(report["stamp"]), "",
           f"{report['settings']['threads']} threads for ours and dwidenoise; {report['timing']}.",
           f"Phantoms: {report['phantom_shape']} voxels x {report['volumes']} volumes: "
           + "; ".join(f"{p.name}: {p.description}" for p in phantoms) + ".", "",
           "dwidenoise (float32, its defaults) in the same run:", "",
           reference_table(report["references"], phantoms), "",
           "The first sweep's winner and the method's options from it:", "",
           summary_table([report["sweep_winner"]] + report["method_rows"], names, report.get("current_row"),
                         report["winner"]), "",
           recommendation(report), "", "The first sweep, sorted by RMSE (ratio to dwidenoise's, geometric mean "
           "over the phantoms):", "", summary_table(report["rows"], names, report.get("current_row"),
                                                    report["winner"]), ""]
    return "\n".join(out)


def choices(convert, allowed=None):
    """An argparse type for a comma-separated list, each item converted and, optionally, checked."""
    def parse(text):
        try:
            items = tuple(convert(item.strip()) for item in text.split(","))
        except ValueError:
            raise argparse.ArgumentTypeError(f"cannot read {text!r}") from None
        if allowed is not None and not set(items) <= set(allowed):
            raise argparse.ArgumentTypeError(f"{text!r}: choose from {','.join(allowed)}")
        return items
    return parse


def main(argv=None):
    from mppca_nipype.engine import DEFAULTS

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_options(parser, threads_help="cores: nprocs for ours and -nthreads for dwidenoise (default 2)",
                    repeats_help="timed runs per setting and phantom, best kept (default 3; --quick: 1)",
                    single_above=10.0, out_name="choose_defaults.json")
    parser.add_argument("--extents", type=choices(lambda e: e if e == "auto" else int(e)), default=EXTENTS,
                        help="only these extents (default auto,5,7)")
    parser.add_argument("--strides", type=choices(int), default=STRIDES, help="only these strides (default 1,2,3)")
    parser.add_argument("--aggregations", type=choices(str, AGGREGATIONS), default=AGGREGATIONS,
                        help="only these aggregations (default weighted,uniform,center)")
    parser.add_argument("--demean", type=choices(str, DEMEANING), default=DEMEANING,
                        help=f"only these demeaning modes (default {','.join(DEMEANING)})")
    args = parser.parse_args(argv)
    shape, volumes, run, run_settings = start_run(args, parser)
    run_settings.update(extents=list(args.extents), strides=list(args.strides),
                        aggregations=list(args.aggregations), demean=list(args.demean))
    phantoms = [make_phantom(spec.strip(), shape, volumes) for spec in args.phantoms.split(",")]
    warm_up_ours(args.threads)

    references = {}
    for phantom in phantoms:
        with NiftiPhantom(phantom) as files:
            try:
                dwi = Dwidenoise(files, args.threads)
            except RuntimeError as err:
                raise SystemExit(f"choose_defaults.py times every setting against dwidenoise: {err}") from None
            _, seconds = timed(dwi.run, args.repeats, args.single_above)
            denoised, noise = files.read(dwi.name)
        references[phantom.name] = dict(seconds=min(seconds), seconds_all=seconds, runs=runs_label(seconds),
                                        **score(phantom, denoised, noise))
        log(f"{phantom.name}: dwidenoise {references[phantom.name]['seconds']:.2f} s, "
            f"RMSE {references[phantom.name]['rmse_mask']:.3f}")

    current = {k: DEFAULTS.get(k, "auto") for k in KEYS}
    current["extent_resolved"] = list(distinct_extents(shape, volumes, [current["extent"]])[0][2])
    extents = [(label + (f" (= {current['extent']})" if list(resolved) == current["extent_resolved"]
                         and extent != current["extent"] else ""), extent, resolved)
               for label, extent, resolved in distinct_extents(shape, volumes, args.extents)]
    sweep = list(settings(extents, args.strides, args.aggregations, args.demean))
    if not sweep:
        parser.error("the filters leave no setting to measure")
    rows = []
    for count, setting in enumerate(sweep, 1):
        row = measure(setting, phantoms, references, args)
        rows.append(row)
        log(f"[{count}/{len(sweep)}] {row['key']}: RMSE x{row['rmse_ratio_geomean']:.4f}, "
            f"speed-up {row['speedup_min']:.2f}x")
    sweep_winner, note = choose(rows)
    log(f"first sweep's winner: {sweep_winner['key']}")
    method_rows = []
    variants = method_variants(sweep_winner)
    for count, setting in enumerate(variants, 1):
        method_rows.append(measure(setting, phantoms, references, args))
        log(f"[method {count}/{len(variants)}] {method_rows[-1]['key']}: RMSE "
            f"x{method_rows[-1]['rmse_ratio_geomean']:.4f}, speed-up {method_rows[-1]['speedup_min']:.2f}x")
    for combination in combinations_of_bests(sweep_winner, method_rows):
        method_rows.append(measure(combination, phantoms, references, args))
        log(f"[combination] {method_rows[-1]['key']}: RMSE x{method_rows[-1]['rmse_ratio_geomean']:.4f}")
    winner, _ = choose(rows + method_rows)

    current_row = next((r for r in rows + method_rows if is_setting(r, current)), None)
    report = dict(stamp=run, settings=run_settings,
                  timing=f"wall time: {timing_note(args.repeats, args.single_above)}; {ENGINE_AGAINST_DWIDENOISE}",
                  phantom_shape="x".join(map(str, shape)), volumes=volumes,
                  phantoms=[p.summary() for p in phantoms], speedup_target=SPEEDUP_TARGET,
                  references=references, rows=rows, sweep_winner=sweep_winner, method_rows=method_rows,
                  winner=winner, note=note, current_defaults=current, current_row=current_row)
    report["recommendation"] = recommendation(report)

    harness.finish(run)
    details = "\n\n".join(f"Phantom {p.name}, every setting:\n\n" + phantom_detail_table(rows + method_rows,
                                                                                         p.name)
                          for p in phantoms)
    markdown = report_markdown(report, phantoms)
    footer = harness.load_note(run)
    written = harness.write_result(args.out, report, markdown + "\n" + details + "\n\n" + footer)
    log("wrote " + " and ".join(map(str, written)))
    print(markdown + "\n" + footer)


if __name__ == "__main__":
    main()
