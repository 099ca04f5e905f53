"""Checkpoint the error-feedback state with the model: a resumed run matches the uninterrupted one bit for bit.

    mpiexec -n 2 python mpi_examples/checkpoint_feedback.py
    mpiexec -n 2 python mpi_examples/checkpoint_feedback.py --steps 20 --save-at 7 --dir ckpt/

A toy data-parallel least-squares fit: every rank computes the gradient on its
own data and a 4-bit all-reduce sums them. Its `Feedback` is never reset, so
the quantization residual of step t is added into step t+1 (error feedback
across steps, as in EF-SGD): the residuals are training state, like the
weights. At step k every rank saves its weights and ``fb.state_dict()`` (one
``np.savez`` file per rank), and the run goes on to step T. Then a fresh
communicator restores the checkpoint (``comm.load_feedback``) and replays
steps k..T-1: the weights must equal the uninterrupted run's bit for bit (exit
status 1 otherwise). Resuming without the feedback state does not.

(A per-forward-pass state, reset at every pass as in tp_transformer_block.py,
is zero between steps: only states that live across steps need checkpointing.)
"""
import argparse
import json
import os
import sys
import tempfile

import numpy as np
from mpi4py import MPI

import echonccl

p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
p.add_argument("--steps", type=int, default=12, help="T, the number of training steps")
p.add_argument("--save-at", type=int, default=5, help="k, the step whose starting state is saved")
p.add_argument("--dim", type=int, default=4096, help="number of weights (elements per all-reduce)")
p.add_argument("--dir", default=None, help="checkpoint directory (default: a temporary one)")
args = p.parse_args()
T, k = args.steps, args.save_at
assert 0 <= k < T

comm = echonccl.Communicator(algorithm="two_shot")     # always 4-bit ("auto": plain sum below a few MiB)
gpu = comm.engine.name == "gpu"
if gpu:
    import cupy as xp
else:
    xp = np
world = MPI.COMM_WORLD
r = comm.rank

# This rank's data shard (512 samples), fitted by one shared weight vector.
X = xp.random.default_rng(100 + r).standard_normal((512, args.dim), dtype=xp.float32)
w_true = xp.random.default_rng(0).standard_normal(args.dim, dtype=xp.float32)
y = X @ w_true
lr = np.float32(0.05 / (X.shape[0] * comm.size))


def host(a):
    return a.get() if gpu else np.array(a)


def loss(w):
    return world.allreduce(float(0.5 * xp.sum((X @ w - y) ** 2)))


def step(comm, fb, w):
    g = X.T @ (X @ w - y)                       # this rank's gradient
    g = comm.all_reduce(g, feedback=fb)         # summed over ranks in 4 bits; residual kept in fb
    return w - lr * g


def save(path, w, fb):
    sd = fb.state_dict()                        # plain numpy arrays + the binding key, codec, version
    meta = json.dumps({n: sd[n] for n in ("version", "codec", "residual_dtype", "enabled", "key")})
    arrays = {n: sd[n] for n in ("inputs", "output") if n in sd}
    np.savez(path, w=host(w), meta=meta, **arrays)


def load(path, comm):
    with np.load(path) as z:
        sd = json.loads(str(z["meta"]))
        sd.update({n: z[n] for n in ("inputs", "output") if n in z.files})
        return xp.asarray(z["w"]), comm.load_feedback(sd)


with tempfile.TemporaryDirectory() as tmp:
    ckdir = args.dir or tmp
    os.makedirs(ckdir, exist_ok=True)
    path = os.path.join(ckdir, f"feedback_rank{r:05d}.npz")

    # 1. The uninterrupted run, saving at step k.
    fb = comm.new_feedback()
    w = xp.zeros(args.dim, dtype=xp.float32)
    loss0, trace = loss(w), []
    for t in range(T):
        if t == k:
            save(path, w, fb)
        w = step(comm, fb, w)
        trace.append(host(w))
    lossT = loss(w)
    comm.close()

    # 2. A fresh communicator resumes from the checkpoint and replays steps k..T-1.
    comm = echonccl.Communicator(algorithm="two_shot")
    w, fb = load(path, comm)
    resumed = []
    for t in range(k, T):
        w = step(comm, fb, w)
        resumed.append(host(w).tobytes() == trace[t].tobytes())

    # 3. The same, but with a fresh Feedback instead of the saved one.
    w, _ = load(path, comm)
    fresh = comm.new_feedback()
    without = []
    for t in range(k, T):
        w = step(comm, fresh, w)
        without.append(host(w).tobytes() == trace[t].tobytes())
    comm.close()

ok = world.allreduce(all(resumed), op=MPI.LAND)
same_without = world.allreduce(all(without), op=MPI.LAND)
if r == 0:
    print(f"{comm.size} ranks on {comm.engine.name}: {T} steps of a 4-bit gradient all-reduce of {args.dim} "
          f"float32 with error feedback across steps; loss {loss0:.4g} -> {lossT:.4g}")
    print(f"checkpoint at step {k} (weights + fb.state_dict(), np.savez per rank), "
          f"resumed in a fresh communicator, steps {k}..{T - 1} replayed:")
    print(f"  with the saved feedback state: {'match' if ok else 'MISMATCH'} "
          f"(bit for bit, {T - k} steps, all ranks)")
    print(f"  with a fresh feedback state:   {'match' if same_without else 'differs'} (expected: differs)")
sys.exit(0 if ok else 1)
