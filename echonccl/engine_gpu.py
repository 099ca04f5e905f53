"""The GPU engine: CUDA kernels (cupy RawModule) over NCCL send/recv (ctypes). The product.

One process per GPU. The GPU is the node-local rank (``Split_type(COMM_TYPE_SHARED)``)
modulo the visible devices, unless ``device`` or ``ECHONCCL_DEVICE`` names one.
Everything runs on the current cupy stream (or the one a call passes) and
returns without synchronizing the host; `synchronize` waits, bounded by the
timeout, and aborts the NCCL communicator when a peer stops answering.
"""
from __future__ import annotations

import contextlib
import os
import socket
import time

import numpy as np

from . import dtypes, fused, nccl
from .errors import EchoncclError, PeerTimeoutError
from .kernels_cuda import CudaKernels
from .transport_mpi import allgather_object, node_rank_and_size
from .transport_nccl import NcclTransport

import cupy


def gpu_available() -> bool:
    try:
        return cupy.cuda.runtime.getDeviceCount() > 0
    except cupy.cuda.runtime.CUDARuntimeError:
        return False


def _current_stream_ptr() -> int:
    return cupy.cuda.get_current_stream().ptr


def _as_cupy_stream(stream):
    """A cupy stream for a cupy Stream, a raw ``cudaStream_t`` int, or an object with
    ``cuda_stream`` (PyTorch) or ``__cuda_stream__`` (the CUDA stream protocol)."""
    if isinstance(stream, (cupy.cuda.Stream, cupy.cuda.ExternalStream)):
        return stream
    if hasattr(stream, "__cuda_stream__"):
        return cupy.cuda.ExternalStream(int(stream.__cuda_stream__()[1]))
    ptr = getattr(stream, "cuda_stream", stream)
    if isinstance(ptr, int):
        return cupy.cuda.ExternalStream(ptr)
    raise TypeError(f"stream must be a cupy stream, a cudaStream_t int or have .cuda_stream, "
                    f"not {type(stream).__name__}")


# ``auto`` below this input size runs the 16-bit one-shot when peers map each other's memory
# (measured on two H200s over NVLink: BENCHMARKS.md, "Fused path").
FUSED_CROSSOVER_BYTES = int(os.environ.get("ECHONCCL_FUSED_CROSSOVER_BYTES", 16 << 20))


