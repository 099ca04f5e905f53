"""The transport interface every engine implements (mpi4py: `transport_mpi`, NCCL: `transport_nccl`).

``exchange(sends, recvs)``
    One grouped round of point-to-point transfers: ``sends`` and ``recvs`` are
    sequences of ``(peer_rank, buffer)`` with ``buffer`` a contiguous 1-D uint8
    array of the engine (numpy or device memory). All transfers of the round
    may proceed concurrently, so a call never deadlocks on ordering. When the
    call returns, in the engine's stream order, every recv buffer holds its
    data and every send buffer may be reused. Messages between one pair of
    ranks are matched in call order, so every rank must issue the same rounds.

``start(sends, recvs)`` / ``wait(handle)``
    The same round split in two, so that a schedule can work while it is in
    flight: ``start`` posts the round (GPU: on a communication stream that
    first waits for the work already queued on the current stream) and
    returns a handle; ``wait`` makes what follows (GPU: the current stream)
    wait for it. The buffers belong to the round until then. ``exchange`` is
    ``wait(start(...))``.

``all_gather(buf, n)``
    ``buf`` is a contiguous uint8 buffer of ``size * n`` bytes whose part
    ``[rank * n, (rank + 1) * n)`` this rank filled; afterwards (in the engine's
    stream order) every part holds its rank's bytes. A collective: every rank
    calls it with the same ``n`` in the same place of its rounds. The NCCL
    transport runs ``ncclAllGather`` (NCCL's ring, all its channels); an engine
    without one does `gather_transfers` as one round. ``start_all_gather`` /
    `wait` split it in two, as ``start`` does a round.

``rank`` and ``size`` identify this process in the group.
"""
from __future__ import annotations

from typing import Protocol, Sequence, Tuple, Any

Transfer = Tuple[int, Any]


class Transport(Protocol):
    rank: int
    size: int

    def exchange(self, sends: Sequence[Transfer], recvs: Sequence[Transfer]) -> None: ...

    def start(self, sends: Sequence[Transfer], recvs: Sequence[Transfer]) -> Any: ...

    def wait(self, handle: Any) -> None: ...

    def all_gather(self, buf: Any, n: int) -> None: ...

    def start_all_gather(self, buf: Any, n: int) -> Any: ...


def gather_transfers(rank: int, size: int, buf, n: int) -> tuple[list, list]:
    """`Transport.all_gather` of ``buf`` as one round of point-to-point transfers: this rank's
    part to every peer, each peer's part from it; ``(sends, recvs)`` for `Transport.exchange`."""
    own = buf[rank * n:(rank + 1) * n]
    peers = [s for s in range(size) if s != rank]
    return [(s, own) for s in peers], [(s, buf[s * n:(s + 1) * n]) for s in peers]
