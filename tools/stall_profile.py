#!/usr/bin/env python3
"""Where the kernels' warps wait: CUPTI PC sampling with stall reasons, per kernel.

    gcc -shared -fPIC -O2 -I/usr/local/cuda/include -I$CUPTI/include tools/pcsampling.c -o fb/pcsampling.so
    python tools/stall_profile.py --lib fb/pcsampling.so --cupti $CUPTI/lib \\
        [--codecs int4 int4-h32] [--match in=bfloat16] [--period 9] [--iters 20] [--json F]
    python tools/stall_profile.py --lib ... --cupti ... --fused [--ranks 2] [--sizes 16M 1G]
        [--kernels whole] [--codec C] [--residual input|float32|int8] [--offset N] [--json F]
    python tools/stall_profile.py --annotate F --sass K.sass      # no GPU

($CUPTI: the nvidia-cuda-cupti wheel's nvidia/cu13, unzipped.) The kernels are
`tools/kernel_bench.py`'s cases (as two_shot calls them), or with ``--fused`` the fused kernels
of `tools/fused_solo.py` (rank 0 of P alone on the GPU, its peers' data pre-filled), each sampled
three ways for a two-shot kernel: the whole call, and the launches that start at its owner's and
at its decode's first item (the phases before skipped, as ``fused_solo.py --phases`` times them).
Each selected case runs ``--iters`` times inside one sampling range. For each case: the share of
samples per stall reason, the warp's state when sampled (``selected`` issued, ``long_scoreboard``
waits on global memory, ``short_scoreboard`` on shuffles and shared memory, ``barrier``,
``math_pipe_throttle``, ``lg_throttle``, ...; each sample has one, and the ``*_not_issued``
counters, which count again a reason's samples taken when the scheduler issued nothing, are left
out), and the hottest PC offsets, which match the ``/*0xxx*/`` offsets of ``nvdisasm -c`` (or
``cuobjdump -sass``) on the same cubin. ``--json`` keeps every PC's counts.

``--annotate F --sass K.sass`` (offline): the samples of a ``--json`` dump by function (a fused
kernel's phases are device functions inside it: ``phase_contribute``, ``phase_reduce``,
``phase_decode``; ``entry`` is the kernel's own code, its item loop, waits and barriers), from the
``nvdisasm -c`` listing of the cubin that ran: for the prebuilt kernels,
``cuobjdump -xelf all echonccl/prebuilt/kernels.fatbin`` then ``nvdisasm -c kernels.1.sm_90.cubin``
(the nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm wheels; they need no GPU).
"""
from __future__ import annotations

import argparse
import bisect
import ctypes
import json
import os
import re
import shutil
import subprocess
import sys
import time

import numpy as np

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
    import cupy as cp

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


# ------------------------------------------------------------------------ PCs -> functions
def sass_functions(text: str) -> dict:
    """From an ``nvdisasm -c`` listing: for each kernel (its ``.text.<kernel>`` section), the
    functions in it as a sorted list of (first PC offset, name): ``entry`` for the kernel's own
    code, then each function by its label (``$<kernel>$<mangled>``: the mangled name; a helper such
    as ``$__internal_3_$__cuda_sm20_div_s64``: the label without its ``$``)."""
    out: dict = {}
    kernel = None
    pending = "entry"
    for line in text.splitlines():
        m = re.match(r"^\s*\.text\.(\S+):\s*$", line)
        if m:
            kernel, pending = m.group(1), "entry"
            out[kernel] = []
            continue
        if kernel is None:
            continue
        m = re.match(r"^\s*(\$\S+):\s*$", line)
        if m:
            label = m.group(1)
            pending = label[len(kernel) + 2:] if label.startswith(f"${kernel}$") else label.strip("$")
            continue
        m = re.search(r"/\*([0-9a-f]{4,})\*/", line)
        if m and pending is not None:
            out[kernel].append((int(m.group(1), 16), pending))
            pending = None
    return out


