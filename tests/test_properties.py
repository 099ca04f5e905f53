"""Property tests (hypothesis) of the codec and of both schedules on the CPU engine's kernels.

* codec: every finite group round-trips within half a quantization step, keeps signs, never
  writes the -8 nibble, re-encodes its decoded values to the same codes; zero groups are exact;
  non-finite groups decode to NaN without touching their neighbours;
* schedules, in one process: P ranks simulated by threads over an in-memory transport (the
  numpy kernels and the schedule code of the CPU engine, world sizes 2..6): identical outputs on
  every rank, NaN exactly in the groups with a NaN/Inf input, the README's error bound without
  feedback, telescoping with it, and ring == two-shot bit for bit at two ranks;
* schedules across real MPI ranks: tests/mpi/hardening.py ``properties`` under mpiexec (the same
  derandomized examples on every rank), through the Communicator.
"""
from __future__ import annotations

import queue
from concurrent.futures import ThreadPoolExecutor

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from echonccl import codec, dtypes
from echonccl.communicator import Workspace
from echonccl.feedback import Feedback
from echonccl.kernels_numpy import NumpyKernels
from echonccl.layout import Layout
from echonccl.schedules import SCHEDULES, gather_slots, run_rounds
from echonccl.transport import gather_transfers

import support
from test_hardening import SHARED_LAUNCH

SETTINGS = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
F32_MAX = float(np.finfo(np.float32).max)
SUB = 2.0 ** -149                      # smallest float32 subnormal
DTYPES = ("float32", "bfloat16", "float16")


# -- codec ----------------------------------------------------------------------------------------
@st.composite
def float32_groups(draw, allow_nonfinite=False):
    """(values, group): 1..6 groups of float32: arbitrary bit patterns' floats (subnormals,
    extremes), scaled normals, or constant groups."""
    group = 32                                 # int4 and int4-h32 (int7-h32: test_codec_int7.py)
    n = group * draw(st.integers(1, 6))
    kind = draw(st.sampled_from(["any", "scaled", "constant"]))
    if kind == "any":
        elems = st.floats(width=32, allow_nan=allow_nonfinite, allow_infinity=allow_nonfinite)
        v = draw(hnp.arrays(np.float32, n, elements=elems))
    elif kind == "scaled":
        rng = np.random.default_rng(draw(st.integers(0, 2 ** 32 - 1)))
        v = (rng.standard_normal(n) * 2.0 ** draw(st.integers(-149, 126))).astype(np.float32)
    else:
        v = np.full(n, draw(st.floats(width=32, allow_nan=False, allow_infinity=False)), np.float32)
    if allow_nonfinite and draw(st.booleans()):
        v[draw(st.integers(0, n - 1))] = draw(st.sampled_from([np.nan, np.inf, -np.inf]))
    return np.ascontiguousarray(v), group


@SETTINGS
@given(float32_groups())
def test_codec_finite_groups_round_trip_within_half_a_step(vg):
    v, G = vg
    q, scale = codec.quantize_groups(v, G)
    assert q.dtype == np.int8 and np.all(np.abs(q) <= 7)
    assert np.array_equal(codec.unpack_codes(codec.pack_codes(q)), q)
    packed = codec.pack_codes(q)
    assert not np.any((packed & 0x0F) == 0x8) and not np.any((packed >> 4) == 0x8), "the -8 nibble was written"
    d = codec.dequantize_groups(q, scale, G)
    assert np.isfinite(d).all(), "a finite input decoded non-finite"
    g = v.reshape(-1, G).astype(np.float64)
    amax = np.abs(g).max(axis=1)
    assert np.array_equal(scale == 0, amax == 0), "scale is 0 exactly for all-zero groups"
    nz = amax > 0
    assert np.all(scale[nz] >= SUB)
    expect = np.maximum((np.abs(v.reshape(-1, G)).max(axis=1) / np.float32(7)).astype(np.float32), np.float32(SUB))
    assert np.array_equal(scale[nz], expect[nz]), "scale is not max(amax / 7, 2**-149) in float32"
    err = np.abs(g - d.reshape(-1, G).astype(np.float64))
    step = scale.astype(np.float64)[:, None]
    # half a step, the decode's own rounding, and (groups below ~1e-44 only) the clip to +-7
    assert np.all(err <= 0.5 * step * (1 + 2.0 ** -20) + np.abs(d.reshape(-1, G)) * 2.0 ** -23 + 4 * SUB)
    normal = amax >= 2.0 ** -120
    assert np.all(np.abs(g[normal] / step[normal]) <= 7.5), "clipping outside the subnormal range"
    dd = d.reshape(-1, G)
    assert np.all((dd == 0) | (np.sign(dd) == np.sign(g))), "a sign flipped"
    q2, _ = codec.quantize_groups(d, G)
    assert np.array_equal(q2, q), "re-encoding decoded values changed the codes"


