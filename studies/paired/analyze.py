"""Tables (ACCURACY.md, "Residual formats") from the per-sequence .npz files of persq.py and the
depth JSONs, read from studies/results/ (where the commands in ACCURACY.md write them).

    .venv/bin/python studies/paired/analyze.py [--formats A B] [--codec CODEC] [--results DIR]

Two residual formats A and B (default float32 and input) of runs of ``CODEC`` (default int4-h32):
B - A per sequence; with A = float32 also the null control (float32 again, ``--batch 8``).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).resolve().parent.parent / "results"
NAMES = {"float32": "float32", "input": "bf16 (input)", "int8": "int8"}


def load(folder: Path, tag: str):
    p = folder / f"{tag}.npz"
    return np.load(p) if p.exists() else None


def summary(d, row):
    nll, top = d["nll__" + row], d["top__" + row]
    ref_ppl = np.exp(d["nll_ref"].mean())
    return np.exp(nll.mean()) / ref_ppl - 1, (top == d["top_ref"]).mean()


def paired(a, b, row):
    """b - a per sequence: mean log-ppl difference (~ relative ppl difference) and agreement
    difference, each with its standard error over sequences; and the same on disjoint blocks of 8."""
    dn = (b["nll__" + row] - a["nll__" + row]).mean(axis=1)
    dg = ((b["top__" + row] == b["top_ref"]).astype(float) - (a["top__" + row] == a["top_ref"])).mean(axis=1)
    n = len(dn)
    se = lambda x: x.std(ddof=1) / np.sqrt(len(x))  # noqa: E731
    blocks = [float(np.exp(dn[i:i + 8].mean()) - 1) for i in range(0, n - n % 8, 8)]
    return dict(n=n, dlog=dn.mean(), dlog_se=se(dn), dagree=dg.mean(), dagree_se=se(dg), blocks8=blocks,
                dn=dn, dg=dg)


def pct(x):
    return f"{100 * x:+.2f}%"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--formats", nargs=2, default=["float32", "input"], metavar=("A", "B"))
    ap.add_argument("--codec", default="int4-h32")
    ap.add_argument("--results", type=Path, default=RESULTS)
    a = ap.parse_args()
    R = a.results
    rows = (("1 round", f"echonccl two_shot {a.codec}"), ("flush", f"echonccl two_shot {a.codec} + flush"))
    fa, fb = a.formats
    null = fa == "float32"
    cells = [(text, P) for P in (2, 4, 8) for text in ("lee", "wiki")]     # those with results
    out = []
    out.append(f"| text | P | seqs | row | {NAMES[fa]} residuals | {NAMES[fb]} residuals |"
               + (" null: float32, --batch 8 |" if null else ""))
    out.append("|---|---|---|---|---|---|" + ("---|" if null else ""))
    diffs = []
    for text, P in cells:
        for n in (32, 16, 8):
            base = f"sm_{text}_p{P}_n{n}"
            da, db = load(R, f"{base}_{fa}"), load(R, f"{base}_{fb}")
            nul = load(R, base + "_float32_batch8") if null else None
            if da is None and db is None:
                continue
            for label, row in rows:
                cols = []
                for d in (da, db, nul)[:3 if null else 2]:
                    if d is None:
                        cols.append("")
                    else:
                        p, g = summary(d, row)
                        cols.append(f"{pct(p)} / {100 * g:.2f}%")
                out.append(f"| {text} | {P} | {n} | {label} | " + " | ".join(cols) + " |")
                for what, b in ((f"{NAMES[fb]} - {NAMES[fa]}", db), ("null (--batch 8) - float32", nul)):
                    if da is not None and b is not None:
                        diffs.append((text, P, n, label, what, paired(da, b, row)))
    out.append("")
    out.append("Paired per-sequence differences (b - a over the same sequences): perplexity ratio "
               "exp(mean dNLL) - 1 and agreement difference, each +- 1.96 standard errors over sequences; "
               "then the perplexity difference on each disjoint block of 8 sequences.")
    out.append("")
    out.append("| text | P | seqs | row | comparison | d perplexity (+-95%) | d agreement (+-95%) | d ppl per block of 8 |")
    out.append("|---|---|---|---|---|---|---|---|")
    for text, P, n, label, what, s in diffs:
        out.append(f"| {text} | {P} | {s['n']} | {label} | {what} | {pct(np.exp(s['dlog']) - 1)} +- {100 * 1.96 * s['dlog_se']:.2f} | "
                   f"{100 * s['dagree']:+.2f} +- {100 * 1.96 * s['dagree_se']:.2f} pt | "
                   + ", ".join(pct(x) for x in s["blocks8"]) + " |")
    out.append("")
    out.append("Pooled over every cell above (each sequence of each cell one sample):")
    out.append("")
    out.append("| row | comparison | samples | d perplexity (+-95%) | d agreement (+-95%) |")
    out.append("|---|---|---|---|---|")
    for label, _ in rows:
        for what in sorted({w for *_, w, _ in diffs}):
            sel = [s for _, _, _, lab, w, s in diffs if lab == label and w == what]
            if not sel:
                continue
            dn = np.concatenate([s["dn"] for s in sel])
            dg = np.concatenate([s["dg"] for s in sel])
            se = lambda x: x.std(ddof=1) / np.sqrt(len(x))  # noqa: E731
            out.append(f"| {label} | {what} | {len(dn)} | {pct(np.exp(dn.mean()) - 1)} +- {100 * 1.96 * se(dn):.2f} | "
                       f"{100 * dg.mean():+.2f} +- {100 * 1.96 * se(dg):.2f} pt |")
    out.append("")
    out.append(f"Depth study (bf16 terms, {a.codec}, L = 128): two_shot relative stream error")
    out.append("")
    out.append("| P | seed | residuals | err(1) | err(128) | err(128)/err(1) |")
    out.append("|---|---|---|---|---|---|")
    for P in (2, 4):
        for seed in ("", "_s1", "_s2", "_s3", "_s4"):
            for rd in (fa, fb):
                p = R / f"depth_p{P}_{rd}{seed}.json"
                if not p.exists():
                    continue
                e = json.load(open(p))["errors"][f"two_shot {a.codec}"]
                out.append(f"| {P} | {seed[2:] or 0} | {rd} | {e[0]:.3e} | {e[-1]:.3e} | {e[-1] / e[0]:.3f} |")
    print("\n".join(out))


if __name__ == "__main__":
    main()
