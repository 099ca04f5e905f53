"""Multi-rank checks, run as ``mpiexec -n N python tests/mpi/checks.py CHECK[,CHECK...] [ENGINE]``.

Each check asserts on every rank and prints ``OK <check> ranks=N engine=E`` on rank 0; several
checks, comma-separated, run one after the other in one launch (mpi_common.run_checks). The
pytest wrappers in tests/test_multirank.py launch them and read those lines.
The engine defaults to cpu; ``gpu`` runs the same checks on CUDA + NCCL.
"""
from __future__ import annotations

import sys

import ml_dtypes
import numpy as np

import echonccl
from echonccl import codec, dtypes

from mpi_common import ALGOS, ENGINE, P, RANK, WORLD, rank_data, run_checks, to_engine, to_host
from support import ONE_HOP, amax_sum, assert_identical_across_ranks, error_bound, exact_sum


def check_identical_and_bounded():
    """Both schedules, every dtype, odd sizes, in and out of place: identical on all ranks and
    within the documented per-element bound of the exact fp64 sum."""
    comm = echonccl.Communicator(engine=ENGINE)
    G = comm.group_size
    for algo in ALGOS:
        for dt in ("float32", "float16", "bfloat16"):
            for n in (1, 7, 513, 5000, 100_003):
                x = rank_data(n, dt, seed=n)
                exact = exact_sum(x)
                xe = to_engine(x)
                y = to_host(comm.all_reduce(xe, feedback=False, algorithm=algo))
                yi = to_engine(x.copy())
                comm.all_reduce(yi, yi, feedback=False, algorithm=algo)
                assert to_host(yi).tobytes() == y.tobytes(), f"{algo} {dt} n={n}: in-place differs"
                assert_identical_across_ranks(y, f"{algo} {dt} n={n}")
                bound = error_bound(exact, amax_sum(x, codec.unit_size(comm.config.codec, G)), algo, P, dt,
                                    comm.config.codec)
                err = np.abs(y.astype(np.float64) - exact)
                worst = float(np.max(err / bound))
                assert worst <= 1.0, f"{algo} {dt} n={n}: error {worst:.3f} of the bound"
    comm.close()


def check_telescoping():
    """Over T calls sharing a Feedback: sum(out) - sum(exact) == -(all residuals), up to fp32
    rounding; with one 4-bit round per call and with two (``rounds=2``)."""
    comm = echonccl.Communicator(engine=ENGINE)
    n, T = 3000, 40
    for algo in ALGOS:
        for rounds in (1, 2):
            fb = comm.new_feedback()
            acc_out = np.zeros(n)
            acc_exact = np.zeros(n)
            for t in range(T):
                x = rank_data(n, "float32", seed=t)
                acc_exact += exact_sum(x)
                y = comm.all_reduce(to_engine(x), feedback=fb, algorithm=algo, rounds=rounds)
                acc_out += to_host(y).astype(np.float64)
            residual = owed(fb, n)
            gap = acc_out - acc_exact + residual
            # each round rounds a handful of fp32 additions of magnitude ~P: about 1e-6 each
            tol = 2.0 ** -22 * T * P * 2 * rounds
            worst = np.max(np.abs(gap))
            if RANK == 0:
                print(f"{algo} rounds={rounds}: telescoping gap {worst:.3g} (tolerance {tol:.3g}), "
                      f"residual {np.max(np.abs(residual)):.3g}")
            assert worst <= tol, f"{algo} rounds={rounds}: telescoping gap {worst:.3g} > {tol:.3g}"
            # (int7-h32 contributions' residuals are some 60 times smaller per round: two rounds leave ~8 tol, and
            # one_shot_q's, quantizing each element once, ~3.7 tol)
            guard = 3 if codec.wide(codec.parts(comm.config.codec)[0]) else 100
            assert np.max(np.abs(residual)) > guard * tol, f"{algo}: residuals too small for the test to mean anything"
    comm.close()