@SETTINGS
@given(float32_groups(allow_nonfinite=True))
def test_codec_nonfinite_groups_are_nan_and_isolated(vg):
    v, G = vg
    q, scale = codec.quantize_groups(v, G)
    d = codec.dequantize_groups(q, scale, G).reshape(-1, G)
    bad = ~np.isfinite(v.reshape(-1, G)).all(axis=1)
    assert np.isnan(scale[bad]).all() and not q.reshape(-1, G)[bad].any()
    assert np.isnan(d[bad]).all(), "a group with NaN/Inf did not decode to NaN"
    assert np.isfinite(d[~bad]).all()
    for i in np.flatnonzero(~bad):                      # groups are encoded independently
        qi, si = codec.quantize_groups(np.ascontiguousarray(v.reshape(-1, G)[i]), G)
        assert np.array_equal(qi, q.reshape(-1, G)[i]) and si[0] == scale[i]
    r = codec.residual_of(v, d.reshape(-1), np.float32)
    assert np.isfinite(r).all(), "a residual came out non-finite"
    assert not r.reshape(-1, G)[bad].any(), "a non-finite group left a residual"


@SETTINGS
@given(st.integers(1, 8).map(lambda k: 512 * k), st.just(32), st.integers(0, 2 ** 32 - 1),
       st.integers(-140, 120))
def test_wire_format_size_and_round_trip(S, G, seed, e):
    v = (np.random.default_rng(seed).standard_normal(S) * 2.0 ** e).astype(np.float32)
    wire = codec.encode(v, G)
    assert wire.dtype == np.uint8 and wire.size == codec.slice_bytes(S, G) == S // 2 + 4 * (S // G)
    q, scale = codec.quantize_groups(v, G)
    assert codec.decode(wire, S, G).tobytes() == codec.dequantize_groups(q, scale, G).tobytes()


# -- schedules over simulated ranks ---------------------------------------------------------------
class ThreadTransport:
    """`transport.Transport` between threads of one process: unbounded queues per (src, dst),
    sends posted before receives, so a round never deadlocks; messages keep their size."""

    def __init__(self, hub, rank: int, size: int):
        self.hub, self.rank, self.size = hub, rank, size

    def exchange(self, sends, recvs) -> None:
        for peer, buf in sends:
            self.hub[(self.rank, peer)].put(buf.copy())
        for peer, buf in recvs:
            data = self.hub[(peer, self.rank)].get(timeout=30)
            assert data.size == buf.size, f"rank {self.rank}: {data.size} bytes from {peer}, expected {buf.size}"
            buf[:] = data

    def all_gather(self, buf, n: int) -> None:
        self.exchange(*gather_transfers(self.rank, self.size, buf, n))


@pytest.mark.parametrize("P", [1, 2, 3, 5])
def test_all_gather_as_one_round(P):
    """`gather_transfers` (the MPI engine's all-gather, and the NCCL one's fallback): every rank
    ends with every rank's part, its own untouched, each part sent exactly once to each peer."""
    n, hub = 7, {(s, d): queue.SimpleQueue() for s in range(P) for d in range(P)}
    bufs = [np.full(P * n, 255, np.uint8) for _ in range(P)]
    for r in range(P):
        bufs[r][r * n:(r + 1) * n] = np.arange(n, dtype=np.uint8) + 10 * r
    with ThreadPoolExecutor(P) as ex:
        list(ex.map(lambda r: ThreadTransport(hub, r, P).all_gather(bufs[r], n), range(P)))
    want = np.concatenate([np.arange(n, dtype=np.uint8) + 10 * r for r in range(P)])
    for r in range(P):
        assert bufs[r].tobytes() == want.tobytes(), f"rank {r}"
    assert all(q.empty() for q in hub.values())
    sends, recvs = gather_transfers(1 % P, P, bufs[0], n)
    assert [p for p, _ in sends] == [p for p, _ in recvs] == [s for s in range(P) if s != 1 % P]


