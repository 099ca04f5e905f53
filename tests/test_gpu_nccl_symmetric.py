"""NCCL on symmetric windows (NCCL >= 2.27): the binding with one rank on one GPU (ncclMemAlloc,
a symmetric window on a 1-rank communicator, an all-reduce on it gives its input back,
deregister, free), and echonccl-perf's NCCL_sym column beside plain NCCL, eager and as a CUDA
graph. Skipped without a GPU (and the binding test with an NCCL older than 2.27).

Where NCCL will not register the window (it answers an error, or a NULL window when the
communicator has no symmetric memory), the binding test skips with NCCL's answer and the tool
must show NCCL_sym as n/a with that answer as the reason: no other outcome passes.
"""
import json

import numpy as np
import pytest

from conftest import needs_gpus, run_mpi, visible_gpus

pytestmark = needs_gpus(1)

NCCL_REASONS = ("NCCL refused a symmetric window: nccl", "NCCL registered no window")


def _window_lib():
    from echonccl import nccl

    lib = nccl.load()
    if not lib.supports_windows():
        pytest.skip(f"NCCL {'.'.join(map(str, lib.version()))} has no symmetric windows (2.27+)")
    return lib


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_all_reduce_on_a_symmetric_window_one_rank(dtype):
    import cupy

    from echonccl import dtypes, nccl

    lib = _window_lib()
    cupy.cuda.Device(0).use()
    comm = nccl.NcclComm.init_rank(1, lib.get_unique_id(), 0, lib=lib)
    try:
        count = 3 * 4096 + 5
        host = np.random.default_rng(1).standard_normal(count).astype(dtypes.numpy_dtype(dtype))
        stride = -(-host.nbytes // nccl.NCCL_WIN_REQUIRED_ALIGNMENT) * nccl.NCCL_WIN_REQUIRED_ALIGNMENT
        size = 2 * stride                                       # an input and an output
        ptr = lib.mem_alloc(size)
        assert ptr and ptr % nccl.NCCL_WIN_REQUIRED_ALIGNMENT == 0
        win = None
        try:
            try:
                win = comm.register_window(ptr, size, symmetric=True)
            except nccl.NcclError as exc:
                pytest.skip(f"NCCL refused a symmetric window on a 1-rank communicator: {exc}")
            x, out = ptr, ptr + stride
            stream = cupy.cuda.Stream(non_blocking=True)
            cupy.cuda.runtime.memcpy(x, host.ctypes.data, host.nbytes, cupy.cuda.runtime.memcpyHostToDevice)
            for dst in (out, x):                                # out of place, then in place
                comm.all_reduce(x, dst, count, dtype, stream.ptr)
                stream.synchronize()
                got = np.empty_like(host)
                cupy.cuda.runtime.memcpy(got.ctypes.data, dst, host.nbytes, cupy.cuda.runtime.memcpyDeviceToHost)
                assert got.tobytes() == host.tobytes()
        finally:
            cupy.cuda.runtime.deviceSynchronize()
            comm.deregister_window(win)                         # None: nothing registered
            lib.mem_free(ptr)
        if win is None:
            pytest.skip("NCCL registered no window (its answer without symmetric memory); "
                        "the all-reduce ran on the plain buffers")
    finally:
        comm.destroy()


def _perf(tmp_path, nranks: int, mode: list):
    """echonccl-perf on the GPU engine: 1 KiB, 32 KiB, 1 MiB; its stdout and JSON."""
    proc = run_mpi(nranks, ["-m", "echonccl.perf.all_reduce", "--engine", "gpu", "-b", "1K", "-e", "1M",
                            "-f", "32", "-n", "5", "-w", "2", "--quiet", "-J", "sym.json", *mode],
                   timeout=300, clean=True, abort_on_error=False, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout, json.loads((tmp_path / "sym.json").read_text())


def _check_both_columns(out: str, doc: dict, nranks: int) -> bool:
    """Both NCCL columns printed and recorded; True when NCCL_sym was timed, False when it is
    n/a for a reason NCCL gave (anything else fails)."""
    lines = out.splitlines()
    i = next(i for i, ln in enumerate(lines) if ln.startswith("#") and "algbw" in ln)
    assert lines[i - 1].split()[1:3] == ["NCCL", "NCCL_sym"]
    assert doc["baselines"] == ["NCCL", "NCCL_sym"] and doc["engine"] == "gpu"
    assert [row["size"] for row in doc["results"]] == [1024, 32768, 1 << 20]
    why = doc["unavailable"].get("NCCL_sym")
    if why is not None:
        assert why.startswith(NCCL_REASONS), why
        assert f"# NCCL_sym : n/a: {why}" in lines
        assert doc["speedup_baseline"] == "NCCL" and lines[i + 1].split()[-2:] == ["vs", "NCCL"]
        assert all(row["results"][1]["time_us"] is None for row in doc["results"])
        return False
    assert f"# NCCL_sym : {doc['notes']['NCCL_sym']}" in lines
    assert doc["speedup_baseline"] == "fastest" and lines[i + 1].split()[-2:] == ["vs", "fastest"]
    for row in doc["results"]:
        plain, sym, *mine = row["results"]
        assert (plain["label"], sym["label"]) == ("NCCL", "NCCL_sym")
        assert sym["time_us"] > 0 and sym["wrong"] == 0
        if nranks == 1:
            assert sym["relerr"] == 0.0 == plain["relerr"]          # one rank: the input itself
        for r in mine:
            assert set(r["speedups"]) == {"NCCL", "NCCL_sym"} and r["speedup"] == min(r["speedups"].values())
    return True


@pytest.mark.parametrize("mode", [[], ["-G", "2"]], ids=["eager", "graph"])
def test_perf_prints_both_nccl_columns_one_rank(tmp_path, mode):
    out, doc = _perf(tmp_path, 1, mode)
    if not _check_both_columns(out, doc, 1):
        pytest.skip(f"NCCL_sym n/a on one rank: {doc['unavailable']['NCCL_sym']}")


@pytest.mark.skipif(visible_gpus() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("mode", [[], ["-G", "2"]], ids=["eager", "graph"])
def test_perf_times_nccl_sym_on_two_gpus(tmp_path, mode):
    """Two ranks, one GPU each (P2P): NCCL >= 2.27 registers the windows, NCCL_sym is timed."""
    out, doc = _perf(tmp_path, 2, mode)
    from echonccl import nccl

    if nccl.load().supports_windows():
        assert _check_both_columns(out, doc, 2), doc["unavailable"]
