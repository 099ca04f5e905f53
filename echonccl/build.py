"""Compile the kernel table ahead of time with nvcc: ``python -m echonccl.build``.

    python -m echonccl.build [--out DIR] [--all] [--arch sm_90 ...] [--nvcc PATH]

writes ``DIR/kernels.fatbin`` (SASS for each architecture, and the PTX of the newest for GPUs
newer than all of them) and ``DIR/manifest.json`` (the kernels' names, the architectures, the
source fingerprint `kernel_table.fingerprint` and ptxas's registers and spills per kernel).
``DIR`` defaults to the package's ``prebuilt/`` folder, where `kernel_loader` looks; the kernels
default to `kernel_table.PREBUILT` (``--all``: every kernel of the table). The architectures
default to sm_80, sm_90 and sm_100 where this nvcc has it. Building the wheel runs this where
nvcc is found (``setup.py``); `make kernels` runs it for a checkout.

nvcc runs are cached by fingerprint (nvcc's version, its arguments, every input byte) in
``ECHONCCL_DEV_NVCC_CACHE`` when set: the test suite and the wheel it builds share one compile.

Runs without numpy or cupy (the wheel build imports nothing else of the package): as a module of
the package, or as a script by path.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

if __package__:
    from . import kernel_table as kt
    from . import settings
else:   # run by path (setup.py): the package's own folder is sys.path[0]
    import kernel_table as kt  # type: ignore[no-redef,import-not-found]
    import settings  # type: ignore[no-redef,import-not-found]

ARCHS = ("sm_80", "sm_90", "sm_100")
FATBIN = "kernels.fatbin"
MANIFEST = "manifest.json"
CACHE_VERSION = "2"          # bump when what a cache entry holds changes
DEFAULT_OUT = Path(__file__).resolve().parent / "prebuilt"

_PTXAS_FUNC = re.compile(r"Compiling entry function '(\w+)' for '(\w+)'")
_PTXAS_PROPS = re.compile(r"Function properties for (\w+)")
_PTXAS_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_REGS = re.compile(r"Used (\d+) registers")


def find_nvcc(nvcc: str | None = None) -> str | None:
    """nvcc to use: ``nvcc``, else ``$NVCC``, else the one on PATH or in /usr/local/cuda; None."""
    import os

    for cand in (nvcc, os.environ.get("NVCC"), "nvcc", "/usr/local/cuda/bin/nvcc"):
        path = cand and (shutil.which(cand) or cand)
        if path and Path(path).is_file():
            return str(path)
    return None


def fatbin_images(data: bytes) -> list[tuple[str, str]]:
    """What a fatbin's bytes hold, in order: ``("sass", "sm_90")``, ``("ptx", "compute_100")``, ...
    (the container: a 16-byte header, magic 0xBA55ED50, then entries of kind 1 = PTX or 2 = ELF,
    each with its header size at byte 4, payload size at 8 and architecture at 28)."""
    magic, _, hsize, size = struct.unpack_from("<IHHQ", data, 0)
    if magic != 0xBA55ED50:
        raise ValueError("not a fatbin")
    out, off = [], hsize
    while off < hsize + size:
        kind, _, ehsize, payload = struct.unpack_from("<HHIQ", data, off)
        arch = struct.unpack_from("<I", data, off + 28)[0]
        out.append(("ptx", f"compute_{arch}") if kind == 1 else ("sass", f"sm_{arch}"))
        off += ehsize + payload
    return out


def _run(cmd: list[str], cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)


def nvcc_version(nvcc: str) -> str:
    """nvcc's release, e.g. ``13.0``."""
    r = _run([nvcc, "--version"])
    m = re.search(r"release (\d+\.\d+)", r.stdout)
    if r.returncode or not m:
        raise RuntimeError(f"{nvcc} --version failed: {r.stdout}{r.stderr}")
    return m.group(1)


