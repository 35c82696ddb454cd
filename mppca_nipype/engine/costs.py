"""Which engine finishes a run first: the cost model behind ``device="auto"``.

A new process that runs the GPU engine first pays a fixed start (importing torch and Triton, the CUDA context,
the kernels loaded from Triton's cache, cuSOLVER where it serves): ``GPU_START_SECONDS``, measured on the
H200 machine (docs/benchmarks.md, "Whole commands"). After that the GPU engine runs a series 8 to 250 times
faster than the CPU engine on 16 cores. So the GPU wins once the CPU's estimated time exceeds its start by
enough; below that, the CPU is faster as the user times it (a 96x96x48x48 series at the seed's settings: 2.2 s
on 16 CPU cores against 3.5 s on the GPU, file to file, start included).

The CPU's time is estimated from the work of its windows, fitted on the same machine by
``benchmarks/auto_costs.py`` (docs/benchmarks.md, "The cost model behind auto"):

* per window, ``CPU_SECONDS_PER_PRODUCT`` per multiply-add of its Gram and projection (n x T x m, with m the
  smaller side) and ``CPU_SECONDS_PER_EIGEN`` per m^3 of its eigensolve, plus ``CPU_SECONDS_PER_WINDOW``;
* spread over the worker processes with the speed-up p / (1 + ``CPU_SERIAL_SHARE`` (p - 1)) that
  the calibration's cases measured (their median: 5.9x at 16 workers);
* plus ``CPU_START_SECONDS`` (the pool, the shared copy of the series);
* and the GPU's, its start plus ``GPU_SECONDS_PER_CORE_SECOND`` of that one-core work.

Estimates only have to be right near the crossing (a few seconds); far from it either engine wins by far.
"""

from __future__ import annotations

from dataclasses import dataclass
import math
import sys

from .patches import window_positions

#: Seconds a new process spends before the GPU engine's first window: torch and Triton imported, the CUDA
#: context made, the kernels loaded from Triton's cache (H200 machine, compiled Python modules).
GPU_START_SECONDS = 3.0
#: The same where this process has already run the GPU engine (torch imported, the CUDA context live).
GPU_RESTART_SECONDS = 0.05
#: The GPU engine's seconds per second of the CPU's estimated work on one core, at most (96x96x60x300 at
#: the defaults: ~3 s against an estimated 520 core-seconds; the seed's problem: 0.01 s against ~10).
GPU_SECONDS_PER_CORE_SECOND = 0.01
#: One CPU core's seconds per multiply-add of a window's Gram and projection (n x T x m, m the smaller side),
#: per m^3 of its eigensolve, and per window (one thread): fitted to six geometries from the seed's problem
#: to 64x64x40x300 on one worker (within 6% of each; the eigensolve's share is absorbed by the products at
#: these sizes: LAPACK's tridiagonal steps cost like a Gram here).
CPU_SECONDS_PER_PRODUCT = 1.79e-10
CPU_SECONDS_PER_EIGEN = 7.1e-12
CPU_SECONDS_PER_WINDOW = 1.5e-4
#: The share of a CPU run that does not spread over worker processes (Amdahl's law; the median of the
#: calibration's cases at 16 workers, 5.9x).
CPU_SERIAL_SHARE = 0.115
#: Seconds a CPU run spends before its first window with several workers (the pool, the shared series).
CPU_START_SECONDS = 0.3


@dataclass(frozen=True)
class Estimate:
    """What ``estimate`` says: the seconds each engine would take, and the engine it picks."""

    cpu_seconds: float
    gpu_seconds: float

    @property
    def device(self) -> str:
        return "cuda" if self.gpu_seconds < self.cpu_seconds else "cpu"

    def reason(self) -> str:
        return (f"estimated {self.cpu_seconds:.1f} s on the CPU against {self.gpu_seconds:.1f} s on the GPU, "
                "its start included")


def window_count(spatial_shape, extent, stride: int) -> int:
    """The distinct windows of the geometry (every voxel in the mask; a mask only lowers it)."""
    return math.prod(len(window_positions(size, e, stride)) for size, e in zip(spatial_shape, extent))


def core_seconds(spatial_shape, n_volumes: int, extent, stride: int) -> float:
    """The CPU engine's estimated work on one core, in seconds."""
    n = math.prod(extent)
    m = min(n, n_volumes)
    per_window = (CPU_SECONDS_PER_PRODUCT * n * n_volumes * m + CPU_SECONDS_PER_EIGEN * m**3
                  + CPU_SECONDS_PER_WINDOW)
    return window_count(spatial_shape, extent, stride) * per_window


def gpu_started() -> bool:
    """Whether this process has already started the GPU engine (torch imported, its CUDA context live)."""
    torch = sys.modules.get("torch")
    return torch is not None and torch.cuda.is_initialized()


def estimate(spatial_shape, n_volumes: int, extent, stride: int, nprocs: int,
             started: bool | None = None) -> Estimate:
    """Both engines' estimated seconds for the series: the CPU's with ``nprocs`` worker processes, the GPU's
    from whether the GPU engine is ``started`` already (a started GPU starts again at almost no cost; None:
    whether this process started it, ``gpu_started``)."""
    work = core_seconds(spatial_shape, n_volumes, extent, stride)
    speed_up = nprocs / (1 + CPU_SERIAL_SHARE * (nprocs - 1))
    cpu = (CPU_START_SECONDS if nprocs > 1 else 0.0) + work / speed_up
    started = gpu_started() if started is None else started
    start = GPU_RESTART_SECONDS if started else GPU_START_SECONDS
    return Estimate(cpu_seconds=cpu, gpu_seconds=start + GPU_SECONDS_PER_CORE_SECOND * work)
