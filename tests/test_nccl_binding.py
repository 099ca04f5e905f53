"""The NCCL ctypes binding against the real libnccl of the installed wheel (no GPU needed)."""
from __future__ import annotations

import ctypes
import importlib.metadata
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from echonccl import nccl
from echonccl.errors import EchoncclError


@pytest.fixture(scope="module")
def lib():
    return nccl.load()


def _wheel():
    for name in nccl.WHEELS:
        try:
            return importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    pytest.skip("no nvidia-nccl wheel installed")


def _header() -> Path:
    dist = _wheel()
    for f in dist.files or ():
        if f.name == "nccl.h":
            return Path(dist.locate_file(f))
    pytest.skip("the wheel has no nccl.h")


def test_finds_the_wheel_library(monkeypatch):
    monkeypatch.delenv(nccl.ENV_LIBRARY, raising=False)
    path = Path(nccl.find_library())
    assert path.is_file()
    assert path.name == "libnccl.so.2"
    assert path.parent.parts[-3:] == ("nvidia", "nccl", "lib")
    assert "site-packages" in path.parts
    assert nccl.load().path == str(path)


def test_version_matches_the_wheel_and_header(monkeypatch):
    monkeypatch.delenv(nccl.ENV_LIBRARY, raising=False)
    lib = nccl.load(nccl.find_library())
    v = lib.version()
    assert v >= nccl.MIN_VERSION
    assert lib.version_code() == nccl.version_code(*v)
    assert v[:2] == tuple(int(x) for x in _wheel().version.split(".")[:2])
    text = _header().read_text()
    hdr = tuple(int(re.search(rf"#define NCCL_{k} (\d+)", text).group(1)) for k in ("MAJOR", "MINOR", "PATCH"))
    assert v == hdr
    real = os.path.basename(os.path.realpath(lib.path))  # libnccl.so.2 or libnccl.so.2.28.3
    parts = [int(x) for x in re.fullmatch(r"libnccl\.so\.([\d.]+)", real).group(1).split(".")]
    assert tuple(parts) == v[:len(parts)]


def test_loaded_path_is_resolved(lib):
    assert nccl._loaded_path(lib._cdll) == lib.path


def test_version_decoding():
    assert nccl.decode_version(23203) == (2, 32, 3)
    assert nccl.decode_version(2708) == (2, 7, 8)
    assert nccl.version_code(2, 19, 0) == 21900 and nccl.version_code(2, 8, 4) == 2804
    for v in [(2, 7, 8), (2, 19, 3), (2, 28, 9), (3, 0, 1)]:
        assert nccl.decode_version(nccl.version_code(*v)) == v


def test_old_version_is_refused(monkeypatch, lib):
    monkeypatch.setattr(nccl.NcclLibrary, "version_code", lambda self: 21800)
    with pytest.raises(EchoncclError) as info:
        nccl.NcclLibrary(lib.path)
    msg = str(info.value)
    assert "2.18.0" in msg and lib.path in msg and "2.19.0" in msg


def test_unique_id(lib):
    a, b = lib.get_unique_id(), lib.get_unique_id()
    assert isinstance(a, bytes) and len(a) == 128 == ctypes.sizeof(nccl.ncclUniqueId)
    assert a != b
    assert bytes(nccl.ncclUniqueId.from_bytes(a)) == a
    with pytest.raises(ValueError):
        nccl.ncclUniqueId.from_bytes(a[:-1])


def test_error_strings_and_names(lib):
    for code, name in nccl.RESULT_NAMES.items():
        assert lib.error_string(code).strip()
    assert nccl.RESULT_NAMES[1] == "ncclUnhandledCudaError" and nccl.RESULT_NAMES[6] == "ncclRemoteError"
    assert nccl.result_name(99) == "ncclResult99"
    assert isinstance(lib.last_error(None), str)


