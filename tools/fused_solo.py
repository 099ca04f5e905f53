#!/usr/bin/env python3
"""A rank's own time on one GPU: rank 0 of a P-rank fused all-reduce, alone on the GPU, against
peer buffers filled as its peers would have left them: a lower bound of the P-GPU time.

    python tools/fused_solo.py [--ranks 2 4 8] [--sizes 16M 64M 256M 1G] [--kernels general whole q q_whole]
        [--codec int4-h32] [--residual auto|input|float32|int8] [--rounding on|off] [--iters 20] [--reps 2]
        [--grid N] [--tiles N] [--offset N] [--max-bytes 4G] [--timeout 10] [--phases] [-G]
        [--baseline DIR]
    python tools/fused_bench.py --solo [the same options]

One process, no MPI peers, no MPS: the MPS proxy (`tools/fused_bench.py` under
`tools/with_mps.sh`) halves each rank's GPU and adds the other rank's work; here rank 0's kernel
has every SM and all of HBM to itself, and what it would store over NVLink goes to the same HBM
(NVLink's bandwidth and latency are left out). The MPS proxy stays the check that concurrent
ranks make progress; this mode does not exercise the waits (they are satisfied before the launch).

How. `FusedPaths` (the communicator's own launch code: same kernels, grid, tiles, arguments) of
rank 0 of P runs over a `SoloRegion`: P regions of `peer_memory.region_layout` on this one device
and rank 0's `peer_memory.peer_table` pointing rank r's entries at region r (the same device, so a
plain pointer serves as the mapped one). Before timing:

* `peer_data` computes, with the three-kernel GPU path (`kernels_cuda`, bitwise the fused
  kernels and the numpy reference), what the P ranks of a first call (zero residuals) send: every
  rank's quantized contribution to every slice, and every owner's codes of its reduced slice;
* `fill` writes into rank 0's region what its peers would have left there at that call: its recv
  slots (peer s's contribution to slice 0, slot s - 1), its gather slots s >= 1 (owner s's codes),
  and for ``q`` parts s >= 1 of both push parities (peer s's P quantized slices). Rank 0's kernel
  never writes these (it writes recv, gather slot 0 and push part 0 of the *other* regions, and
  ``q`` push part 0 of its own), so they stay valid for every later call;
* before every launch, outside the timed interval, `arm` (a tiny kernel on the same stream) sets
  every flag of rank 0's region that a peer sets, to rank 0's next epoch (its ``ctl.epoch + 1``,
  read on the device): recv slots 0..P-2 and gather slots P..2P-2 (owners 1..P-1), all tiles; not
  gather slot P-1 (rank 0's own), which only rank 0's ``q`` kernel writes (and waits on: its own
  push, a real dependency inside the launch). So no wait spins: every flag rank 0 waits on is
  set before it starts, as when its peers have finished.

Rank 0's first call is checked bit for bit against the P-rank reference all-reduce of the same
inputs (`expected`; its residuals start at zero, as the peers' contributions assume); later calls
reuse the first call's peer data with rank 0's residuals moving on: the same work, outputs that
stay finite (checked), but no longer an all-reduce. A kernel that gives up waiting (``ctl.error``)
stops the run. Timing: CUDA events around the fused launch alone, median of ``--iters`` after 3
warm-ups, each kernel ``--reps`` times in alternation; the launches are queued behind a spin kernel
so that host gaps do not count. ``-G`` (``--graph``): each kernel also captured ``--iters`` calls
to a CUDA graph, the graph replayed 5 times after one `arm` each (its flags ``--iters`` epochs on,
which the waits of all those calls accept), us per call the median replay's time over ``--iters``:
echonccl-perf's ``-G``, without the launch gaps of eager calls. The grid is the whole GPU's
(`kernel_table.FUSED_BLOCKS_PER_SM` a SM) unless ``--grid``. A size whose region exceeds ``--max-bytes`` (the communicator's default)
prints ``-``: the communicator would take the NCCL path for it.

Baseline (``--baseline DIR``): each kernel also as another build left it, in the same launch:
DIR is a prebuilt folder made at another commit (``python -m echonccl.build --arch sm_90 --out
DIR`` in its checkout), whose fatbin is loaded as it is (no fingerprint check: the launch
arguments must be this build's). Each kernel KERNEL gets a column KERNEL@base, prepared with the
baseline's kernel of the same name, checked bit for bit the same way and timed in alternation with
it: a change's before and after side by side.

Phases (``--phases``): each two-shot kernel is timed three ways, the `arm` before each launch
setting the ticket (Ctl's second word) to the first item of a phase, so that the launch skips the
phases before it: from the contributions (the all-reduce), from the owner's items, from the decode's.
A phase's time is its launch's beyond the next phase's launch: what it adds where the kernel ends,
overlap included; each against its own byte floor (`phase_bytes`).

Byte floor (`floor_bytes`): what one rank's kernel moves through HBM per all-reduce of n
elements, t bytes each, slices of S elements and B wire bytes, residual slices of R bytes: input
read and output written 2 t n, residuals read and written 2 P R; wire, two-shot 2 (P - 1) B
+ 2 (P - 1) Bs with Bs the sums' slice bytes (B, or a mixed codec's int7-h32 ones) (recv: P - 1
slices written by the peers, read; gather: P - 1 written by the owners, read), ``q`` 2 P^2 B
(P parts of P slices written into the push area, read). The same on P GPUs (there the peers
write the wire slices into this HBM; here rank 0 writes them into the peers' regions, in the same
HBM). Implied bandwidth: those bytes over the best rep's median.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import echonccl
from echonccl import codec, peer_memory
from echonccl.feedback import DEFAULT_RESIDUAL, DEFAULT_ROUNDING
from echonccl.schedules.two_shot import _quantize

KERNELS = ("general", "whole", "q", "q_whole")
FAMILY = {"general": "two_shot", "whole": "two_shot", "q": "one_shot_q", "q_whole": "one_shot_q"}
_SHORT_FAMILY = {"two_shot": "two-shot", "one_shot_q": "q"}
BASE = "@base"   # the suffix of a --baseline column


def family_of(column: str) -> str:
    """The schedule of a kernel column (KERNEL or KERNEL@base)."""
    return FAMILY[column.removesuffix(BASE)]


def columns(kernels, baseline: bool) -> list:
    """The kernel columns: each kernel, followed by its baseline's with --baseline."""
    return [c for kn in kernels for c in ((kn, kn + BASE) if baseline else (kn,))]


