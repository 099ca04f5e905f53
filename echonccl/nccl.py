"""A ctypes binding of the part of NCCL that echonccl uses (no compiled extension).

Finding the library (`find_library`): ``$ECHONCCL_NCCL_LIBRARY`` (a path; an
error if it does not exist), then the ``nvidia-nccl-cu13`` and
``nvidia-nccl-cu12`` wheels, then the system's ``libnccl.so.2``.

Versions: NCCL >= `MIN_VERSION` (2.19, the oldest with every entry point of
`SIGNATURES` but the windows') is accepted; 2.28 and newer is what is tested.
Registered windows (`NcclComm.register_window`, symmetric memory) need
`WINDOW_VERSION` (2.27): `NcclLibrary.supports_windows` says whether the
loaded library has them, and the calls raise `EchoncclError` where it does not.

Contracts: pointers (device buffers) and streams are plain Python ints (a
``cudaStream_t``; 0 is the legacy default stream); the caller owns the
buffers and keeps them alive until the stream has run the operation. NCCL
calls only enqueue work on the stream: nothing here synchronizes it. Every
``ncclResult_t`` goes through `NcclLibrary.check`, which raises `NcclError`.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import importlib.metadata
import importlib.util
import os
from ctypes import POINTER, c_char_p, c_int, c_size_t, c_uint, c_void_p
from typing import Any

from . import settings
from .errors import EchoncclError

MIN_VERSION = (2, 19, 0)
ENV_LIBRARY = "ECHONCCL_NCCL_LIBRARY"
WHEELS = ("nvidia-nccl-cu13", "nvidia-nccl-cu12")
SONAME = "libnccl.so.2"

# ncclResult_t (nccl.h); ncclTimeout exists from 2.29 on.
RESULT_NAMES = {0: "ncclSuccess", 1: "ncclUnhandledCudaError", 2: "ncclSystemError",
                3: "ncclInternalError", 4: "ncclInvalidArgument", 5: "ncclInvalidUsage",
                6: "ncclRemoteError", 7: "ncclInProgress", 8: "ncclTimeout"}
ncclSuccess, ncclInProgress = 0, 7
# ncclDataType_t and ncclRedOp_t (nccl.h).
DTYPES = {"int8": 0, "uint8": 1, "int32": 2, "uint32": 3, "int64": 4, "uint64": 5,
          "float16": 6, "float32": 7, "float64": 8, "bfloat16": 9}
ncclUint8, ncclSum = DTYPES["uint8"], 0

NCCL_CONFIG_UNDEF_INT = -(2 ** 31)  # INT_MIN
NCCL_API_MAGIC = 0xCAFEBEEF

# Window registration (nccl.h, 2.27+): winFlags, and the alignment of a window's start
# within its allocation (ncclMemAlloc's pointers have it).
WINDOW_VERSION = (2, 27, 0)
NCCL_WIN_DEFAULT, NCCL_WIN_COLL_SYMMETRIC = 0x00, 0x01
NCCL_WIN_REQUIRED_ALIGNMENT = 4096


def p2p_disabled() -> bool:
    """NCCL is told to avoid peer-to-peer (``NCCL_P2P_DISABLE`` set, and not to 0): NCCL's own
    variable, read where its regime decides something (the fused path, ``auto``'s crossover)."""
    return os.environ.get("NCCL_P2P_DISABLE", "0") not in ("0", "")


def version_code(major: int, minor: int, patch: int) -> int:
    """nccl.h's ``NCCL_VERSION(X, Y, Z)``."""
    if major <= 2 and minor <= 8:
        return major * 1000 + minor * 100 + patch
    return major * 10000 + minor * 100 + patch


def decode_version(code: int) -> tuple:
    """The (major, minor, patch) of an ``ncclGetVersion`` code (both encodings)."""
    if code >= 10000:
        return code // 10000, code % 10000 // 100, code % 100
    return code // 1000, code % 1000 // 100, code % 100


class NcclError(EchoncclError):
    """An NCCL call returned ``code`` (``name``, e.g. ``ncclSystemError``); ``message`` says
    which call and carries ncclGetErrorString and ncclGetLastError."""

    def __init__(self, code: int, name: str, message: str):
        self.code, self.name, self.message = code, name, message
        super().__init__(f"{name} ({code}): {message}")


class ncclUniqueId(ctypes.Structure):
    """``ncclUniqueId``: 128 opaque bytes, made by one rank and broadcast (``bytes(uid)``)."""

    _fields_ = [("internal", ctypes.c_char * 128)]

    def __bytes__(self) -> bytes:
        return ctypes.string_at(ctypes.addressof(self), ctypes.sizeof(self))

    @classmethod
    def from_bytes(cls, data: bytes) -> "ncclUniqueId":
        if len(data) != ctypes.sizeof(cls):
            raise ValueError(f"an ncclUniqueId has {ctypes.sizeof(cls)} bytes, got {len(data)}")
        return cls.from_buffer_copy(data)


class ncclConfig_t(ctypes.Structure):
    """``ncclConfig_t`` in its fixed 2.17-2.19 layout (``ncclConfig_v21700``), announced
    as ``version`` = NCCL_VERSION(2,19,0) and ``size`` = sizeof(this) = 48.

    NCCL copies ``min(size, its sizeof)`` bytes over its own NCCL_CONFIG_INITIALIZER
    and resets the fields newer than ``version``, so every later field keeps
    NCCL's default. ``_tail`` is the C padding of that layout; it is where 2.25+
    put ``trafficClass``, so it holds NCCL_CONFIG_UNDEF_INT too.
    """

    LAYOUT_VERSION = (2, 19, 0)
    _fields_ = [("size", c_size_t), ("magic", c_uint), ("version", c_uint),
                ("blocking", c_int), ("cgaClusterSize", c_int), ("minCTAs", c_int),
                ("maxCTAs", c_int), ("netName", c_char_p), ("splitShare", c_int),
                ("_tail", c_int)]

    @classmethod
    def initializer(cls, blocking: bool | None = None) -> "ncclConfig_t":
        """NCCL_CONFIG_INITIALIZER, with ``blocking`` set unless None (NCCL's default: 1)."""
        u = NCCL_CONFIG_UNDEF_INT
        return cls(ctypes.sizeof(cls), NCCL_API_MAGIC, version_code(*cls.LAYOUT_VERSION),
                   u if blocking is None else int(bool(blocking)), u, u, u, None, u, u)


ncclResult_t = c_int
ncclComm_t = c_void_p
ncclWindow_t = c_void_p
cudaStream_t = c_void_p

# The one table of the C signatures used: (name, restype, argtypes).
SIGNATURES: tuple[tuple[str, Any, list], ...] = (
    ("ncclGetVersion", ncclResult_t, [POINTER(c_int)]),
    ("ncclGetUniqueId", ncclResult_t, [POINTER(ncclUniqueId)]),
    ("ncclCommInitRank", ncclResult_t, [POINTER(ncclComm_t), c_int, ncclUniqueId, c_int]),
    ("ncclCommInitRankConfig", ncclResult_t,
     [POINTER(ncclComm_t), c_int, ncclUniqueId, c_int, POINTER(ncclConfig_t)]),
    ("ncclCommDestroy", ncclResult_t, [ncclComm_t]),
    ("ncclCommAbort", ncclResult_t, [ncclComm_t]),
    ("ncclCommGetAsyncError", ncclResult_t, [ncclComm_t, POINTER(ncclResult_t)]),
    ("ncclGetErrorString", c_char_p, [ncclResult_t]),
    ("ncclGetLastError", c_char_p, [ncclComm_t]),
    ("ncclGroupStart", ncclResult_t, []),
    ("ncclGroupEnd", ncclResult_t, []),
    ("ncclSend", ncclResult_t, [c_void_p, c_size_t, c_int, c_int, ncclComm_t, cudaStream_t]),
    ("ncclRecv", ncclResult_t, [c_void_p, c_size_t, c_int, c_int, ncclComm_t, cudaStream_t]),
    ("ncclAllReduce", ncclResult_t,
     [c_void_p, c_void_p, c_size_t, c_int, c_int, ncclComm_t, cudaStream_t]),
    ("ncclAllGather", ncclResult_t, [c_void_p, c_void_p, c_size_t, c_int, ncclComm_t, cudaStream_t]),
    ("ncclCommCount", ncclResult_t, [ncclComm_t, POINTER(c_int)]),
    ("ncclCommUserRank", ncclResult_t, [ncclComm_t, POINTER(c_int)]),
    ("ncclMemAlloc", ncclResult_t, [POINTER(c_void_p), c_size_t]),
    ("ncclMemFree", ncclResult_t, [c_void_p]),
    # 2.27+ (WINDOW_VERSION)
    ("ncclCommWindowRegister", ncclResult_t, [ncclComm_t, c_void_p, c_size_t, POINTER(ncclWindow_t), c_int]),
    ("ncclCommWindowDeregister", ncclResult_t, [ncclComm_t, ncclWindow_t]),
)
_SIGNATURES = {name: (res, args) for name, res, args in SIGNATURES}


# -- finding the library -------------------------------------------------------------------------
def _wheel_library(dist_name: str) -> str | None:
    try:
        dist = importlib.metadata.distribution(dist_name)
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in dist.files or ():
        if f.name == SONAME:
            path = str(dist.locate_file(f))
            if os.path.isfile(path):
                return path
    return None


def _namespace_library() -> str | None:
    """``nvidia/nccl/lib/libnccl.so.2`` on the ``nvidia`` namespace path (wheel without metadata)."""
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        return None
    for root in (spec.submodule_search_locations or ()) if spec else ():
        path = os.path.join(root, "nccl", "lib", SONAME)
        if os.path.isfile(path):
            return path
    return None


def _system_library() -> str | None:
    """The system's NCCL, as the dynamic loader finds it: its path when it can be told."""
    for name in (SONAME, ctypes.util.find_library("nccl")):
        if not name:
            continue
        try:
            handle = ctypes.CDLL(name)
        except OSError:
            continue
        return _loaded_path(handle) or name
    return None


def _loaded_path(handle) -> str | None:
    class _LinkMap(ctypes.Structure):
        _fields_ = [("l_addr", c_void_p), ("l_name", c_char_p)]

    try:
        dlinfo = ctypes.CDLL(None).dlinfo
        lm = POINTER(_LinkMap)()
        if dlinfo(c_void_p(handle._handle), 2, ctypes.byref(lm)) == 0:  # RTLD_DI_LINKMAP
            return lm.contents.l_name.decode() or None
    except (AttributeError, OSError, ValueError):
        pass
    return None


def find_library() -> str:
    """The path (or, for a system library the loader finds, its soname) of libnccl to use."""
    env = settings.get(ENV_LIBRARY)
    if env:
        if not os.path.isfile(env):
            raise EchoncclError(f"${ENV_LIBRARY}={env!r} is not a file")
        return env
    tried = []
    for dist_name in WHEELS:
        path = _wheel_library(dist_name)
        if path:
            return path
        tried.append(f"the {dist_name} wheel")
    for finder, what in ((_namespace_library, "nvidia/nccl/lib on the nvidia namespace package"),
                         (_system_library, f"the system's {SONAME}")):
        path = finder()
        if path:
            return path
        tried.append(what)
    raise EchoncclError("no NCCL library found; tried $" + ENV_LIBRARY + " (unset), "
                        + ", ".join(tried) + ". Install nvidia-nccl-cu13 or nvidia-nccl-cu12, "
                        f"or set ${ENV_LIBRARY} to libnccl.so.2")


# -- the library ---------------------------------------------------------------------------------
class NcclLibrary:
    """One loaded libnccl: functions bound on first use from `SIGNATURES`, version checked.

    Use `load` for the shared, cached instance.
    """

    def __init__(self, path: str):
        try:
            self._cdll = ctypes.CDLL(path)
        except OSError as exc:
            raise EchoncclError(f"cannot load NCCL from {path}: {exc}") from exc
        self.path = path
        self._fns: dict = {}
        found = self.version()
        if found < MIN_VERSION:
            raise EchoncclError(
                f"NCCL {'.'.join(map(str, found))} at {path} is too old: echonccl needs "
                f"{'.'.join(map(str, MIN_VERSION))} or newer (2.28+ is tested); set "
                f"${ENV_LIBRARY} or install nvidia-nccl-cu13/cu12")

    def fn(self, name: str):
        """The ctypes function ``name``, bound with its `SIGNATURES` types (cached)."""
        f = self._fns.get(name)
        if f is None:
            restype, argtypes = _SIGNATURES[name]
            try:
                f = getattr(self._cdll, name)
            except AttributeError:
                raise EchoncclError(f"{self.path} has no {name}") from None
            f.restype, f.argtypes = restype, argtypes
            self._fns[name] = f
        return f

    def check(self, code: int, call: str, comm=None) -> int:
        """Return ``code`` if it is ncclSuccess, else raise `NcclError` naming ``call``."""
        if code == ncclSuccess:
            return code
        text = self.error_string(code)
        last = self.last_error(comm)
        raise NcclError(code, result_name(code), f"{call} failed: {text}" + (f"; {last}" if last else ""))

    def call(self, name: str, *args, comm=None) -> int:
        """Call ``name`` (returning ncclResult_t) and `check` its result."""
        return self.check(self.fn(name)(*args), name, comm)

    def error_string(self, code: int) -> str:
        return (self.fn("ncclGetErrorString")(code) or b"").decode(errors="replace")

    def last_error(self, comm=None) -> str:
        """ncclGetLastError: the last error text of ``comm`` (a handle) or, for None, of the process."""
        return (self.fn("ncclGetLastError")(comm) or b"").decode(errors="replace")

    def version_code(self) -> int:
        v = c_int()
        self.call("ncclGetVersion", ctypes.byref(v))
        return v.value

    def version(self) -> tuple:
        """(major, minor, patch) of this library."""
        return decode_version(self.version_code())

    def get_unique_id(self) -> bytes:
        """A fresh ncclUniqueId (128 bytes). The calling rank hosts the bootstrap root."""
        uid = ncclUniqueId()
        self.call("ncclGetUniqueId", ctypes.byref(uid))
        return bytes(uid)

    # -- memory for windows ----------------------------------------------------------------------
    def supports_windows(self) -> bool:
        """This library has ncclCommWindowRegister (NCCL >= `WINDOW_VERSION`)."""
        return self.version() >= WINDOW_VERSION

    def require_windows(self) -> None:
        """Raise `EchoncclError` unless `supports_windows`."""
        if not self.supports_windows():
            raise EchoncclError(
                f"NCCL {'.'.join(map(str, self.version()))} at {self.path} has no registered windows "
                f"(ncclCommWindowRegister, symmetric memory): they need NCCL "
                f"{'.'.join(map(str, WINDOW_VERSION))} or newer")

    def mem_alloc(self, nbytes: int) -> int:
        """ncclMemAlloc: ``nbytes`` of device memory on the current CUDA device (CUDA VMM memory
        where NCCL can, which windows need), its address. Free it with `mem_free`."""
        ptr = c_void_p()
        self.call("ncclMemAlloc", ctypes.byref(ptr), int(nbytes))
        return int(ptr.value or 0)

    def mem_free(self, ptr: int) -> None:
        """ncclMemFree of a `mem_alloc` pointer: after every window on it is deregistered and
        the work that uses it has finished."""
        self.call("ncclMemFree", c_void_p(ptr))


def result_name(code: int) -> str:
    return RESULT_NAMES.get(code, f"ncclResult{code}")


_LOADED: dict = {}


def load(path: str | None = None) -> NcclLibrary:
    """The `NcclLibrary` at ``path`` (default `find_library`), loaded once per path."""
    path = path or find_library()
    lib = _LOADED.get(path)
    if lib is None:
        lib = _LOADED[path] = NcclLibrary(path)
    return lib


# -- communicator --------------------------------------------------------------------------------
class NcclComm:
    """A blocking ``ncclComm_t`` of ``count`` ranks, this one ``user_rank``.

    Owns the NCCL communicator (not the CUDA device, streams or buffers). Call
    `destroy` (or `abort` after an error) on every rank; there is no cleanup in
    ``__del__``. Calls only enqueue work on a stream; a peer that stops answering
    shows in `async_error` (the engine polls it and calls `abort`).
    """

    def __init__(self, lib: NcclLibrary, handle: c_void_p):
        self.lib = lib
        self._handle: c_void_p | None = handle
        self._aborted = False
        f = lib.fn
        self._send, self._recv = f("ncclSend"), f("ncclRecv")
        self._allreduce, self._allgather = f("ncclAllReduce"), f("ncclAllGather")
        self._gstart, self._gend = f("ncclGroupStart"), f("ncclGroupEnd")
        self.count = self._query("ncclCommCount")
        self.user_rank = self._query("ncclCommUserRank")

    @classmethod
    def init_rank(cls, nranks: int, unique_id, rank: int, *, lib: NcclLibrary | None = None) -> "NcclComm":
        """ncclCommInitRankConfig: collective over ``nranks`` processes sharing ``unique_id``
        (bytes or `ncclUniqueId`). The caller has already set this process's CUDA device."""
        lib = lib or load()
        uid = unique_id if isinstance(unique_id, ncclUniqueId) else ncclUniqueId.from_bytes(bytes(unique_id))
        cfg = ncclConfig_t.initializer(blocking=True)
        handle = c_void_p()
        lib.call("ncclCommInitRankConfig", ctypes.byref(handle), int(nranks), uid, int(rank), ctypes.byref(cfg))
        return cls(lib, handle)

    # -- operations (enqueued on ``stream_ptr``) ---------------------------------------------------
    def send(self, ptr: int, nbytes: int, peer: int, stream_ptr: int) -> None:
        """Send ``nbytes`` bytes at device address ``ptr`` to ``peer``."""
        code = self._send(ptr, nbytes, ncclUint8, peer, self._handle or self._live(), stream_ptr)
        if code:
            self.lib.check(code, "ncclSend", self._handle)

    def recv(self, ptr: int, nbytes: int, peer: int, stream_ptr: int) -> None:
        """Receive ``nbytes`` bytes from ``peer`` into device address ``ptr``."""
        code = self._recv(ptr, nbytes, ncclUint8, peer, self._handle or self._live(), stream_ptr)
        if code:
            self.lib.check(code, "ncclRecv", self._handle)

    def all_gather(self, send_ptr: int, recv_ptr: int, nbytes: int, stream_ptr: int) -> None:
        """Every rank's ``nbytes`` bytes at ``send_ptr``, rank r's at ``recv_ptr + r * nbytes``;
        ``send_ptr == recv_ptr + rank * nbytes`` is in place."""
        code = self._allgather(send_ptr, recv_ptr, nbytes, ncclUint8, self._handle or self._live(), stream_ptr)
        if code:
            self.lib.check(code, "ncclAllGather", self._handle)

    def all_reduce(self, send_ptr: int, recv_ptr: int, count: int, dtype_name: str,
                   stream_ptr: int) -> None:
        """Sum ``count`` elements of ``dtype_name`` ('float16', 'bfloat16', 'float32', ...) over
        all ranks; ``send_ptr == recv_ptr`` is in place."""
        self.prepare_all_reduce(send_ptr, recv_ptr, count, dtype_name)(stream_ptr)

    def prepare_all_reduce(self, send_ptr: int, recv_ptr: int, count: int, dtype_name: str):
        """`all_reduce` of these buffers as a ``run(stream_ptr)`` with its arguments converted
        once (what a repeated call costs on the host: one ctypes call)."""
        dt = DTYPES.get(dtype_name)
        if dt is None:
            raise ValueError(f"NCCL has no dtype {dtype_name!r}; one of {sorted(DTYPES)}")
        fn, check, handle = self._allreduce, self.lib.check, self._handle
        args = (c_void_p(send_ptr), c_void_p(recv_ptr), ctypes.c_size_t(count), ctypes.c_int(dt),
                ctypes.c_int(ncclSum))

        def run(stream_ptr: int) -> None:
            code = fn(*args, self._handle or self._live(), stream_ptr)
            if code:
                check(code, "ncclAllReduce", handle)
        return run

    # -- registered windows (NCCL >= 2.27) ----------------------------------------------------------
    def register_window(self, ptr: int, nbytes: int, symmetric: bool = True) -> int | None:
        """ncclCommWindowRegister: collective (every rank, the same ``nbytes``). ``ptr``: memory
        from `NcclLibrary.mem_alloc` (aligned to NCCL_WIN_REQUIRED_ALIGNMENT within it);
        ``symmetric``: NCCL_WIN_COLL_SYMMETRIC, which lets collectives whose buffers lie at the
        same offset of the window on every rank run NCCL's symmetric kernels.

        Returns the ``ncclWindow_t`` (an int), or None when NCCL registered nothing: it returns
        success with a NULL window where the communicator has no symmetric memory (CUMEM off,
        ``NCCL_WIN_ENABLE=0``, ranks without CUDA P2P). `EchoncclError` on NCCL < 2.27.
        Deregister it (`deregister_window`) before freeing the memory or destroying this."""
        self.lib.require_windows()
        win = c_void_p()
        flags = NCCL_WIN_COLL_SYMMETRIC if symmetric else NCCL_WIN_DEFAULT
        self.lib.call("ncclCommWindowRegister", self._live(), c_void_p(ptr), int(nbytes), ctypes.byref(win),
                      flags, comm=self._handle)
        return win.value or None

    def deregister_window(self, win: int | None) -> None:
        """ncclCommWindowDeregister of a `register_window` handle (every rank; None: nothing).
        The work on the window must have finished."""
        if win is not None:
            self.lib.require_windows()
            self.lib.call("ncclCommWindowDeregister", self._live(), c_void_p(win), comm=self._handle)

    def group_start(self) -> None:
        code = self._gstart()
        if code:
            self.lib.check(code, "ncclGroupStart", None)

    def group_end(self) -> None:
        code = self._gend()
        if code:
            self.lib.check(code, "ncclGroupEnd", self._handle)

    # -- state and lifecycle ------------------------------------------------------------------------
    def async_error(self) -> int:
        """ncclCommGetAsyncError's result code (ncclSuccess, ncclInProgress or an error); no raise."""
        res = c_int()
        self.lib.call("ncclCommGetAsyncError", self._live(), ctypes.byref(res))
        return res.value

    def abort(self) -> None:
        """ncclCommAbort: stop outstanding work and free the communicator (not collective)."""
        if self._handle is not None:
            handle, self._handle, self._aborted = self._handle, None, True
            self.lib.call("ncclCommAbort", handle)

    def destroy(self) -> None:
        """ncclCommDestroy; idempotent, and skipped after `abort`."""
        if self._handle is not None:
            handle, self._handle = self._handle, None
            self.lib.call("ncclCommDestroy", handle)

    @property
    def closed(self) -> bool:
        return self._handle is None

    def _live(self) -> c_void_p:
        if self._handle is None:
            raise EchoncclError("the NCCL communicator was " + ("aborted" if self._aborted else "destroyed"))
        return self._handle

    def _query(self, name: str) -> int:
        v = c_int()
        self.lib.call(name, self._handle, ctypes.byref(v), comm=self._handle)
        return v.value

    def __repr__(self) -> str:
        return f"NcclComm({'closed' if self._handle is None else f'rank {self.user_rank}/{self.count}'})"
