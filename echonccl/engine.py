"""The engine interface: one kernels implementation plus one transport, and the array plumbing
the communicator needs around them. Implemented by `engine_cpu.CpuEngine` (numpy + MPI, the
reference) and `engine_gpu.GpuEngine` (CUDA + NCCL, the product).

Arrays are the engine's own (numpy or cupy). Every method runs in the engine's stream order
(CPU: at once) and, except `synchronize` and `allgather_object`, never blocks the host.
"""
from __future__ import annotations

from typing import Any, Protocol

from .kernels import Kernels
from .transport import Transport


class Engine(Protocol):
    name: str                 # "cpu" or "gpu"
    baseline_name: str        # what `baseline_all_reduce` is: "MPI" or "NCCL"
    per_call_check: bool      # compare every call's signature across ranks (else the first of each)
    kernels: Kernels
    transport: Transport

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
    def call_scope(self, stream): ...              # context manager: the engine's device, `stream` current
    def writable(self, obj, a) -> bool: ...        # may a call write into the caller's `obj` (viewed as `a`)

    # lifetime of cached buffers (`cache.BufferCache`)
    def is_capturing(self) -> bool: ...            # the current stream is capturing a CUDA graph
    def use_token(self) -> Any: ...                # what a buffer used now must wait for before reuse
    def retire(self, obj, token) -> None: ...      # keep evicted `obj` alive until `token`'s work ran
    def reap(self) -> None: ...                    # drop retired buffers whose work has run

    # collectives and policy
    def allgather_object(self, obj) -> list: ...   # small metadata, bounded by the timeout
    def allgather_digest(self, digest: int) -> Any: ...   # every rank's int64, bounded by the timeout
    def baseline_all_reduce(self, x, out) -> None: ...
    def crossover_bytes(self, nranks: int) -> int: ...
    def preferred_schedule(self, nranks: int) -> str: ...
    def small_algorithm(self) -> str: ...          # what ``auto`` runs below the crossover
    def fused_schedule(self, algo: str, layout): ...   # a one-launch implementation, or None
    def one_shot(self, x, out) -> None: ...        # 16-bit one-shot sum (CPU: the baseline)
    def synchronize(self, timeout: float | None = None) -> None: ...
    def abort(self) -> None: ...                   # stop at once after a failure (GPU: ncclCommAbort)
    def close(self) -> None: ...
