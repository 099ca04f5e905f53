"""tools/fused_solo.py's host side, on the CPU (numpy arrays and the numpy kernels in place of cupy
and the CUDA ones): the peer data it fills is the schedules' first call, it lies where rank 0's
fused kernel reads it (through rank 0's `PeerTable`, as cuda_src/fused.cuh addresses it), the
flags it arms are every flag that kernel waits on and a peer sets, the byte floor; and `run_solo`
and `main` end to end with cupy and the fused launch emulated (`_EmuLaunch`). The GPU run is
tests/test_gpu_solo.py."""
from __future__ import annotations

import ctypes
import functools
import sys
import types

import numpy as np
import pytest

import fused_solo
from echonccl import codec, dtypes, fused
from echonccl.feedback import Feedback
from echonccl.kernels_numpy import NumpyKernels
from echonccl.layout import Layout
from echonccl.peer_memory import MAX_RANKS, PeerMemory, fused_tiles, region_layout
from echonccl.schedules.two_shot import _quantize
from test_properties import simulate

BF16 = dtypes.numpy_dtype("bfloat16")
CASES = [(P, n, cd, rdt, rounding)
         for P, n in ((2, 2 * 4096), (3, 5000), (4, 4 * 2048), (4, 3001))
         for cd in ("int4-h32", "int4", codec.MIXED)
         for rdt, rounding in (("input", True), ("float32", False), ("int8", True))]


def _inputs(n):
    return lambda r: np.random.default_rng(r).standard_normal(n, dtype=np.float32).astype(BF16)


def _states(P, n, layout, rdt, rounding, cd):
    return [Feedback(rdt, rounding=rounding).bind((n, P, layout.group, "bfloat16"), layout, BF16, np.zeros, cd)
            for _ in range(P)]


def _setup(P, n, cd, rdt, rounding):
    layout = Layout(n, P, cd)
    states = _states(P, n, layout, rdt, rounding, cd)
    data = fused_solo.peer_data(NumpyKernels(), layout, _inputs(n), states[0].inputs.dtype,
                                states[0].owner_ref(BF16, False), np)
    return layout, states, data


def _reference(algo, P, n, cd, rdt, rounding):
    """Rank 0's output of the schedule run by P simulated ranks (first call, zero residuals)."""
    layout = Layout(n, P, cd)
    return simulate(algo, [_inputs(n)(r) for r in range(P)], layout.group,
                    _states(P, n, layout, rdt, rounding, cd), 1, cd)[0]


@pytest.mark.parametrize("P,n,cd,rdt,rounding", CASES)
def test_peer_data_is_the_first_call_of_the_schedules(P, n, cd, rdt, rounding):
    """`expected` of `peer_data` is the P-rank all-reduce, two-shot and one_shot_q, bit for bit."""
    layout, _, data = _setup(P, n, cd, rdt, rounding)
    for family, algo in (("two_shot", "two_shot"), ("one_shot_q", "one_shot_q")):
        out = np.empty(n, BF16)
        fused_solo.expected(NumpyKernels(), layout, data, family, out)
        want = _reference(algo, P, n, cd, rdt, rounding)
        assert out.view(np.uint16).tobytes() == want.view(np.uint16).tobytes(), (family, P, n, cd, rdt)


class _Addr:
    """Rank 0's table addresses back to bytes of the SoloRegion's host buffers."""

    def __init__(self, region):
        self.bufs = region.bufs

    def __call__(self, addr: int, nbytes: int) -> np.ndarray:
        for b in self.bufs:
            base = b.ctypes.data
            if base <= addr and addr + nbytes <= base + b.size:
                return b[addr - base:addr - base + nbytes]
        raise AssertionError(f"address {addr:#x} ({nbytes} bytes) in no region")


class _Sizes:
    """A region's sizes and layout, nothing allocated."""

    def __init__(self, comm, allgather, slice_bytes, max_tiles, push_bytes=0):
        self.slice_bytes, self.max_tiles, self.push_bytes = slice_bytes, max_tiles, push_bytes
        self.lay = region_layout(comm.Get_size(), slice_bytes, max_tiles, push_bytes)

    def fits(self, *a):
        return False


