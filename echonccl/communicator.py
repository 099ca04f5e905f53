"""The array API: one `Communicator` per process, all-reducing arrays in 4 bits with error feedback."""
from __future__ import annotations

import hashlib
import sys
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import NamedTuple

from . import codec as wire
from . import config as _config
from . import dtypes
from .cache import BufferCache
from .engine import Engine
from .errors import CommunicatorFailedError, EchoncclError, MismatchError
from .feedback import DEFAULT_RESIDUAL, Feedback
from .layout import Layout
from .schedules import SCHEDULES, gather_slots, run_rounds


@dataclass
class Workspace:
    """Wire buffers of one layout, owned by the communicator, reused by every call.

    ``peers_out``/``peers_in``: P-1 slices of contributions each; ``gather``: the schedule's
    `schedules.gather_slots` (P slices of sums; `one_shot_q`'s: P * P contributions, and no peer
    slots).
    """

    peers_out: object
    peers_in: object
    gather: object


class CallSignature(NamedTuple):
    """What every rank must agree on for one all-reduce (`Communicator._check_consistent`)."""

    n: int                    # elements
    shape: tuple
    dtype: str
    algorithm: str
    no_feedback: bool
    rounds: int
    codec: str

    def describe(self) -> str:
        return (f"count={self.n} shape={self.shape} dtype={self.dtype} algorithm={self.algorithm} "
                f"rounds={self.rounds} codec={self.codec}"
                f"{' no feedback' if self.no_feedback else ''}")


class _WireBuffers:
    """The buffers behind the workspaces of every layout whose slices fit (`_size_class`):
    P - 1 peer slots of ``peer_bytes`` each way (none when the gather is not P slots) and
    ``gather_slots`` of ``gather_bytes``, and the exact-size views handed to each layout."""

    __slots__ = ("peers_out", "peers_in", "gather", "peers", "gather_slots", "views")

    def __init__(self, engine, nranks: int, peer_bytes: int, gather_slots: int, gather_bytes: int):
        self.peers, self.gather_slots = self._peers(nranks, gather_slots), gather_slots
        self.peers_out = engine.empty_bytes(self.peers * peer_bytes)
        self.peers_in = engine.empty_bytes(self.peers * peer_bytes)
        self.gather = engine.empty_bytes(gather_slots * gather_bytes)
        self.views: dict = {}

    @staticmethod
    def _peers(nranks: int, gather_slots: int) -> int:
        return nranks - 1 if gather_slots == nranks else 0

    @classmethod
    def nbytes(cls, nranks: int, peer_bytes: int, gather_slots: int, gather_bytes: int) -> int:
        return 2 * cls._peers(nranks, gather_slots) * peer_bytes + gather_slots * gather_bytes

    def workspace(self, layout: Layout, gather_bytes: int) -> Workspace:
        """Views of exactly the bytes ``layout`` uses, gather slots of ``gather_bytes`` (schedules
        address slots from offset 0, so a layout with smaller slices fits)."""
        ws = self.views.get(layout)
        if ws is None:
            if len(self.views) >= 64:
                self.views.clear()
            B = layout.slice_bytes
            ws = self.views[layout] = Workspace(self.peers_out[:self.peers * B], self.peers_in[:self.peers * B],
                                                self.gather[:self.gather_slots * gather_bytes])
        return ws


