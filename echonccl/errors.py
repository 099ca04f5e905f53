"""Exceptions echonccl raises; every failure surfaces as one of these or a builtin with a precise message."""


class EchoncclError(RuntimeError):
    """Base class of echonccl's own errors."""


class PeerTimeoutError(EchoncclError, TimeoutError):
    """A peer did not complete its part of a collective within the configured timeout."""


class MismatchError(EchoncclError, ValueError):
    """Ranks called the same collective with different sizes, dtypes or options."""


class CommunicatorFailedError(EchoncclError):
    """A collective of this communicator failed midway (a timeout, an MPI or NCCL error, an
    interruption): its ranks may be out of step, so it refuses every further collective.
    Close it and create a new `Communicator` on every rank."""
