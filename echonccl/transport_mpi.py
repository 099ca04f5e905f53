"""The CPU engine's transport: grouped nonblocking MPI send/recv of byte buffers."""
from __future__ import annotations

import os
import pickle
import time

import numpy as np

from .errors import MismatchError, PeerTimeoutError
from .transport import gather_transfers

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
        """One round, completed before it returns (see `start`, `wait`)."""
        self.wait(self.start(sends, recvs))

    def all_gather(self, buf, n: int) -> None:
        """`transport.Transport.all_gather` as one point-to-point round (so that it keeps the
        round's timeout and its check of message sizes)."""
        self.exchange(*gather_transfers(self.rank, self.size, buf, n))

    def start_all_gather(self, buf, n: int):
        """`all_gather` posted as `start` posts a round."""
        return self.start(*gather_transfers(self.rank, self.size, buf, n))

    def start(self, sends, recvs):
        """Post one round of nonblocking sends and receives; returns the handle `wait` takes.
        The buffers belong to the round until `wait` returns."""
        MPI = self._MPI
        reqs = [self.comm.Irecv([buf, MPI.BYTE], source=peer, tag=_TAG) for peer, buf in recvs]
        reqs += [self.comm.Isend([buf, MPI.BYTE], dest=peer, tag=_TAG) for peer, buf in sends]
        return reqs, list(sends), list(recvs)

    def wait(self, handle) -> None:
        """Complete a round; a message whose size differs from its receive buffer (ranks out of
        step: different collectives whose signatures each had already checked) raises
        `MismatchError`, a silent peer `PeerTimeoutError`."""
        MPI = self._MPI
        reqs, sends, recvs = handle
        statuses = [MPI.Status() for _ in reqs]
        what = f"rank {self.rank}: exchange with ranks {sorted({p for p, _ in sends + recvs})}"
        try:
            wait_all(reqs, self.timeout, what, statuses, peers=[p for p, _ in recvs] + [p for p, _ in sends])
        except MPI.Exception as exc:
            errs = {st.Get_error() for st in statuses} - {MPI.SUCCESS, MPI.ERR_PENDING}
            text = "; ".join(MPI.Get_error_string(e).strip() for e in sorted(errs)) or exc.Get_error_string()
            raise MismatchError(f"{what}: a message did not fit its buffer ({text}): {_OUT_OF_STEP}") from exc
        for (peer, buf), st in zip(recvs, statuses):
            got = st.Get_count(MPI.BYTE)
            if got != buf.nbytes:
                raise MismatchError(f"rank {self.rank}: rank {peer} sent {got} bytes where {buf.nbytes} "
                                    f"were expected: {_OUT_OF_STEP}")


_OUT_OF_STEP = ("the ranks are running different collectives (calls out of step, or sizes that "
                "differ in a call signature already checked); this communicator cannot be used further")


# wait_all polls yielding the core (ranks may share cores, and a rank that spins without yielding
# holds up the peer it waits for), then, after a long wait, sleeps 0.1 ms a poll.
_SPINS_BEFORE_SLEEP = 20000


def wait_all(reqs, timeout: float, what: str, statuses=None, peers=None) -> None:
    """Wait for mpi4py requests, polling, and raise `PeerTimeoutError` after ``timeout`` s.
    ``statuses``: optional list of `MPI.Status`, filled as in ``MPI.Request.Testall``;
    ``peers``: the rank of each request, to name the silent ones in the error."""
    from mpi4py import MPI

    if MPI.Request.Testall(reqs, statuses):
        return
    deadline = time.monotonic() + timeout
    spins = 0
    while not MPI.Request.Testall(reqs, statuses):
        if time.monotonic() > deadline:
            silent = set()
            for i, r in enumerate(reqs):
                try:
                    if peers is not None and not r.Test():
                        silent.add(peers[i])
                    r.Cancel()
                except MPI.Exception:
                    pass
            who = f"; no answer from ranks {sorted(silent)}" if silent else ""
            raise PeerTimeoutError(f"{what} did not complete within {timeout:g} s (a peer died or hangs){who}")
        spins += 1
        if spins > _SPINS_BEFORE_SLEEP:
            time.sleep(1e-4)
        else:
            os.sched_yield()


def allgather_object(comm, obj, timeout: float) -> list:
    """Every rank's ``obj`` (small, picklable), through nonblocking MPI bounded by ``timeout``."""
    from mpi4py import MPI

    buf = np.frombuffer(pickle.dumps(obj), dtype=np.uint8)
    sizes = np.zeros(comm.Get_size(), dtype=np.int64)
    what = f"rank {comm.Get_rank()}: metadata check (allgather of the call signature)"
    wait_all([comm.Iallgather(np.array([buf.size], dtype=np.int64), sizes)], timeout, what)
    displs = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    recv = np.empty(int(sizes.sum()), dtype=np.uint8)
    wait_all([comm.Iallgatherv(buf, [recv, sizes, displs, MPI.BYTE])], timeout, what)
    return [pickle.loads(recv[d:d + n].tobytes()) for d, n in zip(displs, sizes)]


def allgather_digest(comm, digest: int, timeout: float, bufs=None) -> np.ndarray:
    """Every rank's 64-bit ``digest``, bounded by ``timeout``: point-to-point messages (tag
    `_DIGEST_TAG`) rather than a collective, so that a timeout names the silent ranks and
    cancels what it posted. ``bufs``: reusable (send [1], receive [size]) int64 arrays."""
    from mpi4py import MPI

    rank, size = comm.Get_rank(), comm.Get_size()
    send, recv = bufs if bufs is not None else (np.zeros(1, np.int64), np.zeros(size, np.int64))
    send[0] = recv[rank] = digest
    peers = [p for p in range(size) if p != rank]
    reqs = [comm.Irecv([recv[p:p + 1], MPI.INT64_T], source=p, tag=_DIGEST_TAG) for p in peers]
    reqs += [comm.Isend([send, MPI.INT64_T], dest=p, tag=_DIGEST_TAG) for p in peers]
    wait_all(reqs, timeout, f"rank {rank}: metadata check (exchange of the call signature)", peers=peers + peers)
    return recv


_DIGEST_TAG = _TAG + 1


def node_rank_and_size(comm) -> tuple[int, int]:
    """This rank's place among the ranks of ``comm`` that share its node, and their number."""
    from mpi4py import MPI

    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return node.Get_rank(), node.Get_size()
    finally:
        node.Free()