def _region(P, layout, family, make=functools.partial(fused_solo.SoloRegion, xp=np)):
    """The SoloRegion `FusedPaths` would get for ``layout`` (its `PeerMemory` growth rule)."""
    pm = PeerMemory(fused_solo.SoloComm(P), None, fused.DEFAULT_MAX_BYTES, make_region=make)
    sb, nt, pb = ((fused._two_shot_slot(layout), fused_tiles(layout.slice_elems), 0) if family == "two_shot"
                  else fused._one_shot_q_needs(layout, fused_tiles(layout.slice_elems)))
    return pm.region_for(sb, nt, push_bytes=pb)


@pytest.mark.parametrize("P,n,cd,rdt,rounding", CASES[::5])
def test_fill_lies_where_rank_0s_kernel_reads(P, n, cd, rdt, rounding):
    """Rank 0's fused kernels emulated from what they read through its `PeerTable`
    (cuda_src/fused.cuh): two-shot: recv[0] + slot * B (P - 1 contributions), own slice and
    output residual, gather[0] + s * Bs for the owners s >= 1 (Bs: the sums' slice bytes); one_shot_q: push[0] + parity *
    push_half + s * P * B for s >= 1 at either parity, its own part quantized here. Both give the
    schedules' all-reduce."""
    layout, states, data = _setup(P, n, cd, rdt, rounding)
    k, B, S = NumpyKernels(), layout.slice_bytes, layout.slice_elems
    x0, st = data.x0, states[0]
    ref = _reference("two_shot", P, n, cd, rdt, rounding)
    region = _region(P, layout, "two_shot")
    assert "two_shot" in fused_solo.fill(region, layout, data)
    t, at = region.table, _Addr(region)
    assert [int(t[s]) for s in range(P)] == [b + region.lay["recv"] for b in region.bases]
    sums = layout.sums                  # the owners' codes: a mixed codec's int7-h32
    Bs = sums.slice_bytes
    g = np.zeros(P * Bs, np.uint8)
    lo, hi = layout.bounds(0)
    k.reduce_quantize(layout, at(int(t[0]), (P - 1) * B).copy(), 0, x0[lo:hi], st.output.copy(), g[:Bs],
                      st.owner_ref(BF16, False), out_layout=sums)
    for s in range(1, P):
        g[s * Bs:(s + 1) * Bs] = at(int(t[MAX_RANKS]) + s * Bs, Bs)
    out = np.empty(n, BF16)
    k.dequantize(sums, g, out)
    assert out.view(np.uint16).tobytes() == ref.view(np.uint16).tobytes()

    ref = _reference("one_shot_q", P, n, cd, rdt, rounding)
    region = _region(P, layout, "one_shot_q")
    assert "one_shot_q" in fused_solo.fill(region, layout, data)
    t, at = region.table, _Addr(region)
    assert int(t[7 * MAX_RANKS]) == region.push_bytes
    mine = np.zeros(P * B, np.uint8)
    res = st.inputs.copy()
    for v in range(P):
        lo, hi = layout.bounds(v)
        k.reduce_quantize(layout, None, 0, x0[lo:hi], codec.residual_span(res, v * S, (v + 1) * S),
                          mine[v * B:(v + 1) * B], "float32")
    for epoch in (1, 2):
        half = (epoch & 1) * int(t[7 * MAX_RANKS])
        parts = np.concatenate([mine] + [at(int(t[5 * MAX_RANKS]) + half + s * P * B, P * B) for s in range(1, P)])
        out = np.empty(n, BF16)
        k.dequantize(layout, parts, out, terms=P)
        assert out.view(np.uint16).tobytes() == ref.view(np.uint16).tobytes(), f"epoch {epoch}"


def _waits(family, P, T, mt):
    """The flag words of rank 0's region its kernel waits on (cuda_src/fused.cuh), rank 0:
    two_shot: recv slots i < P - 1 (phase 2) and gather slots P - 1 + s, s != 0 (phase 3), tiles
    j < T; one_shot_q: gather slots P - 1 + s, every s, tiles v * T + j < P * T."""
    if family == "two_shot":
        return ({i * mt + j for i in range(P - 1) for j in range(T)}
                | {(P - 1 + s) * mt + j for s in range(1, P) for j in range(T)})
    return {(P - 1 + s) * mt + tile for s in range(P) for tile in range(P * T)}


