#!/usr/bin/env python3
"""MP-PCA denoising of a BIDS dataset through Nipype's SLURM plugin: every run's denoising is its own job.

    python workflows/nipype_slurm.py BIDS_DIR OUTPUT_DIR [--participant-label 01 02] [--sbatch-args "-p short"]

Run it on a login node (it only submits and waits). Each denoising node is submitted with the resources its
input needs: ``--cpus-per-task`` and ``--mem`` from the input's shape (mppca_nipype.workflows.node_resources,
the memory model in docs/hpc.md) and ``--gres=gpu:1`` when it runs on a GPU (``--device cuda``/``auto``
with a GPU here). The small nodes (joining the sidecar, writing the derivatives) run here, not as jobs.

What to copy into your own pipeline: ``sbatch_resources(node)`` as each node's ``plugin_args``, and
``workflow.run(plugin="SLURM", plugin_args={"sbatch_args": ...})``. ``mppca-nipype ... --plugin SLURM``
does the same from the command line.
"""

from __future__ import annotations

import argparse
from contextlib import ExitStack
import getpass
import os
from pathlib import Path
import sys


def build_workflow(bids_dir, output_dir, work_dir, participants=None, use_gpu=False, cpus=8):
    """The BIDS workflow for the selected participants, each denoising node sized for its input."""
    from mppca_nipype.bids import normalise_labels, open_layout, query_runs
    from mppca_nipype.workflows import init_bids_wf, sbatch_resources

    layout = open_layout(bids_dir, work_dir)
    runs = [run for run in query_runs(layout, participants=normalise_labels(participants, "sub-"))
            if run.skip is None]
    if not runs:
        sys.exit("nipype_slurm.py: no DWI or BOLD run selected")
    workflow = init_bids_wf(runs, bids_dir=bids_dir, output_dir=output_dir, use_gpu=use_gpu,
                            num_threads=cpus)
    workflow.base_dir = str(work_dir)
    for node in workflow._get_all_nodes():
        if node.name == "denoise":
            # appended to the global sbatch arguments, so the node's own needs win
            node.plugin_args = {"sbatch_args": sbatch_resources(node), "overwrite": False}
    return workflow, runs


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("bids_dir", type=Path)
    parser.add_argument("output_dir", type=Path)
    parser.add_argument("--participant-label", nargs="+", help="participants (default: all)")
    parser.add_argument("-w", "--work-dir", type=Path, help="shared work folder (default: OUTPUT_DIR/.mppca-work)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="cpu",
                        help="cuda: every denoising job asks for a GPU (--gres=gpu:1)")
    parser.add_argument("--cpus", type=int, default=8, help="the most CPUs one job may ask for (default 8)")
    parser.add_argument("--sbatch-args", default="", help='for every job, e.g. "-p short --time=1:00:00"')
    args = parser.parse_args(argv)

    os.environ.setdefault("NIPYPE_NO_ET", "1")
    os.environ.setdefault("LOGNAME", getpass.getuser())  # Nipype's SLURM plugin names jobs with it
    from nipype import config

    from mppca_nipype.bids import output_lock, write_dataset_files
    from mppca_nipype.interfaces import gpu_probably_usable
    from mppca_nipype.workflows import citation_text

    bids_dir, output_dir = args.bids_dir.resolve(), args.output_dir.resolve()
    work_dir = (args.work_dir or output_dir / ".mppca-work").resolve()
    output_dir.mkdir(parents=True, exist_ok=True)
    use_gpu = args.device == "cuda" or (args.device == "auto" and gpu_probably_usable())
    workflow, runs = build_workflow(bids_dir, output_dir, work_dir, args.participant_label, use_gpu, args.cpus)
    config.update_config({"execution": {"crashdump_dir": str(output_dir / "logs"), "crashfile_format": "txt",
                                        "poll_sleep_duration": 1, "remove_unnecessary_outputs": False}})
    write_dataset_files(output_dir, bids_dir, citation_text(workflow))
    with ExitStack() as locks:  # the same per-run locks as mppca-nipype: no two writers of one run
        for run in sorted(runs, key=lambda r: r.node_name):
            locks.enter_context(output_lock(output_dir, f"run-{run.node_name}"))
        workflow.run(plugin="SLURM", plugin_args={"sbatch_args": args.sbatch_args, "max_tries": 2})
    print(f"nipype_slurm.py: {len(runs)} runs denoised into {output_dir}")


if __name__ == "__main__":
    main()
