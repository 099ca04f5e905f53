"""The all-reduce variants the accuracy studies compare, behind one interface.

A reducer is called collectively on every rank with this rank's float32
partial sum and returns the float32 (or, for `Exact`, float64) total, the
same on every rank. ``reset()`` starts a new forward pass (zeroes feedback).

* `Exact`: float64 sum over MPI, the reference.
* `Bf16`: what NCCL does with bfloat16 tensors: each rank's term rounded to
  bf16, summed, the sum rounded to bf16.
* `Echo`: echonccl's 4-bit all-reduce (``two_shot`` or ``ring``), with one
  `Feedback` shared by every call until ``reset()``, or ``feedback=False``
  (plain 4-bit). ``dtype`` is the dtype handed to echonccl: ``bfloat16``
  (partial sums cast to bf16 first, as a bf16 deployment would) or ``float32``.
  ``rounds`` and ``flush``: more 4-bit rounds per call, or one more on the last
  call of a forward pass.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from echonccl.feedback import DEFAULT_RESIDUAL

BF16 = np.dtype(ml_dtypes.bfloat16)


class Exact:
    name = "exact"

    def __init__(self, mpi_comm):
        self.comm = mpi_comm

    def __call__(self, x: np.ndarray) -> np.ndarray:
        out = np.empty(x.shape, np.float64)
        self.comm.Allreduce(np.ascontiguousarray(x, np.float64), out)
        return out

    def reset(self) -> None:
        pass


class Bf16:
    name = "bf16"

    def __init__(self, mpi_comm):
        self.comm = mpi_comm

    def __call__(self, x: np.ndarray) -> np.ndarray:
        mine = np.ascontiguousarray(x).astype(BF16).astype(np.float32)
        out = np.empty_like(mine)
        self.comm.Allreduce(mine, out)
        return out.astype(BF16).astype(np.float32)

    def reset(self) -> None:
        pass


class Echo:
    """echonccl through ``comm`` (an `echonccl.Communicator`; its group size is the one used).

    ``rounds``: 4-bit rounds per call (`Communicator.all_reduce`). ``flush`` (with
    ``calls_per_pass``): the last call of a forward pass gets one round more, which
    sends what the whole pass still owes the stream (every call's leftover residuals).
    """

    def __init__(self, comm, algorithm: str = "two_shot", feedback: bool = True, dtype: str = "bfloat16",
                 rounds: int = 1, flush: bool = False, calls_per_pass: int = 0, residual_dtype: str = DEFAULT_RESIDUAL):
        self.comm, self.algorithm, self.rounds = comm, algorithm, rounds
        self.flush, self.calls_per_pass, self.calls = flush, calls_per_pass, 0
        self.dtype = BF16 if dtype == "bfloat16" else np.dtype(dtype)
        self.feedback = comm.new_feedback(residual_dtype) if feedback else False
        kind = f"echonccl {algorithm}" if feedback else f"plain 4-bit {algorithm}"
        self.name = (f"{kind} {comm.config.codec}" + (f" x{rounds}" if rounds > 1 else "")
                     + (" + flush" if flush else ""))
        self.gpu = getattr(comm.engine, "name", "cpu") == "gpu"
        if self.gpu and self.dtype == BF16:
            raise ValueError("the accuracy tools feed the GPU engine float32 (cupy has no bfloat16): "
                             "pass --dtype float32")

    def __call__(self, x: np.ndarray) -> np.ndarray:
        self.calls += 1
        last = self.flush and self.calls == self.calls_per_pass
        kw = dict(feedback=self.feedback, algorithm=self.algorithm, rounds=self.rounds, flush=last)
        xin = np.ascontiguousarray(x).astype(self.dtype)
        if self.gpu:
            import cupy

            return cupy.asnumpy(self.comm.all_reduce(cupy.asarray(xin), **kw)).astype(np.float32)
        return self.comm.all_reduce(xin, **kw).astype(np.float32)

    def reset(self) -> None:
        self.calls = 0
        if self.feedback is not False:
            self.feedback.reset()


def communicators(codecs, engine: str = "cpu") -> dict:
    """One echonccl `Communicator` per codec (collective; over MPI.COMM_WORLD)."""
    from echonccl import Communicator

    comms = {}
    for cd in codecs:
        c = Communicator(engine=engine, codec=cd)
        if c.config.codec != cd:
            raise RuntimeError(f"asked for codec {cd}, got {c.config.codec}: unset ECHONCCL_CODEC")
        comms[cd] = c
    return comms
