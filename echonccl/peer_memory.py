"""Peer-memory buffers for the fused path: registered once, mapped by every rank of the node.

Each rank allocates one region with plain ``cudaMalloc`` (never CuPy's pool: an IPC handle
names a whole allocation and opens at its base), zeroes it, and exchanges its CUDA IPC
handle over MPI; every rank opens every other rank's handle. This is how vLLM's custom
all-reduce and QuickReduce share buffers, and it works with any NCCL (NCCL's own symmetric
memory would tie the kernels to the device-API headers of the NCCL loaded at run time).

Region layout (offsets 256-byte aligned; ``cuda_src/fused_sync.cuh`` reads the same)::

    ctl     256 B: epoch, ticket, done, error (u32 each; local use)
    epochs  u32[LL_BLOCKS]: the low-latency one-shot's per-block epochs (local use)
    flags   u32[(P - 1) + P][max_tiles]: recv slots, then gather slots
    recv    (P - 1) x slice_bytes: the contributions of the other ranks (two_shot's peers_in)
    gather  P x slice_bytes: every owner's codes (two_shot's gather)
    push    2 parities x push_bytes: what the one-shots push (16-bit inputs; one_shot_q's parts),
            the half of a call's epoch parity (a rank can be at most one call ahead of another,
            and these are read until the end of a call: ``cuda_src/fused_sync.cuh``)
    ll      2 parities x (P - 1) slots x LL_WORDS lines of 8 bytes {4 data bytes, epoch}

A `PeerTable` (device array of 8-byte words, per rank: recv, gather, flags, ll; the other ranks'
gather areas in ring order from this one; every rank's push area; the other ranks' push areas in
ring order; then push_bytes) is what the kernels take. Regions grow collectively (a call whose
layout does not fit makes a region twice as large on every rank, at the same call, since every
rank runs the same sequence of calls);
older regions stay mapped until `close`, so CUDA graphs that captured them stay valid.
Growth synchronizes the device and exchanges handles over MPI: it cannot happen inside a
CUDA-graph capture (warm the size up first).
"""
from __future__ import annotations

import numpy as np