def _writes_own(family, P, T, mt):
    """The flag words of rank 0's own region its own kernel sets: one_shot_q's gather slot P - 1
    (its phase 1); a two-shot flags only its peers."""
    return {(P - 1) * mt + j for j in range(P * T)} if family == "one_shot_q" else set()


@pytest.mark.parametrize("P", [2, 3, 4, 8])
def test_arm_sets_every_flag_a_peer_would_and_none_of_rank_0s(P):
    for elems in (512, 3 << 20, 1 << 26):
        layout = Layout(elems * P, P)
        for family in ("two_shot", "one_shot_q"):
            region = _region(P, layout, family, _Sizes)
            if region is None:          # larger than the communicator's regions: never fused
                assert family == "one_shot_q" and P == 8 and elems == 1 << 26
                continue
            T, mt = fused_tiles(layout.slice_elems), region.max_tiles
            assert (P * T if family == "one_shot_q" else T) <= mt      # no wait beyond its slot
            n, lo, hi = fused_solo.armed_range(P, mt)
            armed = set(range(0, lo)) | set(range(hi, n))
            assert n * 4 <= region.lay["recv"] - region.lay["flags"], "past the flag area"
            waits, own = _waits(family, P, T, mt), _writes_own(family, P, T, mt)
            assert waits - own <= armed, (family, P, elems)
            assert not own & armed
            assert waits <= armed | own


def test_floor_bytes():
    """bf16 in and out, bf16 residuals, P = 2: 8 bytes an element and the wire: two-shot 4 slices
    (recv written and read, the peer's gather written and read), one_shot_q 8."""
    L = Layout(1 << 20, 2, "int4-h32")
    B, n = L.slice_bytes, L.count
    assert B * 8 == L.slice_elems * 4.5                  # 4.5 bits an element
    assert fused_solo.floor_bytes("two_shot", L, 2, BF16) == 8 * n + 4 * B
    assert fused_solo.floor_bytes("one_shot_q", L, 2, BF16) == 8 * n + 8 * B
    L8 = Layout(1 << 20, 8, "int4-h32")
    assert fused_solo.floor_bytes("two_shot", L8, 2, np.dtype(np.float32)) == 12 * n + 28 * L8.slice_bytes
    assert fused_solo.floor_bytes("one_shot_q", L8, 2, None) == 4 * n + 128 * L8.slice_bytes
    M = Layout(1 << 20, 2, codec.MIXED)        # contributions of B bytes, sums of S bytes (int7-h32)
    assert M.sums.slice_bytes == M.slice_elems and M.slice_bytes == B
    assert fused_solo.floor_bytes("two_shot", M, 2, BF16) == 8 * n + 2 * B + 2 * M.slice_elems


def test_solo_region_is_what_fused_paths_uses():
    """The `Region` surface `FusedPaths`/`PeerMemory` touch, and a zeroed Ctl (epoch 0, no error)."""
    region = fused_solo.SoloRegion(fused_solo.SoloComm(4), None, 4096, 64, 1000, xp=np)
    assert region.size == 4 and region.rank == 0 and region.push_bytes == 1024
    assert region.fits(4096, 64, 1000) and not region.fits(4097, 64, 0)
    assert region.ctl == region.bases[0] and region.epochs == region.ctl + region.lay["epochs"]
    assert region.table.dtype == np.uint64 and region.error_flag() == 0
    assert region.ctl_words().tolist() == [0, 0, 0, 0]
    assert region.flags().size == 7 * 64
    region.close()


