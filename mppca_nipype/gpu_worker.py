"""One process that keeps the GPU engine started for many runs.

A new process that runs the GPU engine first imports torch, makes its CUDA context and loads the kernels and
cuSOLVER: 4-6 s on the H200 machine (docs/benchmarks.md, "What a user waits for"), more than the engine
takes for most series. The BIDS app's Nipype nodes each run in a worker process of their own, so each of them
would pay it. Instead the app starts one ``GPUWorker`` beside its nodes; a node that runs on the GPU sends its
series to it (``denoise_remote``) and gets the result back, while the node itself reads and writes its files.

The worker listens on a Unix socket in a private folder (its address and key in the environment variables
``ADDRESS_VARIABLE`` and ``KEY_VARIABLE``, which the nodes inherit) and serves one run at a time, in the
order they come: it is the GPU's queue. Series and results travel through shared memory, not the socket.
It ends when the app stops it, or by itself once the app's process is gone.

Run as ``python -m mppca_nipype.gpu_worker FOLDER [--device cuda|cpu]``; ``cpu`` serves the same requests on
the CPU engine (tests, and machines without a GPU).
"""

from __future__ import annotations

import argparse
from contextlib import ExitStack
from dataclasses import dataclass
import os
from pathlib import Path
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings

import numpy as np

#: Where a node finds the worker: the socket's path and the connection's key (hex).
ADDRESS_VARIABLE = "MPPCA_GPU_WORKER"
KEY_VARIABLE = "MPPCA_GPU_WORKER_KEY"
#: The socket's name inside the worker's folder; it appears once the worker is ready.
SOCKET_NAME = "gpu-worker.sock"


def _block(name=None, size=0, *, owned=False):
    """A shared memory block, new (``size``) or the one called ``name``. Only a process that will unlink the
    block (``owned``) leaves it known to its resource tracker; for the others the tracker forgets it, so that
    no tracker unlinks, at the exit of a process that merely used it, a block another process still needs."""
    from multiprocessing import resource_tracker, shared_memory

    block = shared_memory.SharedMemory(name=name, create=name is None, size=size)
    if not owned:
        resource_tracker.unregister(block._name, "shared_memory")  # noqa: SLF001 - the tracker's own key
    return block


def _shared_array(array, stack: ExitStack | None = None):
    """A copy of ``array`` in new shared memory (in its memory order), and how to find it: ``(name, shape,
    dtype, order)``. With ``stack`` the block is this process's, unlinked when the stack closes; without,
    the process that receives the description unlinks it (``_attached(..., take=True)``)."""
    array = np.asarray(array)
    order = "F" if array.flags.f_contiguous and not array.flags.c_contiguous else "C"
    block = _block(size=max(array.nbytes, 1), owned=stack is not None)
    view = np.ndarray(array.shape, array.dtype, buffer=block.buf, order=order)
    view[...] = array
    del view
    if stack is not None:
        stack.callback(block.unlink)
        stack.callback(block.close)
    else:
        block.close()
    return block.name, array.shape, array.dtype.str, order


def _attached(description, stack: ExitStack | None = None, *, take=False):
    """The array a ``_shared_array`` description names: a view of the block, open until ``stack`` closes,
    or with ``take`` an array of this process's own, the block unlinked."""
    name, shape, dtype, order = description
    block = _block(name, owned=take)
    view = np.ndarray(shape, np.dtype(dtype), buffer=block.buf, order=order)
    if not take:
        stack.callback(_close, block)
        return view
    array = np.array(view, order=order)
    del view
    block.close()
    block.unlink()
    return array


def _close(block):
    try:
        block.close()
    except BufferError:  # an array still views it (an error's frame): the mapping goes with that array
        pass


def worker_address() -> str | None:
    """The socket of the GPU worker serving this process, or None."""
    return os.environ.get(ADDRESS_VARIABLE) or None


def denoise_remote(data, mask, parameters, *, phase=None, gpu_memory=None):
    """``denoise`` (or with ``phase``, ``denoise_complex``) of the series by the GPU worker, as
    ``denoise(data, mask, **parameters, device="cuda", gpu_memory=gpu_memory)`` would return it here
    (``data`` a 4D series, or the echoes of a multi-echo series as a 5D array or a list).

    The engine's warnings are raised again in this process, its errors too (``MPPCAInputError``,
    ``GPUOutOfMemoryError``). ``ConnectionError`` when the worker cannot be reached.
    """
    from multiprocessing.connection import Client

    from .engine import DenoiseResult
    from .engine.complex_data import ComplexDenoiseResult

    address = worker_address()
    key = bytes.fromhex(os.environ.get(KEY_VARIABLE, ""))
    if isinstance(data, (list, tuple)):  # the echoes of a multi-echo series, as the one array denoise takes
        data = np.stack(data, axis=3)
    with ExitStack() as stack:
        request = dict(data=_shared_array(data, stack),
                       mask=None if mask is None else _shared_array(mask, stack),
                       phase=None if phase is None else _shared_array(phase, stack),
                       parameters=parameters, gpu_memory=gpu_memory)
        try:
            connection = Client(address, family="AF_UNIX", authkey=key)
        except OSError as err:
            raise ConnectionError(f"the GPU worker at {address} cannot be reached ({err})") from None
        with connection:
            connection.send(request)
            try:
                reply = connection.recv()
            except EOFError:
                raise ConnectionError(f"the GPU worker at {address} ended during the run") from None
        for category, message in reply["warnings"]:
            warnings.warn(message, category, stacklevel=2)
        if "error" in reply:
            raise reply["error"]
        arrays = {name: _attached(description, take=True) for name, description in reply["arrays"].items()}
    kind = ComplexDenoiseResult if reply["kind"] == ComplexDenoiseResult.__name__ else DenoiseResult
    return kind(**arrays, info=dict(reply["info"], gpu_worker=reply["pid"]))  # (the maps asked for, too)