class Baseline:
    """Kernels by name from another build's prebuilt folder (``--baseline``): its fatbin as it is,
    loaded on first use."""

    def __init__(self, folder):
        from echonccl import kernel_loader

        self.folder = Path(folder)
        self.fatbin = self.folder / kernel_loader.FATBIN
        self.names = set(json.loads((self.folder / kernel_loader.MANIFEST).read_text())["kernels"])
        self.module = None

    def resolve(self, name: str) -> str:
        """The baseline's kernel for ``name``: the same, or for a shifted twin (``_shift``) the
        general kernel of a build from before the twins, which ran misaligned buffers itself."""
        general = name.removesuffix("_shift")
        if name not in self.names and general != name and general in self.names:
            return general
        if name not in self.names:
            raise KeyError(f"--baseline {self.folder}: no kernel {name} (build it there with --all)")
        return name

    def function(self, name: str):
        """The baseline's kernel ``name`` (a cupy RawKernel, as `kernel_loader.function` gives)."""
        name = self.resolve(name)
        if self.module is None:
            import cupy

            self.module = cupy.RawModule(path=str(self.fatbin))
        return self.module.get_function(name)

    @contextlib.contextmanager
    def launches(self):
        """Within it, the fused launches made take the baseline's kernels."""
        from echonccl import kernel_loader

        saved, kernel_loader.function = kernel_loader.function, self.function
        try:
            yield
        finally:
            kernel_loader.function = saved

# The arm kernel (every flag of rank 0's region but its own gather slot: its epoch ``ahead``
# calls on, which satisfies the waits of that many calls; the ticket, Ctl's second word, to
# `ticket` unless it is negative) and a spin that holds the stream while the host queues the
# timed launches.
ARM_SOURCE = r"""
extern "C" __global__ void echo_solo_arm(unsigned int* ctl, unsigned int* flags, long long n,
                                         long long skip_lo, long long skip_hi, long long ticket,
                                         long long ahead) {
    const unsigned int epoch = *((volatile const unsigned int*)ctl) + (unsigned int)ahead;   // Ctl.epoch: its first word
    if (ticket >= 0 && blockIdx.x == 0 && threadIdx.x == 0) ctl[1] = (unsigned int)ticket;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        if (i < skip_lo || i >= skip_hi) flags[i] = epoch;
}

extern "C" __global__ void echo_solo_spin(long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while ((long long)(t - t0) < ns);
}
"""


class SoloComm:
    """What `peer_memory.PeerMemory` and `FusedPaths` ask of a communicator: rank 0 of ``size``."""

    def __init__(self, size: int):
        self.size = int(size)

    def Get_rank(self) -> int:
        return 0

    def Get_size(self) -> int:
        return self.size


