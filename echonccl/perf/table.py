"""What rank 0 prints while the tool runs, nccl-tests style.

* the header: `run_info` (the run's metadata, also the top level of the
  JSON), `header_lines` (versions, engine, options, `rank_line` per rank);
* the table: `Column` and `table_header` (three ``#`` lines: a group of
  columns per variant, echonccl's with a ``speedup`` whose unit line names
  the baseline it divides by), `table_row` (one line per size; ``n/a`` in
  the columns of a variant that could not run);
* the footer: `footer_lines` (average bus bandwidth, geometric-mean
  speedup, the check) from `echonccl.perf.report.summary`;
* `Progress`: a one-line bar on stderr.
"""
from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from .. import __version__
from .check import FASTEST, MAX_RELERR, Row, speedup_baseline
from .options import AVERAGE_MODES

if TYPE_CHECKING:
    from .bench import Collective


# ---------------------------------------------------------------------------------------------
# Header
# ---------------------------------------------------------------------------------------------
def mpi_library_version() -> str:
    """The first line of the MPI library's version string, spaces collapsed."""
    from mpi4py import MPI

    lines = MPI.Get_library_version().strip().splitlines() or ["unknown"]
    return " ".join(lines[0].split())[:80]


def format_nccl_version(v) -> str:
    """NCCL's version code (22805, or 2804 before 2.9) or anything else, as text."""
    if isinstance(v, int):
        major, rest = (v // 10000, v % 10000) if v >= 10000 else (v // 1000, v % 1000)
        return f"{major}.{rest // 100}.{rest % 100}"
    return ".".join(map(str, v)) if isinstance(v, (tuple, list)) else str(v)


def baseline_version(engine) -> str:
    """NCCL's version when the engine reports it, the MPI library's on the CPU engine."""
    if hasattr(engine, "nccl_version"):
        return format_nccl_version(engine.nccl_version())
    return mpi_library_version() if engine.name == "cpu" else "unknown"


def run_info(opts, collective: Collective, mpi, comm, arrays, variants=()) -> dict:
    """Collective: the run's metadata (JSON's top level); ``ranks`` (one entry per rank: pid,
    host, device) on rank 0 only. From ``variants`` (the `Variant` list): ``baselines`` (the
    baselines' labels, in table order), ``speedup_baseline`` (the one ``speedup`` divides by),
    ``notes`` (what a variant is, by label) and ``unavailable`` (why one could not run: n/a)."""
    engine = comm.engine
    index, desc = arrays.device()
    if hasattr(engine, "device_description"):
        desc = engine.device_description()
    me = {"rank": mpi.Get_rank(), "pid": os.getpid(), "host": socket.gethostname().split(".")[0],
          "device": index, "description": desc}
    return {
        "tool": opts.prog, "collective": collective.name, "echonccl_version": __version__,
        "nranks": mpi.Get_size(), "engine": engine.name, "engine_description": engine.describe(),
        "baseline": getattr(engine, "baseline_name", "baseline"), "baseline_version": baseline_version(engine),
        "baseline_run": not opts.no_baseline, "mpi_version": mpi_library_version(),
        "cuda": arrays.cuda_version(), "dtype": opts.datatype, "group_size": comm.group_size,
        "codec": comm.config.codec,
        "feedback": not opts.no_feedback, "residual": opts.residual, "rounds": opts.rounds,
        "algorithms": list(opts.algorithms),
        "baselines": [v.label for v in variants if v.baseline],
        "speedup_baseline": speedup_baseline(variants),
        "notes": {v.label: v.note for v in variants if v.note},
        "unavailable": {v.label: v.unavailable for v in variants if v.unavailable},
        "max_relerr_bound": MAX_RELERR, "units": {"time_us": "us", "algbw": "GB/s", "busbw": "GB/s"},
        "options": {k: v for k, v in vars(opts).items() if k not in ("sizes", "prog")},
        "ranks": mpi.gather(me, root=0),
    }


def header_lines(info: dict) -> list:
    """The ``#`` lines before the table: versions, engine, options, one line per rank."""
    o = info["options"]
    step = f"{o['stepfactor']:g}(factor)" if o["stepfactor"] > 1 else f"{o['stepbytes']}(bytes)"
    lines = [f"# {info['tool']} {info['collective']}: echonccl {info['echonccl_version']}, "
             f"{format_ranks(info['nranks'])}",
             f"# engine   : {info['engine_description']}",
             f"# baseline : {info['baseline']} ({info['baseline_version']})"
             + ("" if info["baseline_run"] else " (not run: --no-baseline)")]
    for label in info.get("baselines", [])[1:]:              # NCCL on symmetric windows
        why = info.get("unavailable", {}).get(label)
        lines.append(f"# {label:<8} : " + (f"n/a: {why}" if why else info.get("notes", {}).get(label, "")))
    if info.get("speedup_baseline") == FASTEST:
        lines.append("# speedup  : the fastest baseline's time at each size / each echonccl variant's")
    elif info.get("speedup_baseline"):
        lines.append(f"# speedup  : {info['speedup_baseline']}'s time / each echonccl variant's")
    if info["engine"] != "cpu":
        lines.append(f"# MPI      : {info['mpi_version']}")
    if info["cuda"]:
        lines.append(f"# CUDA     : {info['cuda']}")
    lines += [f"# echonccl : {info['dtype']}, codec {info.get('codec', 'int4')}, group size {info['group_size']}, feedback "
              f"{'on (' + info['residual'] + ' residuals)' if info['feedback'] else 'off'}, "
              f"rounds {info['rounds']}, algorithms {' '.join(info['algorithms'])}",
              f"# minBytes {o['minbytes']} maxBytes {o['maxbytes']} step: {step} warmup iters: "
              f"{o['warmup_iters']} iters: {o['iters']} check iters: {o['check']} cudagraph: "
              f"{o['cudagraph']} average: {o['average']} ({AVERAGE_MODES[o['average']]})",
              "#", "# Using devices"]
    lines += [rank_line(r) for r in info["ranks"]]
    return lines + ["#"]


def format_ranks(n: int) -> str:
    """``1 rank``, ``2 ranks``."""
    return f"{n} rank" + ("" if n == 1 else "s")


def rank_line(r: dict) -> str:
    """nccl-tests' per-rank line: ``#  Rank  0 Group  0 Pid   1234 on  host device  0 [name]``."""
    dev = "-" if r["device"] is None else r["device"]
    return (f"#  Rank {r['rank']:2d} Group  0 Pid {r['pid']:6d} on {r['host']:>10} "
            f"device {dev:>2} [{r['description']}]")


# ---------------------------------------------------------------------------------------------
# Table
# ---------------------------------------------------------------------------------------------
def format_optional(value, spec: str) -> str:
    """``value`` formatted per ``spec``, ``N/A`` when it is None."""
    return "N/A" if value is None else format(value, spec)


def _fmt_time(us: float) -> str:
    """nccl-tests' precision: fewer decimals as the time grows."""
    return f"{us:.0f}" if us >= 10000 else f"{us:.1f}" if us >= 100 else f"{us:.2f}"


@dataclass(frozen=True)
class Column:
    """A table column: its name, unit line, width and how a `Result` (or a `Row`) renders in it."""

    name: str
    unit: str
    width: int
    render: Callable


SIZE = Column("size", "(B)", 12, lambda row: str(row.size))
COUNT = Column("count", "(elements)", 12, lambda row: str(row.count))
TYPE = Column("type", "", 9, lambda row: row.dtype)
TIME = Column("time", "(us)", 9, lambda r: _fmt_time(r.time_us))
ALGBW = Column("algbw", "(GB/s)", 7, lambda r: f"{r.algbw:.2f}")
BUSBW = Column("busbw", "(GB/s)", 7, lambda r: f"{r.busbw:.2f}")
SPEEDUP = Column("speedup", "(x)", 7, lambda r: format_optional(r.speedup, ".2f"))   # `speedup_column`
RELERR = Column("relerr", "", 8, lambda r: format_optional(r.relerr, ".2e"))
MAXERR = Column("maxerr", "", 8, lambda r: format_optional(r.maxerr, ".2e"))
WRONG = Column("#wrong", "", 6, lambda r: format_optional(r.wrong, "d"))
PREFIX = (SIZE, COUNT, TYPE)


def speedup_column(base: str) -> Column:
    """`SPEEDUP` dividing by baseline ``base``: its unit line says so (``vs fastest``, ``vs NCCL``)."""
    unit = f"vs {base}"
    return Column(SPEEDUP.name, unit, max(SPEEDUP.width, len(unit)), SPEEDUP.render)


def variant_columns(baseline: bool, speedup_vs) -> list:
    """The columns of one variant's group: speedup only for echonccl's variants, when there is a
    baseline ``speedup_vs`` (its label; None: none) to divide by."""
    speed = [speedup_column(speedup_vs)] if speedup_vs and not baseline else []
    return [TIME, ALGBW, BUSBW] + speed + [RELERR, MAXERR, WRONG]


def _cells(columns, texts) -> str:
    return " ".join(f"{t:>{c.width}}" for c, t in zip(columns, texts))


def _line(lead: str, prefix: str, groups) -> str:
    return lead + prefix + "".join("   " + g for g in groups)


def _groups(variants) -> list:
    """Column lists per variant (anything with ``label``, ``baseline`` and, optionally,
    ``unavailable``; for a `Result`, a missing time), in table order."""
    vs = speedup_baseline(variants)
    return [variant_columns(v.baseline, vs) for v in variants]


def table_header(variants) -> list:
    """Three ``#`` lines: variant labels centred over their groups, column names, units."""
    groups = _groups(variants)
    width = lambda cols: sum(c.width for c in cols) + len(cols) - 1  # noqa: E731
    blank = " " * width(PREFIX)
    labels = [v.label.center(width(cols)) for v, cols in zip(variants, groups)]
    names = [_cells(cols, [c.name for c in cols]) for cols in groups]
    units = [_cells(cols, [c.unit for c in cols]) for cols in groups]
    return [_line("#", blank, labels).rstrip(),
            _line("#", _cells(PREFIX, [c.name for c in PREFIX]), names),
            _line("#", _cells(PREFIX, [c.unit for c in PREFIX]), units).rstrip()]


def table_row(row: Row) -> str:
    """One size's line of the table; ``n/a`` in every column of a variant that could not run."""
    groups = _groups([_Ran(r) for r in row.results])
    cells = [_cells(cols, ["n/a" if r.time_us is None else c.render(r) for c in cols])
             for r, cols in zip(row.results, groups)]
    return _line(" ", _cells(PREFIX, [c.render(row) for c in PREFIX]), cells)


class _Ran:
    """A `Result` seen as a variant for `_groups`: unavailable when it has no time."""

    def __init__(self, r):
        self.label, self.baseline = r.label, r.baseline
        self.unavailable = "n/a" if r.time_us is None else None


# ---------------------------------------------------------------------------------------------
# Footer
# ---------------------------------------------------------------------------------------------
def footer_lines(summ: dict, checked: bool) -> list:
    """nccl-tests-style footer lines from a `summary`: the geometric-mean speedups against the
    speedup baseline first, then against each other baseline."""
    bw = "  ".join(f"{k} {_na(v, '.2f')}" for k, v in summ["avg_busbw"].items())
    lines = [f"# Avg bus bandwidth    : {bw}  (GB/s)"]
    if summ["geomean_speedup"]:
        first = summ.get("speedup_baseline")
        per = dict(summ.get("geomean_speedups") or {first: summ["geomean_speedup"]})
        per[first] = summ["geomean_speedup"]
        order = [first] + [b for b in per if b != first]
        sp = ";  ".join((f"vs {b}: " if b else "") + "  ".join(f"{k} {format_optional(v, '.2f')}x"
                                                                for k, v in per[b].items()) for b in order)
        lines.append(f"# Geomean speedup      : {sp}")
    lines.append(f"# Check                : {_check_text(summ, checked)}")
    return lines + ["#"]


def _na(value, spec: str) -> str:
    """``value`` per ``spec``, ``n/a`` for None (a variant that could not run)."""
    return "n/a" if value is None else format(value, spec)


def _check_text(summ: dict, checked: bool) -> str:
    if not checked:
        return "disabled (-c 0)"
    if summ["ok"]:
        errs = ", ".join(f"{k} {_na(v, '.2e')}" for k, v in summ["max_relerr"].items())
        return f"OK (max relerr: {errs})"
    shown = summ["failures"][:5]
    more = len(summ["failures"]) - len(shown)
    return "FAILED: " + "; ".join(shown) + (f"; and {more} more" if more else "")


# ---------------------------------------------------------------------------------------------
# Progress bar
# ---------------------------------------------------------------------------------------------
class Progress:
    """A one-line bar on stderr, ``[#####     ] 3/7 64 KiB``; does nothing unless ``enabled``."""

    def __init__(self, total: int, enabled: bool, width: int = 30, stream=None):
        self.total, self.enabled, self.width = max(total, 1), enabled, width
        self.stream = stream or sys.stderr
        self._shown = 0

    def show(self, done: int, label: str) -> None:
        """Draw the bar with ``done`` of ``total`` steps finished, working on ``label``."""
        if not self.enabled:
            return
        filled = self.width * done // self.total
        text = f"[{'#' * filled}{' ' * (self.width - filled)}] {done}/{self.total} {label}"
        self.stream.write("\r" + text.ljust(self._shown))
        self.stream.flush()
        self._shown = len(text)

    def clear(self) -> None:
        """Erase the bar (before a table line is printed)."""
        if self.enabled and self._shown:
            self.stream.write("\r" + " " * self._shown + "\r")
            self.stream.flush()
            self._shown = 0