def supported_archs(nvcc: str, wanted=ARCHS) -> list[str]:
    """The architectures of ``wanted`` this nvcc can compile for."""
    r = _run([nvcc, "--list-gpu-code"])
    have = set(r.stdout.split()) if r.returncode == 0 else set(wanted)
    return [a for a in wanted if a in have]


def gencode(archs) -> list[str]:
    """-gencode arguments: SASS for each of ``archs``, and the newest one's PTX too."""
    args = []
    for i, a in enumerate(archs):
        n = a.split("_", 1)[1]
        code = f"[sm_{n},compute_{n}]" if i == len(archs) - 1 else f"sm_{n}"
        args += ["-gencode", f"arch=compute_{n},code={code}"]
    return args


# ---------------------------------------------------------------------- nvcc with a cache
def _cache_dir() -> Path | None:
    d = settings.get("ECHONCCL_DEV_NVCC_CACHE")
    return Path(d) if d else None


def nvcc_run(args: list[str], inputs: dict[str, bytes], outputs: list[str],
             nvcc: str | None = None) -> tuple[dict[str, bytes], str]:
    """Run ``nvcc *args`` in a folder holding ``inputs`` (name -> bytes; ``args`` name them and
    ``outputs`` relative to it), removed after. Returns ({output: bytes}, nvcc's stdout + stderr); raises
    `RuntimeError` on a compile error. With ``ECHONCCL_DEV_NVCC_CACHE`` set, a run whose nvcc,
    arguments and inputs were seen before returns the stored outputs without compiling; a new
    entry appears whole (renamed into place) or not at all."""
    nvcc = find_nvcc(nvcc)
    if nvcc is None:
        raise FileNotFoundError("nvcc not found (set NVCC or put it on PATH)")
    cache = _cache_dir()
    if cache is not None:
        h = hashlib.sha256()
        for part in (CACHE_VERSION, _run([nvcc, "--version"]).stdout, *args):
            h.update(part.encode() + b"\0")
        for name in sorted(inputs):
            h.update(name.encode() + b"\0" + hashlib.sha256(inputs[name]).digest())
        entry = cache / h.hexdigest()
        if (entry / "log.txt").is_file():
            return {o: (entry / o).read_bytes() for o in outputs}, (entry / "log.txt").read_text()
        cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".nvcc-", dir=cache))
    try:
        work, staging = tmp / "work", tmp / "entry"
        work.mkdir()
        staging.mkdir()
        for name, data in inputs.items():
            (work / name).write_bytes(data)
        r = _run([nvcc, *args], cwd=work)
        log = r.stdout + r.stderr
        if r.returncode:
            raise RuntimeError(f"nvcc {' '.join(args)} failed ({r.returncode}):\n{log[-20000:]}")
        for o in outputs:
            if not (work / o).is_file():
                raise RuntimeError(f"nvcc {' '.join(args)} wrote no {o}")
            shutil.move(str(work / o), staging / o)
        result = {o: (staging / o).read_bytes() for o in outputs}
        if cache is not None:
            (staging / "log.txt").write_text(log)  # last: it marks the entry complete
            try:
                staging.rename(entry)               # atomic; a concurrent run of the same key may win
            except OSError:
                pass
        return result, log
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def ptxas_resources(log: str) -> dict:
    """From a ``-Xptxas -v`` log, per architecture: ``registers`` of each kernel and ``spills``
    (bytes stored plus loaded) of each function ptxas reports, kernels and the device functions
    they call (the fused kernels' phases, by mangled name)."""
    out: dict = {}
    arch = func = None
    for line in log.splitlines():
        if m := _PTXAS_FUNC.search(line):
            func, arch = m.groups()
            out.setdefault(arch, {"registers": {}, "spills": {}})["registers"][func] = 0
        elif arch and (m := _PTXAS_PROPS.search(line)):
            func = m.group(1)
        elif arch and func and (m := _PTXAS_SPILL.search(line)):
            out[arch]["spills"][func] = int(m.group(1)) + int(m.group(2))
        elif arch and (m := _PTXAS_REGS.search(line)):
            out[arch]["registers"][next(reversed(out[arch]["registers"]))] = int(m.group(1))
    return out