class SoloRegion:
    """A `peer_memory.Region` of rank 0 whose P - 1 peers' regions are plain allocations of this
    process (the same `region_layout`, zeroed): ``bufs[r]`` is rank r's region (uint8 array of
    ``xp``, cupy by default; numpy for the host-side tests) and ``table`` rank 0's `PeerTable`
    over them. Made by `PeerMemory` through its ``make_region`` (same arguments as `Region`)."""

    def __init__(self, comm, allgather, slice_bytes: int, max_tiles: int, push_bytes: int = 0, xp=None):
        if xp is None:
            import cupy as xp  # type: ignore[no-redef]
        self.xp = xp
        self.rank, self.size = 0, comm.Get_size()
        self.slice_bytes, self.max_tiles = int(slice_bytes), int(max_tiles)
        self.push_bytes = peer_memory._align(int(push_bytes))
        self.lay = peer_memory.region_layout(self.size, self.slice_bytes, self.max_tiles, self.push_bytes)
        self.nbytes = self.lay["nbytes"]
        self.bufs = [xp.zeros(self.nbytes, dtype=xp.uint8) for _ in range(self.size)]
        self.bases = [_ptr(b) for b in self.bufs]
        self.table = xp.asarray(peer_memory.peer_table(0, self.bases, self.lay, self.push_bytes))
        self.ctl = self.bases[0]
        self.epochs = self.ctl + self.lay["epochs"]
        self._arm = None          # `_Solo.arm`'s launch arguments

    fits = peer_memory.Region.fits

    def error_flag(self) -> int:
        """Rank 0's error word (1 after a wait timed out); synchronous."""
        return int(self.ctl_words()[3])

    def ctl_words(self) -> np.ndarray:
        """Rank 0's Ctl (epoch, ticket, done, error) on the host; synchronous."""
        w = self.bufs[0][:16].view(self.xp.uint32)
        return np.asarray(w.get() if hasattr(w, "get") else w)

    def flags(self):
        """Rank 0's flag words, u32[(2P - 1) * max_tiles] (a view)."""
        off = self.lay["flags"]
        return self.bufs[0][off:off + 4 * (2 * self.size - 1) * self.max_tiles].view(self.xp.uint32)

    def close(self) -> None:
        self.bufs, self.table, self._arm = [], None, None


def _bits(a, xp):
    """``a`` viewed as unsigned integers of its size (copies and compares without the dtype)."""
    return a.view({1: xp.uint8, 2: xp.uint16, 4: xp.uint32}[a.dtype.itemsize])


def _ptr(a) -> int:
    return a.ctypes.data if isinstance(a, np.ndarray) else a.data.ptr


def armed_range(nranks: int, max_tiles: int) -> tuple[int, int, int]:
    """``(n, lo, hi)``: `arm` sets flags ``[0, n)`` of rank 0's region except ``[lo, hi)``, its own
    gather slot (P - 1), which only its own ``q`` kernel writes."""
    P = nranks
    return (2 * P - 1) * max_tiles, (P - 1) * max_tiles, P * max_tiles


def floor_bytes(family: str, layout, itemsize: int, res_dtype) -> int:
    """Bytes one rank's kernel of ``family`` (two_shot, one_shot_q) moves through HBM in one
    all-reduce of ``layout`` (see the module docstring); ``res_dtype`` None: no feedback."""
    P, S, B, n = layout.nranks, layout.slice_elems, layout.slice_bytes, layout.count
    Bs = layout.sums.slice_bytes
    R = 0 if res_dtype is None else codec.residual_size(S, res_dtype) * np.dtype(res_dtype).itemsize
    wire = 2 * (P - 1) * (B + Bs) if family == "two_shot" else 2 * P * P * B
    return 2 * itemsize * n + 2 * P * R + wire


def phase_bytes(layout, itemsize: int, res_dtype) -> dict:
    """`floor_bytes` of a two-shot by phase: ``contribute`` (P - 1 slices of input read, residual
    read and written, codes written), ``owner`` (the own input slice, P - 1 incoming slices read, its
    residual, its codes written to P - 1 peers, its output slice) and ``decode`` (P - 1 owners'
    codes read, output slices written)."""
    P, S, B, Bs = layout.nranks, layout.slice_elems, layout.slice_bytes, layout.sums.slice_bytes
    R = 0 if res_dtype is None else codec.residual_size(S, res_dtype) * np.dtype(res_dtype).itemsize
    tS = itemsize * S
    return {"contribute": (P - 1) * (tS + 2 * R + B), "owner": 2 * tS + 2 * R + (P - 1) * (B + Bs),
            "decode": (P - 1) * (Bs + tS)}


@dataclass
class PeerData:
    """What P ranks' first call (zero residuals) makes, `peer_data`: ``C`` the contributions,
    P parts of P slices (rank r's quantized slice v at ``(r * P + v) * B``: one_shot_q's gather),
    ``G`` the owners' codes, P slices of the sums' layout (two-shot's gather); ``x0`` rank 0's input."""

    x0: Any
    C: Any
    G: Any