def _size_class(nbytes: int) -> int:
    """``nbytes`` rounded up to 4, 5, 6 or 7 times a power of two (at least 4 KiB): at most
    25% more, so that nearby sizes share one workspace."""
    if nbytes <= 4096:
        return 4096
    step = 1 << (nbytes.bit_length() - 3)
    return -(-nbytes // step) * step


_MAX_SIGNATURES = 4096      # signatures remembered as checked, layouts kept (small objects)
_MAX_PREPARED = 1024        # prepared calls kept (no caller arrays; only what the cache or a live Feedback holds)


def _nothing(_stream, _x, _out) -> None:
    pass


class _Prepared:
    """A checked call's work with its buffers resolved: ``run(stream, x, out)`` (x and out: the
    caller's arrays of this call; nothing here holds them), replayed by later calls with the same
    buffers and options while `ready`: the cache entries it uses are still cached, an explicit
    `Feedback` (held weakly: the caller owns it) is alive and holds the same residuals and options,
    and ``valid()`` (the engine's, e.g. the peer region still current) holds. `Communicator`
    drops one that is not ready, and with it what ``run`` holds (a later call of its buffers
    prepares them again)."""

    __slots__ = ("sig", "run", "valid", "entries", "feedback", "residuals", "enabled", "rounding")

    def __init__(self, sig, run, valid=None, entries=(), feedback=None, on_feedback_gone=None):
        self.sig, self.run, self.valid, self.entries = sig, run, valid, entries
        self.feedback = None if feedback is None else weakref.ref(feedback, on_feedback_gone)
        self.residuals = None if feedback is None else feedback.residuals
        self.enabled = None if feedback is None else feedback.enabled
        self.rounding = None if feedback is None else feedback.rounding

    def ready(self) -> bool:
        for e in self.entries:
            if not e.live:
                return False
        if self.feedback is not None:
            fb = self.feedback()
            if fb is None or (fb.residuals is not self.residuals or fb.enabled is not self.enabled
                              or fb.rounding is not self.rounding):
                return False
        return self.valid is None or bool(self.valid())


def _feedback_key(feedback):
    """``feedback`` as part of a prepared call's key: a `Feedback` by a weak reference (equal
    while it lives; a key never keeps the caller's state and its residuals alive)."""
    return weakref.ref(feedback) if isinstance(feedback, Feedback) else feedback


def _pick_engine(name: str, comm, cfg, device) -> Engine:
    if name in ("gpu", "auto"):
        try:
            from .engine_gpu import GpuEngine, gpu_available
        except ImportError as exc:
            if name == "gpu":
                raise EchoncclError(f"the GPU engine needs cupy: {exc}") from exc
        else:
            if name == "gpu" or gpu_available():
                return GpuEngine(comm, cfg.timeout, device=device, use_fused=cfg.fused)
    from .engine_cpu import CpuEngine

    return CpuEngine(comm, cfg.timeout)


class Communicator:
    """An all-reduce communicator over the ranks of an MPI communicator.

    Collective: every rank of ``comm`` (default ``MPI.COMM_WORLD``) constructs
    it together, and calls its collectives in the same order with the same
    sizes, dtypes and options. ``engine`` is ``"gpu"`` (CUDA kernels, NCCL),
    ``"cpu"`` (numpy kernels, MPI) or ``"auto"`` (GPU when cupy sees one).
    ``device`` picks the GPU (default: the node-local rank) and becomes the current
    device of the calling thread: create the communicator before the arrays it reduces.
    ``cache_bytes`` bounds the workspaces and default feedback states kept for sizes not
    in use (README "Memory"). ``codec`` (`codec`, README "Codecs"): ``"int4-h32/int7-h32"``
    (default: 4-bit contributions, each 32-element block rotated by a signed Hadamard transform,
    and 8-bit sums), ``"int4-h32"`` (4-bit both ways: the fewest bytes), ``"int4"`` (unrotated),
    or ``"int7-h32"`` (8-bit both ways: 7-bit codes and a bfloat16 scale per 16, rotated). ``feedback_rounding``:
    the ``rounding`` of the feedback states this communicator makes (`Feedback`; default False).
    ``fused``: False keeps the GPU engine off peer-memory kernels (every schedule over NCCL).
    Each option's ``ECHONCCL_*`` variable, when set, overrides it (`config`, `settings`).
    Call `close` when done.
    """

    def __init__(self, comm=None, *, engine=None, algorithm=None,
                 crossover_bytes=None, timeout=None, rounds=None, device=None, cache_bytes=None,
                 codec=None, feedback_rounding=None, fused=None):
        if comm is None:
            from mpi4py import MPI

            comm = MPI.COMM_WORLD
        self.config = _config.resolve(engine=engine, algorithm=algorithm,
                                      crossover_bytes=crossover_bytes, timeout=timeout, rounds=rounds,
                                      cache_bytes=cache_bytes, codec=codec,
                                      feedback_rounding=feedback_rounding, fused=fused)
        self._mpi = comm.Dup()   # our own context: a timed-out check cannot poison the caller's comm
        self.engine: Engine = _pick_engine(self.config.engine, self._mpi, self.config, device)
        self.rank = self.engine.transport.rank
        self.size = self.engine.transport.size
        self.device = getattr(self.engine, "device_id", None)     # the GPU's index; None on CPU
        self._layouts: OrderedDict = OrderedDict()
        # workspaces ("ws", slice-bytes class, gather slices or None), default feedback states
        # ("fb", count, dtype)
        self._cache = BufferCache(self.config.cache_bytes, self.engine.retire)
        self._checked: OrderedDict = OrderedDict()
        self._prepared: OrderedDict = OrderedDict()     # call key -> _Prepared (`all_reduce`)
        self._swept = (0, 0)            # (cache evictions, Feedback states gone) at the last sweep
        self._feedback_gone = 0         # counted by prepared calls' weak references to their Feedback
        self._closed = False
        self._failure: str | None = None
        if _config.debug_enabled() and self.rank == 0:
            print(f"echonccl INFO {_config.describe(self.config)} engine={self.engine.describe()} "
                  f"ranks={self.size}", file=sys.stderr)

    @property
    def group_size(self) -> int:
        """Elements per scale of this communicator's codec (32; ``int7-h32``: 16): the unit that
        NaN/Inf poison and the error bound speaks of."""
        return wire.group_size(self.config.codec)

    # -- collectives ---------------------------------------------------------------------------
    def all_reduce(self, x, out=None, *, feedback=None, algorithm=None, rounds=None, flush=False, stream=None):
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
        ``flush``: this is the last all-reduce of a forward pass: one round more than
        ``rounds``, which sends what the whole pass still owes the stream (every earlier call's
        residual, through the shared `Feedback`), so the pass's output carries the last round's
        error instead of one call's; 1/L more traffic over L calls a pass. Needs feedback; no
        effect on the 16-bit algorithms (``nccl``, ``one_shot``).
        ``stream``: the CUDA stream to run on (default: the current cupy
        stream); the call returns without synchronizing the host.

        Every rank gets a bitwise-identical result. NaN and Inf reach the
        output of their group of ``group_size`` elements as NaN (`codec`).

        Errors: bad arguments (a read-only ``out`` included) raise `TypeError`/`ValueError`
        (a `Feedback` bound to another call: `EchoncclError`) before any communication.
        The call's signature (count, shape, dtype, algorithm, codec, feedback off,
        rounds) is checked across ranks, every call on the CPU engine, the first call of
        each signature on the GPU engine: ranks that disagree all raise the same
        `MismatchError`. A peer that does not answer raises `PeerTimeoutError` after the
        timeout (GPU: in `synchronize`); after that, or any other failure once the call
        has started communicating, every later call raises `CommunicatorFailedError`.
        """
        self._check_open()
        eng = self.engine
        key = None if out is None else eng.call_key(x, out)
        if key is not None:
            try:
                key = (key, _feedback_key(feedback), algorithm, rounds, flush)
                prep = self._prepared.get(key)
            except TypeError:               # an unhashable argument: the full path says what is wrong
                prep = key = None
            if prep is not None and prep.ready():
                s = eng.call_stream(stream)
                if s is not None:
                    self._replay(prep, s, x, out)
                    return out
        with eng.call_scope(stream):        # GPU: this communicator's device, and `stream`
            xa = eng.as_array(x)
            name = dtypes.canonical(xa.dtype)
            oa = self._output(x, xa, out)
            xf, of = eng.flat(xa), eng.flat(oa)
            algo = self.choose_algorithm(xa.nbytes, algorithm)
            self._check_feedback(feedback, xa.size, name)
            rounds = self._rounds(rounds, feedback, algo, flush)
            # Every argument error above is local and raised before any communication. From
            # here on, a failure may leave the ranks out of step: it marks the communicator failed.
            sig = CallSignature(n=xa.size, shape=tuple(xa.shape), dtype=name, algorithm=algo,
                                no_feedback=feedback is False, rounds=rounds,
                                codec=self.config.codec)
            self._check_consistent(sig)
            try:
                prep = self._prepare(sig, xf, of, feedback, name, rounds)
                prep.run(eng.use_token(), xa, oa)
            except BaseException as exc:
                self._fail(exc)
                raise
            if key is not None:
                self._keep_prepared(key, prep)
        return out if out is not None else oa

    def _keep_prepared(self, key, prep: "_Prepared") -> None:
        """Keep ``prep`` for replay under ``key``, first dropping every prepared call that can no
        longer replay when something it used went since the last sweep (a cache entry evicted, a
        `Feedback` collected): their closures hold workspaces and residuals, which memory then
        gets back. At most `_MAX_PREPARED` are kept, the least recently prepared go first."""
        now = (self._cache.evictions, self._feedback_gone)
        if now != self._swept:
            self._swept = now
            for k in [k for k, p in self._prepared.items() if not p.ready()]:
                del self._prepared[k]
        self._prepared[key] = prep
        if len(self._prepared) > _MAX_PREPARED:
            self._prepared.popitem(last=False)

    def _count_feedback_gone(self, _ref) -> None:
        self._feedback_gone += 1

    def _prepare(self, sig: CallSignature, xf, of, feedback, name: str, rounds: int) -> "_Prepared":
        """The work of a checked call of flat arrays ``xf`` -> ``of``, its buffers resolved
        (allocated or evicted as needed): what this call runs, and what a later call with the
        same buffers replays (``run`` gets that call's arrays, of the caller's shape)."""
        eng, algo = self.engine, sig.algorithm
        if xf.size == 0 or (self.size == 1 and eng.same_memory(xf, of)):
            return _Prepared(sig, _nothing)
        if self.size == 1:      # a copy on the call's stream (GPU: replayed as a graph, like a schedule)
            return _Prepared(sig, eng.prepare_schedule(lambda _s, x, out: eng.copy(eng.flat(out), eng.flat(x))))
        if algo == "nccl":
            return _Prepared(sig, *eng.prepare_baseline(xf, of))
        if algo == "one_shot":
            return _Prepared(sig, *eng.prepare_one_shot(xf, of))
        layout = self._layout(xf.size)
        capturing = eng.is_capturing()
        fb_entry = self._default_entry(layout.count, name) if feedback is None else None
        fused = eng.fused_schedule(algo, layout)     # one kernel in registered buffers
        ws = None if fused is not None else self._workspace(layout, capturing, algo, fb_entry)
        state = self._feedback(feedback, layout, name, fb_entry, ws, capturing)
        if self._cache.nbytes > self._cache.limit:    # what an earlier call left over the bound
            self._make_room(0, (ws, fb_entry), capturing)
        entries = tuple(e for e in (fb_entry, ws) if e is not None)
        fb = feedback if feedback is not None and feedback is not False else None
        if fused is not None:
            launch, valid = fused(layout, xf, of, state, rounds)
            run = lambda stream, _x, _out: launch(stream)     # noqa: E731
        else:
            assert ws is not None                    # every non-fused schedule has its workspace
            valid, schedule, wsv = None, SCHEDULES[algo], ws.obj.workspace(layout, gather_slots(algo, layout)[1])

            def direct(_stream, x, out):
                run_rounds(schedule, eng.kernels, eng.transport, layout, eng.flat(x), eng.flat(out), state, wsv,
                           rounds)
            run = eng.prepare_schedule(direct)
        return _Prepared(sig, run, valid, entries, fb, self._count_feedback_gone)

    def _replay(self, prep: "_Prepared", stream, x, out) -> None:
        """Run a prepared call again: the checks and cache bookkeeping a full call of the same
        buffers would do, in the same order on every rank (so the ranks' caches stay in step)."""
        eng = self.engine
        if eng.per_call_check or prep.sig not in self._checked:
            self._check_consistent(prep.sig)
        else:
            self._checked.move_to_end(prep.sig)
        try:
            if prep.entries:
                capturing = eng.stream_capturing(stream)
                for e in prep.entries:
                    self._cache.touch(e)
                    self._use(e, capturing, stream)
                if self._cache.nbytes > self._cache.limit:
                    self._make_room(0, prep.entries, capturing)
            prep.run(stream, x, out)
        except BaseException as exc:
            self._fail(exc)
            raise

    def baseline_all_reduce(self, x, out=None, *, stream=None):
        """The plain sum (NCCL's ncclAllReduce on GPU, MPI on CPU), for baselines and small sizes."""
        return self.all_reduce(x, out, feedback=False, algorithm="nccl", stream=stream)

    def synchronize(self, timeout: float | None = None) -> None:
        """Wait until this rank's queued collectives have finished (GPU: the current stream).
        A peer that stops answering raises `PeerTimeoutError` after ``timeout`` seconds
        (default: the communicator's) instead of hanging; the NCCL communicator is then aborted
        and this communicator refuses every later call (`CommunicatorFailedError`)."""
        self._check_open()
        try:
            self.engine.synchronize(timeout)
        except BaseException as exc:
            self._fail(exc)
            raise
        self.engine.reap()

    # -- feedback --------------------------------------------------------------------------------
    def new_feedback(self, residual_dtype: str = DEFAULT_RESIDUAL, rounding: bool | None = None) -> Feedback:
        """A fresh, unbound `Feedback`; bound (and allocated) by its first call. ``rounding``: see
        `Feedback` (default: the communicator's ``feedback_rounding``)."""
        return Feedback(residual_dtype, rounding=self.config.feedback_rounding if rounding is None else rounding)

    def load_feedback(self, state: dict) -> Feedback:
        """A `Feedback` restored from `Feedback.state_dict` onto this communicator's engine;
        a corrupt state (missing entries, wrong sizes or dtypes, NaN or Inf residuals) or a
        state of another codec than this communicator's raises `EchoncclError`."""
        if hasattr(state, "get"):
            saved = state.get("codec", "int4") if state.get("version", 1) != 1 else "int4"
            saved = saved.item() if hasattr(saved, "item") else saved
            if state.get("key") is not None and saved != self.config.codec:
                raise EchoncclError(f"feedback state was saved by codec {saved!r}, this communicator uses "
                                    f"{self.config.codec!r}: residuals of one codec mean nothing to the other")
        fb = Feedback()
        fb.load_state_dict(state, zeros=self.engine.zeros)
        return fb

    def default_feedback(self, count: int, dtype) -> Feedback:
        """The state used when a call passes no ``feedback`` (one per count and dtype).
        Kept in the bounded cache (README "Memory"): a state evicted to make room for other
        sizes loses its residuals, and the next call of its size starts a fresh one."""
        return self._default_entry(int(count), dtypes.canonical(dtype)).obj

    def unpin_all(self) -> None:
        """Let the cache evict the workspaces and default states that calls captured into
        CUDA graphs pinned. Call it once those graphs are destroyed (or will not be replayed)."""
        self._cache.unpin_all()

    def cached_bytes(self) -> int:
        """Bytes held in workspaces and default feedback states (bounded by ``cache_bytes``,
        plus the entries in use or pinned)."""
        return self._cache.nbytes

    # -- lifecycle ------------------------------------------------------------------------------
    def close(self) -> None:
        """Release buffers, the engine's resources (NCCL communicator) and the duplicated MPI
        communicator. Every rank should close, after destroying any CUDA graph that captured
        one of its calls (NCCL waits for those graphs to go). Idempotent."""
        if not self._closed:
            self._closed = True
            self._layouts.clear()
            self._prepared.clear()
            self._cache.clear()
            if self._failure is not None:
                self.engine.abort()     # the peers may be gone: nothing collective, nothing to wait for
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
        if self._failure is not None:
            raise CommunicatorFailedError(
                f"rank {self.rank}: this communicator failed in an earlier call ({self._failure}); its "
                "ranks may be out of step, so it refuses every collective: close() it and create a new "
                "Communicator on every rank")

    def _fail(self, exc: BaseException) -> None:
        """Mark the communicator failed after an error midway through a collective."""
        if self._failure is None:
            text = str(exc).splitlines()[0] if str(exc) else ""
            self._failure = f"{type(exc).__name__}: {text}" if text else type(exc).__name__

    def _output(self, x_obj, xa, out):
        eng = self.engine
        if out is None:
            return eng.empty_like(xa)
        if out is x_obj:
            if not eng.writable(x_obj, xa):
                raise ValueError("out=x writes the result into x, and x is read-only: pass a writable "
                                 "array, or out=None")
            return xa
        oa = eng.as_array(out)
        if not eng.writable(out, oa):
            raise ValueError("out is read-only: pass a writable array (or out=None)")
        if oa.shape != xa.shape or oa.dtype != xa.dtype:
            raise ValueError(f"out has shape {oa.shape} and dtype {oa.dtype}, "
                             f"x has {xa.shape} and {xa.dtype}: they must match")
        if eng.overlaps(oa, xa):
            if eng.same_memory(oa, xa):
                return xa
            raise ValueError("out overlaps x partly: pass out=x for in place, or separate memory")
        return oa

    def choose_algorithm(self, nbytes: int, algorithm: str | None = None) -> str:
        """The algorithm `all_reduce` runs for an input of ``nbytes`` bytes given ``algorithm``
        (None: the communicator's): ``auto`` resolved to the engine's small-size algorithm
        (``nccl``, or ``one_shot`` with fused kernels) below the crossover size, else the engine's
        preferred schedule. `ValueError` for an unknown name. Local, no communication."""
        algo = self.config.algorithm if algorithm is None else algorithm
        if algo not in _config.ALGORITHMS:
            raise ValueError(f"algorithm must be one of {_config.ALGORITHMS}, got {algo!r}")
        if algo != "auto":
            return algo
        cross = self.config.crossover_bytes
        if cross is None:
            cross = self.engine.crossover_bytes(self.size)
        return self.engine.small_algorithm() if nbytes < cross else self.engine.preferred_schedule(self.size)

    def _check_consistent(self, sig: CallSignature) -> None:
        """All ranks must agree on the call signature ``sig``: on engines with
        ``per_call_check`` (CPU) every call, by allgathering an 8-byte digest of it; otherwise
        (GPU: no host round trip on the hot path) once per distinct signature. Only on a
        difference are the signatures themselves gathered, to name them in the `MismatchError`
        every rank raises. Any other failure (a timeout) marks the communicator failed."""
        if self.size == 1:
            return
        eng = self.engine
        try:
            if eng.per_call_check:
                digests = eng.allgather_digest(_digest(sig))
                if all(d == digests[0] for d in digests):
                    return
            elif sig in self._checked:
                self._checked.move_to_end(sig)
                return
            sigs = [CallSignature(*s) for s in eng.allgather_object(tuple(sig))]
        except BaseException as exc:
            self._fail(exc)
            raise
        if any(s != sigs[0] for s in sigs):
            detail = "; ".join(f"rank {r}: {s.describe()}" for r, s in enumerate(sigs))
            raise MismatchError(f"ranks called all_reduce with different arguments: {detail}")
        if not eng.per_call_check:
            self._checked[sig] = None
            if len(self._checked) > _MAX_SIGNATURES:     # the same on every rank: calls are in step
                self._checked.popitem(last=False)

    def _check_feedback(self, feedback, count: int, name: str) -> None:
        """Reject, before any communication, a ``feedback`` that is not a state or is bound elsewhere."""
        if feedback is None or feedback is False:
            return
        if not isinstance(feedback, Feedback):
            raise TypeError(f"feedback must be a Feedback, False or None, not {type(feedback).__name__}")
        if feedback.enabled:
            feedback.check_key((count, self.size, self.group_size, name), self.config.codec)

    def _rounds(self, rounds, feedback, algo: str, flush=False) -> int:
        """The call's round count: 1 for the exact baseline and, unless asked for explicitly
        (then `ValueError`), for calls without feedback; else ``rounds`` or the config's, one
        more with ``flush`` (at most `config.MAX_ROUNDS` in all)."""
        if not isinstance(flush, bool):
            raise TypeError(f"flush must be True or False, not {flush!r}")
        no_feedback = feedback is False or (feedback is not None and not feedback.enabled)
        if flush and no_feedback:
            raise ValueError("flush=True sends the feedback residuals: it needs feedback, and this call has none")
        if rounds is None:
            rounds = 1 if no_feedback else self.config.rounds
        else:
            _config.check_rounds(rounds)
            if rounds > 1 and no_feedback:
                raise ValueError(f"rounds={rounds} sends the feedback residuals: it needs feedback, "
                                 "and this call has none")
        if algo in ("nccl", "one_shot"):
            return 1
        if flush and rounds == _config.MAX_ROUNDS:
            raise ValueError(f"flush=True adds a round to rounds={rounds}: at most {_config.MAX_ROUNDS} in all")
        return rounds + flush

    def _feedback(self, feedback, layout, name, entry, ws_entry, capturing: bool):
        """The residuals of this call (``feedback`` already passed `_check_feedback`;
        ``entry``: the cache entry of the default state when ``feedback`` is None)."""
        if feedback is False:
            return None
        key = (layout.count, layout.nranks, layout.group, name)
        if feedback is not None:
            return feedback.bind(key, layout, dtypes.numpy_dtype(name), self.engine.zeros, self.config.codec)
        fb = entry.obj
        if fb.enabled and fb.residuals is None:        # about to allocate its residuals
            dt = wire.residual_dtype(fb.residual_dtype, dtypes.numpy_dtype(name))
            nbytes = dt.itemsize * (wire.residual_size(layout.padded, dt) + wire.residual_size(layout.slice_elems, dt))
            self._make_room(nbytes, (ws_entry, entry), capturing)
        state = fb.bind(key, layout, dtypes.numpy_dtype(name), self.engine.zeros, self.config.codec)
        self._cache.resize(entry, _feedback_bytes(fb))
        self._use(entry, capturing)
        return state

    def _default_entry(self, count: int, name: str):
        key = ("fb", count, name)
        entry = self._cache.get(key)
        if entry is None:
            entry = self._cache.put(key, Feedback(rounding=self.config.feedback_rounding), 0)
        return entry

    def _layout(self, count: int) -> Layout:
        layout = self._layouts.get(count)
        if layout is None:
            layout = self._layouts[count] = Layout(count, self.size, self.config.codec)
            if len(self._layouts) > _MAX_SIGNATURES:
                self._layouts.popitem(last=False)
        return layout

    def _workspace(self, layout: Layout, capturing: bool, algo: str, keep=None):
        """The cache entry of the wire buffers of schedule ``algo`` for ``layout``'s size class
        (``keep``: another entry this call uses, not to be evicted for it)."""
        n, gather_bytes = gather_slots(algo, layout)
        B, Bg = _size_class(layout.slice_bytes), _size_class(gather_bytes)
        key = ("ws", B, n, Bg)
        entry = self._cache.get(key)
        if entry is None:
            nbytes = _WireBuffers.nbytes(layout.nranks, B, n, Bg)
            self._make_room(nbytes, () if keep is None else (keep,), capturing)
            entry = self._cache.put(key, _WireBuffers(self.engine, layout.nranks, B, n, Bg), nbytes)
        self._use(entry, capturing)
        return entry

    def _make_room(self, nbytes: int, keep, capturing: bool) -> None:
        if not capturing:       # nothing is evicted (nor any event queried) during a capture
            self.engine.reap()
            self._cache.make_room(nbytes, keep)

    def _use(self, entry, capturing: bool, token=None) -> None:
        entry.token = self.engine.use_token() if token is None else token
        if capturing:
            entry.pinned = True     # a CUDA graph now holds its pointers: kept until unpin_all/close


def _feedback_bytes(fb: Feedback) -> int:
    r = fb.residuals
    return 0 if r is None else int(r.inputs.nbytes + r.output.nbytes)


def _digest(key) -> int:
    """A signed 64-bit digest of a call signature (the same on every rank for equal keys)."""
    return int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=8).digest(), "little", signed=True)
