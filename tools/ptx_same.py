"""Which fused kernels compile to the same PTX in two checkouts (no GPU; nvcc on PATH or $NVCC).

    python3 tools/ptx_same.py OTHER_CHECKOUT [--kernels whole|general|all] [--match TEXT] [--arch sm_90]
                              [--jobs 2]

For every prebuilt fused kernel (two_shot, one_shot_q) whose name both checkouts' kernel tables
hold, each checkout's own sources and kernel table are compiled to PTX (`nvcc -ptx`, the table's
flags), and the two are compared after renaming what carries no meaning: comments, mangled symbol
names (a template parameter added with its default changes them) and virtual registers, each
renumbered in order of first use. "same" then means the same instructions in the same order, so
ptxas makes the same SASS of them: a time measured on one checkout's kernel stands for the other's.
Prints a line a kernel (same, or how many lines differ with register numbers erased: about how
many instructions changed) and exits 1 if any differ, with a message if none matches. nvcc runs
through `echonccl.build.nvcc_run` (cached under ``ECHONCCL_DEV_NVCC_CACHE`` when set).
This checkout is the one the script lies in.
"""
from __future__ import annotations

import argparse
import difflib
import json
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from echonccl import build  # noqa: E402  (this checkout's, from any directory)

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


def compile_ptx(table: dict, name: str, arch: str) -> str:
    inputs = {n: text.encode() for n, text in table["headers"].items()} | {"k.cu": table["units"][name].encode()}
    out, _ = build.nvcc_run(["-ptx", *table["flags"], "-arch", arch, "-diag-suppress", "128", "-o", "k.ptx", "k.cu"],
                            inputs, ["k.ptx"])
    return out["k.ptx"].decode()


def instructions_differing(x: list[str], y: list[str]) -> int:
    """Lines of two normalized PTX texts that differ with register numbers erased: about how many
    instructions changed (renumbering after an added instruction would count every later line)."""
    erase = [_REGISTER.sub(r"%\1", line) for line in x], [_REGISTER.sub(r"%\1", line) for line in y]
    return sum(1 for d in difflib.unified_diff(*erase, n=0, lineterm="")
               if d[:1] in "+-" and d[:3] not in ("+++", "---"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("other", type=Path, help="the other checkout's root (e.g. a git worktree)")
    ap.add_argument("--kernels", choices=("whole", "general", "all"), default="all")
    ap.add_argument("--match", default="", help="only the kernels whose names contain TEXT")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--jobs", type=int, default=2)
    a = ap.parse_args(argv)
    if build.find_nvcc() is None:
        raise SystemExit("ptx_same: nvcc not found (set NVCC or put it on PATH)")
    mine, other = units(ROOT), units(a.other.resolve())
    names = sorted(n for n in set(mine["units"]) & set(other["units"]) if a.match in n)
    if a.kernels != "all":
        names = [n for n in names if ("_whole" in n) == (a.kernels == "whole")]
    if not names:
        raise SystemExit(f"ptx_same: no prebuilt fused kernel of both checkouts matches --kernels {a.kernels} "
                         f"--match {a.match!r}")
    only = sorted(set(mine["units"]) ^ set(other["units"]))

    def compare(name):
        x = normalize(compile_ptx(other, name, a.arch))
        y = normalize(compile_ptx(mine, name, a.arch))
        return name, x == y, instructions_differing(x, y)

    differ = 0
    with ThreadPoolExecutor(max(1, a.jobs)) as pool:
        for name, same, lines in pool.map(compare, names):
            differ += not same
            print(f"same: {name}" if same else f"differs ({lines} lines, register numbers aside): {name}")
    for n in only:
        print(f"in one checkout only: {n}")
    print(f"# {len(names) - differ} of {len(names)} kernels the same PTX ({a.arch}) as {a.other}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
