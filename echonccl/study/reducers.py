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
  ``bf16_tail = k`` (with ``calls_per_pass``): the last k calls of a forward
  pass go through the baseline all-reduce in bf16 instead, the first of them
  carrying every rank's pending feedback residual (`pending_residual`), so the
  stream ends with no 4-bit error left over (a "flush").
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

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
    """echonccl through ``comm`` (an `echonccl.Communicator`; its group size is the one used)."""

    def __init__(self, comm, algorithm: str = "two_shot", feedback: bool = True, dtype: str = "bfloat16",
                 bf16_tail: int = 0, calls_per_pass: int = 0):
        self.comm, self.algorithm = comm, algorithm
        self.bf16_tail, self.calls_per_pass, self.calls = bf16_tail, calls_per_pass, 0
        self.dtype = BF16 if dtype == "bfloat16" else np.dtype(dtype)
        self.feedback = comm.new_feedback() if feedback else False
        kind = f"echonccl {algorithm}" if feedback else f"plain 4-bit {algorithm}"
        self.name = f"{kind} G={comm.config.group_size}" + (f" + bf16 last {bf16_tail}" if bf16_tail else "")
        self.gpu = getattr(comm.engine, "name", "cpu") == "gpu"
        if self.gpu and self.dtype == BF16:
            raise ValueError("the accuracy tools feed the GPU engine float32 (cupy has no bfloat16): "
                             "pass --dtype float32")

    def __call__(self, x: np.ndarray) -> np.ndarray:
        self.calls += 1
        if self.bf16_tail and self.calls > self.calls_per_pass - self.bf16_tail:
            return self._baseline(x)
        xin = np.ascontiguousarray(x).astype(self.dtype)
        if self.gpu:
            import cupy

            out = self.comm.all_reduce(cupy.asarray(xin), feedback=self.feedback, algorithm=self.algorithm)
            return cupy.asnumpy(out).astype(np.float32)  # waits for the current stream
        out = self.comm.all_reduce(xin, feedback=self.feedback, algorithm=self.algorithm)
        return out.astype(np.float32)

    def _baseline(self, x: np.ndarray) -> np.ndarray:
        """bf16 baseline all-reduce of ``x`` plus this rank's pending residual (then zeroed)."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        if self.feedback is not False and self.feedback.residuals is not None:
            x = x + pending_residual(self.feedback, x.size, self.comm).reshape(x.shape)
            self.feedback.reset()
        xin = x.astype(BF16 if not self.gpu else np.float32)
        if self.gpu:
            import cupy

            return cupy.asnumpy(self.comm.baseline_all_reduce(cupy.asarray(xin))).astype(np.float32)
        return self.comm.baseline_all_reduce(xin).astype(np.float32)

    def reset(self) -> None:
        self.calls = 0
        if self.feedback is not False:
            self.feedback.reset()


def pending_residual(fb, count: int, comm) -> np.ndarray:
    """This rank's share of the error the calls sharing ``fb`` still owe the stream (float32, ``count``).

    Its input residuals (padded layout: element i of the tensor at index i) plus
    its output residual at its own slice. Summed over ranks, this is exactly the
    exact stream minus the stream built so far from the calls' outputs.
    """
    from echonccl.layout import Layout

    def host(a):
        return a.get() if hasattr(a, "get") else a

    lay = Layout(count, comm.size, comm.config.group_size)
    pend = host(fb.residuals.inputs)[:count].astype(np.float32)
    lo, hi = lay.bounds(comm.rank)
    pend[lo:hi] += host(fb.residuals.output)[:hi - lo].astype(np.float32)
    return pend


def communicators(group_sizes, engine: str = "cpu") -> dict:
    """One echonccl `Communicator` per group size (collective; over MPI.COMM_WORLD)."""
    from echonccl import Communicator

    comms = {}
    for g in group_sizes:
        c = Communicator(engine=engine, group_size=g)
        if c.config.group_size != g:
            raise RuntimeError(f"asked for group size {g}, got {c.config.group_size}: unset ECHONCCL_GROUP_SIZE")
        comms[g] = c
    return comms