def test_check_raises_formatted_error(lib):
    assert lib.check(0, "ncclX") == 0
    with pytest.raises(nccl.NcclError, match="ncclInProgress"):
        lib.check(nccl.ncclInProgress, "ncclX")         # only the engine's poll may see it, by name
    with pytest.raises(nccl.NcclError) as info:
        lib.check(4, "ncclAllReduce")
    err = info.value
    assert isinstance(err, EchoncclError)
    assert (err.code, err.name) == (4, "ncclInvalidArgument")
    assert "ncclAllReduce failed" in err.message and lib.error_string(4) in err.message
    assert str(err).startswith("ncclInvalidArgument (4): ncclAllReduce failed: invalid argument")
    err2 = nccl.NcclError(2, "ncclSystemError", "boom")
    assert str(err2) == "ncclSystemError (2): boom"


def test_missing_env_library_is_a_clear_error(monkeypatch, tmp_path):
    missing = tmp_path / "nope" / "libnccl.so.2"
    monkeypatch.setenv(nccl.ENV_LIBRARY, str(missing))
    with pytest.raises(EchoncclError, match=re.escape(str(missing))) as info:
        nccl.find_library()
    assert nccl.ENV_LIBRARY in str(info.value)


def test_env_library_is_used(monkeypatch, lib):
    monkeypatch.setenv(nccl.ENV_LIBRARY, lib.path)
    assert nccl.find_library() == lib.path


def test_nothing_found_lists_what_was_tried(monkeypatch):
    monkeypatch.delenv(nccl.ENV_LIBRARY, raising=False)
    for f in ("_wheel_library", "_namespace_library", "_system_library"):
        monkeypatch.setattr(nccl, f, lambda *a: None)
    with pytest.raises(EchoncclError) as info:
        nccl.find_library()
    msg = str(info.value)
    for what in ("nvidia-nccl-cu13", "nvidia-nccl-cu12", "namespace", "libnccl.so.2", nccl.ENV_LIBRARY):
        assert what in msg


def test_every_signature_exists_and_binds(lib):
    cdll = ctypes.CDLL(lib.path)
    names = [name for name, _, _ in nccl.SIGNATURES]
    assert len(names) == len(set(names))
    for name in names:
        assert hasattr(cdll, name), name
        f = lib.fn(name)
        assert f is lib.fn(name)
    assert set(names) >= {"ncclCommInitRankConfig", "ncclSend", "ncclRecv", "ncclAllReduce", "ncclAllGather",
                          "ncclGroupStart", "ncclGroupEnd", "ncclCommAbort", "ncclGetLastError"}


def test_enums_match_the_header():
    text = _header().read_text()

    def find(pattern, what):
        m = re.search(pattern, text)
        assert m, f"{what} not found in {_header()}"
        return m.group(1)

    def enum(name):
        return int(find(rf"\b{name}\s*=\s*(\d+)", name))

    for code, name in nccl.RESULT_NAMES.items():
        if re.search(rf"\b{name}\s*=", text):
            assert enum(name) == code, name
    header_names = {"int8": "ncclInt8", "uint8": "ncclUint8", "int32": "ncclInt32", "uint32": "ncclUint32",
                    "int64": "ncclInt64", "uint64": "ncclUint64", "float16": "ncclFloat16",
                    "float32": "ncclFloat32", "float64": "ncclFloat64", "bfloat16": "ncclBfloat16"}
    for dt, value in nccl.DTYPES.items():
        assert enum(header_names[dt]) == value, dt
    assert enum("ncclSum") == nccl.ncclSum
    assert int(find(r"#define NCCL_UNIQUE_ID_BYTES (\d+)", "NCCL_UNIQUE_ID_BYTES")) == 128
    # NCCL_CONFIG_INITIALIZER's magic (2.28 spells it out; newer headers name it NCCL_API_MAGIC)
    assert "0xcafebeef" in text.lower()


_C_PROGRAM = r"""
#include <stdio.h>
#include <stddef.h>
#include "nccl.h"
#define F(f) printf(#f " %zu\n", offsetof(ncclConfig_t, f));
int main(void) {
  printf("sizeof %zu\n", sizeof(ncclConfig_t));
  F(size) F(magic) F(version) F(blocking) F(cgaClusterSize) F(minCTAs) F(maxCTAs) F(netName) F(splitShare)
  return 0;
}
"""

