"""Every Triton kernel variant the GPU engine launches compiles for sm_80 and sm_90, here without a GPU
(``tests/kernel_builds.py``, in a child process: the interpreter, which the other kernel tests use, must not
be on there). The interpreter runs the kernels' arithmetic but accepts programs Triton's compiler refuses."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None
                                and os.environ.get("MPPCA_REQUIRE_PEERS") != "1", reason="triton is not installed")


def test_every_kernel_variant_compiles_for_sm80_and_sm90():
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    child = subprocess.run([sys.executable, str(Path(__file__).with_name("kernel_builds.py")), "80", "90"],
                           capture_output=True, text=True, env=env, timeout=1800)
    built = [line for line in child.stdout.splitlines() if line.startswith("built ")]
    assert child.returncode == 0, child.stdout[-4000:] + child.stderr[-4000:]
    # the distinct variants (a launch repeated with the same specialisation is built once): the fused Gram 9
    # (each demeaning in float32, float64 and float64 counted), the reconstruction 12 (each demeaning with
    # float32 and float64 projectors, with a weight per patch voxel, and its centre rows), the tridiagonal
    # values 5 and projectors 10 (a 16-lane and a full launch each), the threshold 8 (each estimator with and
    # without the settling test), the box sums 3, the division 1, the choice of the windows a settling pass
    # redoes 1
    assert len(built) == 2 * 49, "\n".join(built)
