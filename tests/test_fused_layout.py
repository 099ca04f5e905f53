"""The fused path's host-side plan, without a GPU: tiles, the registered region's layout, and
how regions grow (collectively, never during a capture, never past the cap)."""
from __future__ import annotations

import pytest

from echonccl import fused, kernel_table, peer_memory
from echonccl.errors import EchoncclError
from echonccl.peer_memory import (ALIGN, CHUNK, LL_WORDS, PeerMemory, fused_tiles, one_shot_tiles,
                                  region_layout)


@pytest.mark.parametrize("elems,want", [(512, 1), (2048, 1), (4096, 1), (6144, 2), (512 * 1000, 125), (1 << 20, 256),
                                        (2 << 20, 512), (4 << 20, 512), (8 << 20, 512), ((8 << 20) + 2048, 1024),
                                        (1 << 28, 1024)])
def test_fused_tiles_cover_the_chunks(elems, want):
    """512 tiles at most up to 8 M elements a slice, 1024 above; two chunks a tile or more (one step
    of the 16-element loops) where the slice has two."""
    chunks = -(-(elems // 8) // CHUNK)
    assert fused_tiles(elems) == want and 1 <= want <= chunks
    assert 2 * want <= chunks + 1                   # tiles of two chunks, the last perhaps one
    assert fused_tiles(elems, 64) == min(-(-chunks // 2), 64)


def test_one_shot_tiles():
    assert one_shot_tiles(8) == 1
    assert one_shot_tiles(8 * 1024 * 3) == 3
    assert one_shot_tiles(8 * 1024 * 3 + 8) == 4


@pytest.mark.parametrize("P", [2, 3, 4, 8])
@pytest.mark.parametrize("slice_bytes,tiles,push", [(1 << 20, 64, 1 << 20), (5 * 4096 + 64, 1000, 3 * 4096 + 8),
                                                    (160 << 20, 1024, 0)])
def test_region_parts_are_aligned_and_disjoint(P, slice_bytes, tiles, push):
    lay = region_layout(P, slice_bytes, tiles, push)
    parts = [("ctl", 16), ("epochs", 4 * 1024), ("flags", (2 * P - 1) * tiles * 4),
             ("recv", (P - 1) * slice_bytes), ("gather", P * slice_bytes), ("push", 2 * push),
             ("ll", 2 * (P - 1) * LL_WORDS * 8)]
    end = 0
    for name, size in parts:
        assert lay[name] % ALIGN == 0, name
        assert lay[name] >= end, f"{name} overlaps the part before it"
        end = lay[name] + size
    assert lay["nbytes"] == end


def test_peer_table_matches_the_kernels_struct():
    """`peer_table`: recv, gather, flags, ll of every rank, the other ranks' gather areas in ring
    order, every rank's push area, the other ranks' push areas, then the push parity's bytes
    (fused_sync.cuh's PeerTable, 8-byte words)."""
    M, P, rank = peer_memory.MAX_RANKS, 3, 1
    lay = region_layout(P, 4096, 64, 1000)
    bases = [1 << 40, 2 << 40, 3 << 40]
    t = peer_memory.peer_table(rank, bases, lay, 1000)
    assert t.size == 7 * M + 1 and t[7 * M] == 1024                 # the push parity, aligned
    for s, b in enumerate(bases):
        assert [t[k * M + s] for k in (0, 1, 2, 3, 5)] == [b + lay[n] for n in ("recv", "gather", "flags", "ll", "push")]
    assert [t[4 * M + k] for k in range(P - 1)] == [bases[2] + lay["gather"], bases[0] + lay["gather"]]
    assert [t[6 * M + k] for k in range(P - 1)] == [bases[2] + lay["push"], bases[0] + lay["push"]]
    src = (kernel_table.source_dir() / "fused_sync.cuh").read_text()
    body = src[src.index("struct PeerTable {"):src.index("};", src.index("struct PeerTable {"))]
    fields = [ln.split("//")[0].split() for ln in body.splitlines()[1:]]
    assert [f[-1].split("[")[0].rstrip(";") for f in fields if f] == ["recv", "gather", "flags", "ll", "gather_peers", "push",
                                                    "push_peers", "push_half"]


class _FakeRegion:
    made: list = []

    def __init__(self, comm, allgather, slice_bytes, max_tiles, push_bytes=0):
        self.slice_bytes, self.max_tiles, self.push_bytes = slice_bytes, max_tiles, push_bytes
        self.nbytes = region_layout(comm.Get_size(), slice_bytes, max_tiles, push_bytes)["nbytes"]
        _FakeRegion.made.append(self)

    def fits(self, slice_bytes, ntiles, push_bytes=0):
        return slice_bytes <= self.slice_bytes and ntiles <= self.max_tiles and push_bytes <= self.push_bytes


class _Comm:
    def Get_size(self):
        return 2


def test_regions_grow_by_doubling_and_stop_at_the_cap():
    _FakeRegion.made = []
    pm = PeerMemory(_Comm(), None, max_bytes=3 * (8 << 20), make_region=_FakeRegion)
    r1 = pm.region_for(1000, 10)
    assert r1.slice_bytes == 1 << 20 and r1.max_tiles == 64       # the smallest region
    assert pm.region_for(1 << 20, 64) is r1                       # fits: no new region
    r2 = pm.region_for((1 << 20) + 1, 10)
    assert r2.slice_bytes == 2 << 20 and pm.regions == [r1, r2]   # twice the last, old one kept
    assert pm.region_for(1000, 10) is r2                          # the newest serves every call
    assert pm.region_for(5 << 20, 10).slice_bytes == 5 << 20
    assert pm.region_for(9 << 20, 10) is None                     # 3 x 9 MiB > cap: NCCL path
    assert len(_FakeRegion.made) == 3
    r4 = pm.region_for(1000, 10, push_bytes=3 << 20)              # a larger push area: the rest kept
    assert (r4.slice_bytes, r4.push_bytes) == (5 << 20, 3 << 20) and pm.regions[-1] is r4
    assert pm.region_for(1000, 10, push_bytes=6 << 20) is None    # 15 + 2 x 6 MiB > cap


def test_no_growth_during_a_capture():
    _FakeRegion.made = []
    pm = PeerMemory(_Comm(), None, max_bytes=1 << 30, make_region=_FakeRegion)
    r = pm.region_for(1000, 10)
    assert pm.region_for(1000, 10, capturing=lambda: True) is r   # fits: fine while capturing
    with pytest.raises(EchoncclError, match="eager call"):
        pm.region_for(4 << 20, 10, capturing=lambda: True)
    assert pm.regions == [r]


class _Buf:
    """What `fused._aligned` reads of an engine array: size, itemsize, dtype, data.ptr."""

    def __init__(self, size, ptr, dtype="uint16"):
        import numpy as np
        from types import SimpleNamespace

        self.size, self.dtype = size, np.dtype(dtype)
        self.itemsize = self.dtype.itemsize
        self.data = SimpleNamespace(ptr=ptr)


@pytest.mark.parametrize("P", [2, 4, 8])
def test_whole_kernels_only_on_aligned_buffers_of_the_count(P):
    """`fused._aligned`: x and out hold the layout's count and every buffer, each rank's input
    residuals included, is 16-byte aligned (int8 residual blocks are, by format)."""
    from types import SimpleNamespace

    from echonccl.layout import Layout

    L = Layout(P * 4096, P, "int4-h32")
    S = L.slice_elems
    res = SimpleNamespace(inputs=_Buf(P * S, 1 << 20), output=_Buf(S, 2 << 20))
    x, out = _Buf(P * S, 3 << 20), _Buf(P * S, 4 << 20)
    assert fused._aligned(L, x, out, res) and fused._aligned(L, x, x, None)
    n = P * 4096 - 1                                      # any count
    assert fused._aligned(Layout(n, P), _Buf(n, 3 << 20), _Buf(n, 4 << 20), res)
    assert not fused._aligned(Layout(n, P), _Buf(n, 3 << 20), _Buf(n, (4 << 20) + 2), res)
    for n in (P * 4096 - 512, 512):                       # ragged, or all in slice 0
        Ln = Layout(n, P, "int4-h32")
        assert Ln.slice_elems == (S if n > 512 else 512)
        assert fused._aligned(Ln, _Buf(n, 3 << 20), _Buf(n, 4 << 20), None)
        assert not fused._aligned(Ln, _Buf(n, 3 << 20), _Buf(P * S, 4 << 20), None)
    assert not fused._aligned(L, _Buf(P * S, (3 << 20) + 8), out, res)
    assert not fused._aligned(L, x, _Buf(P * S, (4 << 20) + 2), res)
    odd = SimpleNamespace(inputs=_Buf(P * S, (1 << 20) + 4), output=res.output)
    assert not fused._aligned(L, x, out, odd)
    int8 = SimpleNamespace(inputs=_Buf(P * S, (1 << 20) + 8, "int8"), output=_Buf(S, (2 << 20) + 8, "int8"))
    assert fused._aligned(L, x, out, int8)


@pytest.mark.parametrize("P", [2, 8])
def test_first_kernel_whole_then_any_count_then_general(P):
    """`FusedPaths.first_kernel`: on aligned buffers the whole-slice kernel for a multiple of 512, its
    any-count twin for another count where the table has one (the default options' two-shot), the
    general kernel where it has none (``rounding=True``, one_shot_q) or a buffer is off alignment,
    its shifted twin where the table has one and the input or output is off 16-byte alignment."""
    from types import SimpleNamespace

    import ml_dtypes

    from echonccl.codec import DEFAULT_CODEC
    from echonccl.layout import Layout

    paths = object.__new__(fused.FusedPaths)
    paths.whole = True
    bf = ml_dtypes.bfloat16

    def first(family, n, off=0, rounding=False, x_off=0, res_off=0):
        L = Layout(n, P, DEFAULT_CODEC)
        S = L.slice_elems
        state = SimpleNamespace(inputs=_Buf(P * S, 1 << 20, bf), output=_Buf(S, (2 << 20) + 2 * res_off, bf),
                                rounding=rounding)
        return paths.first_kernel(family, L, _Buf(n, (3 << 20) + 2 * x_off, bf), _Buf(n, (4 << 20) + 2 * off, bf),
                                  state)

    whole, odd = P * 8192, P * 8192 - 17
    assert first("two_shot", whole).name == "echo_two_shot_bf16_resbf16_int4_h32_int7_h32_ref32_whole"
    assert first("two_shot", odd).name == "echo_two_shot_bf16_resbf16_int4_h32_int7_h32_ref32_whole_any"
    assert first("two_shot", odd, off=1).name == "echo_two_shot_bf16_resbf16_int4_h32_int7_h32_ref32_shift"
    assert first("two_shot", whole, x_off=8).name == "echo_two_shot_bf16_resbf16_int4_h32_int7_h32_ref32_whole"
    assert first("two_shot", whole, x_off=7).name == "echo_two_shot_bf16_resbf16_int4_h32_int7_h32_ref32_shift"
    assert first("two_shot", whole, res_off=1).name == "echo_two_shot_bf16_resbf16_int4_h32_int7_h32_ref32"
    assert first("two_shot", odd, off=1, rounding=True).name == "echo_two_shot_bf16_resbf16_int4_h32_int7_h32"
    assert first("two_shot", odd, rounding=True).name == "echo_two_shot_bf16_resbf16_int4_h32_int7_h32"
    assert first("one_shot_q", odd).name == "echo_one_shot_q_bf16_resbf16_int4_h32"
    assert first("one_shot_q", whole).name == "echo_one_shot_q_bf16_resbf16_int4_h32_whole"
    for n in (whole - 512, 512):                          # ragged multiples of 512, or all in slice 0
        assert first("two_shot", n, rounding=True).whole and first("one_shot_q", n).whole
    for n in (whole - 256, whole + 16):                   # other counts: none without a twin
        assert not first("two_shot", n, rounding=True).whole and not first("one_shot_q", n).whole
    paths.whole = False                                   # the tools' general kernels everywhere
    assert not first("two_shot", whole).whole and not first("two_shot", odd).whole
    for k in (first("two_shot", odd), first("one_shot_q", odd)):
        assert k in kernel_table.BY_NAME.values(), k.name