_CUDA_STUB = """#ifndef STUB_CUDA_RUNTIME_H
#define STUB_CUDA_RUNTIME_H
#define CUDART_VERSION 10000
typedef struct CUstream_st* cudaStream_t;
typedef struct CUevent_st* cudaEvent_t;
#endif
"""


def test_config_layout_matches_the_header(tmp_path):
    gcc = shutil.which("gcc")
    if gcc is None:
        pytest.skip("gcc is not installed")
    (tmp_path / "cuda_runtime.h").write_text(_CUDA_STUB)
    (tmp_path / "cuda_fp16.h").write_text("")
    (tmp_path / "offsets.c").write_text(_C_PROGRAM)
    exe = tmp_path / "offsets"
    cc = subprocess.run([gcc, "-std=c11", f"-I{tmp_path}", f"-I{_header().parent}", str(tmp_path / "offsets.c"),
                         "-o", str(exe)], capture_output=True, text=True)
    assert cc.returncode == 0, cc.stderr
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    c = {k: int(v) for k, v in (line.split() for line in out.splitlines())}
    S = nccl.ncclConfig_t
    for name, _ in S._fields_:
        if name in c:
            assert getattr(S, name).offset == c[name], name
    assert [n for n, _ in S._fields_][:9] == list(c)[1:]
    # Ours is the 2.17-2.24 prefix: 9 fields + padding (48 bytes), no bigger than NCCL's.
    assert ctypes.sizeof(S) == 48 <= c["sizeof"]
    assert S._tail.offset == c["splitShare"] + 4


def test_config_initializer():
    cfg = nccl.ncclConfig_t.initializer()
    assert cfg.size == ctypes.sizeof(nccl.ncclConfig_t) and cfg.magic == 0xCAFEBEEF
    assert cfg.version == 21900
    undef = nccl.NCCL_CONFIG_UNDEF_INT
    assert undef == -2147483648
    assert (cfg.blocking, cfg.cgaClusterSize, cfg.minCTAs, cfg.maxCTAs, cfg.splitShare, cfg._tail) == (undef,) * 6
    assert cfg.netName is None
    assert nccl.ncclConfig_t.initializer(blocking=False).blocking == 0
    assert nccl.ncclConfig_t.initializer(blocking=True).blocking == 1


@pytest.mark.skipif(os.path.exists("/dev/nvidia0"), reason="a GPU is present")
@pytest.mark.parametrize("with_config", [True, False])
def test_comm_init_without_gpu_raises(lib, with_config):
    uid = nccl.ncclUniqueId.from_bytes(lib.get_unique_id())
    if with_config:
        with pytest.raises(nccl.NcclError) as info:
            nccl.NcclComm.init_rank(2, bytes(uid), 0, lib=lib)
    else:
        handle = ctypes.c_void_p()
        with pytest.raises(nccl.NcclError) as info:
            lib.call("ncclCommInitRank", ctypes.byref(handle), 2, uid, 0)
    err = info.value
    assert err.code != 0 and err.name in nccl.RESULT_NAMES.values()
    assert "ncclCommInitRank" in err.message


# -- registered windows (NCCL >= 2.27) and ncclMemAlloc -------------------------------------------
def test_window_signatures(lib):
    sig = {name: (res, args) for name, res, args in nccl.SIGNATURES}
    P = ctypes.POINTER
    assert sig["ncclMemAlloc"] == (ctypes.c_int, [P(ctypes.c_void_p), ctypes.c_size_t])
    assert sig["ncclMemFree"] == (ctypes.c_int, [ctypes.c_void_p])
    assert sig["ncclCommWindowRegister"] == (
        ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, P(ctypes.c_void_p), ctypes.c_int])
    assert sig["ncclCommWindowDeregister"] == (ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p])
    for name in sig:
        if name.startswith(("ncclMem", "ncclCommWindow")):
            f = lib.fn(name)
            assert (f.restype, f.argtypes) == sig[name]


