"""Engine arrays and the benchmark's input data.

Arrays live where the engine computes: numpy for the CPU engine
(`HostArrays`, timed with ``time.perf_counter``), cupy for the GPU engine
(`CudaArrays`, timed with CUDA events or replayed as a CUDA graph for
``-G``; the only code of the tool that imports cupy, and only when the
engine is ``gpu``); `make_arrays` picks one. Both draw the inputs: fresh
standard-normal values, none zero or subnormal, from a seed per (rank, size,
buffer) (`seed_for`), in `buffer_count` buffers rotated across iterations.
`NcclWindow` (``CudaArrays.nccl_window``) holds copies of them in NCCL's own
memory, registered as a symmetric window, for the NCCL_sym baseline.
"""
from __future__ import annotations

import contextlib
import os
import platform
import time
from typing import Optional

import ml_dtypes
import numpy as np

from .options import UsageError

ROTATE_BYTES = 256 << 20      # rotate enough input buffers to cover this many bytes ...
MIN_BUFFERS, MAX_BUFFERS = 2, 8   # ... within these bounds (fewer if memory is short)
BASE_SEED = 0x45434E43        # mixed with (rank, size, buffer) for every input buffer


def buffer_count(nbytes: int, budget_bytes: int) -> int:
    """How many input buffers of ``nbytes`` to rotate: enough to cover `ROTATE_BYTES`, between
    `MIN_BUFFERS` and `MAX_BUFFERS`, fewer (at least 1) when ``budget_bytes`` cannot hold them
    plus the output buffer."""
    want = max(MIN_BUFFERS, min(MAX_BUFFERS, -(-ROTATE_BYTES // max(nbytes, 1))))
    fit = budget_bytes // max(nbytes, 1) - 1
    return int(max(1, min(want, fit)))


def seed_for(rank: int, nbytes: int, index: int) -> int:
    """The 32-bit seed of input buffer ``index`` of size ``nbytes`` on ``rank``."""
    return int(np.random.SeedSequence([BASE_SEED, rank, nbytes, index]).generate_state(1)[0])


def _nonzero_cast(xp, a, dtype):
    """``a`` (float32) cast to ``dtype`` with every magnitude raised to the dtype's smallest normal,
    so no element is zero or subnormal in ``dtype``. ``xp``: numpy or cupy."""
    mag = xp.abs(a)
    xp.maximum(mag, np.float32(ml_dtypes.finfo(dtype).tiny), out=mag)
    xp.copysign(mag, a, out=mag)
    return mag.astype(dtype)


def _ms_to_s(values) -> np.ndarray:
    return np.asarray(values, dtype=np.float64) * 1e-3


class HostArrays:
    """Engine arrays for the CPU engine: numpy, timed with `time.perf_counter`."""

    def random(self, count: int, dtype, seed: int) -> np.ndarray:
        """``count`` standard-normal, non-zero values of ``dtype`` drawn from ``seed``."""
        a = np.random.default_rng(seed).standard_normal(count, dtype=np.float32)
        return _nonzero_cast(np, a, dtype)

    def empty(self, count: int, dtype) -> np.ndarray:
        return np.empty(count, dtype=dtype)

    def to_host(self, a) -> np.ndarray:
        return a

    def synchronize(self) -> None:
        pass

    def release(self) -> None:
        pass

    def memory_budget(self, local_ranks: int) -> int:
        """Bytes of input and output buffers one rank may hold: a quarter of its share of free RAM."""
        try:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            free = 64 << 30
        return free // (4 * max(local_ranks, 1))

    def time_calls(self, call, bufs, out, iters: int, barrier) -> np.ndarray:
        """Seconds of each of ``iters`` calls, input ``i`` being ``bufs[i % len(bufs)]``; the ranks
        start together (``barrier``)."""
        times = np.empty(iters)
        barrier()
        for i in range(iters):
            t0 = time.perf_counter()
            call(bufs[i % len(bufs)], out, None)
            times[i] = time.perf_counter() - t0
        return times

    def time_graph(self, call, bufs, out, iters: int, launches: int, barrier) -> np.ndarray:
        raise UsageError("-G (CUDA-graph replay) needs the GPU engine")

    def device(self) -> tuple:
        """(index or None, description) of this rank's device."""
        return None, f"cpu {platform.machine()}".strip()

    def cuda_version(self) -> Optional[str]:
        return None


class CudaArrays:
    """Engine arrays for the GPU engine: cupy on the current device, timed with CUDA events
    recorded on the current stream, or replayed as a CUDA graph (``-G``)."""

    def __init__(self):
        import cupy

        self.cp = cupy

    def random(self, count: int, dtype, seed: int):
        """``count`` standard-normal, non-zero values of ``dtype`` drawn on the device from ``seed``."""
        a = self.cp.random.default_rng(seed).standard_normal(count, dtype=self.cp.float32)
        return _nonzero_cast(self.cp, a, dtype)

    def empty(self, count: int, dtype):
        return self.cp.empty(count, dtype=dtype)

    def to_host(self, a) -> np.ndarray:
        return self.cp.asnumpy(a)

    def synchronize(self) -> None:
        self.cp.cuda.get_current_stream().synchronize()

    def release(self) -> None:
        """Return the freed blocks of cupy's pool to the device (between sizes)."""
        self.cp.get_default_memory_pool().free_all_blocks()

    def memory_budget(self, local_ranks: int) -> int:
        """A quarter of the device's free memory (the communicator needs workspace and residuals)."""
        free, _total = self.cp.cuda.runtime.memGetInfo()
        return free // 4

    def _events(self, n: int) -> list:
        return [(self.cp.cuda.Event(), self.cp.cuda.Event()) for _ in range(n)]

    def time_calls(self, call, bufs, out, iters: int, barrier) -> np.ndarray:
        """Seconds of each of ``iters`` calls by event pairs on the current stream, synchronized
        once after the loop; the ranks start together (device idle, then ``barrier``)."""
        stream = self.cp.cuda.get_current_stream()
        events = self._events(iters)
        stream.synchronize()
        barrier()
        for i, (start, end) in enumerate(events):
            start.record(stream)
            call(bufs[i % len(bufs)], out, stream)
            end.record(stream)
        events[-1][1].synchronize()
        return _ms_to_s([self.cp.cuda.get_elapsed_time(s, e) for s, e in events])

    def time_graph(self, call, bufs, out, iters: int, launches: int, barrier) -> np.ndarray:
        """Seconds per call for each of ``launches`` replays of a graph capturing ``iters`` calls
        (the replay's time divided by ``iters``). The calls must have run before (warm-up)."""
        self.synchronize()              # the warm-up, on the current stream, is done
        graph, stream = self._capture(call, bufs, out, iters)
        graph.launch(stream)            # first replay uploads the graph: not timed
        events = self._events(launches)
        stream.synchronize()
        barrier()
        for start, end in events:
            start.record(stream)
            graph.launch(stream)
            end.record(stream)
        events[-1][1].synchronize()
        return _ms_to_s([self.cp.cuda.get_elapsed_time(s, e) for s, e in events]) / iters

    def _capture(self, call, bufs, out, iters: int):
        """A CUDA graph of ``iters`` calls captured on a new non-blocking stream, and that stream."""
        stream = self.cp.cuda.Stream(non_blocking=True)
        with stream:
            stream.begin_capture()
            try:
                for i in range(iters):
                    call(bufs[i % len(bufs)], out, stream)
            except BaseException:
                with contextlib.suppress(Exception):
                    stream.end_capture()
                raise
            graph = stream.end_capture()
        return graph, stream

    def nccl_window(self, ncomm, bufs, out) -> "NcclWindow":
        """Collective: copies of ``bufs`` and an output like ``out`` in one symmetric NCCL window
        of ``ncomm`` (an `echonccl.nccl.NcclComm`), on the current stream."""
        return NcclWindow(self.cp, ncomm, bufs, out)

    def device(self) -> tuple:
        """(index, name) of the current device."""
        index = self.cp.cuda.Device().id
        name = self.cp.cuda.runtime.getDeviceProperties(index)["name"]
        return index, name.decode() if isinstance(name, bytes) else str(name)

    def cuda_version(self) -> str:
        rt = self.cp.cuda.runtime
        fmt = lambda v: f"{v // 1000}.{v % 1000 // 10}"  # noqa: E731
        return f"runtime {fmt(rt.runtimeGetVersion())}, driver {fmt(rt.driverGetVersion())}"


class NcclWindow:
    """A size's input buffers copied, and an output buffer, in one ``ncclMemAlloc`` allocation
    registered as one symmetric window of an NCCL communicator (``NCCL_WIN_COLL_SYMMETRIC``).

    Collective: every rank passes as many buffers of the same size, so buffer ``i`` lies at the
    same offset of the window on every rank, which NCCL's symmetric kernels need; each starts
    on a ``NCCL_WIN_REQUIRED_ALIGNMENT`` boundary. ``bufs`` and ``out``: cupy arrays on the
    window (the copies are enqueued on the current stream). `close` (collective, once the work
    on them is done: it synchronizes the device) deregisters the window and frees the memory;
    the arrays must not be used after it. `EchoncclError` when NCCL registers no window.
    """

    def __init__(self, cp, ncomm, bufs, out):
        from ..errors import EchoncclError
        from ..nccl import NCCL_WIN_REQUIRED_ALIGNMENT as ALIGN

        self._cp, self._ncomm, self._lib = cp, ncomm, ncomm.lib
        stride = -(-max(out.nbytes, 1) // ALIGN) * ALIGN
        size = stride * (len(bufs) + 1)
        self._ptr = self._lib.mem_alloc(size)
        try:
            self._win = ncomm.register_window(self._ptr, size, symmetric=True)
        except BaseException:
            self._lib.mem_free(self._ptr)
            raise
        if self._win is None:
            self._lib.mem_free(self._ptr)
            raise EchoncclError("NCCL registered no window: this communicator has no symmetric memory")
        mem = cp.cuda.UnownedMemory(self._ptr, size, self, cp.cuda.Device().id)
        views = [cp.ndarray(out.shape, out.dtype, cp.cuda.MemoryPointer(mem, i * stride))
                 for i in range(len(bufs) + 1)]
        for view, b in zip(views, bufs):
            view.data.copy_from_device_async(b.data, b.nbytes)
        self.bufs, self.out = views[:-1], views[-1]

    def close(self) -> None:
        if self._ptr:
            self._cp.cuda.runtime.deviceSynchronize()
            self.bufs, self.out = [], None
            ptr, self._ptr = self._ptr, 0
            try:
                self._ncomm.deregister_window(self._win)
            finally:
                self._lib.mem_free(ptr)


def make_arrays(engine):
    """`CudaArrays` for the GPU engine (imports cupy), `HostArrays` otherwise."""
    return CudaArrays() if engine.name == "gpu" else HostArrays()
