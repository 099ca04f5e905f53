"""The GPU engine's fused paths through peer memory: one kernel launch per all-reduce.

* `FusedPaths.two_shot`: the two-shot schedule (`schedules.two_shot`) as ONE kernel
  (``cuda_src/fused_kernels.cu``): blocks quantize their part of the input into the owner's
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
other's memory (`available`), unless ``ECHONCCL_FUSED=0`` (then the NCCL send/recv path runs
every schedule). Launches go on the current stream, allocate nothing once a size fits the
registered region, never synchronize the host, and can be captured in a CUDA graph.
"""
from __future__ import annotations

import ctypes
import os
from collections import OrderedDict

from . import cuda_driver, dtypes, kernels_cuda
from .peer_memory import (LL_MAX_BYTES, LL_WORDS, MAX_RANKS, ONE_SHOT_TILE, PeerMemory, fused_tiles,
                          one_shot_tiles)

SOURCE = "fused_kernels.cu"
BLOCK = 256
# Blocks of the fused two-shot per SM: the kernels are built for 3 resident (ECHO_FUSED_MIN_BLOCKS).
BLOCKS_PER_SM = int(os.environ.get("ECHONCCL_FUSED_BLOCKS_PER_SM", 3))
# Benchmark switch: 0 runs the general (bounds-tested) fused kernel even where the whole-slice one fits.
WHOLE = os.environ.get("ECHONCCL_FUSED_WHOLE", "1") not in ("0", "false", "no")
DEFAULT_MAX_BYTES = 4 << 30
_SHORT = {"float16": "f16", "bfloat16": "bf16", "float32": "f32"}


def enabled_by_env() -> bool:
    """False when ``ECHONCCL_FUSED=0`` or NCCL is told not to use peer-to-peer (``NCCL_P2P_DISABLE``)."""
    if os.environ.get("ECHONCCL_FUSED", "1") in ("0", "false", "no"):
        return False
    return os.environ.get("NCCL_P2P_DISABLE", "0") in ("0", "")


def available(comm, device_id: int, allgather) -> bool:
    """Collective: True when every rank is on this node and every pair of devices can map each
    other's memory (or is the same device), at most `MAX_RANKS` ranks. Same answer on every rank."""
    from cupy.cuda import runtime

    from .transport_mpi import node_rank_and_size

    local = node_rank_and_size(comm)[1] == comm.Get_size() and comm.Get_size() <= MAX_RANKS
    devs = allgather((device_id, local, enabled_by_env()))
    ok = all(d[1] and d[2] for d in devs)
    if ok:
        ok = all(d == device_id or runtime.deviceCanAccessPeer(device_id, d) for d, _, _ in devs)
    return all(allgather(ok))


def fused_name(dtype: str, res: str, group: int, codec_name: str = "int4", whole: bool = False,
               ref32: bool = False) -> str:
    """The fused two-shot entry point; ``whole``: the one for slices that lie whole in 16-byte
    aligned buffers (no bounds tests: `FusedPaths` picks it when the call allows); ``ref32`` (16-bit
    data only): the owner's ref in float32, for `Residuals.rounding` off, never accumulating."""
    suffix = ("_r32" if ref32 else "") + ("_whole" if whole else "")
    return f"echo_fused_two_shot_{dtype}_res{res}_g{group}{kernels_cuda.codec_suffix(codec_name)}{suffix}"


def one_shot_q_name(dtype: str, res: str, group: int, codec_name: str = "int4", whole: bool = False) -> str:
    """The fused quantized one-shot entry point (``whole``: as in `fused_name`)."""
    return fused_name(dtype, res, group, codec_name, whole).replace("_two_shot_", "_one_shot_q_")


def one_shot_name(dtype: str, low_latency: bool = False) -> str:
    return f"echo_one_shot_{'ll_' if low_latency else ''}{dtype}"


# (input, residual) pairs of the fused two-shot, per group size (cuda_src/fused_kernels.cu).
_FUSED_COMBOS = (("f16", "f32"), ("f16", "f16"), ("f16", "i8"), ("bf16", "f32"), ("bf16", "bf16"), ("bf16", "i8"),
                 ("f32", "f32"), ("f32", "i8"))


