"""The array API: one `Communicator` per process, all-reducing arrays in 4 bits with error feedback."""
from __future__ import annotations

import sys
from dataclasses import dataclass

from . import config as _config
from . import dtypes
from .errors import EchoncclError, MismatchError
from .feedback import Feedback
from .layout import Layout
from .schedules import SCHEDULES, run_rounds


@dataclass
class Workspace:
    """Wire buffers of one layout, owned by the communicator, reused by every call.

    ``peers_out``/``peers_in``: P-1 slices each; ``gather``: P slices.
    """

    peers_out: object
    peers_in: object
    gather: object


def _pick_engine(name: str, comm, cfg, device):
    if name in ("gpu", "auto"):
        try:
            from .engine_gpu import GpuEngine, gpu_available
        except ImportError as exc:
            if name == "gpu":
                raise EchoncclError(f"the GPU engine needs cupy: {exc}") from exc
        else:
            if name == "gpu" or gpu_available():
                return GpuEngine(comm, cfg.timeout, device=device)
    from .engine_cpu import CpuEngine

    return CpuEngine(comm, cfg.timeout)


class Communicator:
    """An all-reduce communicator over the ranks of an MPI communicator.

    Collective: every rank of ``comm`` (default ``MPI.COMM_WORLD``) constructs
    it together, and calls its collectives in the same order with the same
    sizes, dtypes and options. ``engine`` is ``"gpu"`` (CUDA kernels, NCCL),
    ``"cpu"`` (numpy kernels, MPI) or ``"auto"`` (GPU when cupy sees one).
    ``device`` picks the GPU (default: the node-local rank). ``codec``:
    ``"int4"`` or ``"int4-h32"`` (each group rotated by a 32-point Hadamard
    transform before quantizing: about 5x less perplexity loss on a real model
    at the same bytes; `codec`). Options may be
    overridden by ``ECHONCCL_*`` variables (`config`). Call `close` when done.
    """

    def __init__(self, comm=None, *, engine=None, algorithm=None, group_size=None,
                 crossover_bytes=None, timeout=None, rounds=None, device=None, codec=None):
        if comm is None:
            from mpi4py import MPI

            comm = MPI.COMM_WORLD
        self.config = _config.resolve(engine=engine, algorithm=algorithm, group_size=group_size,
                                      crossover_bytes=crossover_bytes, timeout=timeout, rounds=rounds,
                                      codec=codec)
        self._mpi = comm.Dup()   # our own context: a timed-out check cannot poison the caller's comm
        self.engine = _pick_engine(self.config.engine, self._mpi, self.config, device)
        self.rank = self.engine.transport.rank
        self.size = self.engine.transport.size
        self._layouts: dict[int, Layout] = {}
        self._workspaces: dict[Layout, Workspace] = {}
        self._defaults: dict[tuple, Feedback] = {}
        self._checked: set = set()
        self._closed = False
        if _config.debug_enabled() and self.rank == 0:
            print(f"echonccl INFO {_config.describe(self.config)} engine={self.engine.describe()} "
                  f"ranks={self.size}", file=sys.stderr)

    # -- collectives ---------------------------------------------------------------------------
    def all_reduce(self, x, out=None, *, feedback=None, algorithm=None, rounds=None, stream=None):
        """Sum ``x`` over all ranks into ``out`` and return ``out``.

        ``x``: a float16/bfloat16/float32 array of the engine (numpy for the
        CPU engine; cupy or any object with ``__cuda_array_interface__`` or
        ``__dlpack__`` on this communicator's GPU for the GPU engine),
        C-contiguous, any shape. ``out``: None (a new array), ``x`` itself
        (in place), or an array of the same shape and dtype not overlapping
        ``x``. ``feedback``: a `Feedback` shared by the calls whose outputs add
        into one residual stream; None (default), the communicator's default state
        for this (count, dtype); False, no feedback. ``algorithm``:
        ``two_shot``, ``ring``, ``nccl`` (the plain baseline) or ``auto``.
        ``rounds`` (default: the communicator's, 1): 4-bit rounds; each round
        after the first sends the residuals the previous one left, through the
        feedback state, and adds their sum to ``out`` (`schedules.rounds`): r
        times the traffic, about 10x less error per extra round. Needs feedback.
        ``stream``: the CUDA stream to run on (default: the current cupy
        stream); the call returns without synchronizing the host.

        Every rank gets a bitwise-identical result. NaN and Inf reach the
        output of their group of ``group_size`` elements as NaN (`codec`).

        Errors: bad arguments raise `TypeError`/`ValueError` (a `Feedback` bound
        to another call: `EchoncclError`) before any communication. The first call
        of each signature (count, shape, dtype, algorithm, group size, feedback
        off, rounds) is checked across ranks: ranks that disagree all raise the same
        `MismatchError`. A peer that does not answer raises `PeerTimeoutError`
        after the timeout (GPU: in `synchronize`).
        """
        self._check_open()
        eng = self.engine
        with eng.stream_scope(stream):      # a new `out` is allocated in the caller's stream order too
            xa = eng.as_array(x)
            name = dtypes.canonical(xa.dtype)
            oa = self._output(x, xa, out)
            xf, of = eng.flat(xa), eng.flat(oa)
            algo = self._algorithm(algorithm, xa)
            self._check_feedback(feedback, xa.size, name)
            rounds = self._rounds(rounds, feedback, algo)
            # Every argument error above is local and raised before any communication.
            self._check_consistent(("all_reduce", xa.size, name, algo, self.config.group_size,
                                    feedback is False, tuple(xa.shape), rounds, self.config.codec))
            if xa.size == 0:
                pass
            elif self.size == 1:
                if oa is not xa:
                    eng.copy(of, xf)
            elif algo == "nccl":
                eng.baseline_all_reduce(xf, of)
            else:
                layout = self._layout(xa.size)
                state = self._feedback(feedback, layout, name)
                run_rounds(SCHEDULES[algo], eng.kernels, eng.transport, layout, xf, of, state,
                           self._workspace(layout), rounds)
        return out if out is not None else oa

    def baseline_all_reduce(self, x, out=None, *, stream=None):
        """The plain sum (NCCL's ncclAllReduce on GPU, MPI on CPU), for baselines and small sizes."""
        return self.all_reduce(x, out, feedback=False, algorithm="nccl", stream=stream)

    def synchronize(self, timeout: float | None = None) -> None:
        """Wait until this rank's queued collectives have finished (GPU: the current stream).
        A peer that stops answering raises `PeerTimeoutError` after ``timeout`` seconds
        (default: the communicator's) instead of hanging; the NCCL communicator is then aborted."""
        self.engine.synchronize(timeout)

    # -- feedback --------------------------------------------------------------------------------
    def new_feedback(self, residual_dtype: str = "float32") -> Feedback:
        """A fresh, unbound `Feedback`; bound (and allocated) by its first call."""
        return Feedback(residual_dtype)

    def load_feedback(self, state: dict) -> Feedback:
        """A `Feedback` restored from `Feedback.state_dict` onto this communicator's engine.
        A state of another codec than this communicator's raises `EchoncclError`."""
        saved = state.get("codec", "int4")
        saved = saved.item() if hasattr(saved, "item") else saved
        if saved != self.config.codec:
            raise EchoncclError(f"feedback state was saved by codec {saved!r}, this communicator uses "
                                f"{self.config.codec!r}: residuals of one codec mean nothing to the other")
        fb = Feedback(state["residual_dtype"], state["enabled"])
        fb.load_state_dict(state, zeros=self.engine.zeros)
        return fb

    def default_feedback(self, count: int, dtype) -> Feedback:
        """The state used when a call passes no ``feedback`` (one per count and dtype)."""
        key = (int(count), dtypes.canonical(dtype))
        return self._defaults.setdefault(key, Feedback())

    # -- lifecycle ------------------------------------------------------------------------------
    def close(self) -> None:
        """Release buffers, the engine's resources (NCCL communicator) and the duplicated MPI
        communicator. Every rank should close, after destroying any CUDA graph that captured
        one of its calls (NCCL waits for those graphs to go). Idempotent."""
        if not self._closed:
            self._closed = True
            self._layouts.clear()
            self._workspaces.clear()
            self._defaults.clear()
            self.engine.close()
            self._mpi.Free()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- internals ------------------------------------------------------------------------------
    def _check_open(self):
        if self._closed:
            raise EchoncclError("communicator is closed")

    def _output(self, x_obj, xa, out):
        eng = self.engine
        if out is None:
            return eng.empty_like(xa)
        if out is x_obj:
            return xa
        oa = eng.as_array(out)
        if oa.shape != xa.shape or oa.dtype != xa.dtype:
            raise ValueError(f"out has shape {oa.shape} and dtype {oa.dtype}, "
                             f"x has {xa.shape} and {xa.dtype}: they must match")
        if eng.overlaps(oa, xa):
            if eng.same_memory(oa, xa):
                return xa
            raise ValueError("out overlaps x partly: pass out=x for in place, or separate memory")
        return oa

    def _algorithm(self, algorithm, xa) -> str:
        algo = algorithm or self.config.algorithm
        if algo not in _config.ALGORITHMS:
            raise ValueError(f"algorithm must be one of {_config.ALGORITHMS}, got {algo!r}")
        if algo != "auto":
            return algo
        cross = self.config.crossover_bytes
        if cross is None:
            cross = self.engine.crossover_bytes(self.size)
        return "nccl" if xa.nbytes < cross else self.engine.preferred_schedule(self.size)

    def _check_consistent(self, key) -> None:
        """Once per distinct call signature: all ranks must agree on it (one small allgather)."""
        if key in self._checked or self.size == 1:
            return
        keys = self.engine.allgather_object(key)
        if any(k != keys[0] for k in keys):
            detail = "; ".join(f"rank {r}: count={k[1]} shape={k[6]} dtype={k[2]} algorithm={k[3]} "
                               f"group={k[4]} rounds={k[7]} codec={k[8]}{' no feedback' if k[5] else ''}"
                               for r, k in enumerate(keys))
            raise MismatchError(f"ranks called all_reduce with different arguments: {detail}")
        self._checked.add(key)

    def _check_feedback(self, feedback, count: int, name: str) -> None:
        """Reject, before any communication, a ``feedback`` that is not a state or is bound elsewhere."""
        if feedback is None or feedback is False:
            return
        if not isinstance(feedback, Feedback):
            raise TypeError(f"feedback must be a Feedback, False or None, not {type(feedback).__name__}")
        if feedback.enabled:
            feedback.check_key((count, self.size, self.config.group_size, name), self.config.codec)

    def _rounds(self, rounds, feedback, algo: str) -> int:
        """The call's round count: 1 for the exact baseline and, unless asked for explicitly
        (then `ValueError`), for calls without feedback; else ``rounds`` or the config's."""
        no_feedback = feedback is False or (feedback is not None and not feedback.enabled)
        if rounds is None:
            return 1 if no_feedback or algo == "nccl" else self.config.rounds
        _config.check_rounds(rounds)
        if rounds > 1 and no_feedback:
            raise ValueError(f"rounds={rounds} sends the feedback residuals: it needs feedback, "
                             "and this call has none")
        return 1 if algo == "nccl" else rounds

    def _feedback(self, feedback, layout, name):
        """The residuals of this call (``feedback`` already passed `_check_feedback`)."""
        if feedback is False:
            return None
        fb = self.default_feedback(layout.count, name) if feedback is None else feedback
        key = (layout.count, layout.nranks, layout.group, name)
        return fb.bind(key, layout, dtypes.numpy_dtype(name), self.engine.zeros, self.config.codec)

    def _layout(self, count: int) -> Layout:
        layout = self._layouts.get(count)
        if layout is None:
            layout = self._layouts[count] = Layout(count, self.size, self.config.group_size,
                                                         codec=self.config.codec)
        return layout

    def _workspace(self, layout: Layout) -> Workspace:
        ws = self._workspaces.get(layout)
        if ws is None:
            P, B = layout.nranks, layout.slice_bytes
            e = self.engine
            ws = Workspace(e.empty_bytes((P - 1) * B), e.empty_bytes((P - 1) * B), e.empty_bytes(P * B))
            self._workspaces[layout] = ws
        return ws