# -- run_solo end to end on an emulated GPU ---------------------------------------------------------
# A stand-in for cupy (numpy arrays whose ``data.ptr`` is their address) and for the fused launch:
# `_EmuLaunch` runs rank 0's fused kernel from its arguments as cuda_src/fused.cuh does, reading
# and writing memory by address through its `PeerTable`: its epoch from Ctl, every wait a check
# that the flag has reached the epoch (else Ctl.error, as a wait that times out), the work with
# the numpy kernels, the flags it sets, the epoch it publishes; a ticket set before the launch skips
# the phases whose items lie below it. What it does not model: blocks running at once (the waits of
# one launch are taken in phase order).
class _Dev(np.ndarray):
    @property
    def data(self):            # cupy's MemoryPointer: .ptr
        return types.SimpleNamespace(ptr=self.ctypes.data)


def _mem(ptr: int, nbytes: int, dtype=np.uint8) -> np.ndarray:
    return np.frombuffer((ctypes.c_uint8 * nbytes).from_address(ptr), dtype=np.uint8).view(dtype)


_DT = {"bf16": BF16, "f16": np.dtype(np.float16), "f32": np.dtype(np.float32), "i8": np.dtype(np.uint8)}


class _EmuLaunch:
    launches: list = []
    firsts: list = []
    made: list = []         # (kernel name, the kernel lookup in force when the launch was made)

    def __init__(self, kernel, grid, args):
        self.kernel, self.grid, self.args = kernel, grid, [int(a) for a in args]
        _EmuLaunch.made.append((kernel.name, fused.kernel_loader.function))

    def __call__(self, stream) -> None:
        if getattr(stream, "captured", None) is not None:      # a graph being captured: replayed later
            stream.captured.append(self)
            return
        kern, a = self.kernel, self.args
        two = kern.family == "two_shot"
        if two:
            x, x_n, out, count, res_in, res_out, S, rank, P, T, mt, acc, table, ctl, _ = a
        else:
            x, x_n, out, count, res_in, S, rank, P, T, mt, acc, table, ctl, _ = a
            res_out = 0
        assert acc == 0 and x_n == count and rank == 0
        assert not kern.whole or kern.any_count or count % 512 == 0, (kern.name, count)
        L = Layout(count, P, kern.codec)
        assert L.slice_elems == S
        B, k, dt, rdt = L.slice_bytes, NumpyKernels(), _DT[kern.dtype], _DT[kern.res]
        c, tab = _mem(ctl, 16, np.uint32), _mem(table, 8 * (7 * MAX_RANKS + 1), np.uint64)
        epoch = np.uint32(int(c[0]) + 1)
        first = int(c[1])                                 # the ticket: the first item taken

        def flags(r):
            return _mem(int(tab[2 * MAX_RANKS + r]), 4 * (2 * P - 1) * mt, np.uint32)

        def waited(idx) -> bool:
            ok = bool(((flags(rank)[idx] - epoch).astype(np.int32) >= 0).all())
            if not ok:
                c[3] = 1
            return ok

        X, OUT = _mem(x, 2 * x_n, dt), _mem(out, 2 * count, dt)
        rin = _mem(res_in, codec.residual_size(P * S, rdt) * rdt.itemsize, rdt)
        js = np.arange(T)
        _EmuLaunch.launches.append((kern.name, ctl, int(epoch)))
        _EmuLaunch.firsts.append(first)
        if two:
            for s in range(1, P) if first < (P - 1) * T else ():   # 1. contributions into peer s's recv
                slot = rank if rank < s else rank - 1
                lo, hi = L.bounds(s)
                _quantize(k, L, X[lo:hi], codec.residual_span(rin, s * S, (s + 1) * S),
                          _mem(int(tab[s]) + slot * B, B))
                flags(s)[slot * mt + js] = epoch
            Bs = L.sums.slice_bytes                       # the owners' codes: the sums' codec
            ok = first >= P * T or waited(np.concatenate([i * mt + js for i in range(P - 1)]))
            if first < P * T and ok:                      # 2. the owner
                lo, hi = L.bounds(rank)
                wire = np.empty(Bs, np.uint8)             # into the peers' gather only
                k.reduce_quantize(L, _mem(int(tab[rank]), (P - 1) * B).copy(), rank, X[lo:hi],
                                  _mem(res_out, codec.residual_size(S, rdt) * rdt.itemsize, rdt), wire,
                                  "float32" if kern.ref == "f32" else dt, out_layout=L.sums)
                for i in range(P - 1):
                    _mem(int(tab[4 * MAX_RANKS + i]) + rank * Bs, Bs)[:] = wire
                for s in range(1, P):
                    flags(s)[(P - 1 + rank) * mt + js] = epoch
            if ok and waited(np.concatenate([(P - 1 + s) * mt + js for s in range(1, P)])):   # 3. decode
                gather = _mem(int(tab[MAX_RANKS + rank]), P * Bs).copy()
                if first < P * T:
                    gather[rank * Bs:(rank + 1) * Bs] = wire  # the owner writes its own slice of out
                    k.dequantize(L.sums, gather, OUT)
                else:                                     # the peers' slices alone
                    dec = np.empty_like(OUT)
                    k.dequantize(L.sums, gather, dec)
                    OUT[L.bounds(rank)[1]:] = dec[L.bounds(rank)[1]:]
        else:
            half, part = (int(epoch) & 1) * int(tab[7 * MAX_RANKS]), P * B
            tiles = np.arange(P * T)
            for v in range(P):                            # 1. every slice into part `rank` everywhere
                lo, hi = L.bounds(v)
                off = half + rank * part + v * B
                wire = _mem(int(tab[5 * MAX_RANKS + rank]) + off, B)
                _quantize(k, L, X[lo:hi], codec.residual_span(rin, v * S, (v + 1) * S), wire)
                for i in range(P - 1):
                    _mem(int(tab[6 * MAX_RANKS + i]) + off, B)[:] = wire
            for s in range(P):
                flags(s)[(P - 1 + rank) * mt + tiles] = epoch
            if waited(np.concatenate([(P - 1 + s) * mt + tiles for s in range(P)])):   # 2. decode the sum
                k.dequantize(L, _mem(int(tab[5 * MAX_RANKS + rank]) + half, P * part).copy(), OUT, terms=P)
        c[0], c[1] = epoch, 0                             # end_call, whether or not a wait failed