def entry_points() -> list[str]:
    """Every kernel ``fused_kernels.cu`` defines."""
    from .codec import codec_groups

    names = [f(t, r, g, c, w) for f in (fused_name, one_shot_q_name) for c, g in codec_groups()
             for t, r in _FUSED_COMBOS for w in (False, True)]
    names += [fused_name(t, r, g, c, w, ref32=True) for c, g in codec_groups() for t, r in _FUSED_COMBOS
              if t != "f32" for w in (False, True)]
    return names + [one_shot_name(t, ll) for ll in (False, True) for t in _SHORT.values()]


def _whole_slices(layout, x, out, state) -> bool:
    """True when every rank's slice lies whole in ``x``, ``out`` and the residuals, 16-byte aligned:
    what the ``_whole`` fused kernels assume."""
    S, P = layout.slice_elems, layout.nranks
    ptrs = [x.data.ptr, out.data.ptr]
    if state is not None and state.inputs.dtype.itemsize != 1:   # int8 blocks: aligned by format
        ptrs += [state.inputs.data.ptr + s * S * state.inputs.itemsize for s in range(P)] + [state.output.data.ptr]
    return x.size == out.size == P * S and not any(p & 15 for p in ptrs)


class _Module:
    def __init__(self, options=()):
        self.options = tuple(options)
        self._raw = None
        self._kernels = {}

    def kernel(self, name: str):
        k = self._kernels.get(name)
        if k is None:
            import cupy

            if self._raw is None:
                fatbin = os.environ.get("ECHONCCL_FUSED_FATBIN")
                if fatbin:
                    self._raw = cupy.RawModule(path=fatbin)
                else:
                    d = kernels_cuda.source_dir()
                    self._raw = cupy.RawModule(code=kernels_cuda.module_source(SOURCE),
                                               options=kernels_cuda.NVRTC_OPTIONS + (f"-I{d}",) + self.options)
            k = self._kernels[name] = self._raw.get_function(name)
        return k


class _Launch:
    """One kernel launch with its arguments packed once (8-byte values: pointers and ints), made
    by one ``cuLaunchKernel`` through ctypes on the stream given: what a call costs on the host
    once its buffers have been seen (CuPy's ``RawKernel`` call converts every argument each time)."""

    def __init__(self, kern, grid: int, args):
        self.kern, self.grid = kern, int(grid)
        self.fn = kern.kernel.ptr
        self.vals = (ctypes.c_int64 * len(args))(*[int(a) for a in args])
        base = ctypes.addressof(self.vals)
        self.params = (ctypes.c_void_p * len(args))(*[base + 8 * i for i in range(len(args))])

    def __call__(self, stream) -> None:
        """Enqueue on ``stream`` (a cupy stream)."""
        cuda_driver.launch(self.fn, self.grid, BLOCK, stream.ptr, self.params, getattr(self.kern, "name", "?"))


class _Plans(OrderedDict):
    """Prepared launches by (region, kernel, buffers), least recently used dropped past `MAX_PLANS`."""

    def get_or_make(self, key, make):
        plan = self.get(key)
        if plan is None:
            plan = self[key] = make()
            if len(self) > MAX_PLANS:
                self.popitem(last=False)
        else:
            self.move_to_end(key)
        return plan


MAX_PLANS = 512