MAX_RANKS = 8
CTL_BYTES = 256
ALIGN = 256
LL_MAX_BYTES = 1 << 20            # inputs up to this size take the low-latency one-shot
LL_WORDS = LL_MAX_BYTES // 4
LL_BLOCKS = 1024
CHUNK = 256                       # threads (8 elements each) per chunk, as the kernels' blocks
SMALL_SLICE_CHUNKS = 4096         # up to this many chunks a slice (8 M elements), 512 tiles
ONE_SHOT_TILE = 1024              # threads per tile of the (not low-latency) one-shot


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def fused_tiles(slice_elems: int, most: int = 0) -> int:
    """Tiles T of a slice in the fused two-shot: tile j is its chunks j, j + T, ...
    At most 512 tiles up to `SMALL_SLICE_CHUNKS` chunks, 1024 above (two H200s, fused two-shot:
    512 tiles made 8-32 MiB 8-17% faster, 1024 made 128-512 MiB 3-12% faster; BENCHMARKS.md);
    ``most`` > 0 sets the most instead (`FusedPaths.tiles`: the tools' ``--tiles``). A tile holds two chunks or more where the slice has them: one
    step of the 16-element loops (cuda_src/fused_phases.cuh), whose block halves take two chunks at once."""
    chunks = -(-(slice_elems // 8) // CHUNK)
    most = most or (512 if chunks <= SMALL_SLICE_CHUNKS else 1024)
    return max(1, min(-(-chunks // 2), most))


def one_shot_tiles(elems: int) -> int:
    """Tiles of ``elems`` elements (a multiple of 8) in the tiled one-shot."""
    return max(1, -(-(elems // 8) // ONE_SHOT_TILE))


def region_layout(nranks: int, slice_bytes: int, max_tiles: int, push_bytes: int = 0) -> dict:
    """Byte offsets of a region's parts (see the module docstring) and its size ``nbytes``."""
    P = nranks
    off = {"ctl": 0, "epochs": CTL_BYTES}
    off["flags"] = off["epochs"] + _align(LL_BLOCKS * 4)
    off["recv"] = off["flags"] + _align((2 * P - 1) * max_tiles * 4)
    off["gather"] = off["recv"] + _align((P - 1) * slice_bytes)
    off["push"] = off["gather"] + _align(P * slice_bytes)
    off["ll"] = off["push"] + 2 * _align(push_bytes)
    off["nbytes"] = off["ll"] + 2 * (P - 1) * LL_WORDS * 8
    return off


def peer_table(rank: int, bases: list, lay: dict, push_bytes: int) -> np.ndarray:
    """The `PeerTable` of ``rank`` (the kernels' struct, 8-byte words) from every rank's region
    base address and `region_layout` ``lay``."""
    P = len(bases)
    table = np.zeros(7 * MAX_RANKS + 1, dtype=np.uint64)
    for s, b in enumerate(bases):
        table[s] = b + lay["recv"]
        table[MAX_RANKS + s] = b + lay["gather"]
        table[2 * MAX_RANKS + s] = b + lay["flags"]
        table[3 * MAX_RANKS + s] = b + lay["ll"]
        table[5 * MAX_RANKS + s] = b + lay["push"]
    for k in range(P - 1):
        peer = bases[(rank + 1 + k) % P]
        table[4 * MAX_RANKS + k] = peer + lay["gather"]
        table[6 * MAX_RANKS + k] = peer + lay["push"]
    table[7 * MAX_RANKS] = _align(push_bytes)
    return table


class Region:
    """One generation of registered buffers: ``slice_bytes`` per wire slot, ``max_tiles`` flags
    per slot, ``push_bytes`` a push parity. Collective (every rank of ``comm`` constructs it at
    the same point)."""

    def __init__(self, comm, allgather, slice_bytes: int, max_tiles: int, push_bytes: int = 0):
        import cupy
        from cupy.cuda import runtime

        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        P = self.size
        self.slice_bytes, self.max_tiles = int(slice_bytes), int(max_tiles)
        self.push_bytes = _align(int(push_bytes))
        lay = region_layout(P, self.slice_bytes, self.max_tiles, self.push_bytes)
        self.epochs_off, self.flags_off, self.recv_off = lay["epochs"], lay["flags"], lay["recv"]
        self.gather_off, self.push_off, self.ll_off, self.nbytes = lay["gather"], lay["push"], lay["ll"], lay["nbytes"]
        self.ptr = runtime.malloc(self.nbytes)
        self._opened: list[int] = []
        try:
            runtime.memset(self.ptr, 0, self.nbytes)
            runtime.deviceSynchronize()        # zero before any peer can write into it
            handles = allgather(bytes(runtime.ipcGetMemHandle(self.ptr)))
            bases = []
            for s, h in enumerate(handles):
                if s == self.rank:
                    bases.append(self.ptr)
                else:
                    p = runtime.ipcOpenMemHandle(h)
                    self._opened.append(p)
                    bases.append(p)
        except BaseException:
            self.close()
            raise
        self.table = cupy.asarray(peer_table(self.rank, bases, lay, self.push_bytes))
        self.ctl = self.ptr
        self.epochs = self.ptr + self.epochs_off

    def fits(self, slice_bytes: int, ntiles: int, push_bytes: int = 0) -> bool:
        return slice_bytes <= self.slice_bytes and ntiles <= self.max_tiles and push_bytes <= self.push_bytes

    def error_flag(self) -> int:
        """The kernels' error word (1 after a wait timed out). Synchronous device read."""
        from cupy.cuda import runtime

        host = np.zeros(4, dtype=np.uint32)
        runtime.memcpy(host.ctypes.data, self.ctl, 16, runtime.memcpyDeviceToHost)
        return int(host[3])

    def close(self) -> None:
        from cupy.cuda import runtime

        for p in self._opened:
            runtime.ipcCloseMemHandle(p)
        self._opened = []
        if self.ptr:
            runtime.free(self.ptr)
            self.ptr = 0


class PeerMemory:
    """The regions of one communicator: the newest serves calls that fit; a call that does not
    fit (up to ``max_bytes`` per region) grows them collectively."""

    def __init__(self, comm, allgather, max_bytes: int, make_region=Region):
        self.comm, self.allgather, self.max_bytes = comm, allgather, int(max_bytes)
        self.make_region = make_region
        self.regions: list[Region] = []

    def region_for(self, slice_bytes: int, ntiles: int, capturing=lambda: False, push_bytes: int = 0):
        """The region serving a call of this size (``push_bytes``: a push parity it needs),
        growing if needed; None if it exceeds ``max_bytes`` (that call takes the NCCL path).
        Growing is collective and synchronizes the device: during a CUDA-graph capture
        (``capturing()``) it raises `EchoncclError`. A part that grows at least doubles."""
        cur = self.regions[-1] if self.regions else None
        if cur is not None and cur.fits(slice_bytes, ntiles, push_bytes):
            return cur
        if capturing():
            from .errors import EchoncclError

            raise EchoncclError("this all-reduce size needs larger peer buffers, which cannot be registered "
                                "during a CUDA-graph capture: make one eager call of it before capturing")
        P = self.comm.Get_size()

        def grown(need, have, first):
            if cur is None:
                return max(need, first)
            return have if need <= have else max(need, 2 * have)

        sb = grown(slice_bytes, cur.slice_bytes if cur else 0, 1 << 20)
        nt = grown(ntiles, cur.max_tiles if cur else 0, 64)
        pb = grown(push_bytes, cur.push_bytes if cur else 0, 1 << 20)
        if (2 * P - 1) * sb + 2 * pb > self.max_bytes:
            sb, pb = max(slice_bytes, cur.slice_bytes if cur else 0), max(push_bytes, cur.push_bytes if cur else 0)
            if (2 * P - 1) * sb + 2 * pb > self.max_bytes:
                return None
        self.regions.append(self.make_region(self.comm, self.allgather, sb, nt, pb))
        return self.regions[-1]

    def errors(self) -> bool:
        return any(r.error_flag() for r in self.regions)

    def close(self) -> None:
        for r in self.regions:
            r.close()
        self.regions = []
