"""The GPU engine's transport: one NCCL group of ncclRecv/ncclSend per round, ncclAllGather
for all-gathers (``ECHONCCL_DEV_NCCL_ALLGATHER=0``: a round of send/recv instead)."""
from __future__ import annotations

from . import settings
from .transport import gather_transfers


class NcclTransport:
    """`transport.Transport` over an `nccl.NcclComm` (cupy uint8 device buffers).

    Every round is enqueued on the stream ``stream_ptr_fn()`` returns (a raw
    ``cudaStream_t`` int; the GPU engine passes the current cupy stream) and
    ``exchange`` returns without synchronizing the host: the data is there in
    that stream's order. The caller keeps the buffers alive until the stream
    has run the round. The communicator is the caller's; this object only
    borrows it (no destroy here).

    No timeout: a dead peer hangs the stream, not this call. Watch
    `NcclComm.async_error` and `NcclComm.abort` from the engine for that.
    """

    def __init__(self, nccl_comm, rank: int, size: int, stream_ptr_fn, events: int = 256,
                 priority: bool = False):
        self.comm = nccl_comm
        self.rank = rank
        self.size = size
        self._stream_ptr_fn = stream_ptr_fn
        self._send, self._recv = nccl_comm.send, nccl_comm.recv
        self._group_start, self._group_end = nccl_comm.group_start, nccl_comm.group_end
        self._side: tuple | None = None     # the communication stream and its event ring, made on first start()
        self._nevents = events
        self._all_gather = nccl_comm.all_gather if settings.get("ECHONCCL_DEV_NCCL_ALLGATHER") else None
        # The communication stream at the device's greatest priority (``ECHONCCL_DEV_COMM_PRIORITY``):
        # when a transfer and a codec kernel become ready together, NCCL's blocks take the SMs first.
        self.priority = priority

    def exchange(self, sends, recvs) -> None:
        """One round on the current stream."""
        self._round(sends, recvs, self._stream_ptr_fn())

    def all_gather(self, buf, n: int) -> None:
        """`transport.Transport.all_gather` on the current stream, in place."""
        self._gather(buf, n, self._stream_ptr_fn())

    def start(self, sends, recvs):
        """One round on the communication stream, after the current stream's queued work;
        returns the event `wait` makes the current stream wait for. Events come from a ring
        (no allocation per call; re-recording one never affects waits already enqueued), so
        a handle must be waited on before ``events / 2`` further starts."""
        return self._on_side(lambda stream: self._round(sends, recvs, stream))

    def start_all_gather(self, buf, n: int):
        """`all_gather` on the communication stream, as `start` runs a round."""
        return self._on_side(lambda stream: self._gather(buf, n, stream))

    def _on_side(self, enqueue):
        import cupy

        if self._side is None:
            # CUDA clamps a priority beyond the device's range to its greatest (Hopper: -5).
            prio = -1000 if self.priority else 0
            self._side = (cupy.cuda.Stream(non_blocking=True, priority=prio),
                          [cupy.cuda.Event(disable_timing=True) for _ in range(self._nevents)], [0])
        side, ring, at = self._side
        ready, done = ring[at[0] % len(ring)], ring[(at[0] + 1) % len(ring)]
        at[0] += 2
        ready.record(cupy.cuda.get_current_stream())
        side.wait_event(ready)
        enqueue(side.ptr)
        done.record(side)
        return done

    def _gather(self, buf, n: int, stream: int) -> None:
        if self._all_gather is None:
            self._round(*gather_transfers(self.rank, self.size, buf, n), stream)
        else:
            ptr = buf.data.ptr
            self._all_gather(ptr + self.rank * n, ptr, n, stream)

    def wait(self, handle) -> None:
        import cupy

        cupy.cuda.get_current_stream().wait_event(handle)

    def _round(self, sends, recvs, stream: int) -> None:
        if not sends and not recvs:
            return
        send, recv = self._send, self._recv
        self._group_start()
        try:
            for peer, buf in recvs:
                recv(buf.data.ptr, buf.nbytes, peer, stream)
            for peer, buf in sends:
                send(buf.data.ptr, buf.nbytes, peer, stream)
        except BaseException:
            try:
                self._group_end()
            except Exception:  # the first error is the one to report
                pass
            raise
        self._group_end()