def demangle(names) -> dict:
    """Mangled -> readable names (``c++filt`` if there is one, else as they are), short: the
    function's qualified name without its arguments."""
    names = sorted(set(names))
    plain = names
    if shutil.which("c++filt") and names:
        plain = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True).stdout.split("\n")
    return {n: ((p.split("(")[0].split("<")[0].split() or [n])[-1]) for n, p in zip(names, plain)}


def function_at(funcs: list, off: int) -> str:
    """The function of a kernel's (sass_functions) holding PC offset ``off``."""
    i = bisect.bisect_right([o for o, _ in funcs], off) - 1
    return funcs[i][1] if i >= 0 else "?"


def sampled(reasons) -> np.ndarray:
    """Which reasons count samples: each sample has one reason; a ``*_not_issued`` counter counts
    again those of its reason's samples taken when the warp's scheduler issued nothing."""
    return np.array([not r.endswith("_not_issued") for r in reasons])


def by_function(case: dict, reasons: list, funcs_of: dict) -> list:
    """[(function, samples, {reason: samples})] of a dumped case, most samples first (samples:
    `sampled` reasons only); PCs of kernels without a listing in ``funcs_of`` go by their kernel's name."""
    acc: dict = {}
    for kernel, off, counts in zip(case["funcs"], case["offsets"], case["counts"]):
        name = function_at(funcs_of[kernel], off) if kernel in funcs_of else kernel
        row = acc.setdefault(name, np.zeros(len(reasons), np.int64))
        row += np.asarray(counts, np.int64)
    keep = sampled(reasons)
    rows = [(name, int(c[keep].sum()), {reasons[i]: int(v) for i, v in enumerate(c) if v and keep[i]})
            for name, c in acc.items()]
    return sorted(rows, key=lambda r: -r[1])


def annotate(dump: dict, sass_text: str) -> str:
    funcs_of = sass_functions(sass_text)
    names = demangle(n for fs in funcs_of.values() for _, n in fs)
    lines = []
    for case in dump["cases"]:
        rows = by_function(case, dump["reasons"], funcs_of)
        total = sum(n for _, n, _ in rows) or 1
        lines += [f"\n## {case['name']}: {total} samples", "| function | % of samples | top stall reasons (% of its samples) |",
                  "|---|---:|---|"]
        for name, n, per in rows:
            top = sorted(per.items(), key=lambda kv: -kv[1])[:5]
            lines.append(f"| {names.get(name, name)} | {100 * n / total:.1f} | "
                         + ", ".join(f"{r} {100 * v / n:.0f}" for r, v in top) + " |")
    return "\n".join(lines)


# ------------------------------------------------------------------------ sampling
def report(name: str, reasons, funcs, off, counts, totals, top: int) -> dict:
    """Print a case's stall reasons and hottest PCs (shares of its samples: `sampled`); its dump."""
    keep = sampled(reasons)
    per_reason = np.where(keep, counts.sum(axis=0), 0).astype(np.float64)
    total = per_reason.sum()
    print(f"\n## {name}: {int(total)} samples in {len(off)} PCs "
          f"(CUPTI total {int(totals[0])}, dropped {int(totals[1])}, hw buffer full {int(totals[3])}); "
          f"kernel {sorted(set(funcs))}")
    order = np.argsort(-per_reason)
    print("| stall reason | % |\n|---|---:|")
    for i in order:
        if total and per_reason[i] / total >= 0.005:
            print(f"| {reasons[i]} | {100 * per_reason[i] / total:.1f} |")
    by_pc = counts[:, keep].sum(axis=1)
    print("hottest PCs (offset: % of samples, top reasons):")
    for r in np.argsort(-by_pc)[:top]:
        best = np.argsort(-np.where(keep, counts[r].astype(np.int64), 0), kind="stable")[:3]
        desc = ", ".join(f"{reasons[i]} {100 * counts[r, i] / total:.1f}" for i in best if counts[r, i] and keep[i])
        print(f"  {funcs[r][-40:]} 0x{int(off[r]):04x}: {100 * by_pc[r] / total:.1f}%  ({desc})")
    return {"name": name, "funcs": funcs, "offsets": [int(o) for o in off], "counts": counts.tolist(),
            "totals": [int(t) for t in totals]}


