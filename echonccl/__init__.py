"""echonccl: 4-bit all-reduce with error feedback for tensor parallelism.

Quantize each contribution to 4 bits, sum in float32 on the slice's owner,
quantize the sum once, and feed every quantization's residual into the next
call that shares its `Feedback` state. See README.md and `codec` for the
wire format.
"""
from .communicator import Communicator
from .errors import CommunicatorFailedError, EchoncclError, MismatchError, PeerTimeoutError
from .feedback import Feedback
from .layout import Layout

__version__ = "0.1.0"

__all__ = ["Communicator", "Feedback", "Layout", "EchoncclError", "MismatchError",
           "PeerTimeoutError", "CommunicatorFailedError", "__version__"]
