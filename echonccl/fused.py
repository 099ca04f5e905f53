"""The GPU engine's fused paths through peer memory: one kernel launch per all-reduce.

* `FusedPaths.two_shot`: the two-shot schedule (`schedules.two_shot`) as ONE kernel
  (``cuda_src/fused.cuh``): blocks quantize their part of the input into the owner's
  registered receive buffer, the owner reduces, requantizes and stores its codes into every
  rank's gather buffer, every rank decodes; flags in peer memory order the steps. Outputs and
  residuals are bitwise those of the three-kernel two_shot, and so of the numpy reference.
  Rounds > 1 are one launch per round (``accumulate``), as `schedules.rounds` runs them.
* `FusedPaths.one_shot`: a 16-bit one-shot all-reduce for small sizes: every rank pushes its
  input to every peer and sums the P inputs in rank order in float32, rounded once.
* `FusedPaths.one_shot_q`: the quantized one-shot (`schedules.one_shot_q`) as ONE kernel: blocks
  quantize the input (with feedback) straight into every rank's push area, then decode the P
  contributions summed; bitwise the schedule's outputs and residuals.

Used when every rank of the communicator is on one node and every pair of GPUs can map each
other's memory (`available`), unless the communicator's ``fused`` option is off
(``ECHONCCL_FUSED=0``; then the NCCL send/recv path runs every schedule). Launches go on the
current stream, allocate nothing once a size fits the registered region, never synchronize the
host, and can be captured in a CUDA graph. The kernels and their names: `kernel_table`.
"""
from __future__ import annotations

import ctypes
from dataclasses import replace

from . import cuda_driver, dtypes, kernel_loader
from .codec import SLICE_QUANTUM
from .kernel_table import BLOCK, FUSED_BLOCKS_PER_SM, Kernel, takes_any_count, takes_shift
from .nccl import p2p_disabled
from .peer_memory import (LL_MAX_BYTES, LL_WORDS, MAX_RANKS, ONE_SHOT_TILE, PeerMemory, fused_tiles,
                          one_shot_tiles)

DEFAULT_MAX_BYTES = 4 << 30


def available(comm, device_id: int, allgather, enabled: bool = True) -> bool:
    """Collective: True when every rank is on this node, has ``enabled`` and NCCL is not told to
    avoid peer-to-peer (``NCCL_P2P_DISABLE``), and every pair of devices can map each other's
    memory (or is the same device), at most `MAX_RANKS` ranks. Same answer on every rank."""
    from cupy.cuda import runtime

    from .transport_mpi import node_rank_and_size

    local = node_rank_and_size(comm)[1] == comm.Get_size() and comm.Get_size() <= MAX_RANKS
    enabled = enabled and not p2p_disabled()
    devs = allgather((device_id, local, enabled))
    ok = all(d[1] and d[2] for d in devs)
    if ok:
        ok = all(d == device_id or runtime.deviceCanAccessPeer(device_id, d) for d, _, _ in devs)
    return all(allgather(ok))


def _aligned(layout, x, out, state) -> bool:
    """True when ``x`` and ``out`` hold the layout's count and they and the residuals are 16-byte
    aligned: what the ``_whole`` fused kernels and their any-count twins assume (which count each
    takes: `FusedPaths.first_kernel`). The blocks past the count they leave alone, as every fused
    kernel does."""
    S, P = layout.slice_elems, layout.nranks
    ptrs = [x.data.ptr, out.data.ptr]
    if state is not None and state.inputs.dtype.itemsize != 1:   # int8 blocks: aligned by format
        ptrs += [state.inputs.data.ptr + s * S * state.inputs.itemsize for s in range(P)] + [state.output.data.ptr]
    return x.size == out.size == layout.count and not any(p & 15 for p in ptrs)


class _Launch:
    """One launch of `kernel_table.Kernel` ``kernel`` with its arguments packed once (8-byte
    values: pointers and ints), made by one ``cuLaunchKernel`` through ctypes on the stream given:
    what a call costs on the host once its buffers have been seen (CuPy's ``RawKernel`` call
    converts every argument each time)."""

    def __init__(self, kernel: Kernel, grid: int, args):
        self.kern, self.grid = kernel_loader.function(kernel.name), int(grid)
        self.fn = self.kern.kernel.ptr
        self.vals = (ctypes.c_int64 * len(args))(*[int(a) for a in args])
        base = ctypes.addressof(self.vals)
        self.params = (ctypes.c_void_p * len(args))(*[base + 8 * i for i in range(len(args))])

    def __call__(self, stream) -> None:
        """Enqueue on ``stream`` (a cupy stream)."""
        cuda_driver.launch(self.fn, self.grid, BLOCK, stream.ptr, self.params, getattr(self.kern, "name", "?"))