def owed(fb, n: int) -> np.ndarray:
    """What the calls sharing ``fb`` still owe the sum: every rank's residuals, added (float64, n),
    taken back from the rotated domain for a rotated codec."""
    state = fb.state_dict()
    cd = state["codec"]
    e_in = WORLD.allreduce(codec.residual_values(state["inputs"], cd))
    e_out = np.concatenate(WORLD.allgather(codec.residual_values(state["output"], cd)))
    return (e_in + e_out)[:n]


def check_rounds():
    """``rounds=r``: every extra 4-bit round cuts one call's error several times (down to the
    output dtype's rounding and, with int8 residuals, their own), outputs stay identical on all
    ranks, and the GPU engine gives the CPU engine's bits (outputs and residuals, NaN and Inf
    groups included)."""
    comm = echonccl.Communicator(engine=ENGINE)
    ref = echonccl.Communicator(engine="cpu") if ENGINE == "gpu" else None
    for algo in ALGOS + ("two_shot_pipelined",):
        for dt in ("bfloat16", "float32"):
            for n in (1000, 100_003):
                x = rank_data(n, dt, seed=5)
                exact = exact_sum(x)
                floor = rel_err(exact.astype(x.dtype), exact)       # the output dtype's own rounding
                errs = []
                for rounds in (1, 2, 3):
                    y = to_host(comm.all_reduce(to_engine(x), feedback=comm.new_feedback(), algorithm=algo,
                                                rounds=rounds))
                    what = f"{algo} {dt} n={n} rounds={rounds}"
                    assert_identical_across_ranks(y, what)
                    errs.append(rel_err(y, exact))
                if RANK == 0:
                    print(f"{algo} {dt} n={n}: relative error by rounds {[f'{e:.2e}' for e in errs]}, "
                          f"{dt} rounding alone {floor:.2e}")
                # (one_shot_q does not feed its output's rounding back: each round adds one, 2x the floor)
                floor_q = 2 * floor if algo in ONE_HOP else 0.0
                assert errs[1] < max(errs[0] / 5, floor_q), \
                    f"{algo} {dt} n={n}: rounds=2 error {errs[1]:.3g} vs {errs[0]:.3g}"
                # int8 residuals drop, and do not feed back, up to 1/64 of one round's error (RMS;
                # codec.py, "Residuals")
                res_floor = errs[0] / 64 if _int8_residuals(comm, dt) else 0.0
                assert errs[2] < max(errs[1] / 3, 2 * floor + res_floor), f"{algo} {dt} n={n}: rounds=3 error {errs}"
                if ref is not None:
                    _same_as_reference(comm, ref, algo, dt, n)
    comm.close()
    if ref is not None:
        ref.close()


def _int8_residuals(comm, dt: str) -> bool:
    """Whether ``comm``'s default feedback keeps int8 residual blocks for data of type ``dt``."""
    fmt = comm.new_feedback().residual_dtype
    return codec.residual_dtype(fmt, dtypes.numpy_dtype(dt)) == np.uint8


def rel_err(y: np.ndarray, exact: np.ndarray) -> float:
    return float(np.linalg.norm(y.astype(np.float64) - exact) / np.linalg.norm(exact))


def _same_as_reference(comm, ref, algo, dt, n):
    """Two calls of ``rounds=2`` sharing a state, the second with NaN and Inf: GPU bits == CPU bits."""
    fg, fc = comm.new_feedback(), ref.new_feedback()
    for t in range(2):
        x = call_data(n, dt, t)                        # n > 200 here: call 1 has the NaN and Inf
        yg = to_host(comm.all_reduce(to_engine(x), feedback=fg, algorithm=algo, rounds=2))
        yc = ref.all_reduce(x, feedback=fc, algorithm=algo, rounds=2)
        what = f"{algo} {dt} n={n} rounds=2 call={t}"
        assert same_bits(yg, yc), f"{what}: GPU output differs from the reference"
        assert_same_residuals(fg, fc, what)