class GpuEngine:
    """Engine on device arrays: `CudaKernels` + `NcclTransport` over one NCCL communicator.

    Collective construction over the MPI communicator ``comm``: rank 0 makes
    the NCCL unique id, MPI broadcasts it, every rank joins, and a warm-up
    round (one all-reduce, one send/recv with every peer) opens the
    connections so the first timed or captured call does not pay for them.
    """

    name = "gpu"
    baseline_name = "NCCL"

    def __init__(self, comm, timeout: float, device: int | None = None):
        self.comm = comm
        self.timeout = timeout
        ndev = cupy.cuda.runtime.getDeviceCount()
        if device is None:
            device = int(os.environ.get("ECHONCCL_DEVICE", node_rank_and_size(comm)[0] % max(ndev, 1)))
        if not 0 <= device < ndev:
            raise EchoncclError(f"rank {comm.Get_rank()}: device {device} does not exist ({ndev} visible)")
        self.device = cupy.cuda.Device(device)
        self.device.use()
        rank, size = comm.Get_rank(), comm.Get_size()
        self.lib = nccl.load()
        uid = self.lib.get_unique_id() if rank == 0 else None
        uid = comm.bcast(uid, root=0)
        self.nccl = nccl.NcclComm.init_rank(size, uid, rank, lib=self.lib)
        self.kernels = CudaKernels()
        self.kernels.preload()
        self.transport = NcclTransport(self.nccl, rank, size, _current_stream_ptr)
        self.fused = None
        self._warm_up()
        if size > 1 and fused.available(comm, self.device.id, self.allgather_object):
            self.fused = fused.FusedPaths(comm, self.allgather_object, rank, size, timeout)
            self.fused.preload()

    # -- description ------------------------------------------------------------------------
    def describe(self) -> str:
        path = "fused peer-memory kernels" if self.fused is not None else "NCCL send/recv"
        return f"gpu (CUDA kernels, NCCL {self.nccl_version()}, device {self.device.id}, {path})"

    def nccl_version(self) -> str:
        return ".".join(map(str, self.lib.version()))

    def device_description(self) -> str:
        props = cupy.cuda.runtime.getDeviceProperties(self.device.id)
        return f"{self.device.id} [{props['name'].decode()}] on {socket.gethostname()}"

    # -- arrays ------------------------------------------------------------------------------
    def zeros(self, n: int, dtype):
        with self.device:
            return cupy.zeros(n, dtype=np.dtype(dtype))

    def empty_bytes(self, n: int):
        with self.device:
            return cupy.empty(n, dtype=np.uint8)

    def as_array(self, x):
        """A cupy view of ``x`` (cupy, ``__cuda_array_interface__`` or ``__dlpack__``), zero-copy,
        on this engine's device; `TypeError` for host arrays and unsupported dtypes."""
        if isinstance(x, cupy.ndarray):
            a = x
        elif isinstance(x, np.ndarray):
            raise TypeError("the GPU engine takes device arrays; this is a host numpy array")
        elif hasattr(x, "__dlpack__"):      # first: PyTorch exports bf16 as "<V2" through the CAI
            if hasattr(x, "__dlpack_device__") and int(x.__dlpack_device__()[0]) in (1, 3):
                raise TypeError(f"the GPU engine takes device arrays; this {type(x).__name__} is in host "
                                f"memory (DLPack device {x.__dlpack_device__()})")
            a = cupy.from_dlpack(x)
        elif hasattr(x, "__cuda_array_interface__"):
            a = cupy.asarray(x)
        else:
            raise TypeError(f"the GPU engine takes cupy arrays or objects with __cuda_array_interface__ "
                            f"or __dlpack__, not {type(x).__name__}")
        dtypes.canonical(a.dtype)
        if a.device.id != self.device.id:
            raise ValueError(f"array is on device {a.device.id}, this communicator uses device {self.device.id}")
        return a

    def flat(self, a):
        if not a.flags.c_contiguous:
            raise ValueError("echonccl needs C-contiguous arrays (pass cupy.ascontiguousarray(x))")
        return a.reshape(-1)

    def empty_like(self, a):
        with self.device:
            return cupy.empty_like(a)

    def copy(self, dst, src) -> None:
        cupy.copyto(dst, src)

    def overlaps(self, a, b) -> bool:
        a0, b0 = a.data.ptr, b.data.ptr
        return a0 < b0 + b.nbytes and b0 < a0 + a.nbytes and a.nbytes > 0 and b.nbytes > 0

    def same_memory(self, a, b) -> bool:
        return a.data.ptr == b.data.ptr and a.nbytes == b.nbytes

    def stream_scope(self, stream):
        return contextlib.nullcontext() if stream is None else _as_cupy_stream(stream)

    # -- collectives ---------------------------------------------------------------------------
    def allgather_object(self, obj):
        return allgather_object(self.comm, obj, self.timeout)

    def baseline_all_reduce(self, x, out) -> None:
        """NCCL's own ncclAllReduce (sum) on the current stream."""
        self.nccl.all_reduce(x.data.ptr, out.data.ptr, x.size, dtypes.canonical(x.dtype), _current_stream_ptr())

    def fused_schedule(self, algo: str, layout):
        """The fused one-kernel implementation of schedule ``algo`` for ``layout`` (a callable
        ``(layout, x, out, state, rounds)``), or None: then the schedule runs over NCCL."""
        if self.fused is not None and algo == "two_shot" and self.fused.two_shot_fits(layout):
            return self.fused.two_shot
        return None

    def small_algorithm(self) -> str:
        """What ``auto`` runs below the crossover: the 16-bit peer-memory one-shot, else NCCL."""
        return "one_shot" if self.fused is not None else "nccl"

    def one_shot(self, x, out) -> None:
        """16-bit one-shot all-reduce through peer memory (NCCL's all-reduce where there is none)."""
        if self.fused is not None and self.fused.one_shot_fits(x):
            self.fused.one_shot(x, out)
        else:
            self.baseline_all_reduce(x, out)

    def crossover_bytes(self, nranks: int) -> int:
        """Below this input size ``auto`` dispatches to NCCL's own all-reduce.

        Measured on two H200s with echonccl-perf (BENCHMARKS.md), by the transport
        NCCL is told to use: NVLink/P2P 128 MiB (4-bit reaches 1.0x at 64 MiB),
        ``NCCL_P2P_DISABLE=1`` 8 MiB (0.95-1.04x at 4 MiB, 2.0x at 16 MiB), and
        with ``NCCL_SHM_DISABLE=1`` too (sockets) 2 MiB (2.4x at 16 MiB). Override
        with ``ECHONCCL_CROSSOVER_BYTES``.
        """
        if self.fused is not None:
            return FUSED_CROSSOVER_BYTES
        if os.environ.get("NCCL_P2P_DISABLE", "0") not in ("0", ""):
            return (2 << 20) if os.environ.get("NCCL_SHM_DISABLE", "0") not in ("0", "") else (8 << 20)
        return 128 << 20

    def preferred_schedule(self, nranks: int) -> str:
        return "two_shot"

    def synchronize(self, timeout: float | None = None) -> None:
        """Wait for the current stream; a peer that stops answering raises `PeerTimeoutError`
        after ``timeout`` (default: the engine's) and aborts the NCCL communicator."""
        stream = cupy.cuda.get_current_stream()
        timeout = self.timeout if timeout is None else timeout
        self._wait_stream(stream, timeout)
        if self.fused is not None and self.fused.failed():
            raise PeerTimeoutError(f"rank {self.transport.rank}: a fused all-reduce gave up waiting for a peer "
                                   f"(timeout {self.timeout:g} s): a peer died, hangs or called differently")

    def _wait_stream(self, stream, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not stream.done:
            err = self.nccl.async_error()
            if err not in (nccl.ncclSuccess, nccl.ncclInProgress):
                self.nccl.abort()
                self.lib.check(err, "asynchronous NCCL operation")
            if time.monotonic() > deadline:
                self.nccl.abort()
                raise PeerTimeoutError(f"rank {self.transport.rank}: GPU work did not finish within "
                                       f"{timeout:g} s (a peer died or hangs); NCCL communicator aborted")
            time.sleep(1e-4)

    def close(self) -> None:
        if not self.nccl.closed:
            with contextlib.suppress(EchoncclError):
                self.synchronize()
            if self.fused is not None:
                cupy.cuda.runtime.deviceSynchronize()
                self.fused.close()
            self.nccl.destroy()

    # -- internals ------------------------------------------------------------------------------
    def _warm_up(self) -> None:
        P, r = self.transport.size, self.transport.rank
        buf = self.zeros(1024, np.float32)
        self.baseline_all_reduce(buf, buf)
        peers = [p for p in range(P) if p != r]
        out = [self.empty_bytes(256) for _ in peers]
        inn = [self.empty_bytes(256) for _ in peers]
        self.transport.exchange(list(zip(peers, out)), list(zip(peers, inn)))
        self.synchronize()

