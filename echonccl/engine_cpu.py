"""The CPU engine: numpy kernels over an mpi4py transport. The reference; runs anywhere."""
from __future__ import annotations

import contextlib

import numpy as np

from . import dtypes
from .kernels_numpy import NumpyKernels
from .transport_mpi import MpiTransport, allgather_digest, allgather_object, wait_all


class CpuEngine:
    """Engine on host numpy arrays. Every operation completes before it returns."""

    name = "cpu"
    baseline_name = "MPI"
    per_call_check = True     # every call's signature is compared across ranks (8 bytes each)

    def __init__(self, comm, timeout: float):
        self.comm = comm
        self.timeout = timeout
        self.kernels = NumpyKernels()
        self.transport = MpiTransport(comm, timeout)
        self._digests = (np.zeros(1, np.int64), np.zeros(comm.Get_size(), np.int64))

    def describe(self) -> str:
        return "cpu (numpy kernels, MPI transport)"

    def zeros(self, n: int, dtype) -> np.ndarray:
        return np.zeros(n, dtype=np.dtype(dtype))

    def empty_bytes(self, n: int) -> np.ndarray:
        return np.empty(n, dtype=np.uint8)

    def as_array(self, x) -> np.ndarray:
        """The caller's array itself (numpy); `TypeError` for anything else."""
        if not isinstance(x, np.ndarray):
            raise TypeError(f"the CPU engine takes numpy arrays, not {type(x).__name__}")
        dtypes.canonical(x.dtype)
        return x

    def flat(self, a: np.ndarray) -> np.ndarray:
        """A 1-D view of a C-contiguous array; `ValueError` if no view exists."""
        if not a.flags.c_contiguous:
            raise ValueError("echonccl needs C-contiguous arrays (pass np.ascontiguousarray(x))")
        return a.reshape(-1)

    def empty_like(self, a):
        return np.empty_like(a)

    def copy(self, dst, src) -> None:
        np.copyto(dst, src)

    def overlaps(self, a, b) -> bool:
        return np.shares_memory(a, b)

    def same_memory(self, a, b) -> bool:
        return a.__array_interface__["data"][0] == b.__array_interface__["data"][0] and a.nbytes == b.nbytes

    def crossover_bytes(self, nranks: int) -> int:
        """Below this input size ``auto`` uses the baseline. The CPU engine is the reference: always 4-bit."""
        return 0

    def preferred_schedule(self, nranks: int) -> str:
        return "two_shot"

    def small_algorithm(self) -> str:
        return "nccl"

    def fused_schedule(self, algo: str, layout):
        """The CPU engine runs every schedule as written (no fused implementations)."""
        return None

    # prepared calls (`Communicator`'s replay of a call whose buffers it has seen)
    def call_key(self, x, out):
        """The buffers of a call as a hashable (address and read-only flag, shape, strides, dtype
        of ``x`` and of ``out``, which may be ``x``) for numpy arrays; None for anything else."""
        if type(x) is not np.ndarray or (out is not x and type(out) is not np.ndarray):
            return None
        kx = (x.__array_interface__["data"], x.shape, x.strides, x.dtype)
        return kx if out is x else (kx, out.__array_interface__["data"], out.shape, out.strides, out.dtype)

    def call_stream(self, stream):
        """No streams here: every call may replay (``stream`` is ignored, as by `call_scope`)."""
        return 0

    def stream_capturing(self, stream) -> bool:
        return False

    def prepare_baseline(self, x, out):
        """The baseline as ``(run(stream, x, out), None)``: the arrays come with each call."""
        return (lambda _stream, x, out: self.baseline_all_reduce(x.reshape(-1), out.reshape(-1))), None

    def prepare_schedule(self, run):
        """A schedule's prepared ``run`` as it is (nothing to capture on the CPU)."""
        return run

    def prepare_one_shot(self, x, out):
        """The 16-bit one-shot's CPU stand-in: the baseline (a float32 sum rounded once)."""
        return self.prepare_baseline(x, out)

    def call_scope(self, stream):
        return contextlib.nullcontext()

    def writable(self, obj, a: np.ndarray) -> bool:
        return bool(a.flags.writeable)

    # buffer lifetime (the communicator's cache): every call has completed when it returns
    def is_capturing(self) -> bool:
        return False

    def use_token(self):
        return None

    def retire(self, obj, token) -> None:
        """An evicted buffer: nothing can still be using it."""

    def reap(self) -> None:
        pass

    def allgather_object(self, obj):
        return allgather_object(self.comm, obj, self.timeout)

    def allgather_digest(self, digest: int) -> np.ndarray:
        return allgather_digest(self.comm, digest, self.timeout, self._digests)

    def baseline_all_reduce(self, x: np.ndarray, out: np.ndarray) -> None:
        """MPI's sum (in float32, rounded once to the dtype): the CPU engine's baseline."""
        from mpi4py import MPI

        acc = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
        res = np.empty_like(acc)
        wait_all([self.comm.Iallreduce(acc, res, op=MPI.SUM)], self.timeout, "baseline all-reduce")
        out.reshape(-1)[...] = res.astype(out.dtype)

    def synchronize(self, timeout: float | None = None) -> None:
        """Nothing to wait for: CPU calls complete before they return."""

    def abort(self) -> None:
        """Nothing to stop: CPU calls complete (or time out) before they return."""

    def close(self) -> None:
        pass

