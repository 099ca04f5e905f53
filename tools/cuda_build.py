#!/usr/bin/env python3
"""Build tooling for ``cuda_src/`` with nvcc (no GPU needed): compile checks and the fatbin.

Not part of the installed package (the runtime, `echonccl.kernels_cuda`, only loads a fatbin
or hands the source to NVRTC). Every nvcc run uses `kernels_cuda.NVCC_FLAGS`, the one
definition of the flags.

    python tools/cuda_build.py fatbin [OUT]    # cuda_src/echo_kernels.fatbin + .sha256 (make fatbin)
    python tools/cuda_build.py check [ARCH]    # PTX entry points, registers, spills

nvcc runs are cached by fingerprint: a sha256 of the nvcc version, the command line and
every input file's bytes names a directory under `cache_dir()` (``$ECHONCCL_NVCC_CACHE``,
default ``build/nvcc-cache`` in the checkout) holding the outputs and the log. Changing a
source, a flag or the compiler is a new key, so a cached result is always that of the
current inputs; ``make clean`` (or deleting the folder) forgets them.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from echonccl import kernels_cuda as kc

ROOT = Path(__file__).resolve().parent.parent
CACHE_VERSION = "1"          # bump when what a cache entry holds changes
FATBIN_ARCHS = (("compute_80", "sm_80"), ("compute_90", "sm_90"), ("compute_90", "compute_90"))

_PTXAS_FUNC = re.compile(r"Compiling entry function '(\w+)' for '(\w+)'")
_PTXAS_REGS = re.compile(r"Used (\d+) registers")
_PTXAS_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def cache_dir() -> Path:
    return Path(os.environ.get("ECHONCCL_NVCC_CACHE") or ROOT / "build" / "nvcc-cache")


def find_nvcc(nvcc: str | None = None) -> str:
    nvcc = nvcc or os.environ.get("NVCC") or shutil.which("nvcc")
    if not nvcc:
        raise FileNotFoundError("nvcc not found (set NVCC or put it on PATH)")
    return nvcc


def _nvcc_version(nvcc: str) -> str:
    r = subprocess.run([nvcc, "--version"], capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"{nvcc} --version failed: {r.stderr}")
    return r.stdout


def fingerprint(nvcc: str, args: list[str], inputs: dict[str, bytes]) -> str:
    """The cache key of one nvcc run: compiler version, arguments, input names and bytes."""
    h = hashlib.sha256()
    for part in (CACHE_VERSION, _nvcc_version(nvcc), *args):
        h.update(part.encode() + b"\0")
    for name in sorted(inputs):
        h.update(name.encode() + b"\0" + hashlib.sha256(inputs[name]).digest())
    return h.hexdigest()


def nvcc_run(args: list[str], inputs: dict[str, bytes], outputs: list[str],
             nvcc: str | None = None) -> tuple[dict[str, Path], str]:
    """Run ``nvcc *args`` in a directory holding ``inputs`` (name -> bytes; ``args`` name them
    and ``outputs`` relative to it); return ({output name: path in the cache}, nvcc's stdout +
    stderr).

    Cached (`cache_dir`): a run with the same fingerprint returns the stored outputs without
    calling nvcc. Raises `RuntimeError` on a compile error (nothing is cached then)."""
    nvcc = find_nvcc(nvcc)
    entry = cache_dir() / fingerprint(nvcc, args, inputs)
    if not (entry / "log.txt").is_file():
        entry.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".nvcc-", dir=entry.parent) as tmp:
            work, staging = Path(tmp) / "work", Path(tmp) / "entry"
            work.mkdir()
            staging.mkdir()
            for name, data in inputs.items():
                (work / name).write_bytes(data)
            r = subprocess.run([nvcc, *args], cwd=work, capture_output=True, text=True)
            log = r.stdout + r.stderr
            if r.returncode:
                raise RuntimeError(f"nvcc {' '.join(args)} failed ({r.returncode}):\n{log}")
            for o in outputs:
                if not (work / o).is_file():
                    raise RuntimeError(f"nvcc {' '.join(args)} wrote no {o}")
                shutil.copyfile(work / o, staging / o)
            (staging / "command.json").write_text(json.dumps({"nvcc": nvcc, "args": args,
                                                              "inputs": sorted(inputs)}))
            (staging / "log.txt").write_text(log)      # last: it marks the entry complete
            try:
                staging.rename(entry)       # atomic; a concurrent run of the same key may win
            except OSError:
                pass
    return {o: entry / o for o in outputs}, (entry / "log.txt").read_text()


def source_inputs(d: Path | None = None) -> dict[str, bytes]:
    """Every ``*.cu``/``*.cuh`` of ``cuda_src`` by name (what a compile of any of them may read)."""
    d = d or kc.source_dir()
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.suffix in (".cu", ".cuh")}


def ptx(source: str, *flags: str, arch: str = "sm_90", nvcc: str | None = None) -> str:
    """The PTX of a self-contained source text (no include path), compiled with ``flags``."""
    out, _ = nvcc_run([f"-arch={arch}", "-ptx", "-std=c++17", *flags, "-o", "k.ptx", "k.cu"],
                      {"k.cu": source.encode()}, ["k.ptx"], nvcc)
    return out["k.ptx"].read_text()


def compile_check(nvcc: str | None = None, arch: str = "sm_90", fatbin: bool = False) -> dict:
    """Compile ``cuda_src``'s module with nvcc and check its entry points.

    ``nvcc -ptx`` and ``nvcc -c -Xptxas -v`` for ``arch`` (and, with ``fatbin=True``,
    `build_fatbin`'s compile). Returns ``{"entries": [...], "registers": {name: n},
    "spills": {name: bytes}, "ptx": path, "fatbin": path or None, "log": ptxas log}``
    (paths in the cache); raises `RuntimeError` on a compile error or when the PTX
    entries differ from `kernels_cuda.entry_points()`."""
    inputs = source_inputs()
    cu = kc.MODULE_NAME
    out, _ = nvcc_run([f"-arch={arch}", "-ptx", *kc.NVCC_FLAGS, "-o", "m.ptx", cu], inputs, ["m.ptx"], nvcc)
    ptx_path = out["m.ptx"]
    entries = re.findall(r"^\s*\.(?:visible\s+)?\.entry\s+(\w+)", ptx_path.read_text(), re.M)
    _, log = nvcc_run([f"-arch={arch}", "-c", *kc.NVCC_FLAGS, "-Xptxas", "-v", "-o", "m.o", cu], inputs,
                      ["m.o"], nvcc)
    regs, spills, cur = {}, {}, None
    for line in log.splitlines():
        if m := _PTXAS_FUNC.search(line):
            cur = m.group(1)
        elif cur and (m := _PTXAS_SPILL.search(line)):
            spills[cur] = int(m.group(1)) + int(m.group(2))
        elif cur and (m := _PTXAS_REGS.search(line)):
            regs[cur] = int(m.group(1))
    fb = _fatbin(nvcc) if fatbin else None
    expected = set(kc.entry_points())
    if set(entries) != expected or len(entries) != len(expected):
        raise RuntimeError(f"PTX entries differ from entry_points(): missing "
                           f"{sorted(expected - set(entries))}, extra {sorted(set(entries) - expected)}")
    return {"entries": entries, "registers": regs, "spills": spills, "ptx": str(ptx_path),
            "fatbin": None if fb is None else str(fb), "log": log}


def _fatbin(nvcc: str | None = None) -> Path:
    gencode = [a for c, s in FATBIN_ARCHS for a in ("-gencode", f"arch={c},code={s}")]
    out, _ = nvcc_run(["-fatbin", *kc.NVCC_FLAGS, *gencode, "-o", kc.FATBIN_NAME, kc.MODULE_NAME],
                      source_inputs(), [kc.FATBIN_NAME], nvcc)
    return out[kc.FATBIN_NAME]


def build_fatbin(out: str | os.PathLike | None = None, nvcc: str | None = None) -> Path:
    """``echo_kernels.fatbin`` (sm_80 and sm_90 SASS, compute_90 PTX for newer GPUs) at ``out``
    (default: beside the sources), with the ``.sha256`` fingerprint of the sources it was built
    from, which `kernels_cuda.find_fatbin` compares against the sources next to it."""
    d = kc.source_dir()
    out = Path(out) if out else d / kc.FATBIN_NAME
    out.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(_fatbin(nvcc), out)
    out.with_name(out.name + ".sha256").write_text(kc.source_fingerprint(d) + "\n")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fatbin", help="build cuda_src/echo_kernels.fatbin (+ .sha256)")
    f.add_argument("out", nargs="?")
    c = sub.add_parser("check", help="compile and list entry points, registers and spills")
    c.add_argument("arch", nargs="?", default="sm_90")
    a = p.parse_args(argv)
    if a.cmd == "fatbin":
        print(f"built {build_fatbin(a.out)}")
    else:
        r = compile_check(arch=a.arch)
        print(f"{len(r['entries'])} entry points; max registers {max(r['registers'].values())}; "
              f"spills {sum(r['spills'].values())} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
