"""One GPU: the GPU engine with one rank (P = 1, MPI.COMM_SELF) gives its input back, out of
place and in place, for every dtype; and 2, 4 or 8 ranks sharing the GPU run the fused kernels
bit-exact with the reference. Skipped without a GPU."""
import numpy as np
import pytest

from conftest import needs_gpus, visible_gpus

pytestmark = needs_gpus(1)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_single_rank_gpu_returns_input(dtype):
    import cupy
    from mpi4py import MPI

    import echonccl
    from echonccl import dtypes

    with echonccl.Communicator(MPI.COMM_SELF, engine="gpu") as comm:
        x = cupy.asarray(np.random.default_rng(0).standard_normal((7, 513)).astype(dtypes.numpy_dtype(dtype)))
        for algo in ("two_shot", "ring", "nccl"):
            y = comm.all_reduce(x, algorithm=algo)
            assert y is not x and y.shape == x.shape and y.tobytes() == x.tobytes()
            assert comm.all_reduce(x, x, algorithm=algo) is x
        # a given out, new data in the same buffers: full call, then the replays (a graph from
        # the second on), on the current stream and on another one
        out = cupy.empty_like(x)
        side = cupy.cuda.Stream(non_blocking=True)
        for step in range(5):
            x[...] = step + 1
            cupy.cuda.get_current_stream().synchronize()     # ordered before a call on `side`
            stream = side if step % 2 else None
            comm.all_reduce(x, out, algorithm="two_shot", stream=stream)
            (side if stream else cupy.cuda.get_current_stream()).synchronize()
            assert out.tobytes() == x.tobytes(), f"step {step}"
        comm.synchronize()


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_fused_kernels_match_the_reference_ranks_sharing_one_gpu(mpirun, ranks):
    """The fused peer-memory kernels without NCCL (which refuses two ranks on one GPU): the
    processes map each other's buffers on the same GPU (their kernels take turns); outputs and
    residuals bit for bit against the CPU reference, every codec, at every P of one node
    (tests/mpi/checks.py check_fused_reference). Ranks taking turns on one GPU wait on each
    other's flags a time slice at a time (4 ranks: 90 s on an H200; 8: over 6 minutes): on one
    GPU only 2 ranks run here, which keeps the turn-taking regime tested, and tools/gpu_suite.sh
    runs 4 and 8 under MPS instead, their kernels at once."""
    if ranks > 2 and visible_gpus() == 1:
        pytest.skip(f"{ranks} ranks on one GPU: tools/gpu_suite.sh runs them under MPS")
    res = mpirun(ranks, ["tests/mpi/checks.py", "fused_reference", "gpu"], timeout=600)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    assert f"OK fused_reference ranks={ranks} engine=gpu" in res.stdout


@pytest.mark.parametrize("ranks", [2, 3])
def test_a_rank_a_call_ahead_never_overwrites_what_a_slow_peer_reads(mpirun, ranks):
    """One rank with one block against full grids, fused calls back to back (the one-shots push
    into the half of their call's parity; tests/mpi/checks.py check_fused_skew). On one GPU the
    ranks' kernels take turns here, which hides the race this guards against: tools/gpu_suite.sh
    runs the check again under MPS (before the push halves, 408812 of 1.5 M elements differed)."""
    res = mpirun(ranks, ["tests/mpi/checks.py", "fused_skew", "gpu"], timeout=300)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    assert f"OK fused_skew ranks={ranks} engine=gpu" in res.stdout


def test_a_kernel_compiled_on_demand_matches_the_prebuilt_one(tmp_path, monkeypatch, capfd):
    """The loader without a prebuilt fatbin compiles one kernel with NVRTC (empty caches: one
    line says so), a second loader on the same node finds it in the caches and says nothing; the
    kernel computes the same bits as the prebuilt one (or, without one, as the numpy reference)."""
    import cupy
    import ml_dtypes

    from echonccl import kernel_loader
    from echonccl import kernel_table as kt
    from echonccl.kernels_numpy import NumpyKernels
    from echonccl.layout import Layout

    monkeypatch.setenv("CUPY_CACHE_DIR", str(tmp_path / "cupy"))
    monkeypatch.setenv("ECHONCCL_KERNEL_CACHE", str(tmp_path / "echonccl"))
    name = "echo_dequantize_bf16_int4_h32"
    jit = kernel_loader.KernelLoader(None)
    fn = jit.function(name)
    assert jit.origins == {name: "nvrtc"} and jit.function(name) is fn
    err = capfd.readouterr().err
    assert err.count(f"compiled {name} for sm_") == 1, err
    assert list((tmp_path / "echonccl").glob(f"{name}-*.done")), "no record of the compile"
    again = kernel_loader.KernelLoader(None)
    again.function(name)
    assert "compiled" not in capfd.readouterr().err      # the node's cache: loaded, not compiled

    layout = Layout(4096, 1, "int4-h32")
    x = np.random.default_rng(5).standard_normal(4096).astype(np.float32)
    wire = np.zeros(layout.slice_bytes, np.uint8)
    NumpyKernels().reduce_quantize(layout, None, 0, x, None, wire, "float32")
    want = np.zeros(4096, ml_dtypes.bfloat16)
    NumpyKernels().dequantize(layout, wire, want)
    for f in (fn, kernel_loader.LOADER.function(name)):       # on demand; the process's own
        got = cupy.zeros(4096, dtype=cupy.uint16)           # bfloat16 bits (cupy has no bfloat16)
        f((16, 1), (kt.BLOCK,), (cupy.asarray(wire), got, 4096, layout.slice_elems, 0))
        assert got.get().tobytes() == want.tobytes()