def check_depth():
    """Error of the accumulated sum after T calls: bounded with feedback, growing without."""
    comm = echonccl.Communicator(engine=ENGINE)
    n, T = 4096, 256
    rng = np.random.default_rng(7 + RANK)
    base = rng.standard_normal(n)
    for algo in ALGOS:
        errs = {}
        for use_fb in (True, False):
            fb = comm.new_feedback() if use_fb else False
            acc_out, acc_exact, curve = np.zeros(n), np.zeros(n), []
            for t in range(T):
                x = (base + 0.1 * rng.standard_normal(n)).astype(np.float32)
                acc_exact += exact_sum(x)
                acc_out += to_host(comm.all_reduce(to_engine(x), feedback=fb, algorithm=algo))
                curve.append(np.linalg.norm(acc_out - acc_exact))
            errs[use_fb] = np.array(curve)
        with_fb, without = errs[True], errs[False]
        if RANK == 0:
            print(f"{algo}: accumulated error at T=1,16,256: feedback {with_fb[0]:.3g} {with_fb[15]:.3g} "
                  f"{with_fb[-1]:.3g}; none {without[0]:.3g} {without[15]:.3g} {without[-1]:.3g}")
        assert with_fb.max() <= 2.0 * with_fb[0], f"{algo}: feedback error grew to {with_fb.max() / with_fb[0]:.2f}x"
        assert without[-1] >= 20 * without[0], f"{algo}: plain error grew only {without[-1] / without[0]:.1f}x"
    comm.close()


def check_special_values():
    """NaN/Inf reach their group's (int7-h32: block's) output as non-finite on every rank; other groups stay finite;
    the feedback state stays finite; huge and tiny values survive."""
    comm = echonccl.Communicator(engine=ENGINE)
    G = codec.unit_size(comm.config.codec, comm.group_size)   # one NaN's reach: group or block
    for algo in ALGOS:
        for dt in ("float32", "bfloat16", "float16"):
            fb = comm.new_feedback()
            n = 8 * G * P
            x = rank_data(n, dt, seed=3)
            if RANK == 0:
                x[5] = np.nan
            if RANK == P - 1:
                x[3 * G + 1] = np.inf
            y = to_host(comm.all_reduce(to_engine(x), feedback=fb, algorithm=algo))
            assert_identical_across_ranks(y, f"{algo} {dt} special")
            bad = ~np.isfinite(y.astype(np.float32))
            assert bad[:G].all() and bad[3 * G:4 * G].all(), f"{algo} {dt}: non-finite lost"
            assert bad.sum() == 2 * G, f"{algo} {dt}: {bad.sum()} non-finite, want {2 * G}"
            st = fb.state_dict()
            assert np.isfinite(st["inputs"].astype(np.float32)).all() and np.isfinite(st["output"].astype(np.float32)).all()
            x2 = rank_data(n, dt, seed=4)
            y2 = to_host(comm.all_reduce(to_engine(x2), feedback=fb, algorithm=algo))
            assert np.isfinite(y2.astype(np.float32)).all(), f"{algo} {dt}: NaN poisoned the next call"
            big = np.zeros(n, dtype=dtypes.numpy_dtype(dt))
            dmax = float(ml_dtypes.finfo(big.dtype).max)
            rot = codec.rotated(comm.config.codec)
            if rot:                         # the rotated codec's range: below 2**126 and below max / 4
                dmax = float(np.array(min(dmax / 4, 2.0 ** 125)).astype(big.dtype))
            big[:G] = dmax if RANK == 0 else 0
            big[G:2 * G] = 1e-30 if dt != "float16" else 1e-7
            y3 = to_host(comm.all_reduce(to_engine(big), feedback=False, algorithm=algo)).astype(np.float64)
            assert np.isfinite(y3).all(), f"{algo} {dt}: huge value overflowed"
            if rot:
                assert np.all(np.abs(y3[:G] / dmax - 1) <= 0.25), f"{algo} {dt}: huge value not kept"
            else:
                assert np.all(y3[:G] == dmax), f"{algo} {dt}: max not kept"
            assert np.all(y3[G:2 * G] > 0), f"{algo} {dt}: tiny values collapsed to zero"
    comm.close()


