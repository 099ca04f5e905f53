#!/usr/bin/env python3
"""Soak test: thousands of all-reduces of random sizes, dtypes, algorithms and feedback modes,
every result checked, memory watched.

    python tools/launch.py -n 4 tools/soak.py --engine cpu --calls 2000 --max-bytes 64M --seconds 600
    python tools/launch.py -n 8 tools/soak.py --engine gpu --calls 20000 --max-bytes 256M --seed 7

Every rank draws the same calls from ``--seed``: a size (log-uniform from one element to
``--max-bytes``, from a pool of ``--distinct-sizes`` sizes as a real model has, or a fresh one
every call with ``--distinct-sizes 0``; now and then an edge size or an empty array), a dtype,
an algorithm (``--algos``: two_shot, ring, nccl, auto), a feedback mode (off, the
communicator's default state, or an explicit stream state with float32 or input-dtype
residuals, sometimes reset; with feedback, a quarter of the calls in two 4-bit rounds), in
place or not, 1-D or 2-D, a scale, and sometimes a NaN or Inf on one rank.

Checks:

* every call: the output's hash is allgathered, and must be the same on every rank;
* calls of at most ``--check-bytes`` input bytes, against the float64 sum over ranks (MPI):
  without feedback, the README's per-element error bound; with feedback, the exact
  bookkeeping ``out == exact + residuals before - residuals after`` (to float32 rounding and
  the residual format's own: 16-bit, or the int8 blocks' 2**(x - 134) an element);
  the baseline within the output dtype's rounding; NaN/Inf inputs non-finite in the output,
  every group without one finite.

Rank 0 reports calls, checked calls, errors, wall time, and memory (max over ranks): CPU resident
set size (VmRSS, peak VmHWM from /proc/self/status); GPU cupy memory-pool used/total bytes and
cudaMemGetInfo. Memory is sampled at the start, after the warm-up (a quarter of the calls), at
the end and after closing the communicator, with the bytes the communicator caches
(workspaces and default feedback states, bounded by ``--cache-bytes``): growth after the
warm-up is the leak signal, also with ``--distinct-sizes 0`` (a fresh size every call).

Exit status: 0 when every check passed, 1 on any error, 2 on a usage error.
"""
from __future__ import annotations

import argparse
import gc
import hashlib
import math
import sys
import time
from collections import OrderedDict

import numpy as np

import support  # tools/, beside this script
from echonccl.codec import RES_BLOCK
from echonccl.config import ALGORITHMS
from echonccl.feedback import DEFAULT_RESIDUAL

EDGE_COUNTS = (1, 2, 31, 32, 33, 511, 512, 513, 1023, 1025)
# Every algorithm but the experimental two_shot_pipelined (which --algos may still name).
ALGOS = tuple(a for a in ALGORITHMS if a != "two_shot_pipelined")
DTYPES = ("float32", "bfloat16", "float16")
MAX_STREAMS = 8
MAX_PRINTED_ERRORS = 20


