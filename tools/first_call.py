#!/usr/bin/env python3
"""Seconds to a first all-reduce on a machine with empty caches, as a new user meets it.

    python tools/first_call.py [--procs 1 8] [--reps 1]

For each process count N, starts N processes at once (``tools/launch.py -n N``, as ``mpirun -np N``
does on a fresh node), all sharing one empty kernel cache (``CUPY_CACHE_DIR``,
``ECHONCCL_KERNEL_CACHE``, ``CUDA_CACHE_PATH`` in a new temporary folder), then the same again
with that cache warm. Each process times, from its first line: ``import echonccl``; creating a
`Communicator` on ``MPI.COMM_SELF`` (NCCL's initialization; one GPU cannot hold an NCCL
communicator of several ranks, so each process makes its own); loading the kernels a first
all-reduce with default options loads (`first_call_kernels`: the fused two-shot and the 16-bit one-shots
``auto`` picks between over peer memory, and the NCCL path's three codec kernels: a superset of
any one call's); and one all-reduce. ``--jit`` loads those kernels without the prebuilt fatbin
(compiled on demand: one process of the node compiles, the others wait for it).

Run it against the installed wheel from outside the checkout (``ECHONCCL_DEV_INSTALLED=1``) to
time what a user installs. Prints one row per case: the slowest process's seconds per phase.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

T0 = time.perf_counter()
TOOLS = Path(__file__).resolve().parent

def first_call_kernels() -> tuple[str, ...]:
    """What a first bf16 all-reduce with default options loads, on either path: the fused
    two-shot, the two 16-bit one-shots, the NCCL path's contribution, owner and decode kernels."""
    from echonccl import codec, dtypes
    from echonccl import kernel_table as kt
    from echonccl.feedback import DEFAULT_RESIDUAL, DEFAULT_ROUNDING

    d = codec.DEFAULT_CODEC
    contributions, sums = codec.parts(d)
    res = dtypes.residual_kernel_name(codec.residual_dtype(DEFAULT_RESIDUAL, dtypes.numpy_dtype("bfloat16")))
    ref = "bf16" if DEFAULT_ROUNDING else "f32"     # the owner's reference: the output's type, or float32
    return (kt.Kernel("two_shot", "bf16", d, res, "" if DEFAULT_ROUNDING else "f32", whole=True).name,
            kt.Kernel("one_shot_ll", "bf16").name, kt.Kernel("one_shot", "bf16").name,
            kt.Kernel("reduce_quantize", "bf16", contributions, res, "f32").name,
            kt.Kernel("reduce_quantize", "bf16", d, res, ref).name,
            kt.Kernel("dequantize", "bf16", sums).name)


def child(jit: bool) -> None:
    times = {}
    import echonccl                                   # noqa: F401
    times["import"] = time.perf_counter() - T0
    import cupy
    from mpi4py import MPI

    from echonccl import kernel_loader

    t = time.perf_counter()
    comm = echonccl.Communicator(MPI.COMM_SELF)
    times["communicator"] = time.perf_counter() - t
    t = time.perf_counter()
    loader = kernel_loader.KernelLoader(None) if jit else kernel_loader.LOADER
    for name in first_call_kernels():
        loader.function(name)
    times["kernels"] = time.perf_counter() - t
    t = time.perf_counter()
    x = cupy.ones(1 << 22, dtype=cupy.float32)
    comm.all_reduce(x, x)
    comm.synchronize()
    times["first call"] = time.perf_counter() - t
    times["total"] = time.perf_counter() - T0
    origins = sorted(set(v.split()[0] for v in loader.origins.values()))
    comm.close()
    print("FIRST_CALL " + json.dumps({"rank": MPI.COMM_WORLD.Get_rank(), "times": times, "origins": origins}),
          flush=True)


def run_case(procs: int, env: dict, jit: bool) -> dict:
    cmd = [sys.executable, str(TOOLS / "launch.py"), "-n", str(procs), str(Path(__file__).resolve()), "--child"]
    if jit:
        cmd.append("--jit")
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    rows = [json.loads(ln.split(" ", 1)[1]) for ln in r.stdout.splitlines() if ln.startswith("FIRST_CALL ")]
    if r.returncode or len(rows) != procs:
        raise SystemExit(f"first_call: {' '.join(cmd)} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    worst = {k: max(row["times"][k] for row in rows) for k in rows[0]["times"]}
    compiled = sum(ln.count("compiled echo_") for ln in r.stderr.splitlines())
    return {"worst": worst, "origins": sorted({o for row in rows for o in row["origins"]}), "compile lines": compiled}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--procs", type=int, nargs="+", default=[1, 8])
    p.add_argument("--jit", action="store_true", help="load the kernels compiled on demand, not prebuilt")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        child(a.jit)
        return 0
    print(f"# first all-reduce, {'kernels compiled on demand' if a.jit else 'prebuilt kernels'}; slowest "
          "process's seconds")
    print("| processes | cache | import | Communicator | kernels | first call | total | kernels from | compiles |")
    print("|---:|---|---:|---:|---:|---:|---:|---|---:|")
    for procs in a.procs:
        with tempfile.TemporaryDirectory(prefix="echonccl-first-call-") as tmp:
            env = dict(os.environ, CUPY_CACHE_DIR=f"{tmp}/cupy", ECHONCCL_KERNEL_CACHE=f"{tmp}/echonccl",
                       CUDA_CACHE_PATH=f"{tmp}/cuda")
            for cache in ("empty", "warm"):
                res = run_case(procs, env, a.jit)
                w = res["worst"]
                print(f"| {procs} | {cache} | {w['import']:.2f} | {w['communicator']:.2f} | {w['kernels']:.2f} | "
                      f"{w['first call']:.2f} | {w['total']:.2f} | {', '.join(res['origins'])} | "
                      f"{res['compile lines']} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
