"""Every ``ECHONCCL_*`` environment variable in one typed table, read through `get`.

A `Setting` names its variable, type, default, audience (user, or developer: those are named
``ECHONCCL_DEV_*``) and the moment it is read:

* ``communicator``: when a `Communicator` is created (the options of `config.Config` override
  its keyword arguments, as NCCL's variables do; the engine's switches);
* ``use``: each time the value is needed (the kernel cache, the NCCL library on first load);
* ``build``: by ``python -m echonccl.build`` and the wheel build.

Values are parsed one way: booleans take ``1/0, true/false, on/off, yes/no`` (any case) and
nothing else; byte counts take an int with an optional ``K``/``M``/``G`` suffix (powers of 1024);
an empty variable is unset. A value that does not parse raises `ValueError` naming the variable.
The README's settings table is `markdown_table` (a test checks the two agree).

This module imports nothing outside the standard library (the wheel build reads it).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Mapping

_TRUE = ("1", "true", "on", "yes")
_FALSE = ("0", "false", "off", "no")
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_bool(text: str) -> bool:
    s = text.strip().lower()
    if s in _TRUE:
        return True
    if s in _FALSE:
        return False
    raise ValueError(f"not a boolean (use one of {'/'.join(_TRUE)} or {'/'.join(_FALSE)})")


def parse_bytes(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(?:i?B)?\s*", text, re.I)
    if not m:
        raise ValueError("not a byte count (an integer, optionally with K, M or G)")
    return int(m.group(1)) * _UNITS[m.group(2).upper()]


def _parse_int(text: str) -> int:
    return int(text.strip())


def _parse_float(text: str) -> float:
    return float(text.strip())


def _parse_str(text: str) -> str:
    return text.strip()


def _parse_level(text: str) -> str:
    return text.strip().upper()


_PARSERS = {"bool": parse_bool, "bytes": parse_bytes, "int": _parse_int, "float": _parse_float,
            "str": _parse_str, "path": _parse_str, "level": _parse_level}


@dataclass(frozen=True)
class Setting:
    name: str               # the environment variable
    kind: str               # bool, int, bytes, float, str, path or level (upper-cased; `_PARSERS`)
    default: Any            # None: unset (the doc says what that means)
    doc: str                # one line
    when: str = "communicator"     # communicator, use or build (module docstring)
    user: bool = True       # False: a developer setting (ECHONCCL_DEV_*)
    choices: tuple = ()     # the accepted values of a str setting (empty: checked where used)

    def parse(self, text: str):
        value = _PARSERS[self.kind](text)
        if self.choices and value not in self.choices:
            raise ValueError(f"not one of {', '.join(map(str, self.choices))}")
        return value


SETTINGS: tuple[Setting, ...] = (
    Setting("ECHONCCL_ENGINE", "str", "auto", "gpu (CUDA kernels, NCCL), cpu (numpy, MPI) or auto (gpu when cupy sees one)",
            choices=("auto", "gpu", "cpu")),
    Setting("ECHONCCL_ALGO", "str", "auto", "the all-reduce algorithm (README: Algorithms); auto picks by size"),
    Setting("ECHONCCL_CODEC", "str", "int4-h32/int7-h32",
            "the wire format: int4-h32/int7-h32, int4-h32, int4 or int7-h32 (README: Codecs)"),
    Setting("ECHONCCL_ROUNDS", "int", 1, "4-bit rounds per all-reduce (1-4); each further round sends the residuals"),
    Setting("ECHONCCL_FEEDBACK_ROUNDING", "bool", False,
            "the owner's 16-bit output rounding goes into its residual (Feedback(rounding=))"),
    Setting("ECHONCCL_CROSSOVER_BYTES", "bytes", None, "auto: below this input size the 16-bit path (default: measured per path)"),
    Setting("ECHONCCL_TIMEOUT", "float", 300.0, "seconds before a silent peer raises PeerTimeoutError"),
    Setting("ECHONCCL_CACHE_BYTES", "bytes", 1 << 30, "bound on cached workspaces and default feedback states"),
    Setting("ECHONCCL_FUSED", "bool", True, "peer-memory kernels where the GPUs can map each other's memory; off: NCCL"),
    Setting("ECHONCCL_DEVICE", "int", None, "the GPU of this process (default: the node-local rank)"),
    Setting("ECHONCCL_NCCL_LIBRARY", "path", None, "libnccl.so.2 to load (default: the nvidia-nccl wheel, else the system's)",
            when="use"),
    Setting("ECHONCCL_KERNEL_DIR", "path", None,
            "a prebuilt kernel folder to load instead of the package's (python -m echonccl.build --out DIR)",
            when="use"),
    Setting("ECHONCCL_KERNEL_CACHE", "path", None,
            "where kernels compiled on demand are kept (default: $XDG_CACHE_HOME/echonccl, ~/.cache/echonccl)",
            when="use"),
    Setting("ECHONCCL_DEBUG", "level", None, "INFO: rank 0 logs the resolved options once per Communicator",
            choices=("INFO",)),
    # developer settings: measurements and tests, not tuning
    Setting("ECHONCCL_DEV_GRAPH_SCHEDULES", "bool", True,
            "replay the NCCL path's schedules as CUDA graphs (off: their Python runs every call)", user=False),
    Setting("ECHONCCL_DEV_NCCL_ALLGATHER", "bool", True,
            "all-gathers through ncclAllGather (off: a round of send/recv)", user=False),
    Setting("ECHONCCL_DEV_COMM_PRIORITY", "bool", False,
            "the NCCL path's communication stream at the device's greatest priority", user=False),
    Setting("ECHONCCL_DEV_PIPELINE_MIN_CHUNK", "int", 1 << 20,
            "elements per chunk of two_shot_pipelined at least", when="use", user=False),
    Setting("ECHONCCL_DEV_NVCC_CACHE", "path", None,
            "a directory where nvcc results are kept by fingerprint (tests share one compile)", when="build", user=False),
    Setting("ECHONCCL_DEV_INSTALLED", "bool", False,
            "tools/gpu_suite.sh and tools/launch.py: test the installed package, not the checkout", when="use", user=False),
    Setting("ECHONCCL_DEV_CORPUS_CACHE", "path", None,
            "where studies/corpus.py keeps the accuracy study's texts (default: ~/.cache/echonccl)", when="use",
            user=False),
)
BY_NAME: dict[str, Setting] = {s.name: s for s in SETTINGS}


def get(name: str, environ: Mapping[str, str] | None = None):
    """The value of setting ``name`` (a registered variable) from the environment, or its
    default when unset or empty. `ValueError` names the variable when its value does not parse."""
    s = BY_NAME[name]
    raw = (os.environ if environ is None else environ).get(name)
    if raw is None or not raw.strip():
        return s.default
    try:
        return s.parse(raw)
    except ValueError as exc:
        raise ValueError(f"{name}={raw!r}: {exc}") from None


def is_set(name: str, environ: Mapping[str, str] | None = None) -> bool:
    BY_NAME[name]
    raw = (os.environ if environ is None else environ).get(name)
    return raw is not None and bool(raw.strip())


def markdown_table(user: bool = True) -> str:
    """The settings of one audience as a markdown table (the README's)."""
    def default(s):
        if s.default is None:
            return "unset"
        if s.kind == "bool":
            return "1" if s.default else "0"
        if s.kind == "bytes" and s.default >= 1 << 20:
            return f"{s.default >> 20} MiB" if s.default < 1 << 30 else f"{s.default >> 30} GiB"
        return str(s.default)

    rows = ["| variable | type | default | read at | meaning |", "|---|---|---|---|---|"]
    rows += [f"| `{s.name}` | {s.kind} | {default(s)} | {s.when} | {s.doc} |" for s in SETTINGS if s.user == user]
    return "\n".join(rows)
