"""Residual-stream accuracy study: how all-reduce errors grow with depth.

Run under MPI, one rank per process::

    python tools/launch.py -n 2 studies/accuracy_depth.py --layers 128 --plot docs/accuracy_depth.png

(or ``mpiexec -n 2 python studies/accuracy_depth.py ...`` where echonccl is installed).

L layers each add one all-reduced term into one residual stream that starts
at an embedding ``h0`` (exact, replicated). Rank r's term at layer l (a
tokens x hidden tensor) is

    t[r, l] = c[r] + n[r, l]

* ``c[r]``: a per-rank component shared by every layer (each rank's heads and
  neurons write much the same directions at every depth), heavy-tailed
  (Student-t), with a few outlier channels ``--outlier-scale`` times larger
  (fixed channels, as massive activations are; ``h0`` has them too);
* ``n[r, l]``: independent heavy-tailed noise (Student-t), ``--noise`` x ``c``.

Both are scaled by 1/sqrt(P) so the all-reduced term has the same size for
every P. The exact stream grows from ``|h0|`` by about ``d |sum_r c[r]|``; a
quantizer that makes much the same error at every layer (plain 4-bit) adds
it d times, so its relative error grows until the stream outgrows ``h0``.

Compared: the exact float64 sum, NCCL-style bf16, plain 4-bit (two_shot,
``feedback=False``), and echonccl two_shot, ring and one_shot_q with error feedback (one
`Feedback` per method, shared by all L layers), and two_shot with ``rounds=2``
("two_shot x2"), for each codec. Reported:
relative error of each stream against the exact stream at depths 1, 2, 4, ..., L.
``--check`` asserts the targets: echonccl's error at depth L is at most 1.5x
its depth-1 error, plain 4-bit's grows at least 5x (exit status 1 otherwise).
"""
from __future__ import annotations

import os

