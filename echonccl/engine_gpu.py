"""The GPU engine: CUDA kernels (cupy RawModule) over NCCL send/recv (ctypes). The product.

One process per GPU. The GPU is the node-local rank (``Split_type(COMM_TYPE_SHARED)``)
modulo the visible devices, unless ``device`` or ``ECHONCCL_DEVICE`` names one.
Everything runs on the current cupy stream (or the one a call passes) and
returns without synchronizing the host; `synchronize` waits, bounded by the
timeout, and aborts the NCCL communicator when a peer stops answering.
"""
from __future__ import annotations

import contextlib
import socket
import time

import numpy as np

from . import cuda_driver, dtypes, fused, nccl, settings
from .errors import EchoncclError, PeerTimeoutError
from .kernels_cuda import CudaKernels
from .transport_mpi import allgather_digest, allgather_object, node_rank_and_size
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


# ``auto`` below this input size runs the 16-bit one-shot when peers map each other's memory.
# Two H200s over NVLink (BENCHMARKS.md section 1): the one-shot is faster up to 2 MiB, the
# fused two-shot from 4 MiB (eager and -G); more ranks favour the two-shot further.
FUSED_CROSSOVER_BYTES = 4 << 20


class _GraphedRun:
    """See `GpuEngine.prepare_schedule`."""

    __slots__ = ("run", "capture", "priority", "seen", "graph")

    def __init__(self, run, capture: bool = True, priority: bool = False):
        self.run, self.capture, self.priority, self.seen, self.graph = run, capture, priority, False, None

    def __call__(self, stream, x, out) -> None:
        capturing = _capturing(stream)
        if self.graph is not None and not capturing:
            self.graph.launch(stream)
        elif not self.capture or not self.seen or capturing:
            self.seen = True
            with stream:                            # the schedule enqueues on the current stream
                self.run(stream, x, out)
        else:
            self.graph = self._captured(x, out)
            if self.graph is None:                  # not capturable here: stay direct
                self.capture = False
                with stream:
                    self.run(stream, x, out)
            else:
                self.graph.launch(stream)

    def _captured(self, x, out):
        """A CUDA graph of the schedule, recorded on a side stream (nothing runs there), or None."""
        side = cupy.cuda.Stream(non_blocking=True)
        try:
            with side:
                side.begin_capture()
                try:
                    self.run(side, x, out)
                finally:
                    graph = side.end_capture()
        except Exception:  # noqa: BLE001
            return None
        if self.priority:       # replays keep the communication stream's priority
            with contextlib.suppress(EchoncclError):
                return cuda_driver.PriorityGraph(graph)
        return graph


def _capturing(stream) -> bool:
    """``stream`` is capturing a CUDA graph. When CUDA cannot tell (e.g. the legacy stream while
    another one captures), say yes: pinning buffers and running directly are the safe side."""
    try:
        return bool(stream.is_capturing())
    except Exception:  # noqa: BLE001
        return True


class _CallScope:
    """This engine's device, then ``stream`` (if any), current for the duration of one call;
    both restored afterwards."""

    __slots__ = ("device", "stream")

    def __init__(self, device, stream):
        self.device, self.stream = device, stream

    def __enter__(self):
        self.device.__enter__()
        if self.stream is not None:
            try:
                self.stream.__enter__()
            except BaseException:
                self.device.__exit__(None, None, None)
                raise
        return self

    def __exit__(self, *exc):
        try:
            if self.stream is not None:
                self.stream.__exit__(*exc)
        finally:
            self.device.__exit__(*exc)