class FusedPaths:
    """The fused launches of one communicator over its `PeerMemory` (see the module docstring)."""

    def __init__(self, comm, allgather, rank: int, size: int, timeout: float, capturing,
                 max_bytes: int = DEFAULT_MAX_BYTES):
        import cupy

        self.rank, self.size = rank, size
        self.peers = PeerMemory(comm, allgather, max_bytes)
        self._capturing = capturing       # () -> bool: the current stream is capturing a graph
        self.timeout_ns = int(timeout * 1e9)
        dev = cupy.cuda.runtime.getDevice()
        # every block resident at once (the kernels' launch bounds), as ranks that wait on each
        # other's flags need; tools/fused_bench.py divides it among ranks sharing one GPU
        self.max_blocks = FUSED_BLOCKS_PER_SM * cupy.cuda.Device(dev).attributes["MultiProcessorCount"]
        self.whole = True                 # False: the general kernels everywhere (tools/fused_bench.py)
        self.tiles = 0                    # most tiles a slice (0: by size, `fused_tiles`; the tools' --tiles)
        self._stream = cupy.cuda.get_current_stream

    def tiles_of(self, layout) -> int:
        """Tiles T of a slice of ``layout`` in the two-shot and one_shot_q kernels."""
        return fused_tiles(layout.slice_elems, self.tiles)

    def first_kernel(self, family: str, layout, x, out, state) -> Kernel:
        """The kernel of a ``family`` call's first round (``"two_shot"``, ``"one_shot_q"``) where
        `whole` is set and the buffers are aligned (`_aligned`): the whole-slice one for a multiple
        of 512 elements, else its any-count twin where there is one (`kernel_table.takes_any_count`);
        else the general one, or its shifted twin where there is one (`kernel_table.takes_shift`)
        and ``x`` or ``out`` lies off 16-byte alignment."""
        t, r, _, _ = _types(x, state)
        if family == "two_shot":
            ref32 = state is not None and not state.rounding and t != "f32"
            k = Kernel("two_shot", t, layout.name, r, "f32" if ref32 else "", True)
        else:
            k = Kernel("one_shot_q", t, layout.codec, r, whole=True)
        if self.whole and _aligned(layout, x, out, state):
            if layout.count % SLICE_QUANTUM == 0:
                return k
            if takes_any_count(k):
                return replace(k, any_count=True)
        k = replace(k, whole=False)
        return replace(k, shifted=True) if takes_shift(k) and (x.data.ptr | out.data.ptr) & 15 else k

    # -- two-shot ---------------------------------------------------------------------------
    def two_shot_fits(self, layout) -> bool:
        """True when ``layout`` fits a region (growing it collectively if needed)."""
        return self._region(_two_shot_slot(layout), self.tiles_of(layout)) is not None

    def two_shot(self, layout, x, out, state, rounds: int = 1) -> None:
        """The fused two_shot of ``x`` into ``out`` (flat engine arrays), ``rounds`` launches."""
        self.prepare_two_shot(layout, x, out, state, rounds)[0](self._stream())

    def prepare_two_shot(self, layout, x, out, state, rounds: int = 1):
        """``(run, valid)``: ``run(stream)`` enqueues the fused two_shot of these buffers on a cupy
        stream, ``rounds`` launches (the communicator keeps it for later calls of these buffers);
        ``valid()`` stays true while the region it uses serves new calls."""
        T = self.tiles_of(layout)
        region = self._region(_two_shot_slot(layout), T)
        return self._two_shot_run(layout, T, region, x, out, state, rounds), self._current(region)

    def _two_shot_run(self, layout, T, region, x, out, state, rounds: int):
        """Round 1's launch, then ``rounds - 1`` of a refinement round (no input, accumulate)."""
        S, P = layout.slice_elems, self.size
        t, r, res_in, res_out = _types(x, state)
        grid = min(self.max_blocks, (2 * P - 1) * T)   # its work items (cuda_src/fused.cuh)
        args = [x.data.ptr, x.size, out.data.ptr, out.size, res_in, res_out, S, self.rank, P, T,
                region.max_tiles, 0, region.table.data.ptr, region.ctl, self.timeout_ns]
        first = _Launch(self.first_kernel("two_shot", layout, x, out, state), grid, args)
        if rounds == 1:
            return first
        args[1], args[11] = 0, 1   # a refinement round: no input (so never whole), accumulate
        return _rounds_run(first, _Launch(Kernel("two_shot", t, layout.name, r), grid, args), rounds)

    # -- quantized one-shot -----------------------------------------------------------------
    def one_shot_q_fits(self, layout) -> bool:
        """True when ``layout`` fits a region (growing it collectively if needed)."""
        return self._region(*_one_shot_q_needs(layout, self.tiles_of(layout))) is not None

    def one_shot_q(self, layout, x, out, state, rounds: int = 1) -> None:
        """The fused one_shot_q of ``x`` into ``out`` (flat engine arrays), ``rounds`` launches."""
        self.prepare_one_shot_q(layout, x, out, state, rounds)[0](self._stream())

    def prepare_one_shot_q(self, layout, x, out, state, rounds: int = 1):
        """``(run, valid)`` of the fused one_shot_q of these buffers (as `prepare_two_shot`)."""
        region = self._region(*_one_shot_q_needs(layout, self.tiles_of(layout)))
        return self._one_shot_q_run(layout, region, x, out, state, rounds), self._current(region)

    def _one_shot_q_run(self, layout, region, x, out, state, rounds: int):
        S, P = layout.slice_elems, self.size
        T = self.tiles_of(layout)
        t, r, res_in, _ = _types(x, state)
        grid = min(self.max_blocks, 2 * P * T)
        args = [x.data.ptr, x.size, out.data.ptr, out.size, res_in, S, self.rank, P, T, region.max_tiles, 0,
                region.table.data.ptr, region.ctl, self.timeout_ns]
        first = _Launch(self.first_kernel("one_shot_q", layout, x, out, state), grid, args)
        if rounds == 1:
            return first
        args[1], args[10] = 0, 1   # a refinement round
        return _rounds_run(first, _Launch(Kernel("one_shot_q", t, layout.codec, r), grid, args), rounds)

    # -- one-shot ---------------------------------------------------------------------------
    def one_shot(self, x, out) -> None:
        """16-bit one-shot sum of ``x`` into ``out`` (flat engine arrays of one dtype): up to
        `LL_MAX_BYTES` (4-byte aligned) as low-latency lines, else in flagged tiles; the same bits."""
        self.prepare_one_shot(x, out)[0](self._stream())

    def prepare_one_shot(self, x, out):
        """``(run, valid)`` of the one-shot of these buffers (as `prepare_two_shot`)."""
        _, T, push = _one_shot_needs(x.size, x.itemsize, self.size)
        region = self._region(0, T, push)
        return self._one_shot_run(x, out, T, region), self._current(region)

    def _one_shot_run(self, x, out, T, region):
        t = dtypes.kernel_name(x.dtype)
        if x.nbytes <= LL_MAX_BYTES and not (x.data.ptr | out.data.ptr) & 3:
            words = -(-x.nbytes // 4)
            return _Launch(Kernel("one_shot_ll", t), -(-words // BLOCK),
                           [x.data.ptr, out.data.ptr, x.size, self.rank, self.size, LL_WORDS, region.table.data.ptr,
                            region.epochs, region.ctl, self.timeout_ns])
        return _Launch(Kernel("one_shot", t), max(1, min(self.max_blocks, 2 * T)),
                       [x.data.ptr, out.data.ptr, x.size, self.rank, self.size, ONE_SHOT_TILE, region.max_tiles,
                        region.table.data.ptr, region.ctl, self.timeout_ns])

    def one_shot_fits(self, x) -> bool:
        """True when a one-shot of ``x`` fits a region (growing it collectively if needed)."""
        return self._region(*_one_shot_needs(x.size, x.itemsize, self.size)) is not None

    # -- lifecycle --------------------------------------------------------------------------
    def failed(self) -> bool:
        """True when a kernel gave up waiting for a peer (synchronous: call after the stream is done)."""
        return self.peers.errors()

    def close(self) -> None:
        self.peers.close()

    def _current(self, region):
        """A check that ``region`` is still the one new calls get (a larger size makes a new one)."""
        peers = self.peers
        return lambda: bool(peers.regions) and peers.regions[-1] is region

    def _region(self, slice_bytes: int, ntiles: int, push_bytes: int = 0):
        return self.peers.region_for(slice_bytes, ntiles, self._capturing, push_bytes)


def _types(x, state):
    """(input type, residual type, res_in pointer, res_out pointer) of a fused kernel's name and
    arguments (residuals "f32" and null pointers without feedback)."""
    t = dtypes.kernel_name(x.dtype)
    if state is None:
        return t, "f32", 0, 0
    r = dtypes.residual_kernel_name(state.inputs.dtype)
    return t, r, state.inputs.data.ptr, state.output.data.ptr


def _rounds_run(first, more, rounds: int):
    """``run(stream)``: ``first``, then ``rounds - 1`` launches of ``more`` (refinement rounds)."""
    def run(stream, extra=rounds - 1):
        first(stream)
        for _ in range(extra):
            more(stream)
    return run


def _two_shot_slot(layout) -> int:
    """Bytes of a region slot serving the fused two_shot of ``layout``: a contribution or a sum."""
    return max(layout.slice_bytes, layout.sums.slice_bytes)


def _one_shot_q_needs(layout, tiles: int):
    """(slice bytes, tiles, push bytes) of a region serving the fused one_shot_q of ``layout`` with
    ``tiles`` tiles a slice: P tiles per flag slot per slice, P parts of P slices a push parity."""
    P, B = layout.nranks, layout.slice_bytes
    return 0, P * tiles, P * P * B


def _one_shot_needs(n: int, itemsize: int, P: int):
    """(slice bytes, tiles, push bytes) of a region serving the 16-bit one-shot of ``n`` elements of
    ``itemsize`` bytes on P ranks: a flag a tile, P - 1 peers' inputs (256-byte aligned) a push parity."""
    return 0, one_shot_tiles(max(8, -(-n // 8) * 8)), (P - 1) * (-(-(n * itemsize) // 256) * 256)
