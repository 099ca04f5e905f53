#!/usr/bin/env python3
"""Does a fused call's eager time depend on the SMs' L1 / shared-memory split? One rank alone
(`tools/fused_solo.py`'s cases, checked bit for bit the same way), each case timed six ways in
alternation, eager, us per call (median of ``--iters``, best of ``--reps``):

    python tools/carveout_probe.py [--ranks 2 8] [--sizes 16M 64M] [--kernels whole general]
        [--iters 20] [--reps 3]

* ``arm``: fused_solo's eager figure (its arm kernel before each call, outside the events);
* ``ahead``: armed once for every call, the fused calls back to back (no other kernel between);
* ``f100``: as ``arm``, the fused kernels' preferred carveout MaxShared (100: the split a GEMM that
  uses most of shared memory runs with), the arm kernel's left to the driver;
* ``both``: as ``f100``, the arm kernel's MaxShared too (no change of split between them);
* ``ahead100``: as ``ahead``, the fused kernels MaxShared;
* ``l1``: as ``arm``, the arm kernel's preferred carveout MaxL1 (0).

Carveouts are set with ``cuFuncSetAttribute(CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT)``
on the launched functions and reset to the default (-1) after each case. A research probe: the
shipped kernels leave the carveout to the driver."""
from __future__ import annotations

import argparse
import collections
import ctypes
import sys

import fused_solo as fs

from echonccl import fused

CARVEOUT = 9          # CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT (cuda.h)
# name: (fused kernels' carveout, arm kernel's, armed once for all calls), in the order timed
SETTINGS = {"arm": (-1, -1, False), "ahead": (-1, -1, True), "f100": (100, -1, False),
            "both": (100, 100, False), "ahead100": (100, -1, True), "l1": (-1, 0, False)}
VARIANTS = tuple(SETTINGS)


def probe(ranks, sizes, kernels, iters: int, reps: int) -> dict:
    """``(times, results)``: ``times[(P, nbytes, kernel, variant)]`` the variant's us per rep,
    ``results`` `fused_solo.run_solo`'s (each case's first-call check)."""
    cu = ctypes.CDLL("libcuda.so.1")
    launched = set()
    init = fused._Launch.__init__

    def tracked(self, *a, **k):
        init(self, *a, **k)
        launched.add(self.fn)

    def carve(fns, value):
        for f in fns:
            rc = cu.cuFuncSetAttribute(ctypes.c_void_p(f), CARVEOUT, value)
            if rc:
                raise RuntimeError(f"cuFuncSetAttribute: CUresult {rc}")

    times = collections.defaultdict(list)
    eager = fs._Solo.time_us

    def time_us(self, run, region, n, ticket=-1):
        if ticket != -1:
            return eager(self, run, region, n, ticket)
        case = sys._getframe(1).f_locals          # run_solo's loop: P, nbytes, kn
        key = (case["P"], case["nbytes"], case["kn"])
        arm_fn = self.arm_k.kernel.ptr

        def back_to_back():
            self.arm(region, ahead=n + 3)         # per_launch_us: 3 warm-ups, then n timed calls
            return fs.per_launch_us(run, n, self.spin)

        got = {}
        try:
            for name in VARIANTS:
                f, a, ahead = SETTINGS[name]
                carve(launched, f)
                carve([arm_fn], a)
                got[name] = back_to_back() if ahead else eager(self, run, region, n)
                times[key + (name,)].append(got[name])
        finally:
            carve(launched, -1)
            carve([arm_fn], -1)
        return got["arm"]

    fused._Launch.__init__, fs._Solo.time_us = tracked, time_us
    try:
        results = fs.run_solo(ranks, sizes, kernels, iters=iters, reps=reps)
    finally:
        fused._Launch.__init__, fs._Solo.time_us = init, eager
    return times, results


def main(argv=None) -> int:
    from echonccl.perf.options import parse_size

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", nargs="+", type=int, default=[2, 8])
    p.add_argument("--sizes", nargs="+", default=["16M", "64M"])
    p.add_argument("--kernels", nargs="+", default=["whole", "general"], choices=("whole", "general"))
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--reps", type=int, default=3)
    a = p.parse_args(argv)
    sizes = [parse_size(s) for s in a.sizes]
    times, results = probe(a.ranks, sizes, a.kernels, a.iters, a.reps)
    bad = 0
    for (P, nbytes), cases in results.items():
        for kn, c in cases.items():
            print(f"# check P = {P} {nbytes} B {kn}: {c.check}")
            bad += c.check != "ok"
    print("| P | bytes | kernel | " + " | ".join(VARIANTS) + " |")
    print("|---:|---:|---|" + "---:|" * len(VARIANTS))
    for P in a.ranks:
        for nbytes in sizes:
            for kn in a.kernels:
                row = [times.get((P, nbytes, kn, v)) for v in VARIANTS]
                if all(row):
                    print(f"| {P} | {nbytes} | {kn} | " + " | ".join(f"{min(t):.2f}" for t in row) + " |")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