class GpuEngine:
    """Engine on device arrays: `CudaKernels` + `NcclTransport` over one NCCL communicator.

    Collective construction over the MPI communicator ``comm``: rank 0 makes
    the NCCL unique id, MPI broadcasts it, every rank joins, and a warm-up
    round (one all-reduce, one send/recv with every peer) opens the
    connections so the first timed or captured call does not pay for them.
    """

    name = "gpu"
    baseline_name = "NCCL"
    # Signatures are compared across ranks on their first call only: a per-call allgather
    # would put a host round trip on the hot path (README "Errors and guarantees").
    per_call_check = False

    def __init__(self, comm, timeout: float, device: int | None = None, use_fused: bool = True):
        self.comm = comm
        self.timeout = timeout
        ndev = cupy.cuda.runtime.getDeviceCount()
        if device is None:
            device = settings.get("ECHONCCL_DEVICE")
            if device is None:
                device = node_rank_and_size(comm)[0] % max(ndev, 1)
        if not 0 <= device < ndev:
            raise EchoncclError(f"rank {comm.Get_rank()}: device {device} does not exist ({ndev} visible)")
        self.device_id = device
        self.device = cupy.cuda.Device(device)
        self.device.use()      # arrays the caller makes after this (in this thread) are on our device
        self._retired: list = []
        rank, size = comm.Get_rank(), comm.Get_size()
        self.lib = nccl.load()
        uid = self.lib.get_unique_id() if rank == 0 else None
        uid = comm.bcast(uid, root=0)
        self.nccl = nccl.NcclComm.init_rank(size, uid, rank, lib=self.lib)
        self.kernels = CudaKernels()
        self.transport = NcclTransport(self.nccl, rank, size, _current_stream_ptr,
                                       priority=settings.get("ECHONCCL_DEV_COMM_PRIORITY"))
        self._graph_schedules = settings.get("ECHONCCL_DEV_GRAPH_SCHEDULES")
        self.fused = None
        self._warm_up()
        if size > 1 and fused.available(comm, self.device.id, self.allgather_object, enabled=use_fused):
            self.fused = fused.FusedPaths(comm, self.allgather_object, rank, size, timeout, self.is_capturing)

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
            d = self.device.id
            raise ValueError(
                f"array is on device {a.device.id}, this communicator uses device {d}: make the arrays on "
                f"device {d}. Creating the Communicator makes device {d} current in its thread, so arrays "
                f"created after it (in that thread) are there; for arrays made before it or in another "
                f"thread, call cupy.cuda.Device({d}).use() (PyTorch: torch.cuda.set_device({d})) first, "
                f"or pass Communicator(device=...) the device your arrays are on")
        return a

    def writable(self, obj, a) -> bool:
        """False for memory exported read-only through ``__cuda_array_interface__``
        (``data = (ptr, True)``); cupy arrays are writable."""
        if isinstance(obj, cupy.ndarray):
            return True
        cai = getattr(obj, "__cuda_array_interface__", None)
        if isinstance(cai, dict):
            data = cai.get("data")
            if isinstance(data, (tuple, list)) and len(data) > 1 and data[1]:
                return False
        flags = getattr(obj, "flags", None)
        return bool(getattr(flags, "writeable", True)) if flags is not None else True

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

    def call_scope(self, stream):
        return _CallScope(self.device, None if stream is None else _as_cupy_stream(stream))

    # -- lifetime of cached buffers ------------------------------------------------------------
    def is_capturing(self) -> bool:
        """The current stream is capturing a CUDA graph (then the buffers a call uses are pinned,
        and nothing is evicted). When CUDA cannot tell, say yes: pinning is the safe side."""
        return _capturing(cupy.cuda.get_current_stream())

    def use_token(self):
        """The stream a buffer is used on now (what its release must wait for)."""
        return cupy.cuda.get_current_stream()

    def retire(self, obj, token) -> None:
        """Keep an evicted buffer alive until the work already queued on ``token`` (the stream
        that last used it) has run: cupy's pool could otherwise hand its memory to another
        stream's allocation while that work still reads or writes it."""
        if token is not None:
            self._retired.append([token, None, obj])
            self._mark(self._retired[-1])

    def reap(self) -> None:
        """Drop the retired buffers whose stream has run past their last use."""
        if self._retired:
            with self.device:
                for item in self._retired:
                    if item[1] is None:
                        self._mark(item)
                self._retired = [item for item in self._retired if item[1] is None or not item[1].done]

    @staticmethod
    def _mark(item) -> None:
        """Record the event of a retired buffer on its stream, unless that stream is capturing
        a graph now (recording there would add a node to the graph): then try again later."""
        stream = item[0]
        try:
            if stream.is_capturing():
                return
        except Exception:  # noqa: BLE001 - CUDA cannot tell now: try again at the next reap
            return
        ev = cupy.cuda.Event(disable_timing=True)
        ev.record(stream)
        item[1] = ev

    # -- collectives ---------------------------------------------------------------------------
    def allgather_object(self, obj):
        return allgather_object(self.comm, obj, self.timeout)

    def allgather_digest(self, digest: int):
        return allgather_digest(self.comm, digest, self.timeout)

    def baseline_all_reduce(self, x, out) -> None:
        """NCCL's own ncclAllReduce (sum) on the current stream."""
        self.nccl.all_reduce(x.data.ptr, out.data.ptr, x.size, dtypes.canonical(x.dtype), _current_stream_ptr())

    # -- prepared calls (`Communicator`'s replay of a call whose buffers it has seen) --------------
    def call_key(self, x, out):
        """The buffers of a call as a hashable (pointer, shape, strides, dtype of ``x`` and of
        ``out``, which may be ``x``) for cupy arrays; None for anything else (no replay)."""
        if type(x) is not cupy.ndarray or (out is not x and type(out) is not cupy.ndarray):
            return None
        kx = (x.data.ptr, x.shape, x.strides, x.dtype)
        return kx if out is x else (kx, out.data.ptr, out.shape, out.strides, out.dtype)

    def call_stream(self, stream):
        """The cupy stream a replayed call runs on (``stream``, else the current one), or None
        when the call must take the full path (another device is current, or ``stream`` is not
        a cupy stream)."""
        if cupy.cuda.runtime.getDevice() != self.device_id:
            return None
        if stream is None:
            return cupy.cuda.get_current_stream()
        return stream if isinstance(stream, (cupy.cuda.Stream, cupy.cuda.ExternalStream)) else None

    def stream_capturing(self, stream) -> bool:
        """``stream`` is capturing a CUDA graph (`is_capturing` for a given stream)."""
        return _capturing(stream)

    def prepare_baseline(self, x, out):
        """NCCL's all-reduce of these buffers as ``(run(stream, x, out), None)``."""
        run = self.nccl.prepare_all_reduce(x.data.ptr, out.data.ptr, x.size, dtypes.canonical(x.dtype))
        return (lambda stream, _x, _out: run(stream.ptr)), None

    def prepare_one_shot(self, x, out):
        """The 16-bit one-shot through peer memory (NCCL's all-reduce where there is none) of these
        buffers as ``(run(stream, x, out), valid)`` (``valid``: None, or a check that it still applies)."""
        if self.fused is not None and self.fused.one_shot_fits(x):
            launch, valid = self.fused.prepare_one_shot(x, out)
            return (lambda stream, _x, _out: launch(stream)), valid
        return self.prepare_baseline(x, out)

    def fused_schedule(self, algo: str, layout):
        """The fused one-kernel implementation of schedule ``algo`` for ``layout``, as a
        ``prepare(layout, x, out, state, rounds) -> (run(stream), valid)``, or None: then the
        schedule runs over NCCL."""
        if self.fused is not None and algo == "two_shot" and self.fused.two_shot_fits(layout):
            return self.fused.prepare_two_shot
        if self.fused is not None and algo == "one_shot_q" and self.fused.one_shot_q_fits(layout):
            return self.fused.prepare_one_shot_q
        return None

    def prepare_schedule(self, run):
        """A schedule's ``run(stream, x, out)`` (kernels and NCCL calls on the current stream) as a
        prepared call: the first call runs it; the second captures it into a CUDA graph on a side
        stream, and every later call replays that graph on the call's stream: one host call
        instead of the schedule's Python, launches and NCCL calls (its pointers are fixed: the
        call's buffers, workspace and residuals). Calls on a capturing stream run it directly
        (their graph holds the work), as does everything after a capture that fails."""
        return _GraphedRun(run, capture=self._graph_schedules, priority=self.transport.priority)

    def small_algorithm(self) -> str:
        """What ``auto`` runs below the crossover: the 16-bit peer-memory one-shot, else NCCL."""
        return "one_shot" if self.fused is not None else "nccl"

    def crossover_bytes(self, nranks: int) -> int:
        """Below this input size ``auto`` dispatches to NCCL's own all-reduce.

        Measured on two H200s with echonccl-perf (BENCHMARKS.md), by the transport
        NCCL is told to use: NVLink/P2P 128 MiB (4-bit reaches 1.0x at 64 MiB), and
        ``NCCL_P2P_DISABLE=1``, with or without ``NCCL_SHM_DISABLE=1`` (sockets), 2 MiB
        (with all-gathers through ncclAllGather and the schedule replayed as a CUDA graph:
        host memory 1.23x eager / 1.30x graph at 2 MiB, 1.03x / 1.14x at 512 KiB; sockets
        1.69x / 1.67x at 2 MiB). Override with ``ECHONCCL_CROSSOVER_BYTES``.
        """
        if self.fused is not None:
            return FUSED_CROSSOVER_BYTES
        if nccl.p2p_disabled():
            return 2 << 20
        return 128 << 20

    def preferred_schedule(self, nranks: int) -> str:
        return "two_shot"

    def synchronize(self, timeout: float | None = None) -> None:
        """Wait for the current stream; a peer that stops answering raises `PeerTimeoutError`
        after ``timeout`` (default: the engine's) and aborts the NCCL communicator."""
        with self.device:       # our device's current stream (the null stream is per device)
            self._synchronize(self.timeout if timeout is None else timeout)

    def _synchronize(self, timeout: float) -> None:
        stream = cupy.cuda.get_current_stream()
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
        if self.fused is not None and self.fused.failed():
            raise PeerTimeoutError(f"rank {self.transport.rank}: a fused all-reduce gave up waiting for a peer "
                                   f"(timeout {self.timeout:g} s): a peer died, hangs or called differently")

    def abort(self) -> None:
        """Stop the NCCL communicator without waiting (after a failure midway; not collective)."""
        if not self.nccl.closed:
            self.nccl.abort()

    def close(self) -> None:
        if not self.nccl.closed:
            with contextlib.suppress(EchoncclError):
                self.synchronize()
            if self.fused is not None:
                with self.device:
                    cupy.cuda.runtime.deviceSynchronize()
                    self.fused.close()
            self.nccl.destroy()
        self._retired = []

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

