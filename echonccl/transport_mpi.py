"""The CPU engine's transport: grouped nonblocking MPI send/recv of byte buffers."""
from __future__ import annotations

import pickle
import time

import numpy as np

from .errors import PeerTimeoutError

_TAG = 0x4543  # 'EC'


class MpiTransport:
    """`transport.Transport` over an mpi4py communicator (host numpy buffers).

    ``timeout`` seconds bound every round: a peer that died or stopped
    answering raises `PeerTimeoutError` on this rank instead of a hang. The
    communicator is the caller's; this object only borrows it.
    """

    def __init__(self, comm, timeout: float = 300.0):
        from mpi4py import MPI

        self._MPI = MPI
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.timeout = timeout

    def exchange(self, sends, recvs) -> None:
        MPI = self._MPI
        reqs = [self.comm.Irecv([buf, MPI.BYTE], source=peer, tag=_TAG) for peer, buf in recvs]
        reqs += [self.comm.Isend([buf, MPI.BYTE], dest=peer, tag=_TAG) for peer, buf in sends]
        wait_all(reqs, self.timeout, f"rank {self.rank}: exchange with ranks "
                 f"{sorted({p for p, _ in list(sends) + list(recvs)})}")


def wait_all(reqs, timeout: float, what: str) -> None:
    """Wait for mpi4py requests, polling, and raise `PeerTimeoutError` after ``timeout`` s."""
    from mpi4py import MPI

    if MPI.Request.Testall(reqs):
        return
    deadline = time.monotonic() + timeout
    spins = 0
    while not MPI.Request.Testall(reqs):
        if time.monotonic() > deadline:
            for r in reqs:
                try:
                    r.Cancel()
                except MPI.Exception:
                    pass
            raise PeerTimeoutError(f"{what} did not complete within {timeout:g} s (a peer died or hangs)")
        spins += 1
        if spins > 1000:
            time.sleep(1e-4)


def allgather_object(comm, obj, timeout: float) -> list:
    """Every rank's ``obj`` (small, picklable), through nonblocking MPI bounded by ``timeout``."""
    from mpi4py import MPI

    buf = np.frombuffer(pickle.dumps(obj), dtype=np.uint8)
    sizes = np.zeros(comm.Get_size(), dtype=np.int64)
    wait_all([comm.Iallgather(np.array([buf.size], dtype=np.int64), sizes)], timeout, "metadata check")
    displs = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    recv = np.empty(int(sizes.sum()), dtype=np.uint8)
    wait_all([comm.Iallgatherv(buf, [recv, sizes, displs, MPI.BYTE])], timeout, "metadata check")
    return [pickle.loads(recv[d:d + n].tobytes()) for d, n in zip(displs, sizes)]