def call_data(n: int, dt: str, t: int) -> np.ndarray:
    """Call ``t``'s input of a sequence: on call 1 (n > 200) a NaN on rank 0 and an Inf on the last;
    on call 3 (n > 200) the dtype's maximum on every rank in elements 256-287 (a sum that overflows
    float32 for bfloat16 and float32, the float16 output for float16)."""
    x = rank_data(n, dt, seed=t)
    if t == 1 and n > 200:
        x[17] = np.nan if RANK == 0 else x[17]
        x[100] = np.inf if RANK == P - 1 else x[100]
    if t == 3 and n > 300:
        x[256:288] = ml_dtypes.finfo(x.dtype).max
    return x


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Bitwise equal, except that any NaN matches any NaN (payloads may differ between engines)."""
    a32, b32 = a.astype(np.float32), b.astype(np.float32)
    nan = np.isnan(a32)
    return bool(np.array_equal(nan, np.isnan(b32)) and a[~nan].tobytes() == b[~nan].tobytes())


def assert_same_residuals(fa, fb, what: str) -> None:
    """Both feedback states hold bitwise the same residuals (inputs and output)."""
    sa, sb = fa.state_dict(), fb.state_dict()
    assert sa["inputs"].tobytes() == sb["inputs"].tobytes(), f"{what}: input residual differs"
    assert sa["output"].tobytes() == sb["output"].tobytes(), f"{what}: output residual differs"


def check_matches_reference():
    """GPU engine == CPU engine bit for bit: outputs and both residuals, over several calls
    with feedback, every dtype and residual dtype, odd sizes, special values."""
    gpu = echonccl.Communicator(engine="gpu")
    cpu = echonccl.Communicator(engine="cpu")
    for algo in ALGOS:
        for dt in ("bfloat16", "float16", "float32"):
            for rdt in ("float32", "input", "int8"):
                for n in (1, 1000, 5000, 100_003, (1 << 20) + 3):
                    fg, fc = gpu.new_feedback(rdt), cpu.new_feedback(rdt)
                    for t in range(3):
                        x = call_data(n, dt, t)
                        if t == 1 and n > 200:
                            x[150:160] = 1e-30 if dt != "float16" else 1e-7
                        yg = to_host(gpu.all_reduce(to_engine(x), feedback=fg, algorithm=algo))
                        yc = cpu.all_reduce(x, feedback=fc, algorithm=algo)
                        what = f"{algo} {dt} res={rdt} n={n} call={t}"
                        assert same_bits(yg, yc), f"{what}: GPU output differs from the reference"
                        assert_same_residuals(fg, fc, what)
                        assert_identical_across_ranks(np.nan_to_num(yg.astype(np.float32)), what)
    gpu.close()
    cpu.close()


def check_graph_replay():
    """An all-reduce captured in a CUDA graph and replayed gives what eager calls give."""
    import cupy

    comm = echonccl.Communicator(engine="gpu")
    n = 1 << 22                         # a power of two: two_shot_pipelined cuts it into chunks
    for algo in ALGOS + ("two_shot_pipelined",):
        x = cupy.asarray(rank_data(n, "bfloat16", seed=11))
        out = cupy.empty_like(x)
        eager_fb, graph_fb = comm.new_feedback(), comm.new_feedback()
        comm.all_reduce(x, out, feedback=eager_fb, algorithm=algo)   # warm-up binds state and workspace
        comm.all_reduce(x, out, feedback=graph_fb, algorithm=algo)
        eager_fb.reset()
        graph_fb.reset()
        cupy.cuda.get_current_stream().synchronize()   # the graph runs on another stream: order it after these
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            stream.begin_capture()
            comm.all_reduce(x, out, feedback=graph_fb, algorithm=algo)
            graph = stream.end_capture()
        results = []
        for _ in range(3):
            with stream:
                graph.launch(stream)
            stream.synchronize()
            results.append(out.get())
        expect = []
        for _ in range(3):
            expect.append(comm.all_reduce(x, feedback=eager_fb, algorithm=algo).get())
        for g, e in zip(results, expect):
            assert same_bits(g, e), f"{algo}: graph replay differs from eager calls"
        assert not same_bits(results[0], results[1]), f"{algo}: replays did not carry the feedback state"
        del graph  # NCCL keeps a reference per captured graph: destroy graphs before closing
    comm.close()


def check_torch_interop():
    """PyTorch tensors in and out through DLPack / the CUDA array interface, echonccl importing no torch."""
    import torch

    comm = echonccl.Communicator(engine="gpu")
    cpu = echonccl.Communicator(engine="cpu")
    assert "torch" not in {m.split(".")[0] for m in sys.modules if m.startswith("echonccl")}
    for dt in ("bfloat16", "float16", "float32"):
        x = rank_data(4099, dt, seed=5)
        expect = cpu.all_reduce(x, feedback=False, algorithm="two_shot")
        t = torch.from_numpy(x.view(np.uint16) if dt == "bfloat16" else x)
        t = (t.view(torch.bfloat16) if dt == "bfloat16" else t).to(f"cuda:{comm.engine.device.id}")
        comm.all_reduce(t, t, feedback=False, algorithm="two_shot")  # in place on the tensor
        torch.cuda.synchronize()
        got = t.cpu()
        got = got.view(torch.uint16).numpy().view(x.dtype) if dt == "bfloat16" else got.numpy()
        assert same_bits(got, expect), f"torch {dt}: differs from the reference"
    comm.close()
    cpu.close()


def check_pipelined_matches_two_shot():
    """two_shot_pipelined gives two_shot's bits: outputs and residuals over calls with feedback,
    every dtype, in and out of place (run with a small ECHONCCL_DEV_PIPELINE_MIN_CHUNK so K > 1)."""
    from echonccl.schedules.pipelined import chunk_count

    comm = echonccl.Communicator(engine=ENGINE)
    chunked = 0
    for dt in ("float32", "bfloat16", "float16"):
        for n in (4096 * P, 8192 * P - 3, 65536 * P + 1000, 3000):
            fa, fb = comm.new_feedback(), comm.new_feedback()
            chunked += chunk_count(echonccl.Layout(n, P).slice_elems) > 1
            for t in range(3):
                x = rank_data(n, dt, seed=20 + t)
                ya = to_host(comm.all_reduce(to_engine(x), feedback=fa, algorithm="two_shot"))
                xi = to_engine(x.copy())
                comm.all_reduce(xi, xi, feedback=fb, algorithm="two_shot_pipelined")
                what = f"{dt} n={n} call={t}"
                assert to_host(xi).tobytes() == ya.tobytes(), f"{what}: pipelined output differs"
                assert_same_residuals(fa, fb, what)
    assert chunked >= 6, f"only {chunked} cases were cut into chunks: the test would prove nothing"
    comm.close()

def check_fused(dts=("bfloat16", "float16", "float32"), sizes=(1, 513, 3 * 8192 + 17, (1 << 20) + 3, 3 << 22),
                one_shot_sizes=(1, 5, 1000, 1 << 16, (1 << 20) + 5)):
    """The fused peer-memory kernels (the GPU engine's two_shot where GPUs map each other's
    memory) against the NCCL send/recv path: outputs and both residuals bit for bit, with
    rounds 1 and 2, every dtype and residual dtype, in place too; and the 16-bit one-shot
    equals the float32 sum in rank order rounded once, bitwise, on every rank."""
    import os

    fused = echonccl.Communicator(engine="gpu")
    assert fused.engine.fused is not None, f"no fused path here: {fused.engine.describe()}"
    os.environ["ECHONCCL_FUSED"] = "0"
    try:
        plain = echonccl.Communicator(engine="gpu")
    finally:
        del os.environ["ECHONCCL_FUSED"]
    assert plain.engine.fused is None
    for dt in dts:
        for rdt in ("float32", "input", "int8"):
            for n in sizes:
                fa, fb = fused.new_feedback(rdt), plain.new_feedback(rdt)
                for t in range(3):
                    x = call_data(n, dt, t)
                    rounds = 2 if t == 2 else 1
                    ya = to_host(fused.all_reduce(to_engine(x), feedback=fa, algorithm="two_shot", rounds=rounds))
                    yb = to_host(plain.all_reduce(to_engine(x), feedback=fb, algorithm="two_shot", rounds=rounds))
                    what = f"fused {dt} res={rdt} n={n} call={t}"
                    assert same_bits(ya, yb), f"{what}: fused output differs from the NCCL path"
                    assert_same_residuals(fa, fb, what)
                    assert_identical_across_ranks(np.nan_to_num(ya.astype(np.float32)), what)
                xi = to_engine(x)
                fused.all_reduce(xi, xi, feedback=False, algorithm="two_shot")
                yb = to_host(plain.all_reduce(to_engine(x), feedback=False, algorithm="two_shot"))
                assert same_bits(to_host(xi), yb), f"fused {dt} n={n}: in place differs"
    for dt in dts:
        for n in one_shot_sizes:
            x = rank_data(n, dt, seed=3)
            every = WORLD.allgather(x)
            acc = np.full(n, -0.0, np.float32)
            for xr in every:
                acc = acc + xr.astype(np.float32)
            expect = acc.astype(x.dtype)
            y = to_host(fused.all_reduce(to_engine(x), algorithm="one_shot"))
            assert y.tobytes() == expect.tobytes(), f"one_shot {dt} n={n}: differs from the float32 sum"
            xi = to_engine(x)
            fused.all_reduce(xi, xi, algorithm="one_shot")
            assert to_host(xi).tobytes() == expect.tobytes(), f"one_shot {dt} n={n}: in place differs"
    fused.synchronize()
    fused.close()
    plain.close()



def ranks_sharing_gpu() -> int:
    """How many ranks (this one included) run on this rank's current GPU (collective: every rank calls it)."""
    import cupy

    dev = cupy.cuda.runtime.getDevice()
    return WORLD.allgather(dev).count(dev)