class FusedPaths:
    """The fused launches of one communicator over its `PeerMemory` (see the module docstring)."""

    def __init__(self, comm, allgather, rank: int, size: int, timeout: float, capturing,
                 max_bytes: int = DEFAULT_MAX_BYTES, blocks_per_sm: int = BLOCKS_PER_SM, options=()):
        import cupy

        self.rank, self.size = rank, size
        self.peers = PeerMemory(comm, allgather, max_bytes)
        self._capturing = capturing       # () -> bool: the current stream is capturing a graph
        self.timeout_ns = int(timeout * 1e9)
        self.module = _Module(tuple(options) + tuple(os.environ.get("ECHONCCL_FUSED_DEFINES", "").split()))
        dev = cupy.cuda.runtime.getDevice()
        self.max_blocks = blocks_per_sm * cupy.cuda.Device(dev).attributes["MultiProcessorCount"]
        self._plans = _Plans()
        self._stream = cupy.cuda.get_current_stream

    def preload(self) -> None:
        for t in _SHORT.values():
            self.module.kernel(one_shot_name(t))
            self.module.kernel(one_shot_name(t, True))

    # -- two-shot ---------------------------------------------------------------------------
    def two_shot_fits(self, layout) -> bool:
        """True when ``layout`` fits a region (growing it collectively if needed)."""
        return self._region(layout.slice_bytes, fused_tiles(layout.slice_elems)) is not None

    def two_shot(self, layout, x, out, state, rounds: int = 1) -> None:
        """The fused two_shot of ``x`` into ``out`` (flat engine arrays), ``rounds`` launches."""
        self.prepare_two_shot(layout, x, out, state, rounds)[0](self._stream())

    def prepare_two_shot(self, layout, x, out, state, rounds: int = 1):
        """``(run, valid)``: ``run(stream)`` enqueues the fused two_shot of these buffers on a cupy
        stream; ``valid()`` stays true while the region it uses serves new calls."""
        T = fused_tiles(layout.slice_elems)
        region = self._region(layout.slice_bytes, T)
        res = (0, 0) if state is None else (state.inputs.data.ptr, state.output.data.ptr)
        key = (id(region), layout, x.dtype, None if state is None else (state.inputs.dtype, state.rounding),
               x.data.ptr, x.size, out.data.ptr) + res
        first, more = self._plans.get_or_make(key, lambda: self._two_shot_plan(layout, T, region, x, out, state))
        return _rounds_run(first, more, rounds), self._current(region)

    def _two_shot_plan(self, layout, T, region, x, out, state):
        """The launches of round 1 and of a refinement round (empty input, accumulate)."""
        S, G, P = layout.slice_elems, layout.group, self.size
        t, r, res_in, res_out = _types(x, state)
        grid = min(self.max_blocks, 2 * P * T)
        ref32 = state is not None and not state.rounding and t != "f32"
        args = [x.data.ptr, x.size, out.data.ptr, out.size, res_in, res_out, S, self.rank, P, T,
                region.max_tiles, 0, region.table.data.ptr, region.ctl, self.timeout_ns]
        whole = WHOLE and _whole_slices(layout, x, out, state)
        first = _Launch(self.module.kernel(fused_name(t, r, G, layout.codec, whole, ref32)), grid, args)
        args[1], args[11] = 0, 1   # a refinement round: no input (so never whole), accumulate
        return first, _Launch(self.module.kernel(fused_name(t, r, G, layout.codec)), grid, args)

    # -- quantized one-shot -----------------------------------------------------------------
    def one_shot_q_fits(self, layout) -> bool:
        """True when ``layout`` fits a region (growing it collectively if needed)."""
        return self._region(*_one_shot_q_needs(layout)) is not None

    def one_shot_q(self, layout, x, out, state, rounds: int = 1) -> None:
        """The fused one_shot_q of ``x`` into ``out`` (flat engine arrays), ``rounds`` launches."""
        self.prepare_one_shot_q(layout, x, out, state, rounds)[0](self._stream())

    def prepare_one_shot_q(self, layout, x, out, state, rounds: int = 1):
        """``(run, valid)`` of the fused one_shot_q of these buffers (as `prepare_two_shot`)."""
        region = self._region(*_one_shot_q_needs(layout))
        res = 0 if state is None else state.inputs.data.ptr
        key = ("q", id(region), layout, x.dtype, None if state is None else state.inputs.dtype,
               x.data.ptr, x.size, out.data.ptr, res)
        first, more = self._plans.get_or_make(key, lambda: self._one_shot_q_plan(layout, region, x, out, state))
        return _rounds_run(first, more, rounds), self._current(region)

    def _one_shot_q_plan(self, layout, region, x, out, state):
        S, G, P = layout.slice_elems, layout.group, self.size
        T = fused_tiles(S)
        t, r, res_in, _ = _types(x, state)
        grid = min(self.max_blocks, 2 * P * T)
        args = [x.data.ptr, x.size, out.data.ptr, out.size, res_in, S, self.rank, P, T, region.max_tiles, 0,
                region.table.data.ptr, region.ctl, self.timeout_ns]
        whole = WHOLE and _whole_slices(layout, x, out, state)
        first = _Launch(self.module.kernel(one_shot_q_name(t, r, G, layout.codec, whole)), grid, args)
        args[1], args[10] = 0, 1   # a refinement round
        return first, _Launch(self.module.kernel(one_shot_q_name(t, r, G, layout.codec)), grid, args)

    # -- one-shot ---------------------------------------------------------------------------
    def one_shot(self, x, out) -> None:
        """16-bit one-shot sum of ``x`` into ``out`` (flat engine arrays of one dtype): up to
        `LL_MAX_BYTES` (4-byte aligned) as low-latency lines, else in flagged tiles; the same bits."""
        self.prepare_one_shot(x, out)[0](self._stream())

    def prepare_one_shot(self, x, out):
        """``(run, valid)`` of the one-shot of these buffers (as `prepare_two_shot`)."""
        n8, T, region = self._one_shot_region(x.size, x.itemsize)
        key = (id(region), x.dtype, x.data.ptr, x.size, out.data.ptr)
        return self._plans.get_or_make(key, lambda: self._one_shot_plan(x, out, n8, T, region)), self._current(region)

    def _one_shot_plan(self, x, out, n8, T, region):
        t = _SHORT[dtypes.canonical(x.dtype)]
        if x.nbytes <= LL_MAX_BYTES and not (x.data.ptr | out.data.ptr) & 3:
            words = -(-x.nbytes // 4)
            return _Launch(self.module.kernel(one_shot_name(t, True)), -(-words // BLOCK),
                           [x.data.ptr, out.data.ptr, x.size, self.rank, self.size, LL_WORDS, region.table.data.ptr,
                            region.epochs, region.ctl, self.timeout_ns])
        return _Launch(self.module.kernel(one_shot_name(t)), max(1, min(self.max_blocks, 2 * T)),
                       [x.data.ptr, out.data.ptr, x.size, self.rank, self.size, ONE_SHOT_TILE, region.max_tiles,
                        region.table.data.ptr, region.ctl, self.timeout_ns])

    def one_shot_fits(self, x) -> bool:
        return self._one_shot_region(x.size, x.itemsize)[2] is not None

    def _one_shot_region(self, n: int, itemsize: int):
        n8 = max(8, -(-n // 8) * 8)
        T = one_shot_tiles(n8)
        return n8, T, self._region(0, T, (self.size - 1) * (-(-(n * itemsize) // 256) * 256))

    # -- lifecycle --------------------------------------------------------------------------
    def clear_plans(self) -> None:
        """Forget every prepared launch (the next call of each buffer set prepares it again,
        e.g. after `WHOLE` changed)."""
        self._plans.clear()

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
    t = _SHORT[dtypes.canonical(x.dtype)]
    if state is None:
        return t, "f32", 0, 0
    r = "i8" if state.inputs.dtype.itemsize == 1 else _SHORT[dtypes.canonical(state.inputs.dtype)]
    return t, r, state.inputs.data.ptr, state.output.data.ptr


def _rounds_run(first, more, rounds: int):
    """``run(stream)``: ``first``, then ``rounds - 1`` launches of ``more`` (refinement rounds)."""
    if rounds == 1:
        return first

    def run(stream, extra=rounds - 1):
        first(stream)
        for _ in range(extra):
            more(stream)
    return run


def _one_shot_q_needs(layout):
    """(slice bytes, tiles, push bytes) of a region serving the fused one_shot_q of ``layout``:
    P tiles per flag slot per slice, P parts of P slices a push parity."""
    P, B = layout.nranks, layout.slice_bytes
    return 0, P * fused_tiles(layout.slice_elems), P * P * B
