#!/usr/bin/env python3
"""Where the codec kernels' warps wait: CUPTI PC sampling with stall reasons, per kernel.

    gcc -shared -fPIC -O2 -I/usr/local/cuda/include -I$CUPTI/include tools/pcsampling.c -o fb/pcsampling.so
    python tools/stall_profile.py --lib fb/pcsampling.so --cupti $CUPTI/lib \\
        [--codecs int4 int4-h32] [--match in=bfloat16] [--period 9] [--iters 20] [--json F]

($CUPTI: the nvidia-cuda-cupti wheel's nvidia/cu13, unzipped.) The kernels are
`tools/kernel_bench.py`'s cases (as two_shot calls them); each selected case runs ``--iters``
times inside one sampling range. For each case: the share of samples per stall reason (the
warp's state when sampled: ``selected`` issued, ``long_scoreboard`` waits on global memory,
``short_scoreboard`` on shuffles and shared memory, ``math_pipe_throttle``, ``lg_throttle``,
...), and the hottest PC offsets, which match the ``/*0xxx*/`` offsets of
``cuobjdump -sass`` on the same fatbin. ``--json`` keeps every PC's counts.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import time

import cupy as cp
import numpy as np

import kernel_bench

MAX_PCS = 1 << 16


def load(lib: str, cupti_dir: str):
    ctypes.CDLL(os.path.join(cupti_dir, "libcupti.so.13"), mode=ctypes.RTLD_GLOBAL)
    L = ctypes.CDLL(lib)
    L.pcs_error.restype = ctypes.c_char_p
    L.pcs_reason.restype = ctypes.c_char_p
    L.pcs_reason.argtypes = [ctypes.c_size_t]
    L.pcs_func_name.restype = ctypes.c_char_p
    L.pcs_num_reasons.restype = ctypes.c_size_t
    L.pcs_enable.argtypes = [ctypes.c_void_p, ctypes.c_uint]
    L.pcs_collect.restype = ctypes.c_long
    L.pcs_collect.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long, ctypes.c_void_p]
    return L


def call(L, rc: int) -> None:
    if rc != 0:
        raise RuntimeError(L.pcs_error().decode())


def profile(L, fn, iters: int, nreasons: int):
    """Samples of `iters` launches of fn: (function names, PC offsets, counts[pc, reason], totals)."""
    fn()
    cp.cuda.Device().synchronize()
    call(L, L.pcs_start())
    for _ in range(iters):
        fn()
    cp.cuda.Device().synchronize()
    call(L, L.pcs_stop())
    time.sleep(0.3)   # CUPTI's worker thread decodes the hardware buffer
    func = np.zeros(MAX_PCS, np.int32)
    off = np.zeros(MAX_PCS, np.uint64)
    counts = np.zeros((MAX_PCS, nreasons), np.uint32)
    totals = np.zeros(4, np.uint64)
    n = L.pcs_collect(func.ctypes.data, off.ctypes.data, counts.ctypes.data, MAX_PCS, totals.ctypes.data)
    if n < 0:
        raise RuntimeError(L.pcs_error().decode())
    names = [L.pcs_func_name(int(f)).decode() for f in func[:n]]
    return names, off[:n], counts[:n], totals


def short(reason: str) -> str:
    return reason.replace("smsp__pcsamp_warps_issue_stalled_", "").replace("smsp__pcsamp_", "")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lib", required=True, help="pcsampling.so built from tools/pcsampling.c")
    p.add_argument("--cupti", required=True, help="directory holding libcupti.so.13")
    p.add_argument("--codecs", nargs="+", default=["int4", "int4-h32"])
    p.add_argument("--match", nargs="*", default=["in=bfloat16"],
                   help="profile the cases whose name contains all of these")
    p.add_argument("--elems", type=lambda s: int(eval(s, {})), default=2 ** 26)
    p.add_argument("--group", type=int, default=32)
    p.add_argument("--period", type=int, default=9, help="a sample every 2^period cycles per SM")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--top", type=int, default=12, help="hottest PCs listed per case")
    p.add_argument("--json", default=None, help="write every PC's counts here")
    a = p.parse_args()

    L = load(a.lib, a.cupti)
    cp.zeros(1)   # the context, before any module is loaded
    call(L, L.pcs_enable(ctypes.c_void_p(cp.cuda.driver.ctxGetCurrent()), a.period))
    nreasons = L.pcs_num_reasons()
    reasons = [short(L.pcs_reason(i).decode()) for i in range(nreasons)]
    dump = {"reasons": reasons, "cases": []}
    for codec_name in a.codecs:
        for name, _, fn in kernel_bench.cases(a.elems, a.group, codec_name):
            if not all(m in name for m in a.match):
                continue
            funcs, off, counts, totals = profile(L, fn, a.iters, nreasons)
            per_reason = counts.sum(axis=0).astype(np.float64)
            total = per_reason.sum()
            print(f"\n## {name}: {int(total)} samples in {len(off)} PCs "
                  f"(CUPTI total {int(totals[0])}, dropped {int(totals[1])}, hw buffer full {int(totals[3])}); "
                  f"kernel {sorted(set(funcs))}")
            order = np.argsort(-per_reason)
            print("| stall reason | % |\n|---|---:|")
            for i in order:
                if total and per_reason[i] / total >= 0.005:
                    print(f"| {reasons[i]} | {100 * per_reason[i] / total:.1f} |")
            by_pc = counts.sum(axis=1)
            print(f"hottest PCs (offset: % of samples, top reasons):")
            for r in np.argsort(-by_pc)[:a.top]:
                top = np.argsort(-counts[r])[:3]
                desc = ", ".join(f"{reasons[i]} {100 * counts[r, i] / total:.1f}" for i in top if counts[r, i])
                print(f"  {funcs[r][-40:]} 0x{int(off[r]):04x}: {100 * by_pc[r] / total:.1f}%  ({desc})")
            dump["cases"].append({"name": name, "funcs": funcs, "offsets": [int(o) for o in off],
                                  "counts": counts.tolist(), "totals": [int(t) for t in totals]})
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dump, f)


if __name__ == "__main__":
    main()