class _RawModule:
    def __init__(self, code):
        assert "echo_solo_arm" in code and "echo_solo_spin" in code

    def get_function(self, name):
        def arm(grid, block, args):
            ctl, flags, n, lo, hi, ticket, ahead = args
            i = np.arange(flags.size)
            flags[(i < n) & ((i < lo) | (i >= hi))] = np.uint32(int(ctl[0]) + int(ahead))
            if ticket >= 0:
                ctl[1] = np.uint32(ticket)
        return {"echo_solo_arm": arm, "echo_solo_spin": lambda grid, block, args: None}[name]


class _Stream:
    """A stream whose captures record `_EmuLaunch`es; the graph replays them."""

    ptr = 0
    captured = None

    def __init__(self, non_blocking=False):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def synchronize(self):
        pass

    def begin_capture(self):
        self.captured = []

    def end_capture(self):
        calls, self.captured = self.captured, None
        return types.SimpleNamespace(launch=lambda stream: [c(stream) for c in calls])


class _Event:
    def record(self, stream=None):
        pass

    def synchronize(self):
        pass


def _fake_cupy():
    cp = types.ModuleType("cupy")
    for name in ("uint8", "uint16", "uint32", "float32", "nonzero"):
        setattr(cp, name, getattr(np, name))
    cp.zeros = lambda n, dtype=float: np.zeros(n, dtype).view(_Dev)
    cp.empty = lambda n, dtype=float: np.empty(n, dtype).view(_Dev)
    cp.empty_like = np.empty_like
    cp.asarray = lambda a: np.array(a).view(_Dev)
    cp.asnumpy = lambda a: np.asarray(a).view(np.ndarray)
    cp.random = types.SimpleNamespace(default_rng=lambda seed: types.SimpleNamespace(
        standard_normal=lambda n, dtype: np.random.default_rng(seed).standard_normal(n, dtype=dtype).view(_Dev)))
    cp.RawModule = _RawModule
    cp.get_default_memory_pool = lambda: types.SimpleNamespace(free_all_blocks=lambda: None)
    stream = _Stream()
    cp.cuda = types.SimpleNamespace(Stream=_Stream,
        runtime=types.SimpleNamespace(getDevice=lambda: 0, deviceSynchronize=lambda: None),
        Device=lambda d: types.SimpleNamespace(attributes={"MultiProcessorCount": 2}),
        get_current_stream=lambda: stream, Event=_Event, get_elapsed_time=lambda a, b: 0.0125)
    return cp


