#!/usr/bin/env python3
"""MP-PCA denoising added to an existing Nipype workflow, upstream of what consumes the raw series.

    python workflows/existing_workflow.py DWI.nii.gz BVAL BVEC OUT_DIR       # a DWI: denoise -> tensor fit
    python workflows/existing_workflow.py BOLD.nii.gz OUT_DIR                # a BOLD run: denoise -> mean

The change to an existing pipeline is one node and two connections: where the raw series went into the
first processing step, it now goes through ``MPPCADenoise`` (connect ``out_file`` onward). Denoising must
come first: before motion correction, interpolation or smoothing, which mix the noise between voxels.
The tensor fit here is DIPY's (``nipype.interfaces.dipy.DTI``, when DIPY is installed); the BOLD step is a
plain temporal mean standing in for your preprocessing. Resources: ``node_resources`` sizes the node
(``n_procs``, ``mem_gb``) for MultiProc or a cluster plugin.
"""

from __future__ import annotations

import os
from pathlib import Path
import sys

from nipype import Function, Node, Workflow
from nipype.interfaces.io import DataSink
from nipype.interfaces.utility import IdentityInterface

from mppca_nipype.interfaces import MPPCADenoise
from mppca_nipype.workflows import node_resources


def temporal_mean(in_file):
    """A stand-in for BOLD preprocessing: the series' mean over time."""
    import os

    import nibabel as nib

    image = nib.load(in_file)
    out_file = os.path.abspath("mean.nii.gz")
    nib.save(nib.Nifti1Image(image.get_fdata().mean(axis=3).astype("float32"), image.affine), out_file)
    return out_file


def build(in_file, out_dir, bval=None, bvec=None, work_dir=None, cpus=None):
    """The workflow: inputnode -> MPPCADenoise -> (tensor fit | temporal mean) -> DataSink."""
    import nibabel as nib

    from mppca_nipype.engine import available_cpus

    workflow = Workflow(name="existing_wf", base_dir=str(work_dir or Path(out_dir) / "work"))
    inputnode = Node(IdentityInterface(fields=["in_file", "bval", "bvec"]), name="inputnode")
    inputnode.inputs.in_file = str(Path(in_file).resolve())
    n_procs, mem_gb = node_resources(nib.load(str(in_file)).shape, use_gpu=False, max_procs=cpus or available_cpus())
    # the added node: sized for its input; use_gpu defaults to whether a GPU is usable here
    denoise = Node(MPPCADenoise(num_threads=n_procs), name="denoise", n_procs=n_procs, mem_gb=mem_gb)
    sink = Node(DataSink(base_directory=str(Path(out_dir).resolve()), parameterization=False), name="sink")
    workflow.connect([(inputnode, denoise, [("in_file", "in_file")]),
                      (denoise, sink, [("out_file", "denoised"), ("noise_file", "denoised.@noise")])])
    if bval:  # DWI: the tensor fit now reads the denoised series
        from nipype.interfaces.dipy import DTI

        inputnode.inputs.bval, inputnode.inputs.bvec = str(Path(bval).resolve()), str(Path(bvec).resolve())
        fit = Node(DTI(), name="tensor_fit")
        workflow.connect([(denoise, fit, [("out_file", "in_file")]),
                          (inputnode, fit, [("bval", "in_bval"), ("bvec", "in_bvec")]),
                          (fit, sink, [("out_file", "tensor")])])
    else:  # BOLD: the first preprocessing step now reads the denoised series
        mean = Node(Function(input_names=["in_file"], output_names=["out_file"], function=temporal_mean),
                    name="temporal_mean")
        workflow.connect([(denoise, mean, [("out_file", "in_file")]), (mean, sink, [("out_file", "mean")])])
    return workflow


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 4:
        in_file, bval, bvec, out_dir = argv
    elif len(argv) == 2:
        (in_file, out_dir), bval, bvec = argv, None, None
    else:
        sys.exit(__doc__.split("\n\n")[1])
    os.environ.setdefault("NIPYPE_NO_ET", "1")
    build(in_file, out_dir, bval, bvec).run(plugin="MultiProc")
    print(f"existing_workflow.py: outputs in {out_dir}")


if __name__ == "__main__":
    main()
