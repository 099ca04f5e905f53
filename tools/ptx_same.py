"""Which fused kernels compile to the same PTX in two checkouts (no GPU; nvcc on PATH or $NVCC).

    python3 tools/ptx_same.py OTHER_CHECKOUT [--kernels whole|general|all] [--match TEXT] [--arch sm_90]
                              [--jobs 2]

For every prebuilt fused kernel (two_shot, one_shot_q) whose name both checkouts' kernel tables
hold, each checkout's own sources and kernel table are compiled to PTX (`nvcc -ptx`, the table's
flags), and the two are compared after renaming what carries no meaning: comments, mangled symbol
names (a template parameter added with its default changes them) and virtual registers, each
renumbered in order of first use. "same" then means the same instructions in the same order, so
ptxas makes the same SASS of them: a time measured on one checkout's kernel stands for the other's.
Prints a line a kernel (same, or the count of differing lines) and exits 1 if any differ.
This checkout is the one the script lies in.
"""
from __future__ import annotations

import argparse
import difflib
import json
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Run in a checkout (its root first on sys.path): the fused prebuilt kernels' names and one-kernel
# translation units, as JSON.
_EMIT = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import echonccl.kernel_table as kt
d = kt.source_dir()
print(json.dumps({"flags": list(kt.NVCC_FLAGS),
                  "headers": {n: (d / n).read_text() for n in kt.SOURCE_NAMES},
                  "units": {k.name: kt.source([k], inline=False) for k in kt.PREBUILT
                            if k.family in ("two_shot", "one_shot_q")}}))
"""

_SYMBOL = re.compile(r"\b_Z\w+?(?=_param_\d+\b|\b)")
_REGISTER = re.compile(r"%(r|rd|rs|f|fd|p|h|hh)(\d+)\b")
_DECLARED = re.compile(r"(%(?:r|rd|rs|f|fd|p|h|hh))<\d+>")


def normalize(ptx: str) -> list[str]:
    """``ptx``'s lines without comments, symbols and registers renamed by order of first use."""
    symbols: dict[str, int] = {}
    registers: dict[tuple[str, str], int] = {}
    out = []
    for line in ptx.splitlines():
        if line.lstrip().startswith("//") or not line.strip():
            continue
        line = _SYMBOL.sub(lambda m: f"SYM{symbols.setdefault(m.group(0), len(symbols))}", line)
        if line.lstrip().startswith(".visible .entry") or line.lstrip().startswith(".func"):
            registers.clear()           # virtual registers are numbered per function
        line = _DECLARED.sub(r"\1<N>", line)
        line = _REGISTER.sub(lambda m: f"%{m.group(1)}"
                             f"{registers.setdefault((m.group(1), m.group(2)), len(registers))}", line)
        out.append(line)
    return out


def units(checkout: Path) -> dict:
    r = subprocess.run([sys.executable, "-c", _EMIT, str(checkout)], capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"ptx_same: cannot read {checkout}'s kernel table:\n{r.stderr[-2000:]}")
    return json.loads(r.stdout)


def compile_ptx(nvcc: str, table: dict, name: str, arch: str) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        for n, text in table["headers"].items():
            Path(tmp, n).write_text(text)
        Path(tmp, "k.cu").write_text(table["units"][name])
        r = subprocess.run([nvcc, "-ptx", *table["flags"], "-arch", arch, "-diag-suppress", "128",
                            "-o", "k.ptx", "k.cu"], cwd=tmp, capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(f"ptx_same: nvcc failed on {name}:\n{r.stderr[-2000:]}")
        return Path(tmp, "k.ptx").read_text()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("other", type=Path, help="the other checkout's root (e.g. a git worktree)")
    ap.add_argument("--kernels", choices=("whole", "general", "all"), default="all")
    ap.add_argument("--match", default="", help="only the kernels whose names contain TEXT")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--jobs", type=int, default=2)
    a = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from echonccl.build import find_nvcc

    nvcc = find_nvcc()
    if nvcc is None:
        raise SystemExit("ptx_same: nvcc not found (set NVCC or put it on PATH)")
    mine, other = units(ROOT), units(a.other.resolve())
    names = sorted(n for n in set(mine["units"]) & set(other["units"]) if a.match in n)
    if a.kernels != "all":
        names = [n for n in names if ("_whole" in n) == (a.kernels == "whole")]
    only = sorted(set(mine["units"]) ^ set(other["units"]))

    def compare(name):
        x = normalize(compile_ptx(nvcc, other, name, a.arch))
        y = normalize(compile_ptx(nvcc, mine, name, a.arch))
        return name, sum(1 for d in difflib.unified_diff(x, y, n=0, lineterm="")
                         if d[:1] in "+-" and d[:3] not in ("+++", "---"))

    differ = 0
    with ThreadPoolExecutor(max(1, a.jobs)) as pool:
        for name, lines in pool.map(compare, names):
            differ += lines > 0
            print(f"{'same' if lines == 0 else f'{lines} lines differ'}: {name}")
    for n in only:
        print(f"in one checkout only: {n}")
    print(f"# {len(names) - differ} of {len(names)} kernels the same PTX ({a.arch}) as {a.other}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