def test_window_flags_match_the_header():
    text = _header().read_text()
    for name in ("NCCL_WIN_DEFAULT", "NCCL_WIN_COLL_SYMMETRIC", "NCCL_WIN_REQUIRED_ALIGNMENT"):
        m = re.search(rf"#define {name}\s+(0x[0-9a-fA-F]+|\d+)", text)
        assert m, f"{name} not in {_header()}"
        assert int(m.group(1), 0) == getattr(nccl, name), name
    assert nccl.NCCL_WIN_COLL_SYMMETRIC == 1 and nccl.NCCL_WIN_DEFAULT == 0
    for name in ("ncclMemAlloc(void** ptr, size_t size)", "ncclMemFree(void *ptr)",
                 "ncclCommWindowRegister(ncclComm_t comm, void* buff, size_t size, ncclWindow_t* win, int winFlags)",
                 "ncclCommWindowDeregister(ncclComm_t comm, ncclWindow_t win)"):
        assert name in text, name


def _shell_comm(lib) -> nccl.NcclComm:
    """An `NcclComm` around a made-up handle: for calls that must fail before reaching NCCL, or
    that reach a stand-in of the NCCL function."""
    comm = nccl.NcclComm.__new__(nccl.NcclComm)
    comm.lib, comm._handle, comm._aborted = lib, ctypes.c_void_p(0x1234), False
    return comm


@pytest.mark.parametrize("code,supported", [(22605, False), (22700, True), (22809, True), (23203, True)])
def test_windows_need_nccl_2_27(monkeypatch, lib, code, supported):
    monkeypatch.setattr(nccl.NcclLibrary, "version_code", lambda self: code)
    assert lib.supports_windows() is supported
    if supported:
        lib.require_windows()
        return
    with pytest.raises(EchoncclError) as info:
        lib.require_windows()
    msg = str(info.value)
    assert "NCCL 2.26.5" in msg and lib.path in msg and "2.27.0 or newer" in msg and "ncclCommWindowRegister" in msg
    comm = _shell_comm(lib)
    with pytest.raises(EchoncclError, match="2.27.0 or newer"):
        comm.register_window(0x1000, 4096)
    with pytest.raises(EchoncclError, match="2.27.0 or newer"):
        comm.deregister_window(0x5678)
    comm.deregister_window(None)          # no window: nothing to do, on any version


def test_register_window_flags_and_null_window(monkeypatch, lib):
    """What register_window hands NCCL (the flag of ``symmetric``) and makes of its answer: a
    window handle, or None for the NULL window NCCL returns without symmetric memory."""
    calls = []

    def fake_register(comm, buff, size, win, flags):
        calls.append((comm, buff, size, flags))
        ctypes.cast(win, ctypes.POINTER(ctypes.c_void_p))[0] = 0xABC0 if flags else None
        return nccl.ncclSuccess

    def fake_deregister(comm, win):
        calls.append((comm, win))
        return nccl.ncclSuccess

    monkeypatch.setitem(lib._fns, "ncclCommWindowRegister", fake_register)
    monkeypatch.setitem(lib._fns, "ncclCommWindowDeregister", fake_deregister)
    comm = _shell_comm(lib)
    assert comm.register_window(0x10000, 8192) == 0xABC0
    assert comm.register_window(0x20000, 4096, symmetric=False) is None
    assert [(c.value, b.value, n, f) for c, b, n, f in calls] == [
        (0x1234, 0x10000, 8192, nccl.NCCL_WIN_COLL_SYMMETRIC), (0x1234, 0x20000, 4096, nccl.NCCL_WIN_DEFAULT)]
    comm.deregister_window(0xABC0)
    assert (calls[-1][0].value, calls[-1][1].value) == (0x1234, 0xABC0)
    comm._handle = None
    with pytest.raises(EchoncclError, match="destroyed"):
        comm.register_window(0x10000, 8192)


@pytest.mark.skipif(os.path.exists("/dev/nvidia0"), reason="a GPU is present")
def test_mem_alloc_without_gpu_raises(lib):
    with pytest.raises(nccl.NcclError) as info:
        lib.mem_alloc(1 << 20)
    assert info.value.code != 0 and "ncclMemAlloc failed" in info.value.message
