"""The results of a run, summarised and written to files, and re-read from JSON.

* `summary`: per variant the average bus bandwidth, the geometric-mean
  speedup (against the speedup baseline, and against every baseline) and
  the largest relative error; the failed checks;
* `write_json` (``-J``), `write_csv` (``--csv``), `write_plot` (``--plot``:
  bus bandwidth and speedup over size), `write_outputs` (the ones asked for);
* `load_json` and `markdown_table`, and the command that uses them:

      python -m echonccl.perf.report FILE.json [FILE.json ...] [--markdown]
                                     [--plot OUT.png [--title TEXT]] ...

  prints a markdown table per file (the default without ``--plot``) and
  writes each file's plot (``--plot`` once per file, in order; ``--title``
  an optional first title line, once per plot).
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from dataclasses import asdict
from typing import Optional

import numpy as np

from . import check
from .check import Result, Row
from .options import format_size
from .table import format_ranks


# ---------------------------------------------------------------------------------------------
# Summary
# ---------------------------------------------------------------------------------------------
def feedback_words(info: dict) -> str:
    """``feedback on`` / ``feedback off``, plus ``, R rounds`` when a run used more than one
    (JSON files from before ``--rounds`` have no ``rounds``: one)."""
    rounds = info.get("rounds", 1)
    return f"feedback {'on' if info['feedback'] else 'off'}" + (f", {rounds} rounds" if rounds > 1 else "")


def _series(rows, label: str, field: str) -> list:
    return [getattr(r, field) for row in rows for r in row.results if r.label == label]


def _mean(values) -> Optional[float]:
    """The mean of the values that are not None (a variant that could not run has none): None
    when there are none."""
    known = [v for v in values if v is not None]
    return float(np.mean(known)) if known else None


def _speedups_vs(rows, label: str, base: str) -> list:
    return [(r.speedups or {}).get(base) for row in rows for r in row.results if r.label == label]


def speedup_label(info: dict) -> Optional[str]:
    """The baseline a run's ``speedup`` divides by: ``speedup_baseline`` in its metadata (JSON
    files from before it: the one baseline, when it ran)."""
    if "speedup_baseline" in info:
        return info["speedup_baseline"]
    return info.get("baseline") if info.get("baseline_run", True) else None


def geometric_mean(values) -> Optional[float]:
    """Geometric mean of the finite positive ``values``; None when there are none."""
    logs = [math.log(v) for v in values if v is not None and math.isfinite(v) and v > 0]
    return math.exp(sum(logs) / len(logs)) if logs else None


def failures(rows) -> list:
    """One line per (size, variant) whose check failed (`Result.ok`)."""
    return [f"{format_size(row.size)} {r.label}: #wrong {r.wrong}, relerr {r.relerr:.2e}"
            for row in rows for r in row.results if not r.ok()]


def summary(rows, variants, speedup_baseline: Optional[str] = None) -> dict:
    """Per variant: the average bus bandwidth (nccl-tests' footer; None for a variant that could
    not run), the geometric-mean speedup (``geomean_speedup``: against the speedup baseline;
    ``geomean_speedups``: against each baseline that ran, by baseline) and the largest relative
    error over the sweep; the failed checks; ``ok``. ``speedup_baseline``: the label ``speedup``
    divides by (default: `echonccl.perf.check.speedup_baseline` of ``variants``)."""
    labels = [v.label for v in variants]
    fails = failures(rows)
    relerrs = {k: [e for e in _series(rows, k, "relerr") if e is not None] for k in labels}
    mine = [v.label for v in variants if not v.baseline]
    bases = [v.label for v in variants if v.baseline and not getattr(v, "unavailable", None)]
    return {
        "avg_busbw": {k: _mean(_series(rows, k, "busbw")) for k in labels},
        "speedup_baseline": speedup_baseline or check.speedup_baseline(variants),
        "geomean_speedup": {k: geometric_mean(_series(rows, k, "speedup"))
                            for k in mine if any(v.baseline for v in variants)},
        "geomean_speedups": {b: {k: geometric_mean(_speedups_vs(rows, k, b)) for k in mine} for b in bases},
        "max_relerr": {k: (max(relerrs[k], key=lambda e: (math.isnan(e), e)) if relerrs[k] else None)
                       for k in labels},
        "failures": fails,
        "ok": not fails,
    }


# ---------------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------------
CSV_FIELDS = ("size", "count", "dtype", "buffers", "label", "baseline", "time_us", "algbw", "busbw",
              "speedup", "relerr", "maxerr", "wrong", "speedup_vs")


def _finite(obj):
    """``obj`` with non-finite floats replaced by None (strict JSON)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