def simulate(algo: str, xs: list[np.ndarray], group: int, states=None, rounds: int = 1,
             codec_name: str = "int4") -> list[np.ndarray]:
    """Run one all-reduce of ``xs`` (one array per simulated rank) through the schedule, in ``rounds``."""
    P, n = len(xs), xs[0].size
    layout = Layout(n, P, codec_name)
    hub = {(s, d): queue.SimpleQueue() for s in range(P) for d in range(P)}
    outs = [np.empty_like(x) for x in xs]

    def rank(r):
        B = layout.slice_bytes
        n_gather, Bg = gather_slots(algo, layout)
        ws = Workspace(np.empty((P - 1) * B, np.uint8), np.empty((P - 1) * B, np.uint8),
                       np.empty(n_gather * Bg, np.uint8))
        run_rounds(SCHEDULES[algo], NumpyKernels(), ThreadTransport(hub, r, P), layout, xs[r], outs[r],
                   None if states is None else states[r], ws, rounds)

    with ThreadPoolExecutor(P) as ex:
        list(ex.map(rank, range(P)))
    return outs


def canonical(y) -> bytes:
    f = y.astype(np.float32)
    f[np.isnan(f)] = np.nan
    return f.tobytes()


def bound(xs, algo, group, dtype, codec_name="int4"):
    """(exact sum of the finite inputs, `support.error_bound`) over the simulated ranks ``xs``."""
    x64 = np.stack([x.astype(np.float64) for x in xs])
    exact = np.where(np.isfinite(x64), x64, 0).sum(axis=0)
    amax_sum = sum(support.group_amax(x, group) for x in x64)
    return exact, support.error_bound(exact, amax_sum, algo, len(xs), dtype, codec_name)


case = st.fixed_dictionaries({
    "P": st.integers(2, 6),
    "n": st.one_of(st.integers(1, 3000), st.sampled_from([1, 31, 32, 33, 511, 512, 513, 1537, 3072])),
    "dtype": st.sampled_from(DTYPES),
    "algo": st.sampled_from(("two_shot", "ring", "one_shot_q")),
    "exp": st.integers(-30, 30),
    "seed": st.integers(0, 2 ** 32 - 1),
    "nan_at": st.lists(st.tuples(st.integers(0, 5), st.floats(0, 1, exclude_max=True)), max_size=3),
    "max_at": st.lists(st.floats(0, 1, exclude_max=True), max_size=2),
    "codec": st.sampled_from(codec.CODECS),
}).map(lambda c: {**c, "group": codec.group_size(c["codec"])})


def make_inputs(c, t=0):
    P, n, dt = c["P"], c["n"], dtypes.numpy_dtype(c["dtype"])
    e = max(min(c["exp"], 9), -12) if c["dtype"] == "float16" else c["exp"]
    xs = [(np.random.default_rng([c["seed"], t, r]).standard_normal(n) * 2.0 ** e).astype(dt) for r in range(P)]
    return xs