def check_fused_reference():
    """The fused kernels (two_shot, with and without its output's rounding fed back, and one_shot_q,
    in turn) against the CPU reference directly,
    without NCCL (so ranks may share a GPU: their IPC-mapped buffers work the same; their kernels
    take turns): outputs and both residuals bit for bit, every codec, every dtype and residual
    dtype, rounds 1 and 2, sizes that run the general kernel and those (multiples of 512) that run the
    `_whole` one: 3 * 2^15, and 5 * 2^12, whose slices end inside a 2048-element chunk at 4 and 8
    ranks, 37 * 512 (the last slice ends early) and 3 * 512 (at 4 and 8 ranks, slices with nothing),
    and counts that run the any-count twin where there is one (`kernel_table.takes_any_count`), the
    general kernel elsewhere: 513 and 3 * 8192 + 17 (the last 512-element block in part);
    at 37 * 512 and 3 * 8192 + 17 rank 0's buffers are one element off 16-byte alignment, so rank 0
    runs a general kernel (the shifted twin where there is one, `kernel_table.takes_shift`) and its
    peers the whole or any-count one, which must agree on what they leave alone past the count;
    at 100_003 every rank's buffers are off alignment, each by its own number of elements (the
    shifted kernels' loads and stores at each shift); the one-shot equals the float32 sum in rank
    order rounded once, low-latency (up to 1 MiB) and tiled. Ranks sharing a GPU split its blocks, so
    that their kernels may also run at once (under MPS: tools/gpu_suite.sh); the low-latency
    one-shot's grid is its words / 256 (a block waits for the same block of every peer), so its
    sizes stay small enough for eight ranks' grids to be resident together (20_001 float32
    elements: 79 blocks a rank)."""
    import cupy

    from echonccl import fused as fz
    from echonccl.codec import CODECS
    from echonccl.layout import Layout

    cupy.cuda.Device(RANK % cupy.cuda.runtime.getDeviceCount()).use()
    dup = WORLD.Dup()
    paths = fz.FusedPaths(dup, dup.allgather, RANK, P, 60.0, lambda: False)
    paths.max_blocks //= ranks_sharing_gpu()   # every rank's grid resident at once (MPS)

    def zeros(n, dt):
        return cupy.zeros(n, dtype=dt)

    # every codec
    mixed, mixed_any, ragged = 37 * 512, 3 * 8192 + 17, 100_003
    runs = [(c, ("bfloat16", "float16", "float32"), ("float32", "input", "int8"),
             (513, mixed_any, ragged, 3 << 15, 5 << 12, mixed, 3 * 512)) for c in CODECS]

    def engine_array(x, off):
        """``x`` on the device, ``off`` elements into a larger buffer (off 1: misaligned)."""
        a = cupy.empty(x.size + off, dtype=x.dtype)[off:]
        a[...] = to_engine(x)
        return a

    for codec_name, dts, rdts, sizes in runs:
        ref = echonccl.Communicator(engine="cpu", codec=codec_name)
        for dt in dts:
            for rdt in rdts:
                variants = (("two_shot", True), ("two_shot", False), ("one_shot_q", True))
                for n, (algo, rounding) in ((n, v) for n in sizes for v in variants):
                    run = getattr(paths, algo)
                    L = Layout(n, P, codec_name)
                    fc, fg = ref.new_feedback(rdt, rounding=rounding), echonccl.Feedback(rdt, rounding=rounding)
                    state = fg.bind((n, P, L.group, dt), L, dtypes.numpy_dtype(dt), zeros, codec_name)
                    for t in range(4):
                        x = call_data(n, dt, t)
                        rounds = 2 if t == 2 else 1
                        yc = ref.all_reduce(x, feedback=fc, algorithm=algo, rounds=rounds)
                        # off 16-byte alignment: rank 0 beside whole-kernel peers (mixed); at `ragged`
                        # every rank, each by its own offset (at 8 ranks every one of a 16-byte word's)
                        off = int(RANK == 0) if n in (mixed, mixed_any) else (3 * RANK + 1) % 8 if n == ragged else 0
                        xg = engine_array(x, off)
                        out = engine_array(np.zeros_like(x), off)
                        # where buffers are aligned: the whole-slice kernel for multiples of 512,
                        # else its any-count twin where its phases all run 16 elements a thread
                        loop16 = (algo == "two_shot" and not rounding and dt != "float32"
                                  and rdt in ("input", "int8"))
                        k = paths.first_kernel(algo, L, xg, out, state)
                        assert k.whole == (not off and (n % 512 == 0 or loop16)), (n, k.name)
                        assert k.any_count == (k.whole and n % 512 != 0), (n, k.name)
                        assert k.shifted == (bool(off) and loop16), (n, k.name)
                        run(L, xg, out, state, rounds)
                        cupy.cuda.runtime.deviceSynchronize()
                        what = f"fused {algo} rounding={rounding} {codec_name} {dt} res={rdt} n={n} call={t}"
                        assert same_bits(to_host(out), yc), f"{what}: fused output differs from the reference"
                        assert_same_residuals(fg, fc, what)
                    run(L, xg, xg, None, 1)                               # in place, no feedback
                    yc = ref.all_reduce(x, feedback=False, algorithm=algo)
                    cupy.cuda.runtime.deviceSynchronize()
                    assert same_bits(to_host(xg), yc), f"fused {algo} {codec_name} {dt} n={n}: in place differs"
        ref.close()
    for dt in ("bfloat16", "float16", "float32"):
        for n in (1, 5, 1000, 20_001, (1 << 20) + 5):
            x = rank_data(n, dt, seed=3)
            acc = np.full(n, -0.0, np.float32)
            for xr in WORLD.allgather(x):
                acc = acc + xr.astype(np.float32)
            out = cupy.empty(n, dtype=x.dtype)
            paths.one_shot(to_engine(x), out)
            cupy.cuda.runtime.deviceSynchronize()
            assert to_host(out).tobytes() == acc.astype(x.dtype).tobytes(), f"one_shot {dt} n={n}"
    assert not paths.failed()
    cupy.cuda.runtime.deviceSynchronize()
    paths.close()
    dup.Free()


