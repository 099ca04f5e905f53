"""The few CUDA driver entry points echonccl calls through ctypes, where CuPy has no cheap or
no flag-taking equivalent: `launch` (``cuLaunchKernel`` with arguments packed once, for the
fused kernels' host path) and `PriorityGraph` (a captured graph instantiated so that its
kernels keep the priorities of the streams they were captured on). Loaded on first use; every
failure raises `EchoncclError` with the CUresult."""
from __future__ import annotations

import ctypes

from .errors import EchoncclError

# CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY (cuda.h)
_USE_NODE_PRIORITY = 8
_cu = None


def _lib():
    global _cu
    if _cu is None:
        cu = ctypes.CDLL("libcuda.so.1")
        cu.cuLaunchKernel.restype = ctypes.c_int
        cu.cuLaunchKernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
        cu.cuGraphInstantiateWithFlags.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_ulonglong]
        cu.cuGraphLaunch.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        cu.cuGraphExecDestroy.argtypes = [ctypes.c_void_p]
        _cu = cu
    return _cu


def _check(err: int, what: str) -> None:
    if err:
        raise EchoncclError(f"{what} failed: CUresult {err}")


def launch(fn: int, grid: int, block: int, stream: int, params, what: str = "kernel") -> None:
    """``cuLaunchKernel(fn, grid x 1 x 1, block x 1 x 1, no shared memory, stream, params)``."""
    _check(_lib().cuLaunchKernel(fn, grid, 1, 1, block, 1, 1, 0, stream, params, None), f"cuLaunchKernel({what})")


class PriorityGraph:
    """A CUDA graph (a CuPy ``Graph`` from stream capture, kept alive here) instantiated with
    ``CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY``: without it a replay runs every kernel at
    the priority of the stream it is launched into. ``launch(stream)`` replays it."""

    def __init__(self, graph):
        self.graph, self.exec = graph, None
        ex = ctypes.c_void_p()
        _check(_lib().cuGraphInstantiateWithFlags(ctypes.byref(ex), graph.graph, _USE_NODE_PRIORITY),
               "cuGraphInstantiateWithFlags")
        self.exec = ex

    def launch(self, stream) -> None:
        _check(_lib().cuGraphLaunch(self.exec, stream.ptr), "cuGraphLaunch")

    def __del__(self):
        if self.exec is not None and _cu is not None:
            _cu.cuGraphExecDestroy(self.exec)