@pytest.fixture
def emulated_gpu(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy())
    import echonccl.kernels_cuda as kc

    monkeypatch.setattr(kc, "CudaKernels", NumpyKernels)
    monkeypatch.setattr(fused, "_Launch", _EmuLaunch)
    monkeypatch.setattr(_EmuLaunch, "launches", [])
    monkeypatch.setattr(_EmuLaunch, "firsts", [])
    monkeypatch.setattr(_EmuLaunch, "made", [])
    kb = types.ModuleType("kernel_bench")
    kb.copy_bandwidth = lambda nbytes, iters: 4.0
    monkeypatch.setitem(sys.modules, "kernel_bench", kb)


def test_run_solo_end_to_end_on_an_emulated_gpu(emulated_gpu):
    """Every kernel at P = 2, 3, 4, slices whole and ragged: no wait left unsatisfied (arm before
    every launch, epochs 1, 2, ... of each region), the first call the reference, later calls
    finite, the whole-slice kernel where slices are whole, the two-shot's any-count twin where not."""
    whole, ragged = 2 * 3 * 4 * 1024, 2 * 5000         # bytes of bf16
    res = fused_solo.run_solo([2, 3, 4], [whole, ragged], iters=2, reps=2)
    for (P, nbytes), cases in res.items():
        for kn, c in cases.items():
            what = f"P={P} {nbytes} {kn}"
            assert c.fits and c.check == "ok", f"{what}: {c.check}"
            assert c.times == [12.5, 12.5], what
            assert c.whole == (kn == "whole" or (kn == "q_whole" and nbytes == whole)), what
            assert c.any_count == (kn == "whole" and nbytes != whole), what
    # 6 (P, size), 4 kernels: the check, then 2 reps of 3 warm-ups and 2 timed calls
    names = [n for n, _, _ in _EmuLaunch.launches]
    assert len(names) == 6 * 4 * (1 + 2 * (3 + 2))
    assert any(n.endswith("_whole") for n in names) and any("one_shot_q" in n for n in names)
    last: dict = {}                         # a region's calls: epochs 1, 2, 3, ... (1: a new region,
    for _, ctl, e in _EmuLaunch.launches:   # perhaps at a freed one's address)
        assert e in (1, last.get(ctl, 0) + 1)
        last[ctl] = e


def test_phases_time_the_launches_from_each_phase_on(emulated_gpu, capsys):
    """--phases: each two-shot kernel also from its owner items on ((P - 1) T) and its decode items
    on (P T); the ticket is back at 0 for the next launch; the phase table's floors are the phases'."""
    P, nbytes = 3, 2 * 3 * 4096
    res = fused_solo.run_solo([P], [nbytes], kernels=["whole", "q"], iters=2, reps=1, phases=True)
    c = res[(P, nbytes)]
    assert c["whole"].check == "ok" and c["whole"].later == {"owner": [12.5], "decode": [12.5]}
    assert c["q"].later == {}
    T = fused_tiles(4096)
    # both checks, then whole: all, from the owner on, from the decode on (3 warm-ups, 2 timed each); q
    assert _EmuLaunch.firsts == [0] * 7 + [(P - 1) * T] * 5 + [P * T] * 5 + [0] * 5
    assert fused_solo.main(["--ranks", "2", "--sizes", "16K", "--iters", "2", "--reps", "1", "--codec",
                            "int4-h32", "--kernels", "whole", "--phases"]) == 0
    out = capsys.readouterr().out
    assert "two-shot phases" in out and "| 16 KiB | whole | 0.0 | 0.0 | 12.5 (0%) | 12.5 |" in out


