"""The engine interface: what `communicator.Communicator` calls, implemented by
`engine_cpu.CpuEngine` (numpy + MPI, the reference) and `engine_gpu.GpuEngine` (CUDA + NCCL, the
product). An engine is one kernels implementation plus one transport, and the array plumbing and
policy the communicator needs around them.

Arrays are the engine's own (numpy or cupy). Every method runs in the engine's stream order
(CPU: at once) and, except `synchronize` and the ``allgather_*`` collectives, never blocks the host.

A *prepared call* is ``run(stream, x, out)``: a call's work with its buffers resolved, run by the
call that prepared it and replayed by later calls of the same buffers (the communicator keeps
them); ``valid`` is None or a check that it still applies.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Protocol, Tuple

from .kernels import Kernels
from .transport import Transport

Run = Callable[[Any, Any, Any], None]                 # run(stream, x, out)
Prepared = Tuple[Run, Optional[Callable[[], bool]]]   # (run, valid)


class Engine(Protocol):
    name: str                 # "cpu" or "gpu"
    baseline_name: str        # what the plain all-reduce is: "MPI" or "NCCL"
    per_call_check: bool      # compare every call's signature across ranks (else the first of each)

    @property
    def kernels(self) -> Kernels: ...

    @property
    def transport(self) -> Transport: ...

    def describe(self) -> str: ...

    # arrays
    def as_array(self, x) -> Any: ...              # the caller's object as an engine array, zero-copy
    def flat(self, a) -> Any: ...                  # 1-D view; ValueError if not C-contiguous
    def zeros(self, n: int, dtype) -> Any: ...
    def empty_bytes(self, n: int) -> Any: ...
    def empty_like(self, a) -> Any: ...
    def copy(self, dst, src) -> None: ...
    def overlaps(self, a, b) -> bool: ...
    def same_memory(self, a, b) -> bool: ...
    def call_scope(self, stream) -> Any: ...       # context manager: the engine's device, `stream` current
    def writable(self, obj, a) -> bool: ...        # may a call write into the caller's `obj` (viewed as `a`)

    # lifetime of cached buffers (`cache.BufferCache`)
    def is_capturing(self) -> bool: ...            # the current stream is capturing a CUDA graph
    def use_token(self) -> Any: ...                # what a buffer used now must wait for before reuse
    def retire(self, obj, token) -> None: ...      # keep evicted `obj` alive until `token`'s work ran
    def reap(self) -> None: ...                    # drop retired buffers whose work has run

    # collectives
    def allgather_object(self, obj) -> list: ...   # small metadata, bounded by the timeout
    def allgather_digest(self, digest: int) -> Any: ...   # every rank's int64, bounded by the timeout

    # prepared calls
    def call_key(self, x, out) -> Any: ...         # the buffers of a replayable call, hashable; None: not replayable
    def call_stream(self, stream) -> Any: ...      # the stream a replay runs on; None: take the full path
    def stream_capturing(self, stream) -> bool: ...
    def prepare_baseline(self, x, out) -> Prepared: ...     # the plain all-reduce (NCCL's, MPI's)
    def prepare_one_shot(self, x, out) -> Prepared: ...     # the 16-bit one-shot (else the baseline)
    def prepare_schedule(self, run: Run) -> Run: ...        # a schedule's run, as the engine replays it
    def fused_schedule(self, algo: str, layout) -> Optional[Callable[..., Any]]: ...   # one-launch prepare, or None

    # policy
    def crossover_bytes(self, nranks: int) -> int: ...      # ``auto``: below it `small_algorithm`
    def preferred_schedule(self, nranks: int) -> str: ...   # ``auto``: from the crossover up
    def small_algorithm(self) -> str: ...

    # lifecycle
    def synchronize(self, timeout: float | None = None) -> None: ...
    def abort(self) -> None: ...                   # stop at once after a failure (GPU: ncclCommAbort)
    def close(self) -> None: ...