@SETTINGS
@given(case)
def test_schedules_identical_bounded_and_nan_exact_without_feedback(c):
    P, n, G, algo, cd = c["P"], c["n"], c["group"], c["algo"], c["codec"]
    U = codec.unit_size(cd, G)                 # what one NaN/Inf poisons and one scale bounds
    xs = make_inputs(c)
    dmax = float(ml_dtypes.finfo(xs[0].dtype).max)
    if codec.rotated(cd):
        dmax = min(dmax, 2.0 ** 126)           # the rotated codec's documented range (codec.py)
    bad = np.zeros(-(-n // U), bool)
    big = np.zeros_like(bad)
    for where in c["max_at"]:                  # +-max on rank 0 only, 0 elsewhere: no overflow
        i = int(where * n)
        for r in range(P):
            xs[r][i] = 0
        xs[0][i] = dmax if i % 2 else -dmax
        big[i // U] = True
    for r, where in c["nan_at"]:
        i = int(where * n)
        xs[r % P][i] = np.nan if r % 2 else np.inf
        bad[i // U] = True
    outs = simulate(algo, xs, G, codec_name=cd)
    assert all(canonical(o) == canonical(outs[0]) for o in outs), "outputs differ between ranks"
    y = outs[0].astype(np.float64)
    eb = np.repeat(bad, U)[:n]
    assert np.isnan(y[eb]).all(), "a group with NaN/Inf input is not all NaN"
    exact, b = bound(xs, algo, U, c["dtype"], cd)
    # A rotated codec's output is finite where its error bound keeps it inside the dtype's range
    # (codec.py: a block's quantization error spreads over the block; int4 keeps the max exactly).
    reach = (np.abs(exact) + b >= float(ml_dtypes.finfo(xs[0].dtype).max)) & codec.rotated(cd)
    assert np.isfinite(y[~eb & ~reach]).all(), "non-finite output outside the NaN/Inf groups"
    ok = ~(eb | np.repeat(big & ~bad, U)[:n])
    worst = float(np.max(np.abs(y - exact)[ok] / b[ok])) if ok.any() else 0.0
    assert worst <= 1.0, f"error {worst:.3f} of the bound"


@SETTINGS
@given(case, st.integers(2, 4), st.sampled_from(["float32", "input", "int8"]), st.integers(1, 3), st.booleans())
def test_schedules_telescope_with_feedback(c, T, residual_dtype, rounds, rounding):
    P, n, G, algo, dt, cd = c["P"], c["n"], c["group"], c["algo"], c["dtype"], c["codec"]
    assume(residual_dtype != "int8" or rounds == 1)    # int8's bound needs every stored residual seen
    layout = Layout(n, P, cd)
    key = (n, P, G, dt)
    fbs = [Feedback(residual_dtype, rounding=rounding) for _ in range(P)]
    states = [fb.bind(key, layout, dtypes.numpy_dtype(dt), np.zeros, cd) for fb in fbs]
    acc_out, acc_exact, xmax, rmax = np.zeros(n), np.zeros(n), 0.0, 0.0
    for t in range(T):
        xs = make_inputs(c, t)
        outs = simulate(algo, xs, G, states, rounds, cd)
        rmax = max([rmax] + [float(np.abs(codec.load_residuals(r)).max()) for s in states
                             for r in (s.inputs, s.output)])
        assert all(o.tobytes() == outs[0].tobytes() for o in outs), "outputs differ between ranks"
        acc_out += outs[0].astype(np.float64)
        acc_exact += np.sum([x.astype(np.float64) for x in xs], axis=0)
        xmax = max(xmax, max(float(np.abs(x.astype(np.float64)).max()) for x in xs))
    e_in = np.sum([codec.residual_values(s.inputs, cd) for s in states], axis=0)
    e_out = np.concatenate([codec.residual_values(s.output, cd) for s in states])
    residual = (e_in + e_out)[:n]
    assert all(np.isfinite(codec.load_residuals(s.inputs)).all() and np.isfinite(codec.load_residuals(s.output)).all()
               for s in states)
    gap = float(np.max(np.abs(acc_out - acc_exact + residual)))
    tol = 2.0 ** -18 * T * (P + 1) * xmax + 8 * T * P * SUB
    if residual_dtype == "input" and dt != "float32":
        tol += 2.0 ** -6 * T * (P + 1) * xmax * P
    if (algo in support.ONE_HOP or not rounding) and dt != "float32":   # its output's rounding is not fed back
        tol += 2.0 ** -7 * T * (P + 1) * xmax
    if residual_dtype == "int8":        # each stored residual is kept to 1/128 of its block's largest,
        # in the domain it is stored in: rotated back (int4-h32), an element sums 32 of those errors
        tol += 2.0 ** -7 * T * (P + 1) * rmax * (codec.ROT_BLOCK if codec.rotated(cd) else 1)
    assert gap <= tol, f"telescoping gap {gap:.3g} > {tol:.3g}"


@SETTINGS
@given(case, st.sampled_from(["float32", "input"]))
def test_rounding_off_changes_only_the_owner_residual(c, residual_dtype):
    """Feedback(rounding=False): the same outputs and input residuals; the owner's residual is its
    sum's quantization error alone, which differs from the default's only for 16-bit outputs."""
    P, n, G, algo, dt, cd = c["P"], c["n"], c["group"], c["algo"], c["dtype"], c["codec"]
    layout = Layout(n, P, cd)
    runs = {}
    for rounding in (True, False):
        states = [Feedback(residual_dtype, rounding=rounding).bind((n, P, G, dt), layout, dtypes.numpy_dtype(dt),
                                                                   np.zeros, cd) for _ in range(P)]
        outs = simulate(algo, make_inputs(c), G, states, 1, cd)
        runs[rounding] = (b"".join(o.tobytes() for o in outs), b"".join(s.inputs.tobytes() for s in states),
                          b"".join(s.output.tobytes() for s in states))
    assert runs[True][:2] == runs[False][:2], "outputs or input residuals depend on rounding"
    if dt == "float32" or algo in support.ONE_HOP:
        assert runs[True][2] == runs[False][2]
    elif n >= 256:
        assert runs[True][2] != runs[False][2], "rounding=False changed nothing"


@SETTINGS
@given(case, st.sampled_from(["float32", "input"]))
def test_ring_equals_two_shot_at_two_ranks(c, residual_dtype):
    c = {**c, "P": 2}
    n, G, dt, cd = c["n"], c["group"], c["dtype"], c["codec"]
    results = {}
    for algo in ("two_shot", "ring"):
        layout = Layout(n, 2, cd)
        states = [Feedback(residual_dtype).bind((n, 2, G, dt), layout, dtypes.numpy_dtype(dt), np.zeros, cd)
                  for _ in range(2)]
        outs = [simulate(algo, make_inputs(c, t), G, states, 1, cd)[0] for t in range(2)]
        results[algo] = b"".join(o.tobytes() for o in outs) + b"".join(
            s.inputs.tobytes() + s.output.tobytes() for s in states)
    assert results["two_shot"] == results["ring"]


@pytest.mark.parametrize("algo", ["two_shot", "ring", "one_shot_q"])
@pytest.mark.parametrize("residual_dtype", ["float32", "input", "int8"])
@pytest.mark.parametrize("cd", codec.CODECS)
def test_blocks_past_the_count_keep_a_new_states_bytes(cd, residual_dtype, algo):
    """The schedules leave every residual block past a slice's extent (`Layout.extent`) as a new
    state holds it, byte for byte, with feedback and rounds: what lets the fused kernels skip those
    blocks and still equal the reference. Counts whose last slices end inside a 512-element block,
    on one, or hold nothing at all (4 ranks of 5 * 512 elements)."""
    P, dt = 4, "bfloat16"
    for n in (5 * 512, 5 * 512 + 100, 9 * 512 - 32):
        layout = Layout(n, P, cd)
        S, G = layout.slice_elems, layout.group
        key = (n, P, G, dt)
        fbs = [Feedback(residual_dtype, rounding=False) for _ in range(P)]
        states = [fb.bind(key, layout, dtypes.numpy_dtype(dt), np.zeros, cd) for fb in fbs]
        fresh = Feedback(residual_dtype).bind(key, layout, dtypes.numpy_dtype(dt), np.zeros, cd)
        c = {"P": P, "n": n, "dtype": dt, "exp": 0, "seed": 5}
        past = [(v * S + layout.extent(v), (v + 1) * S) for v in range(P)]
        assert any(lo < hi for lo, hi in past), n
        for t, rounds in enumerate((1, 2, 1)):
            simulate(algo, make_inputs(c, t), G, states, rounds, cd)
        for r, st_ in enumerate(states):
            for lo, hi in past:
                span = codec.residual_span(st_.inputs, lo, hi)
                assert span.tobytes() == codec.residual_span(fresh.inputs, lo, hi).tobytes(), (n, r, lo, hi)
            lo = layout.extent(r)
            assert (codec.residual_span(st_.output, lo, S).tobytes()
                    == codec.residual_span(fresh.output, lo, S).tobytes()), (n, r)
            assert codec.load_residuals(st_.inputs).any(), "no feedback: the test would prove nothing"


# -- across MPI ranks -----------------------------------------------------------------------------
@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 3, pytest.param(4, marks=pytest.mark.slow)])
def test_properties_across_mpi_ranks(check_launches, n):
    """tests/mpi/hardening.py's ``properties`` (30 hypothesis examples, the same on every rank)
    passes on ``n`` ranks; at 2 and 3 ranks in the launch of tests/test_hardening.py's checks
    (every CI run), at 4 on its own (`slow`: a second P > 2 run, 4 ranks on the 2 CI cores)."""
    group = SHARED_LAUNCH if n in (2, 3) else ("properties",)
    res = check_launches.run(n, "tests/mpi/hardening.py", group, "properties", extra_env={"ECHONCCL_TIMEOUT": None})
    assert res.returncode == 0, res.output
    assert f"OK properties ranks={n} engine=cpu" in res.stdout
    assert "properties: 30 examples" in res.stdout