_P = int(os.environ.get("PMI_SIZE") or os.environ.get("OMPI_COMM_WORLD_SIZE") or 1)
for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, str(max(1, (os.cpu_count() or 1) // _P)))

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

import reducers  # noqa: E402  (studies/, beside this script)
from plots import panels_per_codec  # noqa: E402

from echonccl.codec import CODECS, DEFAULT_CODEC, RESIDUAL_FORMATS  # noqa: E402
from echonccl.feedback import DEFAULT_RESIDUAL  # noqa: E402

ECHO_MAX_GROWTH, PLAIN_MIN_GROWTH = 1.5, 5.0
VARIANTS = (("plain", "two_shot", False), ("two_shot", "two_shot", True), ("ring", "ring", True),
            ("one_shot_q", "one_shot_q", True))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=128, help="depth L (<= 128 in the documented runs)")
    p.add_argument("--codecs", nargs="+", choices=list(CODECS), default=[DEFAULT_CODEC],
                   help=f"the echonccl codecs to run (default: {DEFAULT_CODEC}, the library's default)")
    p.add_argument("--engine", choices=["cpu", "gpu"], default="cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="dtype of the terms handed to echonccl")
    p.add_argument("--residual-dtype", choices=RESIDUAL_FORMATS, default=DEFAULT_RESIDUAL,
                   help=f"format of the feedback residuals (default {DEFAULT_RESIDUAL}, the library's; "
                   "input: --dtype)")
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--shared", type=float, default=1.0, help="scale of the per-rank shared component")
    p.add_argument("--noise", type=float, default=0.3, help="scale of the per-layer noise")
    p.add_argument("--embed", type=float, default=10.0, help="scale of the embedding h0 (shared = 1)")
    p.add_argument("--df", type=float, default=4.0, help="Student-t degrees of freedom")
    p.add_argument("--outliers", type=int, default=4, help="outlier channels per hidden vector")
    p.add_argument("--outlier-scale", type=float, default=100.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", help="write a PNG of error vs depth")
    p.add_argument("--json", help="write the results as JSON")
    p.add_argument("--check", action="store_true", help="exit 1 unless the depth targets hold")
    return p.parse_args(argv)


def shared_components(a, outlier_idx, rank: int, size: int) -> np.ndarray:
    """This rank's layer-independent component c[r] (every rank draws all P from one seed)."""
    rng = np.random.default_rng([a.seed, 0])
    u = rng.standard_t(a.df, size=(size, a.tokens, a.hidden)) * (a.shared / np.sqrt(size))
    u[..., outlier_idx] *= a.outlier_scale
    return u[rank].astype(np.float32)


def layer_term(a, c: np.ndarray, rank: int, layer: int) -> np.ndarray:
    """Rank ``rank``'s float32 term at ``layer``: ``c`` plus heavy-tailed noise."""
    rng = np.random.default_rng([a.seed, 1, rank, layer])
    n = rng.standard_t(a.df, size=(a.tokens, a.hidden)) * (a.noise * a.shared / np.sqrt(a.size))
    return (c + n).astype(np.float32)


def depths_of(L: int) -> list[int]:
    d = [1 << i for i in range(L.bit_length()) if (1 << i) <= L]
    return d + ([L] if d[-1] != L else [])


def run(a, mpi):
    rank, size = mpi.Get_rank(), mpi.Get_size()
    a.size = size
    comms = reducers.communicators(a.codecs, a.engine)
    a.codec_used = ",".join(comms)
    methods = {"exact": reducers.Exact(mpi), "bf16": reducers.Bf16(mpi)}
    rd = a.residual_dtype
    for g, c in comms.items():
        for key, algo, fb in VARIANTS:
            methods[f"{key} {g}"] = reducers.Echo(c, algo, fb, a.dtype, residual_dtype=rd)
        methods[f"two_shot x2 {g}"] = reducers.Echo(c, "two_shot", True, a.dtype, rounds=2, residual_dtype=rd)
    outl = np.random.default_rng([a.seed, 2]).choice(a.hidden, a.outliers, replace=False)
    c = shared_components(a, outl, rank, size)
    h0 = np.random.default_rng([a.seed, 3]).standard_t(a.df, size=(a.tokens, a.hidden)) * a.embed
    h0[:, outl] *= a.outlier_scale
    streams = {m: h0.copy() for m in methods}
    depths, errs = depths_of(a.layers), {m: [] for m in methods if m != "exact"}
    for l in range(1, a.layers + 1):
        t = layer_term(a, c, rank, l)
        for m, red in methods.items():
            streams[m] += red(t)
        if l in depths:
            ref = streams["exact"]
            for m in errs:
                errs[m].append(float(np.linalg.norm(streams[m] - ref) / np.linalg.norm(ref)))
    for cm in comms.values():
        cm.close()
    return depths, errs


def checks(errs: dict, codecs) -> list[tuple[str, float, bool]]:
    """(description, growth, passed) for every echonccl method and plain 4-bit at every group size."""
    out = []
    for g in codecs:
        for key in ("two_shot", "ring", "one_shot_q", "two_shot x2"):
            e = errs[f"{key} {g}"]
            out.append((f"echonccl {key} {g}: err(L)/err(1) <= {ECHO_MAX_GROWTH}", e[-1] / e[0],
                        e[-1] <= ECHO_MAX_GROWTH * e[0]))
        e = errs[f"plain {g}"]
        out.append((f"plain 4-bit {g}: err(L)/err(1) >= {PLAIN_MIN_GROWTH}", e[-1] / e[0],
                    e[-1] >= PLAIN_MIN_GROWTH * e[0]))
    return out


def table(depths, errs) -> str:
    head = "| method | " + " | ".join(f"d={d}" for d in depths) + " | err(L)/err(1) |"
    rows = [head, "|" + "---|" * (len(depths) + 2)]
    for m, e in errs.items():
        rows.append(f"| {m} | " + " | ".join(f"{v:.2e}" for v in e) + f" | {e[-1] / e[0]:.2f} |")
    return "\n".join(rows)


def plot(path, depths, errs, codecs, title) -> None:
    with panels_per_codec(path, codecs, title, "depth (layers)") as panels:
        for ax, g in panels:
            styles = (("bf16", "k:"), (f"plain {g}", "r-o"), (f"two_shot {g}", "b-s"), (f"ring {g}", "g--^"),
                      (f"two_shot x2 {g}", "c-d"))
            for m, style in styles:
                ax.loglog(depths, errs[m], style, label=m.replace(f" {g}", "").replace("plain", "plain 4-bit"), ms=4)


def main(argv=None) -> int:
    from mpi4py import MPI

    a = parse_args(argv)
    mpi = MPI.COMM_WORLD
    t0 = time.perf_counter()
    depths, errs = run(a, mpi)
    wall = time.perf_counter() - t0
    if mpi.Get_rank() != 0:
        return 0
    res = checks(errs, a.codecs)
    title = (f"P={mpi.Get_size()} L={a.layers} {a.tokens}x{a.hidden} elems/term, {a.dtype} into echonccl, "
             f"engine {a.engine}, codec {a.codec_used}, {a.residual_dtype} residuals, "
             f"embed={a.embed} shared={a.shared} noise={a.noise} t(df={a.df}) "
             f"outliers {a.outliers}x{a.outlier_scale:g}")
    print(f"# residual-stream depth study: {title}\n")
    print(table(depths, errs))
    print()
    for desc, growth, ok in res:
        print(f"{'PASS' if ok else 'FAIL'} {desc}: {growth:.2f}")
    print(f"\nwall time {wall:.1f} s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "ranks": mpi.Get_size(), "depths": depths, "errors": errs,
                       "checks": [{"check": d, "growth": g, "passed": ok} for d, g, ok in res],
                       "wall_s": wall}, f, indent=1)
    if a.plot:
        plot(a.plot, depths, errs, a.codecs, title)
    return 1 if a.check and not all(ok for _, _, ok in res) else 0


if __name__ == "__main__":
    sys.exit(main())