def write_json(path: str, info: dict, rows, summ: dict) -> None:
    """The run's metadata, one entry per size (``results``: one per variant) and the summary."""
    doc = dict(info, results=[asdict(row) for row in rows], summary=summ)
    with open(path, "w") as f:
        json.dump(_finite(doc), f, indent=1)
        f.write("\n")


def write_csv(path: str, rows, speedup_baseline: Optional[str] = None) -> None:
    """One line per (size, variant), columns `CSV_FIELDS`; empty cells for missing values;
    ``speedup_vs``: the baseline ``speedup`` divides by, on echonccl's lines."""
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        for row in rows:
            for r in row.results:
                rec = dict(asdict(r), size=row.size, count=row.count, dtype=row.dtype, buffers=row.buffers,
                           speedup_vs=None if r.baseline else speedup_baseline)
                w.writerow({k: ("" if rec[k] is None else rec[k]) for k in CSV_FIELDS})


def write_plot(path: str, info: dict, rows, title: Optional[str] = None) -> None:
    """A PNG with two panels over size (log2 axis): bus bandwidth of every variant, and the
    speedup of echonccl's variants over the speedup baseline (`speedup_label`) with a line at 1;
    a variant that could not run has no line. ``title``, when given, is a first line above the
    run's description."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    fig, (bw, sp) = plt.subplots(1, 2, figsize=(12, 4.8), constrained_layout=True)
    sizes = [row.size for row in rows]
    base = speedup_label(info)
    for label, baseline in [(r.label, r.baseline) for r in rows[0].results]:
        xs, ys = _known(sizes, _series(rows, label, "busbw"))
        if not xs:
            continue
        (line,) = bw.plot(xs, ys, marker="o", label=label)
        if not baseline and base:     # same colour per variant in both panels
            sp.plot(*_known(sizes, _series(rows, label, "speedup")), marker="o", label=label,
                    color=line.get_color())
    sp.axhline(1.0, color="gray", linestyle="--", linewidth=1)
    _log_if_wide(bw)
    for ax, ylabel in ((bw, "bus bandwidth (GB/s)"), (sp, f"speedup over {base or info['baseline']} (x)")):
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: format_size(int(v))))
        ax.tick_params(axis="x", labelrotation=45)
        ax.set(xlabel="size", ylabel=ylabel)
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    described = (f"echonccl {info['collective']}: {format_ranks(info['nranks'])}, {info['dtype']}, "
                 f"{info['engine']} engine, {feedback_words(info)}")
    fig.suptitle(described if title is None else f"{title}\n{described}")
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _known(xs, ys) -> tuple:
    """The points of ``(xs, ys)`` whose y is not None, as two lists."""
    pts = [(x, y) for x, y in zip(xs, ys) if y is not None]
    return [x for x, _ in pts], [y for _, y in pts]


def _log_if_wide(ax) -> None:
    """A log y-axis when the plotted positive values span more than two decades."""
    ys = np.concatenate([line.get_ydata() for line in ax.get_lines()] or [np.zeros(0)])
    ys = ys[np.isfinite(ys) & (ys > 0)]
    if ys.size and ys.max() > 100 * ys.min():
        ax.set_yscale("log")


def write_outputs(opts, info: dict, rows, summ: dict) -> None:
    """The files asked for with -J, --csv and --plot."""
    if opts.json:
        write_json(opts.json, info, rows, summ)
    if opts.csv:
        write_csv(opts.csv, rows, info.get("speedup_baseline"))
    if opts.plot:
        write_plot(opts.plot, info, rows)



# ---------------------------------------------------------------------------------------------
# Re-reading the JSON: python -m echonccl.perf.report
# ---------------------------------------------------------------------------------------------
def load_json(path: str) -> tuple:
    """``(info, rows)`` from a file written by ``-J``: the run's metadata (the top level without
    ``results`` and ``summary``) and its `Row` list. Non-finite values, written as null, come
    back as None."""
    with open(path) as f:
        doc = json.load(f)
    rows = [Row(**dict(row, results=[Result(**r) for r in row["results"]])) for row in doc.pop("results")]
    doc.pop("summary", None)
    return doc, rows


def _num(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _relerr_cell(results) -> str:
    """The largest relative error of ``results``: ``N/A`` when unchecked (``-c 0``), ``nan``
    when one is not finite (written as null in the JSON)."""
    checked = [r for r in results if r.wrong is not None]
    if not checked:
        return "N/A"
    if any(r.relerr is None or not math.isfinite(r.relerr) for r in checked):
        return "nan"
    return f"{max(r.relerr for r in checked):.3f}"


def _wrong_cell(results) -> str:
    checked = [r.wrong for r in results if r.wrong is not None]
    return str(sum(checked)) if checked else "N/A"


def markdown_table(info: dict, rows) -> str:
    """One run as a markdown table, after a line describing it (engine, ranks, dtype, group size,
    feedback). Per size: each baseline's time and bus bandwidth (``-`` where it could not run),
    each echonccl variant's time, bus bandwidth and speedup (``speedup vs B``: over baseline B,
    `speedup_label`), then the largest relative error and the total #wrong over echonccl's
    variants. Without a baseline (``--no-baseline``) its columns and the speedups are left out."""
    base = [r.label for r in rows[0].results if r.baseline]
    algos = [r.label for r in rows[0].results if not r.baseline]
    vs = speedup_label(info) or (base[-1] if base else None)
    head = ["size"] + [c for b in base for c in (f"{b} (us)", "busbw (GB/s)")]
    head += [c for a in algos for c in (f"{a} (us)", "busbw") + ((f"speedup vs {vs}",) if base else ())]
    head += ["relerr", "#wrong"]
    lines = [f"{info['engine_description']}, {format_ranks(info['nranks'])}, {info['dtype']}, "
             f"group {info['group_size']}, {feedback_words(info)}", "",
             "| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for row in rows:
        by_label = {r.label: r for r in row.results}
        cells = [format_size(row.size)]
        for label in base + algos:
            r = by_label[label]
            cells += [_num(r.time_us, ".1f"), _num(r.busbw, ".1f")]
            if base and not r.baseline:
                cells.append(_num(r.speedup, ".2f") + ("" if r.speedup is None else "x"))
        mine = [by_label[a] for a in algos]
        cells += [_relerr_cell(mine), _wrong_cell(mine)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m echonccl.perf.report",
        description="Re-read the JSON files written by echonccl-perf -J: print a markdown table per "
        "file and/or write each file's plot (the same as echonccl-perf --plot).")
    p.add_argument("files", nargs="+", metavar="FILE.json", help="JSON written by echonccl-perf -J")
    p.add_argument("--markdown", action="store_true",
                   help="print a markdown table per file (the default when no --plot is given)")
    p.add_argument("--plot", action="append", default=[], metavar="OUT.png",
                   help="write a plot (needs matplotlib); once per FILE, in the same order")
    p.add_argument("--title", action="append", default=[], metavar="TEXT",
                   help="a first title line for the plots; none, or once per --plot")
    return p


def main(argv=None) -> int:
    """``python -m echonccl.perf.report``: the exit status (2 on a usage error)."""
    p = _parser()
    opts = p.parse_intermixed_args(argv)
    if opts.plot and len(opts.plot) != len(opts.files):
        p.error(f"--plot: give one per file ({len(opts.files)}), got {len(opts.plot)}")
    if opts.title and len(opts.title) != len(opts.plot):
        p.error(f"--title: give none or one per --plot ({len(opts.plot)}), got {len(opts.title)}")
    if opts.plot:
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:
            p.error("--plot needs matplotlib (pip install 'echonccl[plot]')")
    runs = [load_json(path) for path in opts.files]
    titles = opts.title or [None] * len(opts.plot)
    for (info, rows), out, title in zip(runs, opts.plot, titles):
        write_plot(out, info, rows, title)
    if opts.markdown or not opts.plot:
        print("\n\n".join(markdown_table(info, rows) for info, rows in runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
