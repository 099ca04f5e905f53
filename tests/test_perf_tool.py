"""echonccl-perf, the nccl-tests-style bandwidth tool, on the CPU engine.

Smoke tests launch ``mpiexec -n 2`` and ``-n 3`` (the one next to the
interpreter, else the one on PATH; skipped without either); unit tests cover
the size parser, the sweep, the bus-bandwidth formula, the accuracy check,
the table layout and the exit status.
"""
from __future__ import annotations

import argparse
import csv
import ctypes
import importlib.util
import io
import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import launch
from conftest import run_mpi
from echonccl import dtypes, nccl
from echonccl.perf import all_reduce, arrays, bench, check, options, report, table

TIMEOUT = 300
SMOKE_ARGS = ["--engine", "cpu", "-b", "1K", "-e", "64K", "-f", "4", "-n", "3", "-w", "1",
              "--algo", "both", "-J", "tmp.json", "--csv", "tmp.csv", "--plot", "tmp.png"]
SMOKE_SIZES = [1024, 4096, 16384, 65536]
LABELS = ["MPI", "two_shot", "ring"]
PNG = b"\x89PNG\r\n\x1a\n"


# -- helpers -------------------------------------------------------------------------------------
def _launch(n: int, args, cwd, script=None) -> subprocess.CompletedProcess:
    """The tool on ``n`` ranks from ``cwd``, no ECHONCCL_* override leaking in; its own exit
    status (no ``-m mpi4py`` abort)."""
    target = [str(script)] if script else ["-m", "echonccl.perf.all_reduce"]
    return run_mpi(n, [*target, *args], timeout=TIMEOUT, clean=True, abort_on_error=False, cwd=cwd)


def _data_lines(stdout: str) -> list:
    return [ln for ln in stdout.splitlines() if ln.strip() and not ln.startswith("#")
            and ln.split()[0].isdigit()]


@pytest.fixture
def no_env_overrides(monkeypatch):
    for k in list(os.environ):
        if k.startswith("ECHONCCL_"):
            monkeypatch.delenv(k)