def test_observe_launches_from_each_phase_on(emulated_gpu):
    """observe (tools/stall_profile.py --fused): after each kernel's timed calls, one armed launch a
    phase start: the whole call (-1: the ticket left at 0), from the owner's items, from the decode's;
    every wait satisfied (a launch that gave up would raise PeerTimeout)."""
    P, nbytes = 3, 2 * 3 * 4096
    seen = []

    def observe(P_, nb, kn, launch, starts):
        seen.append((P_, nb, kn, dict(starts)))
        for first in starts.values():
            launch(first)

    fused_solo.run_solo([P], [nbytes], kernels=["whole", "q"], iters=2, reps=1, observe=observe)
    T = fused_tiles(4096)
    assert seen == [(P, nbytes, "whole", {"all": -1, "owner": (P - 1) * T, "decode": P * T}),
                    (P, nbytes, "q", {"all": -1})]
    # both checks, whole's 5 and q's 5 timed (3 warm-ups, 2 timed); then whole's 3 and q's 1 observed
    assert _EmuLaunch.firsts[12:] == [0, (P - 1) * T, P * T, 0]


def test_graph_replays_calls_armed_ahead(emulated_gpu, capsys):
    """-G: each kernel's calls captured once and replayed, one arm ahead of each replay satisfying
    the waits of all its calls (no timeout, epochs 1, 2, 3, ... of each region); us per call."""
    P, nbytes, iters = 3, 2 * 3 * 4096, 4
    res = fused_solo.run_solo([P], [nbytes], kernels=["whole", "q"], iters=iters, reps=2, graph=True)
    for c in res[(P, nbytes)].values():
        assert c.check == "ok" and c.times == [12.5, 12.5] and c.graph == [12.5 / iters] * 2
    # per kernel: the check; each rep eager 3 + iters, graph 3 warm-ups and 6 replays of iters
    assert len(_EmuLaunch.launches) == 2 * (1 + 2 * (3 + iters + 3 + 6 * iters))
    last: dict = {}
    for _, ctl, e in _EmuLaunch.launches:
        assert e in (1, last.get(ctl, 0) + 1)
        last[ctl] = e
    assert fused_solo.main(["--ranks", "2", "--sizes", "16K", "--iters", "2", "--reps", "1", "--codec",
                            "int4-h32", "--kernels", "whole", "-G"]) == 0
    out = capsys.readouterr().out
    assert "a CUDA graph of 2 calls" in out and "| 16 KiB | 6.2 |" in out


def test_phase_bytes_add_up_to_the_floor():
    for P, cd, rdt in ((2, codec.MIXED, BF16), (4, "int4-h32", np.dtype(np.float32)), (8, "int4", None)):
        L = Layout(P * 3 * 4096, P, cd)
        ph = fused_solo.phase_bytes(L, 2, rdt)
        assert sum(ph.values()) == fused_solo.floor_bytes("two_shot", L, 2, rdt), (P, cd)
        assert ph["decode"] == (P - 1) * (L.sums.slice_bytes + 2 * L.slice_elems)


@pytest.mark.parametrize("cd,rdt,rounding", [("int4", "float32", False), ("int7-h32", "int8", True),
                                             ("int4-h32", "int8", False)])
def test_run_solo_codecs_and_residuals_on_an_emulated_gpu(emulated_gpu, cd, rdt, rounding):
    res = fused_solo.run_solo([3], [2 * 3 * 4096], codec_name=cd, residual=rdt, rounding=rounding, iters=2, reps=1)
    assert all(c.check == "ok" and c.whole == c.kernel.endswith("whole") for c in res[(3, 2 * 3 * 4096)].values())


def test_offset_buffers_take_the_general_kernels(emulated_gpu):
    """``offset=1`` (``--offset 1``): input and output one element past an aligned address, so every
    kernel runs its general form (the two-shot's shifted twin), and its first call is still the
    reference."""
    res = fused_solo.run_solo([2, 3], [2 * 3 * 4096], iters=2, reps=1, offset=1)
    cases = [c for cs in res.values() for c in cs.values()]
    assert len(cases) == 8 and all(c.fits and c.check == "ok" and not c.whole for c in cases)
    assert all(c.shifted == (fused_solo.FAMILY[c.kernel] == "two_shot") for c in cases)
    n = 2 * 3 * 4096
    assert "(shifted)" in fused_solo.table(2, [(n, res[(2, n)])], ["general"], 2, 4.0, {(2, n): {"two_shot": (n, 1.0)}})
    aligned = fused_solo.run_solo([2], [2 * 3 * 4096], kernels=["whole"], iters=2, reps=1)
    assert aligned[(2, 2 * 3 * 4096)]["whole"].whole