# ---------------------------------------------------------------------------- the build
def compile_fatbin(kernels=kt.PREBUILT, archs=None, nvcc: str | None = None) -> tuple[bytes, dict]:
    """nvcc ``-fatbin`` of ``kernels`` for ``archs`` (default: `ARCHS` this nvcc has) with ptxas's
    report: (the fatbin's bytes, the manifest)."""
    nvcc = find_nvcc(nvcc)
    if nvcc is None:
        raise FileNotFoundError("nvcc not found (set NVCC or put it on PATH)")
    kernels = list(kernels)
    archs = list(archs or supported_archs(nvcc))
    if not archs:
        raise RuntimeError(f"{nvcc} compiles for none of {ARCHS}")
    d = kt.source_dir()
    inputs = {n: (d / n).read_bytes() for n in kt.SOURCE_NAMES}
    inputs["kernels.cu"] = kt.source(kernels, inline=False).encode()
    args = ["-fatbin", *kt.NVCC_FLAGS, *gencode(archs), "--threads", "0", "-Xptxas", "-v",
            "-o", FATBIN, "kernels.cu"]
    out, log = nvcc_run(args, inputs, [FATBIN], nvcc)
    resources = ptxas_resources(log)
    built = set(resources.get(archs[0], {}).get("registers", {}))
    names = [k.name for k in kernels]
    if built != set(names):
        raise RuntimeError(f"nvcc built other kernels than asked: missing {sorted(set(names) - built)}, "
                           f"extra {sorted(built - set(names))}")
    manifest = {"kernels": names, "archs": archs, "ptx": f"compute_{archs[-1].split('_', 1)[1]}",
                "images": [list(i) for i in fatbin_images(out[FATBIN])], "nvcc": nvcc_version(nvcc),
                "fingerprint": kt.fingerprint(kernels), "resources": resources}
    return out[FATBIN], manifest


def build(out_dir: Path | str = DEFAULT_OUT, kernels=kt.PREBUILT, archs=None, nvcc: str | None = None) -> Path:
    """Compile ``kernels`` into ``out_dir`` (`FATBIN` and `MANIFEST`); returns the manifest's path."""
    fatbin, manifest = compile_fatbin(kernels, archs, nvcc)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / FATBIN).write_bytes(fatbin)
    (out_dir / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return out_dir / MANIFEST


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m echonccl.build", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(DEFAULT_OUT), help=f"output folder (default {DEFAULT_OUT})")
    p.add_argument("--all", action="store_true", help="every kernel of the table, not only the prebuilt ones")
    p.add_argument("--arch", nargs="+", default=None, help=f"SASS architectures (default {' '.join(ARCHS)})")
    p.add_argument("--nvcc", default=None, help="the nvcc to use (default: $NVCC, PATH, /usr/local/cuda)")
    p.add_argument("--if-nvcc", action="store_true", help="without nvcc, say so and exit 0 (the wheel build)")
    a = p.parse_args(argv)
    if find_nvcc(a.nvcc) is None:
        print("echonccl.build: nvcc not found: no prebuilt kernels (they compile on demand at run time)",
              file=sys.stderr)
        return 0 if a.if_nvcc else 1
    kernels = kt.ALL if a.all else kt.PREBUILT
    path = build(a.out, kernels, a.arch, a.nvcc)
    m = json.loads(path.read_text())
    res = m["resources"].get("sm_90") or next(iter(m["resources"].values()))
    print(f"echonccl.build: {len(m['kernels'])} kernels for {', '.join(m['archs'])} (+ {m['ptx']} PTX) with "
          f"nvcc {m['nvcc']} -> {path.parent}; most registers {max(res['registers'].values())}, "
          f"{sum(res['spills'].values())} bytes spilled in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
