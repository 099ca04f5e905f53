"""The GPU engine's transport: one NCCL group of ncclRecv/ncclSend per round."""
from __future__ import annotations


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

    def __init__(self, nccl_comm, rank: int, size: int, stream_ptr_fn):
        self.comm = nccl_comm
        self.rank = rank
        self.size = size
        self._stream_ptr_fn = stream_ptr_fn
        self._send, self._recv = nccl_comm.send, nccl_comm.recv
        self._group_start, self._group_end = nccl_comm.group_start, nccl_comm.group_end

    def exchange(self, sends, recvs) -> None:
        if not sends and not recvs:
            return
        stream = self._stream_ptr_fn()
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