def _baseline(tmp_path, names):
    import json

    from echonccl import kernel_loader

    (tmp_path / kernel_loader.MANIFEST).write_text(json.dumps({"kernels": names}))
    return fused_solo.Baseline(tmp_path)


def test_baseline_columns_launch_the_baseline_kernels(emulated_gpu, tmp_path):
    """``baseline`` (``--baseline DIR``): each kernel also as KERNEL@base, made while the baseline's
    lookup stands in for `kernel_loader.function` (the real one around it), checked and timed alike."""
    from echonccl import kernel_table

    base = _baseline(tmp_path, sorted(kernel_table.BY_NAME))
    real = fused.kernel_loader.function
    res = fused_solo.run_solo([2], [2 * 3 * 4096], kernels=["general", "whole"], iters=2, reps=2, baseline=base)
    cases = res[(2, 2 * 3 * 4096)]
    assert list(cases) == ["general", "general@base", "whole", "whole@base"]
    assert all(c.fits and c.check == "ok" and len(c.times) == 2 for c in cases.values())
    assert cases["whole@base"].whole and not cases["general@base"].whole
    assert [f == base.function for _, f in _EmuLaunch.made] == [False, True, False, True]
    assert fused.kernel_loader.function is real


def test_baseline_without_a_kernel_says_which(tmp_path):
    base = _baseline(tmp_path, ["echo_dequantize_bf16_int4_h32"])
    with pytest.raises(KeyError, match="no kernel echo_two_shot_bf16_resbf16_int4_h32_int7_h32_ref32_whole"):
        base.function("echo_two_shot_bf16_resbf16_int4_h32_int7_h32_ref32_whole")
    general = "echo_two_shot_bf16_resbf16_int4_h32_int7_h32_ref32"      # a build from before the shifted twins
    assert _baseline(tmp_path, [general]).resolve(general + "_shift") == general
    assert _baseline(tmp_path, [general, general + "_shift"]).resolve(general + "_shift") == general + "_shift"
    assert fused_solo.columns(["whole", "q"], True) == ["whole", "whole@base", "q", "q@base"]
    assert fused_solo.columns(["whole", "q"], False) == ["whole", "q"]


def test_run_solo_stops_when_a_wait_is_not_armed(emulated_gpu, monkeypatch):
    monkeypatch.setattr(fused_solo, "armed_range", lambda P, mt: (P * mt, 0, P * mt))   # no gather flags
    with pytest.raises(fused_solo.PeerTimeout, match="gave up waiting"):
        fused_solo.run_solo([2], [2 * 4096], kernels=["whole"], iters=2, reps=1)


def test_main_prints_the_tables(emulated_gpu, capsys):
    assert fused_solo.main(["--ranks", "2", "4", "--sizes", "16K", "24K", "--iters", "2", "--reps", "1",
                            "--codec", "int4-h32", "--residual", "input"]) == 0
    out = capsys.readouterr().out
    assert "## P = 2" in out and "## P = 4" in out and "| 24 KiB |" in out
    assert "bit for bit, every case" in out
    assert "| 16 KiB | 9.12 | 0.0 | 10.25 | 0.0 | 0.01 (0%) |" in out   # 8 + 4 or 8 slices of 0.28


def test_main_baseline_columns(emulated_gpu, capsys, tmp_path):
    from echonccl import kernel_table

    _baseline(tmp_path, sorted(kernel_table.BY_NAME))
    assert fused_solo.main(["--ranks", "2", "--sizes", "16K", "--iters", "2", "--reps", "1", "--kernels", "whole",
                            "--baseline", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| size | whole | whole@base |" in out and "whole@base TB/s" in out and "bit for bit, every case" in out