def main(argv=None):
    from echonccl.codec import RESIDUAL_FORMATS
    from echonccl.feedback import DEFAULT_RESIDUAL

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lib", help="pcsampling.so built from tools/pcsampling.c")
    p.add_argument("--cupti", help="directory holding libcupti.so.13")
    p.add_argument("--codecs", nargs="+", default=["int4", "int4-h32"])
    p.add_argument("--match", nargs="*", default=["in=bfloat16"],
                   help="profile the cases whose name contains all of these")
    p.add_argument("--elems", type=lambda s: int(eval(s, {})), default=2 ** 26)
    p.add_argument("--group", type=int, default=32)
    p.add_argument("--fused", action="store_true", help="the fused kernels of tools/fused_solo.py instead")
    p.add_argument("--ranks", nargs="+", type=int, default=[2], help="--fused: P")
    p.add_argument("--sizes", nargs="+", default=["16M", "1G"], help="--fused: bytes of bf16 input")
    p.add_argument("--kernels", nargs="+", default=["whole"], help="--fused: fused_solo's kernels")
    p.add_argument("--codec", default=None, help="--fused: the codec (default: the default codec)")
    p.add_argument("--residual", default=DEFAULT_RESIDUAL, choices=RESIDUAL_FORMATS,
                   help="--fused: the residuals' format (Feedback(residual_dtype=))")
    p.add_argument("--offset", type=int, default=0,
                   help="--fused: input and output that many elements off alignment (fused_solo.py --offset)")
    p.add_argument("--period", type=int, default=9, help="a sample every 2^period cycles per SM")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--top", type=int, default=12, help="hottest PCs listed per case")
    p.add_argument("--json", default=None, help="write every PC's counts here")
    p.add_argument("--annotate", default=None, help="a --json dump to print by function (with --sass; no GPU)")
    p.add_argument("--sass", default=None, help="nvdisasm -c listing of the cubin the dump sampled")
    a = p.parse_args(argv)

    if a.annotate:
        if not a.sass:
            p.error("--annotate needs --sass")
        with open(a.annotate) as f, open(a.sass) as g:
            print(annotate(json.load(f), g.read()))
        return 0
    if not (a.lib and a.cupti):
        p.error("--lib and --cupti are needed to sample")

    import cupy as cp

    L = load(a.lib, a.cupti)
    cp.zeros(1)   # the context, before any module is loaded
    call(L, L.pcs_enable(ctypes.c_void_p(cp.cuda.driver.ctxGetCurrent()), a.period))
    nreasons = L.pcs_num_reasons()
    reasons = [short(L.pcs_reason(i).decode()) for i in range(nreasons)]
    dump = {"reasons": reasons, "cases": []}
    if a.fused:
        import fused_solo
        from echonccl import codec
        from echonccl.perf.options import format_size, parse_size

        def observe(P, nbytes, kernel, launch, starts):
            for phase, first in starts.items():
                name = f"P={P} {format_size(nbytes)} {kernel}{f' offset {a.offset}' if a.offset else ''} from {phase}"
                got = profile(L, lambda: launch(first), a.iters, nreasons)
                dump["cases"].append(report(name, reasons, *got, a.top))

        fused_solo.run_solo(a.ranks, [parse_size(s) for s in a.sizes], a.kernels, a.codec or codec.DEFAULT_CODEC,
                            a.residual, iters=a.iters, reps=1, observe=observe, offset=a.offset)
    else:
        import kernel_bench

        for codec_name in a.codecs:
            for name, _, fn in kernel_bench.cases(a.elems, a.group, codec_name):
                if all(m in name for m in a.match):
                    dump["cases"].append(report(name, reasons, *profile(L, fn, a.iters, nreasons), a.top))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dump, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