def peer_data(k, layout, inputs, res_dtype, owner_ref, xp) -> PeerData:
    """The wire data of a first call of the P ranks whose inputs are ``inputs(r)``, through the
    schedules' own steps (the contributions of `schedules.two_shot`, the owner's ``reduce_quantize``) with
    kernels ``k`` on ``xp`` arrays, each with a zero residual of ``res_dtype`` (None: none);
    ``owner_ref``: the owner's ``ref_dtype`` (`Residuals.owner_ref`)."""
    P, B = layout.nranks, layout.slice_bytes
    S = layout.slice_elems
    C = xp.zeros(P * P * B, dtype=xp.uint8)
    res = None if res_dtype is None else xp.zeros(codec.residual_size(S, res_dtype), dtype=res_dtype)
    own, x0 = [], None
    for r in range(P):
        x = inputs(r)
        for v in range(P):
            lo, hi = layout.bounds(v)
            if res is not None:
                res.view(xp.uint8).fill(0)
            _quantize(k, layout, x[lo:hi], res, C[(r * P + v) * B:(r * P + v + 1) * B])
        lo, hi = layout.bounds(r)
        own.append(_bits(x[lo:hi], xp).copy().view(x.dtype))
        if r == 0:
            x0 = x
        del x
    sums = layout.sums
    Bs = sums.slice_bytes
    G = xp.zeros(P * Bs, dtype=xp.uint8)
    inc = xp.zeros(max(P - 1, 1) * B, dtype=xp.uint8)
    for s in range(P):
        for i, r in enumerate(q for q in range(P) if q != s):
            inc[i * B:(i + 1) * B] = C[(r * P + s) * B:(r * P + s + 1) * B]
        if res is not None:
            res.view(xp.uint8).fill(0)
        k.reduce_quantize(layout, incoming=inc if P > 1 else None, own_pos=s, own=own[s], residual=res,
                          wire_out=G[s * Bs:(s + 1) * Bs], ref_dtype=owner_ref, out_layout=sums)
    return PeerData(x0, C, G)


def expected(k, layout, data: PeerData, family: str, out) -> None:
    """Rank 0's output of the first call (every rank's): the P-rank all-reduce, into ``out``."""
    if family == "two_shot":
        k.dequantize(layout.sums, data.G, out)
    else:
        k.dequantize(layout, data.C, out, terms=layout.nranks)


def fill(region, layout, data: PeerData) -> list[str]:
    """Write into rank 0's region of ``region`` what its peers leave there at a call of
    ``layout`` (see the module docstring), for each kernel family the region has room for;
    returns those families."""
    P, B, Bs = layout.nranks, layout.slice_bytes, layout.sums.slice_bytes
    buf, lay, done = region.bufs[0], region.lay, []
    if max(B, Bs) <= region.slice_bytes:
        for s in range(1, P):
            r0, g0 = lay["recv"] + (s - 1) * B, lay["gather"] + s * Bs
            buf[r0:r0 + B] = data.C[s * P * B:(s * P + 1) * B]     # peer s's contribution to slice 0
            buf[g0:g0 + Bs] = data.G[s * Bs:(s + 1) * Bs]         # owner s's codes
        done.append("two_shot")
    if P * P * B <= region.push_bytes:
        for parity in (0, 1):
            p0 = lay["push"] + parity * region.push_bytes
            buf[p0 + P * B:p0 + P * P * B] = data.C[P * B:]          # parts 1..P-1
        done.append("one_shot_q")
    return done


# ------------------------------------------------------------------------------- on the GPU
@dataclass
class Case:
    """One kernel at one (P, size): its medians (us, one per rep), the check, the kernel run."""

    kernel: str
    times: list = field(default_factory=list)
    check: str = ""          # "ok", or what differed; "" before the check ran
    whole: bool = False      # the whole-slice kernel ran (a "whole" one falls back on ragged slices)
    any_count: bool = False  # ... its any-count twin (the count not a multiple of 512)
    shifted: bool = False    # a general one's shifted twin ran (input or output off 16-byte alignment)
    fits: bool = True
    later: dict = field(default_factory=dict)   # two-shot, --phases: "owner" / "decode": the times of
                                                # launches that start there (the phases before skipped)
    graph: list = field(default_factory=list)   # --graph: us per call replayed in a CUDA graph, one per rep