def parse_bytes(text: str) -> int:
    t = text.strip().upper().rstrip("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    try:
        value = int(float(t[:-1] if t[-1:] in "KMG" else t) * mult)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 4096, 64K, 64M, 1G)") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"size must be positive: {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="soak.py", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", choices=("cpu", "gpu", "auto"), default="auto")
    p.add_argument("--calls", type=int, default=1000, help="number of all-reduces (default 1000)")
    p.add_argument("--max-bytes", type=parse_bytes, default=parse_bytes("64M"),
                   help="largest input, in bytes (K/M/G suffixes; default 64M)")
    p.add_argument("--seconds", type=float, default=0, help="stop after this many seconds (0: no limit)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check-bytes", type=parse_bytes, default=parse_bytes("4M"),
                   help="check the error of calls up to this input size against float64 (default 4M)")
    p.add_argument("--distinct-sizes", type=int, default=16,
                   help="draw sizes from a pool of this many (0: a fresh size every call)")
    p.add_argument("--algos", default=",".join(ALGOS), help="comma-separated subset of " + ",".join(ALGORITHMS))
    p.add_argument("--timeout", type=float, default=120, help="echonccl timeout in seconds (default 120)")
    p.add_argument("--cache-bytes", type=parse_bytes, default=None,
                   help="the communicator's cache bound (default: ECHONCCL_CACHE_BYTES or 1G)")
    p.add_argument("--progress", type=int, default=0, help="print a line every N calls (rank 0)")
    return p


# -- memory -------------------------------------------------------------------------------------
def proc_status_kib(field: str) -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1


def _trim_heap() -> None:
    """Give freed heap pages back (glibc), so that RSS measures what is still in use."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def memory_sample(engine: str, comm=None) -> dict:
    gc.collect()
    _trim_heap()
    m = {"rss_mib": proc_status_kib("VmRSS") / 1024, "hwm_mib": proc_status_kib("VmHWM") / 1024}
    if engine == "gpu":
        import cupy

        pool = cupy.get_default_memory_pool()
        free, total = cupy.cuda.runtime.memGetInfo()
        m.update(pool_used_mib=pool.used_bytes() / 2 ** 20, pool_total_mib=pool.total_bytes() / 2 ** 20,
                 device_used_mib=(total - free) / 2 ** 20)
    if comm is not None:
        m.update(cached_mib=comm.cached_bytes() / 2 ** 20, cache_entries=len(comm._cache))
    return m


def format_memory(samples: list[dict]) -> str:
    keys = samples[0].keys()
    return " ".join(f"{k}={max(s[k] for s in samples):.1f}" if k.endswith("mib") else
                    f"{k}={max(s[k] for s in samples)}" for k in keys)


# -- the calls ----------------------------------------------------------------------------------
class Plan:
    """Draws call i's parameters, identically on every rank."""

    def __init__(self, args, nranks: int):
        self.args, self.P = args, nranks
        self.algos = [a.strip() for a in args.algos.split(",") if a.strip()]
        rng = np.random.default_rng([args.seed, 0xC0FFEE])
        self.pool = [self._log_uniform_bytes(rng) for _ in range(args.distinct_sizes)]

    def _log_uniform_bytes(self, rng) -> int:
        return int(math.exp(rng.uniform(0, math.log(self.args.max_bytes))))

    def draw(self, i: int) -> dict:
        rng = np.random.default_rng([self.args.seed, i])
        dtype = DTYPES[rng.integers(len(DTYPES))]
        itemsize = 4 if dtype == "float32" else 2
        cap = max(1, self.args.max_bytes // itemsize)
        u = rng.random()
        if u < 0.01:
            count = 0
        elif u < 0.08:
            count = min(cap, int(rng.choice(EDGE_COUNTS + (512 * self.P - 1, 512 * self.P, 512 * self.P + 1))))
        else:
            nbytes = self.pool[rng.integers(len(self.pool))] if self.pool else self._log_uniform_bytes(rng)
            count = max(1, min(cap, nbytes // itemsize))
        fb = rng.choice(["off", "default", "stream", "stream"])
        shape = (count,)
        if count > 1 and rng.random() < 0.3:
            divs = [d for d in range(2, min(count, 4096) + 1) if count % d == 0]
            if divs:
                d = int(rng.choice(divs))
                shape = (d, count // d)
        special = None
        if count > 0 and rng.random() < 0.05:
            special = (int(rng.integers(self.P)), int(rng.integers(count)), str(rng.choice(["nan", "inf", "-inf"])))
        lo, hi = (-12, 8) if dtype == "float16" else (-40, 40)
        return {"i": i, "count": count, "shape": shape, "dtype": dtype,
                "algo": self.algos[rng.integers(len(self.algos))], "feedback": str(fb),
                "residual": str(rng.choice(["float32", "input", "int8"])), "reset": bool(rng.random() < 0.1),
                "rounds": 2 if fb != "off" and rng.random() < 0.25 else 1,
                "inplace": bool(rng.random() < 0.3), "scale": 2.0 ** int(rng.integers(lo, hi + 1)),
                "special": special}


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.calls < 0 or args.distinct_sizes < 0:
        build_parser().error("--calls and --distinct-sizes must be >= 0")
    algos = [a.strip() for a in args.algos.split(",") if a.strip()]
    if not algos or any(a not in ALGORITHMS for a in algos):
        build_parser().error(f"--algos must be a subset of {','.join(ALGORITHMS)}, got {args.algos!r}")
    from mpi4py import MPI

    import echonccl
    from echonccl import codec, dtypes

    world = MPI.COMM_WORLD
    rank, P = world.Get_rank(), world.Get_size()
    plan = Plan(args, P)
    comm = echonccl.Communicator(world.Dup(), engine=args.engine, timeout=args.timeout,
                                 cache_bytes=args.cache_bytes)
    engine = comm.engine.name
    G = codec.unit_size(comm.config.codec, comm.group_size)   # one NaN's reach, one scale's bound
    if engine == "gpu":
        import cupy

        to_dev, to_host = cupy.asarray, (lambda a: a.get())
    else:
        to_dev, to_host = (lambda a: a), np.asarray

    streams: OrderedDict = OrderedDict()
    errors: list[str] = []           # found identically on every rank (rank 0 prints them)
    local: list[str] = []            # this rank only (exceptions)
    mem = [memory_sample(engine, comm)]
    warm_at = max(1, args.calls // 4)
    checked = calls = 0
    t0 = time.monotonic()

    def fail(msg: str) -> None:
        errors.append(msg)
        if rank == 0 and len(errors) <= MAX_PRINTED_ERRORS:
            print(f"ERROR {msg}", flush=True)

    x = xd = y = yh = f = None
    for i in range(args.calls):
        c = plan.draw(i)
        npdt = dtypes.numpy_dtype(c["dtype"])
        x = (np.random.default_rng([args.seed, i, rank]).standard_normal(c["count"]) * c["scale"]).astype(npdt)
        bad_elems = None
        if c["special"] is not None:
            who, where, kind = c["special"]
            if who == rank:
                x[where] = {"nan": np.nan, "inf": np.inf, "-inf": -np.inf}[kind]
            bad_elems = where
        x = x.reshape(c["shape"])
        if c["feedback"] == "off":
            fb = False
        elif c["feedback"] == "default":
            fb = None
            c["residual"] = DEFAULT_RESIDUAL            # what the communicator's default states store
        else:
            key = (c["count"], c["dtype"], c["residual"])
            fb = streams.pop(key, None) or comm.new_feedback(c["residual"])
            streams[key] = fb
            while len(streams) > MAX_STREAMS:
                streams.popitem(last=False)
            if c["reset"]:
                fb.reset()
        check = 0 < c["count"] and x.nbytes <= args.check_bytes
        state_of = (lambda: comm.default_feedback(c["count"], c["dtype"])) if fb is None else (lambda: fb)
        before = _residual_total(state_of(), world, c["count"]) if check and fb is not False else None
        status, digest = "ok", ""
        try:
            xd = x.copy() if engine == "cpu" and c["inplace"] else to_dev(x)   # x stays the input
            y = comm.all_reduce(xd, xd if c["inplace"] else None, feedback=fb, algorithm=c["algo"],
                                rounds=c["rounds"])
            comm.synchronize(args.timeout)
            yh = to_host(y)
            if yh.shape != x.shape or yh.dtype != x.dtype:
                local.append(f"call {i}: output shape/dtype {yh.shape} {yh.dtype}, input {x.shape} {x.dtype}")
            f = yh.astype(np.float32).reshape(-1)
            f[np.isnan(f)] = np.nan
            digest = hashlib.blake2b(f.tobytes(), digest_size=16).hexdigest()
        except Exception as exc:  # noqa: BLE001 - recorded; the ranks stop together below
            status = f"{type(exc).__name__}: {exc}"
            local.append(f"call {i} {c}: {status}")
            print(f"rank {rank}: ERROR call {i}: {status}", file=sys.stderr, flush=True)
        stop = rank == 0 and args.seconds > 0 and time.monotonic() - t0 > args.seconds
        views = world.allgather((status, digest, stop))
        calls += 1
        if any(v[0] != "ok" for v in views):
            break
        if any(v[1] != views[0][1] for v in views):
            fail(f"call {i} {c}: outputs differ between ranks")
        if check:
            checked += 1
            after = _residual_total(state_of(), world, c["count"]) if fb is not False else None
            msg = _check_values(x, f, c, comm, world, G, P, bad_elems, before, after, engine)
            if msg:
                fail(f"call {i} {c['dtype']} n={c['count']} {c['algo']} feedback={c['feedback']} "
                     f"residual={c['residual']} rounds={c['rounds']}: {msg}")
        if i + 1 == warm_at:
            mem.append(memory_sample(engine, comm))
        if args.progress and rank == 0 and (i + 1) % args.progress == 0:
            print(f"  {i + 1} calls, {len(errors)} errors, {time.monotonic() - t0:.1f} s", flush=True)
        if views[0][2]:
            break

    wall = time.monotonic() - t0
    if len(mem) == 1:
        mem.append(memory_sample(engine, comm))
    mem.append(memory_sample(engine, comm))
    streams.clear()
    x = xd = y = yh = f = None       # noqa: F841 - drop the last call's arrays before measuring
    comm.close()
    mem.append(memory_sample(engine, comm))
    all_mem = world.gather(mem, root=0)
    all_local = world.gather(local, root=0)
    if rank == 0:
        local_all = [e for lst in all_local for e in lst]
        for e in local_all[:MAX_PRINTED_ERRORS]:
            print(f"ERROR {e}")
        n_err = len(errors) + len(local_all)
        print(f"soak: engine={engine} ranks={P} calls={calls} checked={checked} errors={n_err} "
              f"wall={wall:.1f}s seed={args.seed} max_bytes={args.max_bytes} "
              f"distinct_sizes={args.distinct_sizes or 'all'}")
        names = ("start", "warm", "end", "closed")
        for name, col in zip(names, zip(*all_mem)):
            print(f"memory {name:6s} (max over ranks, MiB): {format_memory(list(col))}")
        grow = max(m[2]["rss_mib"] - m[1]["rss_mib"] for m in all_mem)
        extra = ""
        if engine == "gpu":
            extra = "".join(f", {k[:-4]} {max(m[2][k] - m[1][k] for m in all_mem):+.1f} MiB"
                            for k in ("pool_used_mib", "pool_total_mib", "device_used_mib"))
        print(f"memory growth after warm-up: rss {grow:+.1f} MiB{extra} (max over ranks); the communicator "
              f"caches {max(m[2]['cached_mib'] for m in all_mem):.1f} MiB at the end, bound "
              f"{comm.config.cache_bytes / 2 ** 20:.1f} MiB (+ the entries in use)")
        code = 1 if n_err else 0
    else:
        code = 0
    code = world.bcast(code, root=0)
    return code


def _owed(r, codec_name: str):
    """(what residuals ``r`` owe the sum, a bound of its magnitude, a bound of what storing them
    dropped), float64, in the values' domain: for the rotated codec the exact inverse rotation,
    bounded by the block's sum of |r|. Only the int8 block format drops anything here: at most
    2**(x - 133) / 2 an element of a block whose exponent byte is x (codec.py, "Residuals")."""
    from echonccl import codec

    r64 = codec.load_residuals(r).astype(np.float64)
    drop = np.zeros_like(r64)
    if r.dtype == np.uint8:
        x = r.reshape(-1, codec.RES_SUPER_BYTES)[:, codec.RES_SUPER:].reshape(-1).astype(np.float64)
        drop = np.repeat(np.exp2(x - 134), codec.RES_BLOCK)
    if not codec.rotated(codec_name):
        return r64, np.abs(r64), drop
    def block_sum(v):
        return np.repeat(v.reshape(-1, codec.ROT_BLOCK).sum(axis=1), codec.ROT_BLOCK)
    return codec.residual_values(r64, codec_name), block_sum(np.abs(r64)), block_sum(drop)


def _residual_total(fb, world, count: int):
    """(sum over ranks, sum over ranks of magnitudes, sum over ranks of what storing them dropped)
    of a state's residuals (`_owed`), per element; zeros while unbound; None when the state is off."""
    sd = fb.state_dict()
    if not sd["enabled"]:
        return None
    if sd["key"] is None:
        return np.zeros(count), np.zeros(count), np.zeros(count)
    cd = sd["codec"]
    total = world.allreduce(np.stack(_owed(sd["inputs"], cd)))
    outs = world.allgather(np.stack(_owed(sd["output"], cd)))
    total = total + np.concatenate(outs, axis=1)
    return total[0, :count], total[1, :count], total[2, :count]


def _check_values(x, y32, c, comm, world, G, P, bad_elem, before, after, engine) -> str | None:
    """None if the output ``y32`` (float32, flat) is right for ``x`` summed over ranks."""
    n = c["count"]
    x64 = x.reshape(-1).astype(np.float64)
    finite = np.isfinite(x64)
    exact = support.exact_sum(np.where(finite, x64, 0.0), world)
    amax_sum = support.amax_sum(x64, G, world)
    algo = comm.choose_algorithm(x.nbytes, c["algo"])
    ok = np.ones(n, bool)
    if bad_elem is not None:
        y = y32.astype(np.float64)
        if np.isfinite(y[bad_elem]):
            return f"NaN/Inf input at {bad_elem} came out finite"
        g = bad_elem // G
        ok[g * G:(g + 1) * G] = False
        if not np.isfinite(y[ok]).all():
            return "non-finite output outside the NaN/Inf group"
    y = y32.astype(np.float64)
    if not np.isfinite(y[ok]).all():
        return f"non-finite output for finite inputs at {np.flatnonzero(~np.isfinite(y) & ok)[:5]}"
    tiny = 8 * P * 2.0 ** -133
    rounding = np.abs(exact) * 2.0 ** -7 + 2.0 ** -20 * (P + 2) * amax_sum + tiny
    if algo in ("nccl", "one_shot"):   # MPI: one rounding of a float32 sum; NCCL: up to P-1 in the dtype
        steps = (P - 1) * (2.0 ** -7 if c["dtype"] != "float32" else 2.0 ** -22)
        bound, kind = rounding + steps * amax_sum, "baseline"
    elif before is not None and after is not None:
        (r0, r0_abs, _), (r1, r1_abs, r1_drop) = before, after
        y_expect = exact + r0 - r1
        slack = 2.0 ** -20 * (P + 2) * (r0_abs + r1_abs) + r1_drop   # r1_drop: int8 storage
        if r1_drop.any() and c["rounds"] > 1:
            # ... and between rounds: at most 1/64 of the block's 4-bit error (x <= max(S, E + 1))
            four_bit = support.readme_bound(amax_sum, algo, P, comm.config.codec) + r0_abs
            slack += 2.0 ** -6 * (c["rounds"] - 1) * support.group_amax(four_bit, RES_BLOCK)
        if c["residual"] == "input" and c["dtype"] != "float32" and c["feedback"] != "off":
            slack += 2.0 ** -7 * r1_abs          # every rank's residual rounded to the input dtype
            if c["dtype"] == "float16":          # ... where small residuals are float16 subnormals
                # (int4-h32: a value's residual is the inverse rotation of its block's 32
                # rotated ones, each rounded: 32 times one subnormal rounding at most)
                slack += 2.0 ** -25 * (P + 1) * 2 * c["rounds"] * support.codec_factor(comm.config.codec)
            if c["rounds"] > 1:                  # ... also between rounds, where it is a whole 4-bit error
                slack += 2.0 ** -7 * (c["rounds"] - 1) * (support.readme_bound(amax_sum, algo, P, comm.config.codec) + r0_abs)
        # its output's rounding is not fed back (one_shot_q; the two-shot owner with rounding=False):
        # half an ulp a round, of an output that before the last round is the sum plus the residuals
        # it started with, within a round's 4-bit error
        if (algo in support.ONE_HOP or not comm.config.feedback_rounding) and c["dtype"] != "float32":
            slack += 2.0 ** -8 * c["rounds"] * (np.abs(y) + np.abs(exact)) + c["rounds"] * 2.0 ** -24
            slack += 2.0 ** -8 * (c["rounds"] - 1) * (
                r0_abs + support.readme_bound(amax_sum, algo, P, comm.config.codec))
        err = np.abs(y - y_expect)
        bound = 2.0 ** -20 * (P + 2) * amax_sum + slack + tiny   # output rounding is in the residuals
        worst = float(np.max((err / bound)[ok])) if ok.any() else 0.0
        return None if worst <= 1 else f"feedback bookkeeping off by {worst:.3g}x its float32 tolerance"
    else:
        bound, kind = support.readme_bound(amax_sum, algo, P, comm.config.codec) + rounding, "4-bit bound"
    err = np.abs(y - exact)
    worst = float(np.max((err / bound)[ok])) if ok.any() else 0.0
    return None if worst <= 1 else f"error {worst:.3g}x the {kind}"


if __name__ == "__main__":
    sys.exit(main())