def serve_one(request, device: str) -> dict:
    """Run one request (``denoise_remote``'s) on ``device``; the reply: the results' arrays in new shared
    memory (the client unlinks them), ``info``, the warnings, or the error."""
    from .engine import MPPCAWarning, denoise
    from .engine.complex_data import denoise_complex

    reply = dict(pid=os.getpid(), warnings=[], arrays={}, info={})
    with ExitStack() as stack, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", MPPCAWarning)
        try:
            data = _attached(request["data"], stack)
            mask = None if request["mask"] is None else _attached(request["mask"], stack)
            options = dict(request["parameters"], device=device, gpu_memory=request["gpu_memory"])
            if request["phase"] is None:
                result = denoise(data, mask, **options)
            else:
                result = denoise_complex(data, _attached(request["phase"], stack), mask, **options)
            outputs = {name: value for name, value in vars(result).items() if isinstance(value, np.ndarray)}
            for name, array in outputs.items():  # the client takes them
                reply["arrays"][name] = _shared_array(array)
            reply["info"], reply["kind"] = result.info, type(result).__name__
            del data, mask, result, outputs
        except Exception as err:  # the engine's errors go back to the node, which reports them
            reply["error"] = _sendable(err.with_traceback(None))
        reply["warnings"] = [(w.category, str(w.message)) for w in caught if issubclass(w.category, Warning)]
    return reply


def _sendable(err: Exception) -> Exception:
    """``err``, or where it cannot be pickled, a RuntimeError that says the same."""
    import pickle

    try:
        pickle.loads(pickle.dumps(err))
    except Exception:  # noqa: BLE001 - any failure to travel
        return RuntimeError(f"{type(err).__name__}: {err}")
    return err


def serve(folder: Path, device: str = "cuda") -> None:
    """Start the engine on ``device``, then answer requests on ``folder``'s socket until told to stop or the
    parent process is gone."""
    from multiprocessing.connection import Listener

    from .engine import check_device

    key = bytes.fromhex(os.environ[KEY_VARIABLE])
    if device == "cuda":
        check_device("cuda")  # imports torch, starts CUDA; MPPCAInputError (the worker ends) if unusable
        import torch

        torch.zeros(1, device="cuda")
    parent = os.getppid()
    listener = Listener(str(folder / SOCKET_NAME), family="AF_UNIX", authkey=key)

    def watch_parent():
        while os.getppid() == parent:
            time.sleep(0.5)
        shutil.rmtree(folder, ignore_errors=True)
        os._exit(0)  # the app is gone: nothing is left to serve

    threading.Thread(target=watch_parent, daemon=True).start()
    while True:
        try:
            connection = listener.accept()
        except Exception:  # a client with a wrong key, or one that went away: wait for the next
            continue
        with connection:
            try:
                request = connection.recv()
            except EOFError:
                continue
            if request == "stop":
                break
            reply = serve_one(request, device)
            try:
                connection.send(reply)
            except OSError:  # the node went away: free what it did not take
                for description in reply["arrays"].values():
                    _attached(description, take=True)
    listener.close()


@dataclass
class GPUWorker:
    """The app's handle on a worker process: ``start`` it, ``wait_ready``, ``environment`` for the nodes,
    ``stop``."""

    folder: Path
    process: subprocess.Popen
    key: str

    @classmethod
    def start(cls, device: str = "cuda") -> GPUWorker:
        folder = Path(tempfile.mkdtemp(prefix="mppca-gpu-worker-"))  # mode 700: ours alone
        key = secrets.token_hex(16)
        environment = dict(os.environ, **{KEY_VARIABLE: key})
        process = subprocess.Popen([sys.executable, "-m", "mppca_nipype.gpu_worker", str(folder),
                                    "--device", device], env=environment, stdin=subprocess.DEVNULL,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        return cls(folder, process, key)

    @property
    def address(self) -> str:
        return str(self.folder / SOCKET_NAME)

    def wait_ready(self, timeout: float = 120.0) -> str | None:
        """None once the worker listens; else why it will not (it ended, or did not start in time)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                lines = (self.process.stderr.read() or b"").decode(errors="replace").strip().splitlines()
                return lines[-1] if lines else f"it ended with status {self.process.returncode}"
            if Path(self.address).exists():
                return None
            time.sleep(0.05)
        return f"it did not start within {timeout:.0f} s"

    def environment(self) -> dict:
        return {ADDRESS_VARIABLE: self.address, KEY_VARIABLE: self.key}

    def stop(self) -> None:
        from multiprocessing.connection import Client

        if self.process.poll() is None:
            try:
                with Client(self.address, family="AF_UNIX", authkey=bytes.fromhex(self.key)) as connection:
                    connection.send("stop")
                self.process.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait()
        if self.process.stderr is not None:
            self.process.stderr.close()
        shutil.rmtree(self.folder, ignore_errors=True)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m mppca_nipype.gpu_worker", description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="the worker's private folder (its socket goes there)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = parser.parse_args(argv)
    try:
        serve(args.folder, args.device)
    except Exception as err:  # noqa: BLE001 - the app reads the last line and runs without the worker
        print(f"{type(err).__name__}: {err}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