class _Solo:
    """The arm and spin kernels, compiled once."""

    def __init__(self):
        import cupy as cp

        mod = cp.RawModule(code=ARM_SOURCE)
        self.arm_k, self.spin_k = mod.get_function("echo_solo_arm"), mod.get_function("echo_solo_spin")

    def arm(self, region, ticket: int = -1, ahead: int = 1) -> None:
        """Enqueue the arm of ``region`` (`armed_range`) on the current stream, for the next
        ``ahead`` launches; ``ticket`` >= 0: the launch after it starts at that work item (the
        ones before it skipped)."""
        got = region._arm          # (grid, args), kept on the region (freed with it)
        if got is None:
            n, lo, hi = armed_range(region.size, region.max_tiles)
            args = (region.bufs[0][:16].view(np.uint32), region.flags(), np.int64(n), np.int64(lo), np.int64(hi))
            got = region._arm = ((max(1, min(-(-n // 256), 1024)),), args)
        self.arm_k(got[0], (256,), got[1] + (np.int64(ticket), np.int64(ahead)))

    def spin(self, ns: int) -> None:
        self.spin_k((1,), (1,), (np.int64(ns),))

    def time_us(self, run, region, iters: int, ticket: int = -1) -> float:
        """`per_launch_us` of ``run``, armed (``ticket``: `arm`'s) before each launch."""
        return per_launch_us(run, iters, self.spin, lambda: self.arm(region, ticket))

    def time_graph_us(self, run, region, iters: int, replays: int = 5) -> float:
        """Us per call of ``run``: median over ``replays`` of a CUDA graph of ``iters`` calls, each
        replay's time over ``iters`` (echonccl-perf's ``-G``), one arm before each replay for all
        its calls; after 3 warm-up calls and an untimed first replay."""
        import cupy as cp

        stream = cp.cuda.Stream(non_blocking=True)
        with stream:
            self.arm(region, ahead=3)
            for _ in range(3):
                run(stream)
            stream.begin_capture()
            try:
                for _ in range(iters):
                    run(stream)
            finally:
                graph = stream.end_capture()
            self.arm(region, ahead=iters)
            graph.launch(stream)
            ev = [(cp.cuda.Event(), cp.cuda.Event()) for _ in range(replays)]
            self.spin(2_000_000 + 100_000 * replays)
            for a, b in ev:
                self.arm(region, ahead=iters)
                a.record(stream)
                graph.launch(stream)
                b.record(stream)
            ev[-1][1].synchronize()
        return float(np.median([cp.cuda.get_elapsed_time(a, b) * 1e3 / iters for a, b in ev]))


def per_launch_us(run, iters: int, spin, before=lambda: None) -> float:
    """Median of per-launch CUDA-event times (us) of ``run(stream)`` on the current stream, after 3
    warm-ups, ``before()`` enqueued ahead of each launch outside its events; ``spin(ns)`` holds the
    stream while the host queues every launch (host gaps do not count)."""
    import cupy as cp

    stream = cp.cuda.get_current_stream()
    for _ in range(3):
        before()
        run(stream)
    ev = [(cp.cuda.Event(), cp.cuda.Event()) for _ in range(iters)]
    spin(2_000_000 + 100_000 * iters)
    for a, b in ev:
        before()
        a.record(stream)
        run(stream)
        b.record(stream)
    ev[-1][1].synchronize()
    return float(np.median([cp.cuda.get_elapsed_time(a, b) * 1e3 for a, b in ev]))


class PeerTimeout(RuntimeError):
    pass


def phase_firsts(P: int, T: int) -> dict:
    """The first work item of a two-shot kernel's owner and decode phases, P ranks, T tiles a slice
    (cuda_src/fused.cuh: (P - 1) T contributions, then T owner items, then the decodes)."""
    return {"owner": (P - 1) * T, "decode": P * T}


def run_solo(ranks, sizes, kernels=KERNELS, codec_name=codec.DEFAULT_CODEC, residual=DEFAULT_RESIDUAL,
             rounding=DEFAULT_ROUNDING, iters=20, reps=2, grid=0, timeout=10.0, max_bytes=None, report=None,
             phases=False, graph=False, tiles=0, observe=None, offset=0, baseline=None) -> dict:
    """``{(P, nbytes): {kernel: Case}}`` for bf16 inputs of ``nbytes`` (see the module docstring).
    `PeerTimeout` when a kernel gave up waiting; ``report(P, results_of_P)`` after each P. ``phases``:
    each two-shot kernel is also timed from its first owner item and from its first decode item
    (`_Solo.arm`'s ticket; ``Case.later``); ``graph``: each kernel also replayed in a CUDA graph
    (`_Solo.time_graph_us`; ``Case.graph``); ``tiles``: `FusedPaths.tiles`; ``offset``: the input and
    the output start that many elements past a 256-byte boundary (1: off 16-byte alignment, so the
    general kernels run). ``observe(P, nbytes, kernel,
    launch, starts)``, after each kernel's timed reps: ``launch(first)`` enqueues one armed call on the
    current stream, from work item ``first`` on (-1: the whole call), ``starts`` names the firsts
    (``"all"``: -1; two-shot kernels also ``"owner"`` and ``"decode"``, as ``phases`` times them).
    ``baseline``: a `Baseline`; each kernel also as KERNEL@base (`columns`)."""
    import cupy as cp

    from echonccl import dtypes, fused
    from echonccl.kernels_cuda import CudaKernels
    from echonccl.layout import Layout

    bf16 = dtypes.numpy_dtype("bfloat16")
    solo, k = _Solo(), CudaKernels()
    max_bytes = fused.DEFAULT_MAX_BYTES if max_bytes is None else int(max_bytes)
    results: dict = {}

    def zeros(n, dt):
        return cp.zeros(n, dtype=dt)

    for P in ranks:
        for nbytes in sizes:
            n = nbytes // 2
            layout = Layout(n, P, codec_name)
            fb = echonccl.Feedback(residual, rounding=rounding)
            state = fb.bind((n, P, layout.group, "bfloat16"), layout, bf16, zeros, codec_name)
            assert state is not None
            data = peer_data(k, layout, lambda r: cp.random.default_rng(r).standard_normal(n, dtype=cp.float32)
                             .astype(bf16), state.inputs.dtype, state.owner_ref(bf16, False), cp)
            x = data.x0
            if offset:
                x = cp.empty(n + offset, dtype=bf16)[offset:]
                x[...] = data.x0
            out, want = cp.empty(n + offset, dtype=bf16)[offset:], {}
            for family in {family_of(kn) for kn in kernels}:
                want[family] = cp.empty_like(x)
                expected(k, layout, data, family, want[family])
            paths: dict = {}        # family -> FusedPaths over its own SoloRegion
            cases = {kn: Case(kn) for kn in columns(kernels, baseline is not None)}
            runs = {}
            for kn in cases:
                family = family_of(kn)
                if family not in paths:
                    p = fused.FusedPaths(SoloComm(P), None, 0, P, timeout, lambda: False, max_bytes)
                    p.peers.make_region = SoloRegion
                    if grid:
                        p.max_blocks = grid
                    p.tiles = tiles
                    fits = p.two_shot_fits(layout) if family == "two_shot" else p.one_shot_q_fits(layout)
                    if fits:
                        assert family in fill(p.peers.regions[-1], layout, data), (family, P, nbytes)
                    paths[family] = (p, fits)
                p, fits = paths[family]
                if not fits:
                    cases[kn].fits = False
                    continue
                p.whole = kn.removesuffix(BASE).endswith("whole")
                prepare = p.prepare_two_shot if family == "two_shot" else p.prepare_one_shot_q
                with baseline.launches() if kn.endswith(BASE) else contextlib.nullcontext():
                    run, _ = prepare(layout, x, out, state)
                runs[kn] = run
                first = p.first_kernel(family, layout, x, out, state)
                cases[kn].whole, cases[kn].any_count, cases[kn].shifted = first.whole, first.any_count, first.shifted
                region = p.peers.regions[-1]
                # the checked first call: zero residuals, as the peers' data assumes
                for r in (state.inputs, state.output):
                    _bits(r, cp).fill(0)
                _bits(out, cp).fill(0)
                solo.arm(region)
                run(cp.cuda.get_current_stream())
                cp.cuda.runtime.deviceSynchronize()
                _check_timeout(region, P, nbytes, kn)
                cases[kn].check = _compare(out, want[family])
            for _ in range(reps):
                for kn, run in runs.items():
                    p = paths[family_of(kn)][0]
                    region = p.peers.regions[-1]
                    cases[kn].times.append(solo.time_us(run, region, iters))
                    if graph:
                        cases[kn].graph.append(solo.time_graph_us(run, region, iters))
                    if phases and family_of(kn) == "two_shot":
                        for name, first in phase_firsts(P, p.tiles_of(layout)).items():
                            cases[kn].later.setdefault(name, []).append(solo.time_us(run, region, iters, first))
                    cp.cuda.runtime.deviceSynchronize()
                    _check_timeout(region, P, nbytes, kn)
                    if not _finite_bf16(out):
                        cases[kn].check += " (non-finite output after the timed calls)"
            for kn, run in runs.items() if observe is not None else ():
                p = paths[family_of(kn)][0]
                region = p.peers.regions[-1]
                starts = {"all": -1}
                if family_of(kn) == "two_shot":
                    starts.update(phase_firsts(P, p.tiles_of(layout)))

                def launch(first=-1, run=run, region=region):
                    solo.arm(region, first)
                    run(cp.cuda.get_current_stream())

                observe(P, nbytes, kn, launch, starts)
                cp.cuda.runtime.deviceSynchronize()
                _check_timeout(region, P, nbytes, kn)
            for p, _ in paths.values():
                p.close()
            results[(P, nbytes)] = cases
            del data, x, out, want, runs, paths, state, fb
            cp.get_default_memory_pool().free_all_blocks()
        if report is not None:
            report(P, {key: v for key, v in results.items() if key[0] == P})
    return results


def _check_timeout(region, P, nbytes, kernel) -> None:
    if region.error_flag():
        raise PeerTimeout(f"fused_solo: P={P} {nbytes} bytes {kernel}: rank 0 gave up waiting for a flag "
                          f"(ctl {region.ctl_words().tolist()}): a wait `arm` does not satisfy")


def _finite_bf16(a) -> bool:
    """No Inf or NaN in bfloat16 array ``a`` (by its bits: exponent all ones)."""
    import cupy as cp

    return not bool(((_bits(a, cp) & 0x7F80) == 0x7F80).any())


def _compare(out, want) -> str:
    """"ok" when the bfloat16 arrays have the same bits, else how many and the first few differ."""
    import cupy as cp

    a, b = _bits(out, cp), _bits(want, cp)
    diff = a != b
    bad = int(diff.sum())
    if not bad:
        return "ok"
    at = cp.nonzero(diff)[0][:4]
    got, exp = (cp.asnumpy(v[at]).view(out.dtype).astype(np.float32) for v in (a, b))
    return (f"{bad} of {out.size} elements differ from the reference (first at {cp.asnumpy(at).tolist()}: "
            f"{got.tolist()} against {exp.tolist()})")


# -------------------------------------------------------------------------------- the tables
def phase_table(P, cases_by_size, kernels, copy_tbs, phase_floors) -> str:
    """Markdown: each two-shot kernel's time by phase (best reps; a phase is what the launch from
    it on takes beyond the launch from the next phase on), each with its floor's share of it."""
    rows = [(nbytes, kn, cases[kn]) for nbytes, cases in cases_by_size for kn in kernels
            if cases[kn].later and cases[kn].times]
    if not rows:
        return ""
    from echonccl.perf.options import format_size

    lines = [f"## P = {P}: two-shot phases, us (and the phase's HBM floor at {copy_tbs:.2f} TB/s, % of it): "
             "contribute = all - from owner on, owner = from owner on - decode alone", "",
             "| size | kernel | contribute | owner | decode | all |", "|---:|---|---:|---:|---:|---:|"]
    for nbytes, kn, c in rows:
        t_all, t_own, t_dec = min(c.times), min(c.later["owner"]), min(c.later["decode"])
        cells = []
        for name, t in (("contribute", t_all - t_own), ("owner", t_own - t_dec), ("decode", t_dec)):
            floor_us = phase_floors[(P, nbytes)][name] / copy_tbs / 1e6
            cells.append(f"{t:.1f} ({100 * floor_us / t:.0f}%)" if t > 0 else f"{t:.1f}")
        lines.append(f"| {format_size(nbytes)} | {kn} | " + " | ".join(cells) + f" | {t_all:.1f} |")
    return "\n".join(lines)


def table(P, cases_by_size, kernels, iters, copy_tbs, floors, graph=False) -> str:
    """Markdown: times (us, one per rep; ``graph``: the CUDA-graph ones), then the floors and
    implied bandwidths."""
    from echonccl.perf.options import format_size

    how = f"a CUDA graph of {iters} calls, median of 5 replays" if graph else f"median of {iters}"
    lines = [f"## P = {P}: rank 0 alone, us per all-reduce ({how}; one per rep)", "",
             "| size | " + " | ".join(kernels) + " |", "|---:|" + "---:|" * len(kernels)]
    for nbytes, cases in cases_by_size:
        cells = []
        for kn in kernels:
            c = cases[kn]
            cell = " / ".join(f"{t:.1f}" for t in (c.graph if graph else c.times)) if c.fits else "-"
            if c.fits and c.check != "ok":
                cell += " (!)"
            if kn.removesuffix(BASE).endswith("whole") and c.fits and not c.whole:
                cell += " (general)"
            elif c.fits and c.any_count:
                cell += " (any count)"
            elif c.fits and c.shifted:
                cell += " (shifted)"
            cells.append(cell)
        lines.append(f"| {format_size(nbytes)} | " + " | ".join(cells) + " |")
    fams = [f for f in ("two_shot", "one_shot_q") if any(family_of(kn) == f for kn in kernels)]
    lines += ["", f"HBM: bytes rank 0's kernel moves per element, their time at the copy rate ({copy_tbs:.2f} TB/s), "
              "and the bandwidth each kernel's best rep implies (% of the copy rate):", "",
              "| size | " + " | ".join(f"{_SHORT_FAMILY[f]} B/elem | {_SHORT_FAMILY[f]} floor us" for f in fams)
              + " | " + " | ".join(f"{kn} TB/s" for kn in kernels) + " |",
              "|---:|" + "---:|" * (2 * len(fams) + len(kernels))]
    for nbytes, cases in cases_by_size:
        fl = floors[(P, nbytes)]
        cells = [f"{fl[f][1]:.2f} | {fl[f][0] / copy_tbs / 1e6:.1f}" for f in fams]
        for kn in kernels:
            c = cases[kn]
            t = c.graph if graph else c.times
            if not c.fits or not t:
                cells.append("-")
                continue
            tbs = fl[family_of(kn)][0] / min(t) / 1e6
            cells.append(f"{tbs:.2f} ({100 * tbs / copy_tbs:.0f}%)")
        lines.append(f"| {format_size(nbytes)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", nargs="+", type=int, default=[2, 4, 8], help="P: rank 0 of a P-rank all-reduce")
    p.add_argument("--sizes", nargs="+", default=["16M", "64M", "256M", "1G"], help="bytes of bf16 input")
    p.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=KERNELS)
    p.add_argument("--codec", default=codec.DEFAULT_CODEC, choices=codec.CODECS)
    p.add_argument("--residual", default=DEFAULT_RESIDUAL, choices=codec.RESIDUAL_FORMATS)
    p.add_argument("--rounding", default=None, choices=("on", "off"),
                   help="Feedback(rounding=): the owner's output rounding in its residual (default: Feedback's, off)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--grid", type=int, default=0, help="blocks per launch (0: the whole GPU's)")
    p.add_argument("--tiles", type=int, default=0, help="most tiles per slice (0: the default)")
    p.add_argument("--offset", type=int, default=0,
                   help="elements by which input and output start past an aligned address (1: misaligned buffers)")
    p.add_argument("--max-bytes", default=None, help="largest region (default: the communicator's, 4G)")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds a wait may spin before giving up")
    p.add_argument("--phases", action="store_true",
                   help="time the two-shot kernels from their owner and decode phases on too: a time by phase")
    p.add_argument("-G", "--graph", action="store_true",
                   help="time each kernel replayed in a CUDA graph of --iters calls too (echonccl-perf's -G)")
    p.add_argument("--baseline", default=None, metavar="DIR",
                   help="another build's prebuilt folder: each kernel also as it left it (KERNEL@base), alternating")
    a = p.parse_args(argv)
    a.rounding = a.rounding or ("on" if DEFAULT_ROUNDING else "off")

    import cupy as cp

    from echonccl import dtypes, fused
    from echonccl.kernel_table import FUSED_BLOCKS_PER_SM
    from echonccl.layout import Layout
    from echonccl.perf.options import parse_size
    from kernel_bench import copy_bandwidth

    if any(not 2 <= P <= peer_memory.MAX_RANKS for P in a.ranks):
        p.error(f"--ranks: 2 to {peer_memory.MAX_RANKS}")
    sizes = [parse_size(s) for s in a.sizes]
    max_bytes = fused.DEFAULT_MAX_BYTES if a.max_bytes is None else parse_size(a.max_bytes)
    dev = cp.cuda.runtime.getDevice()
    grid = a.grid or FUSED_BLOCKS_PER_SM * cp.cuda.Device(dev).attributes["MultiProcessorCount"]
    copy_tbs = copy_bandwidth(1 << 30, a.iters)
    cp.get_default_memory_pool().free_all_blocks()
    bf16 = dtypes.numpy_dtype("bfloat16")
    res_dt = codec.residual_dtype(a.residual, bf16)
    floors, phase_floors = {}, {}
    for P in a.ranks:
        for nbytes in sizes:
            L = Layout(nbytes // 2, P, a.codec)
            floors[(P, nbytes)] = {f: (b, b / L.count) for f in ("two_shot", "one_shot_q")
                                   for b in [floor_bytes(f, L, 2, res_dt)]}
            phase_floors[(P, nbytes)] = phase_bytes(L, 2, res_dt)
    print(f"# fused kernels, one rank alone on one GPU (rank 0 of P; peers' data pre-filled), {a.codec}, bf16, "
          f"{a.residual} residuals, rounding {a.rounding}, grid {grid}, device-to-device copy {copy_tbs:.2f} TB/s",
          flush=True)
    mismatches: list[str] = []
    baseline = Baseline(a.baseline) if a.baseline else None
    cols = columns(a.kernels, baseline is not None)
    if baseline:
        print(f"# baseline: {baseline.fatbin} (columns KERNEL{BASE})", flush=True)

    def report(P, res):
        rows = [(nbytes, res[(P, nbytes)]) for nbytes in sizes]
        print(table(P, rows, cols, a.iters, copy_tbs, floors) + "\n", flush=True)
        if a.graph:
            print(table(P, rows, cols, a.iters, copy_tbs, floors, graph=True) + "\n", flush=True)
        if a.phases:
            print(phase_table(P, rows, cols, copy_tbs, phase_floors) + "\n", flush=True)
        mismatches.extend(f"P={P} {nbytes} bytes {c.kernel}: {c.check}"
                          for nbytes, cases in rows for c in cases.values() if c.fits and c.check != "ok")

    try:
        run_solo(a.ranks, sizes, a.kernels, a.codec, a.residual, a.rounding == "on", a.iters, a.reps, grid,
                 a.timeout, max_bytes, report, a.phases, a.graph, a.tiles, offset=a.offset, baseline=baseline)
    except PeerTimeout as exc:
        print(exc, file=sys.stderr)
        return 2
    print("# check: rank 0's first call against the P-rank reference all-reduce of the same inputs: "
          + ("bit for bit, every case" if not mismatches else "MISMATCH"), flush=True)
    for m in mismatches:
        print("#   " + m)
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