# -- smoke: the whole tool under mpiexec --------------------------------------------------------
@pytest.mark.mpi
@pytest.mark.parametrize("nranks", [2, 3])
def test_smoke_cpu(tmp_path, nranks):
    proc = _launch(nranks, SMOKE_ARGS, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "# echonccl-perf all_reduce: echonccl" in out and f"{nranks} ranks" in out
    assert "# baseline : MPI (" in out
    assert sum(ln.startswith("#  Rank ") and " Group  0 Pid " in ln for ln in out.splitlines()) == nranks
    names = next(ln for ln in out.splitlines() if ln.startswith("#") and "algbw" in ln).split()
    for col in ("size", "count", "type", "time", "algbw", "busbw", "speedup", "relerr", "maxerr", "#wrong"):
        assert col in names
    rows = _data_lines(out)
    assert [int(r.split()[0]) for r in rows] == SMOKE_SIZES
    assert all(r.split()[2] == "bfloat16" for r in rows)
    assert "# Avg bus bandwidth" in out and "# Geomean speedup" in out and "# Check                : OK" in out
    _check_json(tmp_path / "tmp.json", nranks)
    _check_csv(tmp_path / "tmp.csv")
    assert (tmp_path / "tmp.png").read_bytes()[:8] == PNG
    _check_report(tmp_path, nranks)


def _check_report(tmp_path: Path, nranks: int) -> None:
    """python -m echonccl.perf.report on the smoke run's JSON: one markdown row per size, the plot."""
    proc = subprocess.run([sys.executable, "-m", "echonccl.perf.report", "tmp.json", "--markdown",
                           "--plot", "again.png"], cwd=tmp_path, env=launch.environment(clean=True), capture_output=True,
                          text=True, timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("cpu") and f", {nranks} ranks, bfloat16, group " in lines[0]
    assert lines[0].endswith(", feedback on")
    assert lines[2] == ("| size | MPI (us) | busbw (GB/s) | two_shot (us) | busbw | speedup vs MPI | ring (us) | "
                        "busbw | speedup vs MPI | relerr | #wrong |")
    assert [ln.split(" | ")[0] for ln in lines[4:]] == ["| 1 KiB", "| 4 KiB", "| 16 KiB", "| 64 KiB"]
    assert all(ln.endswith(" | 0 |") for ln in lines[4:])
    assert (tmp_path / "again.png").read_bytes()[:8] == PNG


def _check_json(path: Path, nranks: int) -> None:
    doc = json.loads(path.read_text())
    assert doc["nranks"] == nranks and doc["engine"] == "cpu" and doc["baseline"] == "MPI"
    assert len(doc["ranks"]) == nranks
    assert [row["size"] for row in doc["results"]] == SMOKE_SIZES
    for row in doc["results"]:
        assert row["count"] == row["size"] // 2 and row["buffers"] >= 1
        assert [r["label"] for r in row["results"]] == LABELS
        for r in row["results"]:
            assert r["time_us"] > 0 and r["algbw"] > 0
            assert r["busbw"] == pytest.approx(r["algbw"] * 2 * (nranks - 1) / nranks)
            assert r["relerr"] < 0.5 and r["wrong"] == 0
            assert (r["speedup"] is None) == r["baseline"]
            if not r["baseline"]:
                base = row["results"][0]["time_us"]
                assert r["speedup"] == pytest.approx(base / r["time_us"])
    assert doc["summary"]["ok"] is True and doc["summary"]["failures"] == []
    assert set(doc["summary"]["geomean_speedup"]) == {"two_shot", "ring"}


def _check_csv(path: Path) -> None:
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(SMOKE_SIZES) * len(LABELS)
    assert [r["label"] for r in rows[:3]] == LABELS
    assert all(float(r["time_us"]) > 0 and r["wrong"] == "0" for r in rows)


BAD_TOOL = """
    import sys
    from dataclasses import replace
    import numpy as np
    from echonccl.perf import bench
    from echonccl.perf.all_reduce import ALL_REDUCE

    def variants(comm, opts):
        def call(x, out, stream):
            comm.all_reduce(x, out, feedback=False, algorithm="two_shot")
            out[5] = np.nan                 # non-finite where the exact sum is finite
            if comm.rank == 1:
                out[:3] = -1000.0             # rank 1 disagrees with rank 0 on 3 elements
        return [bench.Variant("bad", False, lambda: call)]

    sys.exit(bench.run(replace(ALL_REDUCE, variants=variants), sys.argv[1:]))
"""


@pytest.mark.mpi
def test_wrong_results_fail(tmp_path):
    script = tmp_path / "bad_tool.py"
    script.write_text(textwrap.dedent(BAD_TOOL))
    proc = _launch(2, ["--engine", "cpu", "-b", "4K", "-e", "4K", "-n", "2", "-w", "0", "-J", "bad.json"],
                   tmp_path, script)
    assert proc.returncode == options.EXIT_FAILED, proc.stdout + proc.stderr
    assert "# Check                : FAILED" in proc.stdout
    result = json.loads((tmp_path / "bad.json").read_text())["results"][0]["results"][0]
    assert result["wrong"] == 4 and result["relerr"] is None     # NaN is written as null


# -- in one process (a singleton MPI job) --------------------------------------------------------
def test_single_rank_run(no_env_overrides, capsys):
    rc = all_reduce.main(["--engine", "cpu", "-b", "1K", "-e", "4K", "-f", "2", "-n", "2", "-w", "1",
                          "--quiet"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert [int(r.split()[0]) for r in _data_lines(out)] == [1024, 2048, 4096]


@pytest.mark.parametrize("option,shown,conflict,refusal", [
    (["--rounds", "2"], "feedback on (auto residuals), rounds 2, algorithms two_shot ring",
     ["--rounds", "2", "--no-feedback"], "--rounds 2 sends the feedback residuals"),
    (["--codec", "int7-h32"], "codec int7-h32, group size 16,", None, None),
])
def test_option_runs_and_its_conflict_is_a_usage_error(no_env_overrides, capsys, option, shown, conflict,
                                                       refusal):
    rc = all_reduce.main(["--engine", "cpu", "-b", "4K", "-e", "4K", "-n", "1", "-w", "0", "--quiet", *option])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert shown in out
    if conflict:
        assert all_reduce.main(["--engine", "cpu", "-b", "1K", "-e", "1K", *conflict]) == options.EXIT_USAGE
        assert refusal in capsys.readouterr().err


def test_cudagraph_needs_gpu(no_env_overrides, capsys):
    rc = all_reduce.main(["--engine", "cpu", "-G", "1", "-b", "1K", "-e", "1K"])
    assert rc == options.EXIT_USAGE
    assert "-G (CUDA-graph replay) needs the GPU engine" in capsys.readouterr().err


def test_bad_options_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        all_reduce.main(["-b", "12Q"])
    assert exc.value.code == 2
    assert all_reduce.main(["-b", "1M", "-e", "1K"]) == options.EXIT_USAGE


@pytest.mark.parametrize("limit", [all_reduce.GATHER_LIMIT_BYTES, 0])
def test_exact_sum_single_rank(monkeypatch, limit):
    from mpi4py import MPI

    monkeypatch.setattr(all_reduce, "GATHER_LIMIT_BYTES", limit)   # 0: the chunked MPI reduce
    monkeypatch.setattr(check, "CHUNK_ELEMS", 7)
    x = arrays.HostArrays().random(100, np.float16, seed=3)
    ref = all_reduce.exact_sum(MPI.COMM_SELF, x)
    np.testing.assert_array_equal(ref, x.astype(np.float64))


# -- units -----------------------------------------------------------------------------------------
def test_parse_size():
    assert options.parse_size("1K") == 1024
    assert options.parse_size("64M") == 64 << 20
    assert options.parse_size("1G") == 1 << 30
    assert options.parse_size("4096") == 4096
    assert options.parse_size("1.5k") == 1536
    assert options.parse_size("2MB") == options.parse_size("2MiB") == 2 << 20
    for bad in ("", "K", "1Q", "-1", "1 K B x"):
        with pytest.raises(ValueError):
            options.parse_size(bad)


def test_size_sweep():
    assert options.size_sweep(1024, 65536, stepfactor=4) == SMOKE_SIZES
    assert options.size_sweep(1000, 3500, stepbytes=1000) == [1000, 2000, 3000]
    assert options.size_sweep(0, 8, stepfactor=2) == [0, 1, 2, 4, 8]
    with pytest.raises(ValueError):
        options.size_sweep(2, 1)
    with pytest.raises(ValueError):
        options.size_sweep(1, 2, stepfactor=1, stepbytes=0)
    assert options.element_counts([0, 1, 2, 3, 4], 2) == [(2, 1), (4, 2)]


def test_bus_bandwidth():
    assert [all_reduce.bus_factor(p) for p in (1, 2, 4, 8)] == [0.0, 1.0, 1.5, 1.75]
    assert bench.bus_bandwidth(10.0, 4, all_reduce.bus_factor) == pytest.approx(15.0)
    assert bench.bus_bandwidth(10.0, 2, all_reduce.bus_factor) == pytest.approx(10.0)


def test_buffer_count():
    big = 1 << 40
    assert arrays.buffer_count(1024, big) == arrays.MAX_BUFFERS
    assert arrays.buffer_count(64 << 20, big) == 4
    assert arrays.buffer_count(1 << 30, big) == arrays.MIN_BUFFERS
    assert arrays.buffer_count(1 << 30, 2 << 30) == 1          # memory-capped, never 0


def test_random_inputs_nonzero_and_seeded():
    host = arrays.HostArrays()
    for dt in ("float16", "bfloat16", "float32"):
        a = host.random(100_000, dtypes.numpy_dtype(dt), seed=1)
        assert a.dtype.name == dt and np.all(a.astype(np.float64) != 0)
    s = {arrays.seed_for(r, n, i) for r in range(2) for n in (1024, 2048) for i in range(2)}
    assert len(s) == 8


def test_accuracy_stats():
    ref = np.arange(1.0, 9.0)
    assert check.accuracy_stats(ref.astype(np.float32), ref) == (0.0, 0.0, 0)
    out = ref.copy()
    out[2] += 0.5
    relerr, maxerr, wrong = check.accuracy_stats(out, ref)
    assert relerr == pytest.approx(0.5 / np.linalg.norm(ref)) and maxerr == 0.5 and wrong == 0
    out[4] = np.inf
    diverged = np.zeros(8, dtype=bool)
    diverged[[0, 4]] = True
    relerr, maxerr, wrong = check.accuracy_stats(out, ref, diverged)
    assert wrong == 2 and not relerr <= check.MAX_RELERR


def test_result_ok():
    r = check.Result("x", False, 1.0, 1.0, 1.0, None, 0.1, 0.2, 0)
    assert r.ok()
    assert not check.Result("x", False, 1.0, 1.0, 1.0, None, 0.6, 0.2, 0).ok()
    assert not check.Result("x", False, 1.0, 1.0, 1.0, None, math.nan, 0.2, 0).ok()
    assert not check.Result("x", False, 1.0, 1.0, 1.0, None, 0.1, 0.2, 3).ok()
    assert check.Result("x", False, 1.0, 1.0, 1.0).ok()       # unchecked (-c 0)


def test_table_columns_align():
    variants = [bench.Variant("MPI", True, None), bench.Variant("ring", False, None)]
    row = check.Row(1024, 512, "bfloat16", 8, [
        check.Result("MPI", True, 12.5, 0.08, 0.08, None, 1e-3, 2e-3, 0),
        check.Result("ring", False, 25000.0, 0.04, 0.04, 0.5, 0.1, 0.4, 0)])
    header = table.table_header(variants)
    line = table.table_row(row)
    assert len(line) == len(header[1]) and "MPI" in header[0] and "ring" in header[0]
    ends = lambda s: [i for i in range(len(s)) if s[i] != " " and (i + 1 == len(s) or s[i + 1] == " ")]  # noqa
    assert ends(line) == ends(" " + header[1][1:])   # every value ends under its column name
    assert line.split()[3:5] == ["12.50", "0.08"] and "25000" in line.split()


def test_progress_bar():
    buf = io.StringIO()
    bar = table.Progress(4, True, width=8, stream=buf)
    bar.show(2, "64 KiB")
    bar.clear()
    assert "[####    ] 2/4 64 KiB" in buf.getvalue() and buf.getvalue().endswith("\r")
    quiet = io.StringIO()
    table.Progress(4, False, stream=quiet).show(1, "x")
    assert quiet.getvalue() == ""


def test_nccl_version_format():
    assert table.format_nccl_version(22805) == "2.28.5"
    assert table.format_nccl_version(2708) == "2.7.8"
    assert table.format_nccl_version((2, 28, 3)) == "2.28.3"
    assert table.format_nccl_version("2.28.3") == "2.28.3"


# -- python -m echonccl.perf.report: JSON written by -J back to markdown and a plot ---------------
INFO = {"collective": "all_reduce", "nranks": 4, "engine": "gpu", "engine_description": "gpu (test)",
        "baseline": "NCCL", "baseline_run": True, "dtype": "bfloat16", "group_size": 32, "feedback": True,
        "algorithms": ["two_shot", "ring"]}


def _rows(baseline: bool = True, checked: bool = True) -> list:
    """Two sizes of synthetic results, as `Bench.row` makes them."""
    rows = []
    for size, t in ((1 << 20, 10.0), (1 << 30, 2000.0)):
        err = lambda e, w: (e, 2 * e, w) if checked else (None, None, None)  # noqa: E731
        results = [check.Result("NCCL", True, t, size / t / 1e3, 1.5 * size / t / 1e3, None, *err(0.002, 0))]
        for label, f, wrong in (("two_shot", 2.0, 0), ("ring", 0.5, 3)):
            results.append(check.Result(label, False, t * f, size / (t * f) / 1e3, 1.5 * size / (t * f) / 1e3,
                                        1 / f, *err(0.12 if label == "ring" else 0.11, wrong)))
        rows.append(check.Row(size, size // 2, "bfloat16", 4, results[0 if baseline else 1:]))
    return rows


def _write(path: Path, rows, **info) -> Path:
    variants = [bench.Variant(r.label, r.baseline, None) for r in rows[0].results]
    report.write_json(str(path), dict(INFO, **info), rows, report.summary(rows, variants))
    return path


def test_report_load_json_round_trip(tmp_path):
    rows = _rows()
    info, back = report.load_json(str(_write(tmp_path / "run.json", rows)))
    assert back == rows and info == INFO
    rows[1].results[2].relerr = math.nan            # written as null, read back as None
    _, back = report.load_json(str(_write(tmp_path / "nan.json", rows)))
    assert back[1].results[2].relerr is None and back[1].results[2].wrong == 3


def test_report_markdown(tmp_path, capsys):
    path = _write(tmp_path / "run.json", _rows())
    assert report.main([str(path), "--markdown"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[:4] == [
        "gpu (test), 4 ranks, bfloat16, group 32, feedback on", "",
        "| size | NCCL (us) | busbw (GB/s) | two_shot (us) | busbw | speedup vs NCCL | ring (us) | busbw "
        "| speedup vs NCCL | relerr | #wrong |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    assert lines[4] == "| 1 MiB | 10.0 | 157.3 | 20.0 | 78.6 | 0.50x | 5.0 | 314.6 | 2.00x | 0.120 | 3 |"
    assert lines[5] == ("| 1 GiB | 2000.0 | 805.3 | 4000.0 | 402.7 | 0.50x | 1000.0 | 1610.6 | 2.00x "
                        "| 0.120 | 3 |")
    assert len(lines) == 6


def test_report_markdown_without_baseline_or_check(tmp_path, capsys):
    one = _write(tmp_path / "one.json", _rows(baseline=False), baseline_run=False, feedback=False, nranks=1)
    two = _write(tmp_path / "two.json", _rows(checked=False))
    assert report.main([str(one), str(two)]) == 0          # markdown is the default without --plot
    head1, table1, head2, table2 = capsys.readouterr().out.split("\n\n")   # a blank line between
    assert head1 == "gpu (test), 1 rank, bfloat16, group 32, feedback off"
    lines = table1.splitlines()
    assert lines[0] == "| size | two_shot (us) | busbw | ring (us) | busbw | relerr | #wrong |"
    assert lines[2] == "| 1 MiB | 20.0 | 78.6 | 5.0 | 314.6 | 0.120 | 3 |"
    assert head2 == "gpu (test), 4 ranks, bfloat16, group 32, feedback on"
    assert table2.splitlines()[2].endswith(" | 2.00x | N/A | N/A |")
    rows = _rows()
    rows[0].results[1].relerr = math.inf                # non-finite: null in the JSON
    assert report.main([str(_write(tmp_path / "inf.json", rows))]) == 0
    assert capsys.readouterr().out.splitlines()[4].endswith(" | nan | 3 |")


def test_report_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    a = _write(tmp_path / "a.json", _rows())
    b = _write(tmp_path / "b.json", _rows(baseline=False), baseline_run=False)
    assert report.main([str(a), "--plot", str(tmp_path / "a.png"), "--title", "NVLink",
                        str(b), "--plot", str(tmp_path / "b.png"), "--title", "no baseline"]) == 0
    assert capsys.readouterr().out == ""                    # --plot alone prints no table
    for name in ("a.png", "b.png"):
        assert (tmp_path / name).read_bytes()[:8] == PNG
    assert report.main([str(a), "--markdown", "--plot", str(tmp_path / "c.png")]) == 0
    assert capsys.readouterr().out.startswith("gpu (test), 4 ranks")
    assert (tmp_path / "c.png").read_bytes()[:8] == PNG


def test_report_usage_errors(tmp_path, capsys):
    a = str(_write(tmp_path / "a.json", _rows()))
    for argv in ([a, a, "--plot", "x.png"], [a, "--plot", "x.png", "--title", "t", "--title", "u"], []):
        with pytest.raises(SystemExit) as exc:
            report.main(argv)
        assert exc.value.code == 2
    assert "--plot: give one per file (2), got 1" in capsys.readouterr().err


def test_algo_lists_and_unknown_names():
    assert options.algorithms("both") == ("two_shot", "ring")
    assert options.algorithms("two_shot,two_shot_pipelined") == ("two_shot", "two_shot_pipelined")
    with pytest.raises(argparse.ArgumentTypeError, match="unknown algorithm 'tree'"):
        options._algo_arg("two_shot,tree")


# -- several baselines: one with memory of its own, one that cannot run (NCCL_sym's paths) ----------
class _Copies:
    """A stand-in of `arrays.NcclWindow` on the CPU engine: copies of the inputs, an output."""

    log: list = []
    current = None

    def __init__(self, arrays_, bufs, out):
        self.bufs, self.out = [b.copy() for b in bufs], np.empty_like(out)
        _Copies.log.append(("open", len(bufs), out.size))
        _Copies.current = self

    def close(self) -> None:
        _Copies.log.append(("close",))
        self.bufs, self.out = [], None


def test_baseline_on_its_own_memory_and_one_not_available(no_env_overrides, tmp_path, monkeypatch, capsys):
    from dataclasses import replace

    monkeypatch.chdir(tmp_path)
    _Copies.log = []
    seen = []

    def own_call(comm):
        def call(x, out, stream):
            own = _Copies.current                  # checked and timed on its copies only
            seen.append(any(x is b for b in own.bufs) and out is own.out)
            comm.baseline_all_reduce(x, out, stream=stream)
        return call

    def with_baselines(comm, opts):
        found = all_reduce.variants(comm, opts)
        extra = [bench.Variant("gone", True, lambda: own_call(comm), unavailable="refused here"),
                 bench.Variant("MPI_own", True, lambda: own_call(comm), memory=_Copies, note="MPI on copies")]
        return found[:1] + extra + found[1:]

    plot = ["--plot", "run.png"] if importlib.util.find_spec("matplotlib") else []
    rc = bench.run(replace(all_reduce.ALL_REDUCE, variants=with_baselines),
                   ["--engine", "cpu", "-b", "1K", "-e", "4K", "-f", "2", "-n", "2", "-w", "1", "--algo", "two_shot",
                    "--quiet", "-J", "run.json", "--csv", "run.csv", *plot])
    out = capsys.readouterr().out
    assert rc == 0, out
    lines = out.splitlines()
    assert "# gone     : n/a: refused here" in lines and "# MPI_own  : MPI on copies" in lines
    assert "# speedup  : the fastest baseline's time at each size / each echonccl variant's" in lines
    i = next(i for i, ln in enumerate(lines) if ln.startswith("#") and "algbw" in ln)
    labels, names, units = lines[i - 1:i + 2]
    assert labels.split()[1:] == ["MPI", "gone", "MPI_own", "two_shot"]
    assert units.split()[-2:] == ["vs", "fastest"] and "speedup" in names.split()
    rows = _data_lines(out)
    assert len(rows) == 3 and all(r.split().count("n/a") == 6 for r in rows)   # gone's six columns
    assert all(len(r) == len(names) for r in rows)
    assert "# Geomean speedup      : vs fastest: two_shot " in out and ";  vs MPI: two_shot " in out
    assert ";  vs MPI_own: two_shot " in out
    # the copies: made, used and closed once per size
    assert _Copies.log == [e for n in (512, 1024, 2048) for e in (("open", 8, n), ("close",))]
    assert seen and all(seen)

    doc = json.loads((tmp_path / "run.json").read_text())
    assert doc["baselines"] == ["MPI", "gone", "MPI_own"] and doc["speedup_baseline"] == check.FASTEST
    assert doc["unavailable"] == {"gone": "refused here"} and doc["notes"] == {"MPI_own": "MPI on copies"}
    for row in doc["results"]:
        mpi, gone, own, mine = row["results"]
        assert gone["time_us"] is None and gone["busbw"] is None and gone["wrong"] is None
        assert own["time_us"] > 0 and own["wrong"] == 0 and own["speedups"] is None
        assert set(mine["speedups"]) == {"MPI", "MPI_own"} and mine["speedup"] == min(mine["speedups"].values())
        assert mine["speedups"]["MPI"] == pytest.approx(mpi["time_us"] / mine["time_us"])
    summ = doc["summary"]
    assert summ["avg_busbw"]["gone"] is None and summ["speedup_baseline"] == check.FASTEST
    assert set(summ["geomean_speedups"]) == {"MPI", "MPI_own"}
    mins = [min(r["results"][3]["speedups"].values()) for r in doc["results"]]
    assert summ["geomean_speedup"]["two_shot"] == pytest.approx(math.prod(mins) ** (1 / len(mins)))
    with open(tmp_path / "run.csv", newline="") as f:
        recs = list(csv.DictReader(f))
    assert [r["speedup_vs"] for r in recs[:4]] == ["", "", "", check.FASTEST] and recs[1]["time_us"] == ""

    assert report.main([str(tmp_path / "run.json")]) == 0
    md = capsys.readouterr().out.splitlines()
    assert md[2] == ("| size | MPI (us) | busbw (GB/s) | gone (us) | busbw (GB/s) | MPI_own (us) | busbw (GB/s) "
                     "| two_shot (us) | busbw | speedup vs fastest | relerr | #wrong |")
    assert md[4].startswith("| 1 KiB | ") and " | - | - | " in md[4]
    if plot:
        assert (tmp_path / "run.png").read_bytes()[:8] == PNG


def test_warm_up_calls_every_input_twice(no_env_overrides, tmp_path, monkeypatch, capsys):
    """``-w 0`` still warms each rotated input twice (its first call prepares the buffer set, the
    second captures an NCCL-path schedule): the timed calls are steady state."""
    from dataclasses import replace

    monkeypatch.chdir(tmp_path)
    seen = []

    def counting(comm, opts):
        def call(x, out, stream):
            seen.append(id(x))
            comm.baseline_all_reduce(x, out, stream=stream)
        return [bench.Variant("MPI", True, lambda: call)]

    rc = bench.run(replace(all_reduce.ALL_REDUCE, variants=counting),
                   ["--engine", "cpu", "-b", "1K", "-e", "1K", "-n", "3", "-w", "0", "-c", "0", "--quiet"])
    assert rc == 0, capsys.readouterr().out
    inputs = set(seen)
    assert len(inputs) > 1 and len(seen) == 2 * len(inputs) + 3
    warm = seen[:2 * len(inputs)]
    assert all(warm.count(b) == 2 for b in inputs)


def _nccl_row(sym_us):
    """One size as the GPU engine's table has it: NCCL, NCCL_sym (None: n/a), ring."""
    sym = (check.Result("NCCL_sym", True, None, None, None) if sym_us is None else
           check.Result("NCCL_sym", True, sym_us, 0.2, 0.2, None, 0.0, 0.0, 0))
    base = 25.0 if sym_us is None else sym_us
    return check.Row(4096, 2048, "bfloat16", 8, [
        check.Result("NCCL", True, 25.0, 0.16, 0.16, None, 0.0, 0.0, 0), sym,
        check.Result("ring", False, 20.0, 0.2, 0.2, base / 20.0, 0.1, 0.4, 0)])


@pytest.mark.parametrize("sym_us", [12.5, None])
def test_table_with_both_nccl_columns(sym_us):
    """The speedup column's unit line names the baseline it divides by: the fastest of NCCL and
    NCCL_sym when both run, NCCL when NCCL_sym is n/a (then its six columns read n/a); every
    value ends under its name."""
    variants = [bench.Variant("NCCL", True, None),
                bench.Variant("NCCL_sym", True, None, unavailable=None if sym_us else "refused"),
                bench.Variant("ring", False, None)]
    header = table.table_header(variants)
    line = table.table_row(_nccl_row(sym_us))
    vs = check.FASTEST if sym_us else "NCCL"
    assert header[2].split()[-2:] == ["vs", vs] and check.speedup_baseline(variants) == vs
    assert len(line) == len(header[1])
    ends = lambda s: [i for i in range(len(s)) if s[i] != " " and (i + 1 == len(s) or s[i + 1] == " ")]  # noqa
    assert ends(line) == ends(" " + header[1][1:])
    cells = line.split()
    assert cells.count("n/a") == (0 if sym_us else 6)
    assert cells[-4] == ("0.62" if sym_us else "1.25")          # ring's speedup vs the fastest / vs NCCL


def test_speedup_divides_by_each_sizes_fastest_baseline():
    """With several baselines the speedup is over the fastest at each size: NCCL_sym below a few
    MiB, plain NCCL above on two H200s; one baseline, or a named one, is divided by as such."""
    assert check.speedup_of({"NCCL": 2.5, "NCCL_sym": 1.25}, check.FASTEST) == 1.25
    assert check.speedup_of({"NCCL": 1.5, "NCCL_sym": 2.0}, check.FASTEST) == 1.5
    assert check.speedup_of({"NCCL": 1.5, "NCCL_sym": 2.0}, "NCCL_sym") == 2.0
    assert check.speedup_of(None, check.FASTEST) is None and check.speedup_of({"MPI": 2.0}, None) is None
    one = [bench.Variant("MPI", True, None), bench.Variant("ring", False, None)]
    assert check.speedup_baseline(one) == "MPI"


def _stub_engine(lib, name="gpu"):
    """A GPU engine as `all_reduce.variants` sees it: a baseline name, an `NcclComm` (around a
    made-up handle) and a one-rank allgather."""
    ncomm = nccl.NcclComm.__new__(nccl.NcclComm)
    ncomm.lib, ncomm._handle, ncomm._aborted = lib, ctypes.c_void_p(0x1234), False
    return SimpleNamespace(name=name, baseline_name="NCCL", nccl=ncomm, allgather_object=lambda obj: [obj])


def test_nccl_sym_variant_on_an_old_nccl_and_its_options(monkeypatch):
    lib = nccl.load()
    monkeypatch.setattr(nccl.NcclLibrary, "version_code", lambda self: 22605)
    comm = SimpleNamespace(engine=_stub_engine(lib))
    parse = lambda *a: options.parse_options(["-b", "1K", "-e", "1K", *a], "t", "all_reduce", 0)  # noqa: E731
    found = all_reduce.variants(comm, parse())
    assert [(v.label, v.baseline) for v in found] == [
        ("NCCL", True), ("NCCL_sym", True), ("two_shot", False), ("ring", False)]
    sym = found[1]
    assert sym.unavailable == ("NCCL 2.26.5 has no symmetric windows (ncclCommWindowRegister: NCCL 2.27 "
                               "or newer)")
    assert sym.memory is not None and sym.note == all_reduce.SYMMETRIC_NOTE
    assert check.speedup_baseline(found) == "NCCL"
    assert [v.label for v in all_reduce.variants(comm, parse("--no-nccl-sym"))] == ["NCCL", "two_shot", "ring"]
    assert [v.label for v in all_reduce.variants(comm, parse("--no-baseline"))] == ["two_shot", "ring"]


@pytest.mark.parametrize("value, left_out", [("1", True), ("0", False)])
def test_nccl_sym_left_out_when_nccl_p2p_is_disabled(monkeypatch, value, left_out):
    """Under NCCL_P2P_DISABLE=1 NCCL's symmetric kernels still use NVLink (231 GB/s on two H200s,
    plain NCCL 29 through host memory): not that regime's baseline, so n/a with the reason, before
    any allocation (an old NCCL stands in: its own reason shows where the regime allows it)."""
    lib = nccl.load()
    monkeypatch.setattr(nccl.NcclLibrary, "version_code", lambda self: 22605)
    monkeypatch.setenv("NCCL_P2P_DISABLE", value)
    comm = SimpleNamespace(engine=_stub_engine(lib))
    found = all_reduce.variants(comm, options.parse_options(["--algo", "ring"], "t", "all_reduce", 0))
    assert [v.label for v in found] == ["NCCL", "NCCL_sym", "ring"]
    assert found[1].unavailable.startswith("left out under NCCL_P2P_DISABLE=1") == left_out
    assert found[1].unavailable.startswith("NCCL 2.26.5 has no symmetric windows") != left_out
    assert check.speedup_baseline(found) == "NCCL"


@pytest.mark.skipif(os.path.exists("/dev/nvidia0"), reason="a GPU is present")
def test_nccl_sym_variant_falls_back_when_nccl_refuses():
    """NCCL >= 2.27 without a GPU: ncclMemAlloc fails, NCCL's own message is the reason (n/a)."""
    lib = nccl.load()
    if not lib.supports_windows():
        pytest.skip("the installed NCCL is older than 2.27")
    comm = SimpleNamespace(engine=_stub_engine(lib))
    found = all_reduce.variants(comm, options.parse_options(["--algo", "ring"], "t", "all_reduce", 0))
    assert [v.label for v in found] == ["NCCL", "NCCL_sym", "ring"]
    assert found[1].unavailable.startswith("NCCL refused a symmetric window: nccl")
    assert "ncclMemAlloc failed" in found[1].unavailable


def _window_fakes(win=0xE0):
    """Stand-ins of cupy (what `arrays.NcclWindow` uses of it) and of an `NcclComm`, and the log
    of their calls."""
    log: list = []

    class Ptr:
        def __init__(self, mem, offset):
            self.mem, self.ptr = mem, mem.ptr + offset

        def copy_from_device_async(self, src, size, stream=None):
            log.append(("copy", self.ptr, src.ptr, size, stream))

    cuda = SimpleNamespace(UnownedMemory=lambda ptr, size, owner, dev: SimpleNamespace(ptr=ptr, size=size, dev=dev),
                           MemoryPointer=Ptr, Device=lambda: SimpleNamespace(id=3),
                           runtime=SimpleNamespace(deviceSynchronize=lambda: log.append(("sync",))))
    cp = SimpleNamespace(cuda=cuda, ndarray=lambda shape, dtype, memptr: SimpleNamespace(shape=shape, dtype=dtype,
                                                                                         data=memptr))

    def register(ptr, size, symmetric=True):
        log.append(("register", ptr, size, symmetric))
        if isinstance(win, Exception):
            raise win
        return win

    lib = SimpleNamespace(mem_alloc=lambda n: log.append(("alloc", n)) or 0x100000,
                          mem_free=lambda p: log.append(("free", p)))
    ncomm = SimpleNamespace(lib=lib, register_window=register,
                            deregister_window=lambda w: log.append(("deregister", w)))
    return cp, ncomm, log


def test_nccl_window_layout_copies_and_cleanup():
    """One ncclMemAlloc for the inputs and the output, each at a 4096-byte boundary (offsets that
    depend on the sizes only: the same on every rank), one symmetric registration of all of it,
    the inputs copied on the current stream; close: synchronize, deregister, then free, once."""
    cp, ncomm, log = _window_fakes()
    out = SimpleNamespace(nbytes=6000, shape=(3000,), dtype=np.float16)
    bufs = [SimpleNamespace(data=SimpleNamespace(ptr=0x9000 * (i + 1)), nbytes=6000) for i in range(3)]
    w = arrays.NcclWindow(cp, ncomm, bufs, out)
    size = 4 * 8192
    assert log[:2] == [("alloc", size), ("register", 0x100000, size, True)]
    assert [b.data.ptr for b in w.bufs] == [0x100000, 0x100000 + 8192, 0x100000 + 2 * 8192]
    assert w.out.data.ptr == 0x100000 + 3 * 8192 and w.out.shape == (3000,) and w.out.dtype == np.float16
    assert log[2:] == [("copy", 0x100000 + i * 8192, 0x9000 * (i + 1), 6000, None) for i in range(3)]
    assert w.out.data.mem.dev == 3 and w.out.data.mem.size == size
    del log[:]
    w.close()
    w.close()
    assert log == [("sync",), ("deregister", 0xE0), ("free", 0x100000)] and w.bufs == []


@pytest.mark.parametrize("answer", [None, nccl.NcclError(5, "ncclInvalidUsage", "no")])
def test_nccl_window_frees_what_nccl_did_not_register(answer):
    from echonccl.errors import EchoncclError

    cp, ncomm, log = _window_fakes(win=answer)
    out = SimpleNamespace(nbytes=10, shape=(5,), dtype=np.float16)
    with pytest.raises(EchoncclError, match="no" if answer else "registered no window"):
        arrays.NcclWindow(cp, ncomm, [out], out)
    assert log == [("alloc", 8192), ("register", 0x100000, 8192, True), ("free", 0x100000)]