def check_fused_skew():
    """A rank a call ahead never overwrites what a slow peer still reads. The last rank runs every
    fused kernel with one block, so it reads its peers' pushes long after they sent them, and the
    others, with their whole grid, finish each call as soon as its pushes are in and start the
    next; calls go back to back with other data: the 16-bit one-shot (tiled, above the
    low-latency size) after itself, one_shot_q after itself and after two_shot, two_shot after
    both. Every output equals its reference (no feedback), on every rank."""
    import cupy

    from echonccl import fused as fz
    from echonccl.layout import Layout

    cupy.cuda.Device(RANK % cupy.cuda.runtime.getDeviceCount()).use()
    dup = WORLD.Dup()
    paths = fz.FusedPaths(dup, dup.allgather, RANK, P, 20.0, lambda: False)
    sharing = ranks_sharing_gpu()                 # (under MPS: all resident at once)
    paths.max_blocks = 1 if RANK == P - 1 else max(1, paths.max_blocks // sharing - 1)
    ref = echonccl.Communicator(engine="cpu")
    n = 3 << 19                                   # 3 MiB of bfloat16: the tiled one-shot
    L = Layout(n, P, ref.config.codec)
    order = ("one_shot", "one_shot", "one_shot", "two_shot", "one_shot_q", "one_shot_q", "two_shot", "one_shot",
             "one_shot_q", "one_shot")
    xs = [rank_data(n, "bfloat16", seed=40 + i) for i in range(len(order))]
    outs = []
    for algo, x in zip(order, xs):                # enqueued back to back, no host wait
        xg, out = to_engine(x), cupy.empty(n, dtype=x.dtype)
        if algo == "one_shot":
            paths.one_shot(xg, out)
        else:
            getattr(paths, algo)(L, xg, out, None, 1)
        outs.append((xg, out))
    cupy.cuda.runtime.deviceSynchronize()
    assert not paths.failed(), "a fused kernel timed out"
    for i, (algo, x) in enumerate(zip(order, xs)):
        got = to_host(outs[i][1])
        if algo == "one_shot":
            acc = np.full(n, -0.0, np.float32)
            for xr in WORLD.allgather(x):
                acc = acc + xr.astype(np.float32)
            want = acc.astype(x.dtype)
        else:
            want = ref.all_reduce(x, feedback=False, algorithm=algo)
        assert got.tobytes() == want.tobytes(), \
            f"call {i} ({algo}) after {order[i - 1] if i else 'none'}: {np.count_nonzero(got != want)} elements differ"
    ref.close()
    paths.close()
    dup.Free()


CHECKS = {f.__name__[len("check_"):]: f for f in
          (check_identical_and_bounded, check_telescoping, check_depth, check_special_values,
           check_matches_reference, check_graph_replay, check_torch_interop,
           check_pipelined_matches_two_shot, check_rounds, check_fused, check_fused_reference, check_fused_skew)}

if __name__ == "__main__":
    import os

    # CHECK_WATCHDOG: seconds one check may run before every thread's stack is dumped and it exits
    run_checks(CHECKS, sys.argv[1], watchdog=float(os.environ.get("CHECK_WATCHDOG", 500)))
