"""A tensor-parallel transformer (L pre-norm blocks) whose all-reduces run in 4 bits, with error feedback.

    mpiexec -n 2 python mpi_examples/tp_transformer_block.py                    # GPU: hidden 4096, seq 2048
    mpiexec -n 2 python mpi_examples/tp_transformer_block.py --dtype float32 --layers 16
    OMP_NUM_THREADS=1 mpiexec -n 2 python mpi_examples/tp_transformer_block.py    # CPU: one BLAS thread per rank

Megatron-style split: every rank holds its attention heads (columns of Wq, Wk,
Wv; rows of Wo) and its MLP neurons (columns of W1; rows of W2). Each
sub-block ends with this rank's partial sum of the output projection; the
all-reduce completes it, and it is added into the residual stream h.

The feedback scope that makes the errors telescope: ONE `Feedback` shared by
every all-reduce adding into the same residual stream (2 per block), reset at
the start of each forward pass (so every pass gives the same output); the last
all-reduce of a pass may flush (``flush=True``: one more round, which sends
what the whole pass still owes the stream). The final hidden state is compared
with the same model run on the baseline all-reduce (NCCL / MPI), with and
without feedback. Activations are float32 or bfloat16 (matmuls in float32). Runs on
the GPU engine (cupy) or the CPU engine (numpy; small sizes by default).
"""
import argparse
import time

import ml_dtypes
import numpy
from mpi4py import MPI

import echonccl

comm = echonccl.Communicator(algorithm="two_shot")     # always 4-bit ("auto": plain sum below a few MiB)
gpu = comm.engine.name == "gpu"
if gpu:
    import cupy as xp
else:
    xp = numpy

p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
p.add_argument("--layers", type=int, default=8)
p.add_argument("--hidden", type=int, default=4096 if gpu else 256)
p.add_argument("--heads", type=int, default=32 if gpu else 8)
p.add_argument("--seq", type=int, default=2048 if gpu else 64)
p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
p.add_argument("--iters", type=int, default=3, help="timed forward passes per variant")
args = p.parse_args()
P, r = comm.size, comm.rank
H, S, L, NH = args.hidden, args.seq, args.layers, args.heads
assert H % NH == 0 and NH >= P, "hidden must be a multiple of heads, and heads >= ranks"
act = numpy.dtype(ml_dtypes.bfloat16) if args.dtype == "bfloat16" else numpy.dtype(numpy.float32)
f32 = numpy.float32
D = H // NH                                  # head dim
heads = numpy.array_split(numpy.arange(NH), P)[r]             # this rank's heads
hcols = (heads[:, None] * D + numpy.arange(D)).reshape(-1)     # their columns of Wq/Wk/Wv
fcols = numpy.array_split(numpy.arange(4 * H), P)[r]           # this rank's MLP neurons
if gpu:
    hcols, fcols = xp.asarray(hcols), xp.asarray(fcols)


def shard(rng):
    """One block's weights (the same full matrices on every rank, same seed), this rank's slices."""
    def w(fan_in, fan_out, scale=1.0):
        return rng.standard_normal((fan_in, fan_out), dtype=xp.float32) * f32(scale / fan_in ** 0.5)
    out_scale = 1.0 / (2 * L) ** 0.5                            # keeps h's growth moderate
    wq, wk, wv, wo = w(H, H), w(H, H), w(H, H), w(H, H, out_scale)
    w1, w2 = w(H, 4 * H), w(4 * H, H, out_scale)
    c = xp.ascontiguousarray
    return dict(wq=c(wq[:, hcols]), wk=c(wk[:, hcols]), wv=c(wv[:, hcols]), wo=c(wo[hcols]),
                w1=c(w1[:, fcols]), w2=c(w2[fcols]))


def rms_norm(x):
    return x / xp.sqrt(xp.mean(x * x, axis=-1, keepdims=True) + f32(1e-6))


def attention_partial(x, b):
    """This rank's heads: causal softmax attention, then its rows of Wo (a partial sum)."""
    q, k, v = ((x @ b[n]).reshape(S, -1, D).transpose(1, 0, 2) for n in ("wq", "wk", "wv"))
    s = (q @ k.transpose(0, 2, 1)) * f32(D ** -0.5)
    s = xp.where(causal, f32(-xp.inf), s)
    s = xp.exp(s - s.max(axis=-1, keepdims=True))
    s /= s.sum(axis=-1, keepdims=True)
    o = (s @ v).transpose(1, 0, 2).reshape(S, -1)
    return o @ b["wo"]


def mlp_partial(x, b):
    u = x @ b["w1"]
    u = u * (f32(1) / (f32(1) + xp.exp(f32(-1.702) * u)))          # GELU (sigmoid approximation)
    return u @ b["w2"]


def forward(h0, all_reduce):
    """L blocks: h += all_reduce(partial, last) twice per block (``last``: the pass's last call).
    h (the residual stream) in ``act``."""
    h = h0
    for i, b in enumerate(blocks):
        for sub in (attention_partial, mlp_partial):
            partial = sub(rms_norm(h.astype(f32)), b).astype(act)      # this rank's partial sum
            last = i == len(blocks) - 1 and sub is mlp_partial
            h = (h.astype(f32) + all_reduce(partial, last).astype(f32)).astype(act)
    return h


rng = xp.random.default_rng(1234)                      # same seed on all ranks: one model
blocks = [shard(rng) for _ in range(L)]
h0 = rng.standard_normal((S, H), dtype=xp.float32).astype(act)
causal = xp.arange(S)[None, :] > xp.arange(S)[:, None]      # True above the diagonal: masked

fb = comm.new_feedback()                               # ONE state for the whole residual stream
variants = {
    comm.engine.baseline_name: lambda x, last: comm.baseline_all_reduce(x),
    "4-bit + shared feedback": lambda x, last: comm.all_reduce(x, feedback=fb),
    "4-bit + feedback + flush": lambda x, last: comm.all_reduce(x, feedback=fb, flush=last),   # 1/(2L) more traffic
    "2 rounds + feedback": lambda x, last: comm.all_reduce(x, feedback=fb, rounds=2),   # 2x traffic, ~10x less error
    "4-bit, no feedback": lambda x, last: comm.all_reduce(x, feedback=False),
}
results = {}
for name, all_reduce in variants.items():
    times, outs = [], []
    for it in range(args.iters + 1):                   # the first pass warms up (kernels, buffers)
        comm.synchronize()
        MPI.COMM_WORLD.Barrier()
        t0 = time.perf_counter()
        fb.reset()                                     # a new forward pass: fresh residuals
        h = forward(h0, all_reduce)
        comm.synchronize()
        times.append(time.perf_counter() - t0)
        outs.append(h.astype(f32))
    results[name] = (outs[-1], min(times[1:]) if args.iters else times[0], bool((outs[0] == outs[-1]).all()))

base = results[comm.engine.baseline_name][0]
if r == 0:
    print(f"{L} blocks, hidden {H}, {NH} heads, seq {S}, {args.dtype}, {P} ranks on {comm.engine.describe()}: "
          f"{2 * L} all-reduces of {S * H} elements per forward pass")
for name, (h, t, same) in results.items():
    diff = float(xp.linalg.norm(h - base) / xp.linalg.norm(base))
    if r == 0:
        print(f"  {name:24s} {t * 1e3:9.2f} ms/forward   final hidden state vs baseline: "
              f"relative difference {diff:.5f}   passes identical: {same}")
comm.close()
