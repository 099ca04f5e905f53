"""The one table of the GPU engine's CUDA kernels: which exist, their names, the launch constants,
and the CUDA source that defines them.

The templates live in ``cuda_src/`` (``kernels.cuh``: the NCCL path's codec kernels;
``fused.cuh`` and ``fused_one_shot.cuh``: the peer-memory kernels; all over ``codec.cuh`` and its
parts). These headers end with one ``ECHO_*_KERNEL`` macro per family; `source` writes the launch
constants and one macro line per kernel of this table, so the CUDA entry points and the names the
launch side uses (`Kernel.name`) come from here alone. Nothing else instantiates a kernel.

* `ALL`: every kernel a documented option can run: for each wire codec, reduce_quantize for each
  (input, residual, reference) type the schedules use, dequantize and its sum of parts for each
  output type, the fused two-shot (and its float32-reference owner for 16-bit data, for
  ``Feedback(rounding=False)``) and quantized one-shot for each (input, residual), each for any
  slices and for slices that lie whole in aligned buffers (the two-shots whose phases all run 16
  elements a thread also for counts that are not a multiple of 512, and for an input or output off
  16-byte alignment: `takes_any_count`, `takes_shift`); for each pair of codecs (`PAIRS`:
  int4-h32 contributions, int7-h32 sums) the owner's reduce_quantize and the fused two-shot (the
  rest of its work runs its parts' kernels); the 16-bit one-shots. Whether a decode adds into
  its output is a run-time argument.
* `PREBUILT`: the kernels of the default options (the default codec, `default_options`: int8
  residuals of 16-bit data, float32 ones of float32 data, or none; ``rounding=False``; refinement
  rounds) for every data type, and the one-shots: what ``python -m echonccl.build`` and the wheel
  compile ahead of time (`echonccl.build`). The rest (other codecs, 16-bit or float32 residuals
  of 16-bit data, ``rounding=True`` on whole slices) are compiled on demand, one at a time, the
  first time a call needs them (`echonccl.kernel_loader`).

This module imports nothing outside the standard library (the wheel build runs it).
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, replace
from pathlib import Path

# ------------------------------------------------------------------ launch constants
BLOCK = 256                 # threads per block of every kernel (ECHO_BLOCK)
ELEMS_PER_THREAD = 8        # elements per thread: one 32-bit word of codes
FUSED_BLOCKS_PER_SM = 3     # resident blocks per SM of the fused kernels (their launch bounds, 80 registers)
DQ_UNROLL = {"f16": 2, "bf16": 2, "f32": 1}   # dequantize: 8-element chunks per thread and grid step
RQ_BLOCKS_PER_SM = 8        # grid of the standalone reduce_quantize (blocks per SM, at most)
DQ_BLOCKS_PER_SM = 16       # grid of the standalone dequantize (blocks per SM, at most)

# ------------------------------------------------------------------------ the table
DTYPES = ("f16", "bf16", "f32")
# wire codec -> (echo::kInt4 / kInt4H32 / kInt7H32, group size); codec.py is the format's definition
# (tests/test_kernel_table.py checks the two agree)
CODECS = {"int4": (0, 32), "int4-h32": (1, 32), "int7-h32": (2, 16)}
PAIRS = ("int4-h32/int7-h32",)       # contributions' codec / sums' codec (codec.MIXED)
DEFAULT_CODEC = PAIRS[0]
FAMILIES = ("reduce_quantize", "dequantize", "dequantize_sum", "two_shot", "one_shot_q", "one_shot", "one_shot_ll")
FUSED_FAMILIES = ("two_shot", "one_shot_q", "one_shot", "one_shot_ll")


def residuals(dtype: str) -> tuple[str, ...]:
    """The residual types of ``dtype``'s kernels: float32, the input's own, the int8 block format."""
    return ("f32", "i8") if dtype == "f32" else ("f32", dtype, "i8")


def refs(dtype: str) -> tuple[str, ...]:
    """reduce_quantize's reference types: float32 (contributions, ring hops) or the output's."""
    return ("f32",) if dtype == "f32" else ("f32", dtype)


@dataclass(frozen=True)
class Kernel:
    """One kernel: ``family`` (`FAMILIES`), ``dtype`` (input/output type), ``codec`` (none for the
    16-bit one-shots; a pair of `PAIRS` for the owner's reduce_quantize, incoming / written, and
    for the fused two-shot, contributions / sums), ``res`` (residual type), ``ref`` (reduce_quantize:
    its reference type; two_shot: ``"f32"`` for the owner whose residual leaves out its output's
    rounding), ``whole`` (two_shot, one_shot_q: the kernel for slices that lie whole in 16-byte
    aligned buffers, a multiple of 512 elements), ``any_count`` (the whole two-shot for a count
    that is not a multiple of 512: the last 512-element block read zero-filled and stored up to
    the count; only where `takes_any_count`), ``shifted`` (the general two-shot of the same kernels
    for an input or output off 16-byte alignment, its 16-element loops at the buffer's shift; only
    where `takes_shift`)."""

    family: str
    dtype: str
    codec: str = ""
    res: str = ""
    ref: str = ""
    whole: bool = False
    any_count: bool = False
    shifted: bool = False

    @property
    def name(self) -> str:
        cid = "_" + self.codec.replace("-", "_").replace("/", "_") if self.codec else ""
        if self.family == "reduce_quantize":
            return f"echo_reduce_quantize_{self.dtype}_res{self.res}_ref{self.ref}{cid}"
        if self.family in ("dequantize", "dequantize_sum", "one_shot", "one_shot_ll"):
            return f"echo_{self.family}_{self.dtype}{cid}"
        suffix = (("_ref32" if self.family == "two_shot" and self.ref == "f32" else "")
                  + ("_whole" if self.whole else "") + ("_any" if self.any_count else "")
                  + ("_shift" if self.shifted else ""))
        return f"echo_{self.family}_{self.dtype}_res{self.res}{cid}{suffix}"

    @property
    def fused(self) -> bool:
        return self.family in FUSED_FAMILIES

    def line(self) -> str:
        """The macro line that defines this kernel (cuda_src/kernels.cuh, fused.cuh, fused_one_shot.cuh)."""
        f, t = self.family, self.dtype
        if f in ("one_shot", "one_shot_ll"):
            return f"ECHO_{f.upper()}_KERNEL({self.name}, {t})"
        first, _, second = self.codec.partition("/")
        (id1, g1), (id2, g2) = CODECS[first], CODECS[second or first]
        codec_id, group = id1, g1
        if f == "reduce_quantize":       # the codec written, then the incoming one
            return f"ECHO_RQ_KERNEL({self.name}, {t}, {self.res}, {self.ref}, {g2}, {id2}, {g1}, {id1})"
        if f == "dequantize":
            return f"ECHO_DQ_KERNEL({self.name}, {t}, {group}, {codec_id})"
        if f == "dequantize_sum":
            return f"ECHO_DQS_KERNEL({self.name}, {t}, {group}, {codec_id})"
        whole = "true" if self.whole else "false"
        if f == "two_shot":
            flags = ", ".join("true" if b else "false" for b in (self.ref == "f32", self.any_count, self.shifted))
            return f"ECHO_TWO_SHOT_KERNEL({self.name}, {t}, {self.res}, {g1}, {id1}, {g2}, {id2}, {whole}, {flags})"
        return f"ECHO_ONE_SHOT_Q_KERNEL({self.name}, {t}, {self.res}, {group}, {codec_id}, {whole})"


def takes_any_count(k: Kernel) -> bool:
    """Whether whole-slice kernel ``k`` has an any-count twin (``any_count=True``): the two-shots
    whose phases all run 16 elements a thread (16-bit data, residuals of its type or int8, the
    owner's float32 reference: ``rounding=False``; cuda_src/fused_phases.cuh's kLoop16)."""
    return k.whole and not k.any_count and _loop16(k)


def takes_shift(k: Kernel) -> bool:
    """Whether general kernel ``k`` has a shifted twin (``shifted=True``): the same two-shots as
    `takes_any_count`'s."""
    return not (k.whole or k.shifted) and _loop16(k)


def _loop16(k: Kernel) -> bool:
    return k.family == "two_shot" and k.dtype != "f32" and k.res in (k.dtype, "i8") and k.ref == "f32"


def _with_twins(kernels: list[Kernel]) -> list[Kernel]:
    return (kernels + [replace(k, any_count=True) for k in kernels if takes_any_count(k)]
            + [replace(k, shifted=True) for k in kernels if takes_shift(k)])


def _codec_kernels(codec: str) -> list[Kernel]:
    out = []
    for t in DTYPES:
        out += [Kernel("reduce_quantize", t, codec, r, f) for r in residuals(t) for f in refs(t)]
        out += [Kernel("dequantize", t, codec), Kernel("dequantize_sum", t, codec)]
        for w in (False, True):
            out += [Kernel("two_shot", t, codec, r, whole=w) for r in residuals(t)]
            if t != "f32":    # float32 data: the owner's reference is float32 anyway
                out += [Kernel("two_shot", t, codec, r, "f32", w) for r in residuals(t)]
            out += [Kernel("one_shot_q", t, codec, r, whole=w) for r in residuals(t)]
    return _with_twins(out)


def _pair_kernels(pair: str) -> list[Kernel]:
    out = []
    for t in DTYPES:
        out += [Kernel("reduce_quantize", t, pair, r, f) for r in residuals(t) for f in refs(t)]
        for w in (False, True):
            out += [Kernel("two_shot", t, pair, r, whole=w) for r in residuals(t)]
            if t != "f32":
                out += [Kernel("two_shot", t, pair, r, "f32", w) for r in residuals(t)]
    return _with_twins(out)


ALL: tuple[Kernel, ...] = tuple(k for c in CODECS for k in _codec_kernels(c)) + tuple(
    k for p in PAIRS for k in _pair_kernels(p)) + tuple(Kernel(f, t) for f in ("one_shot", "one_shot_ll") for t in DTYPES)
BY_NAME: dict[str, Kernel] = {k.name: k for k in ALL}


def kernels_of(codec: str) -> tuple[Kernel, ...]:
    """Every kernel an all-reduce in ``codec`` can run, any schedule, type and residual: a pair's
    own kernels (its owner and fused two-shot), its contributions' codec's others and its sums'
    decodes."""
    first, _, second = codec.partition("/")
    return tuple(k for k in ALL if k.codec == codec
                 or (k.codec == first and not (second and k.family == "two_shot"))
                 or (k.codec == second and k.family in ("dequantize", "dequantize_sum")))


def default_options(k: Kernel) -> bool:
    """Whether ``k`` serves the default options of its codec: ``Feedback()``'s residuals (int8
    for 16-bit data, float32 for float32 data) or none (the float32 instantiation stands in), the
    owner's output rounding left out of its residual (``rounding=False``) but kept in refinement
    rounds (the flush); not 16-bit residuals, int8 ones of float32 data, nor ``rounding=True``
    on whole slices."""
    if k.res not in ("", "f32", "f32" if k.dtype == "f32" else "i8"):
        return False
    if k.family == "reduce_quantize":
        return not (k.res == "f32" and k.ref != "f32")
    if k.family == "two_shot" and k.dtype != "f32":
        if k.res == "f32":                       # no feedback
            return k.ref == ""
        return k.ref == "f32" or not k.whole     # round 1; a refinement round (general slices)
    return True


_DEFAULT_KERNELS = {k for k in kernels_of(DEFAULT_CODEC) if default_options(k)}
PREBUILT: tuple[Kernel, ...] = tuple(k for k in ALL if k.codec == "" or k in _DEFAULT_KERNELS)


def lookup(name: str) -> Kernel:
    """The kernel called ``name``; `KeyError` names what is missing."""
    try:
        return BY_NAME[name]
    except KeyError:
        raise KeyError(f"no kernel {name!r} in echonccl's kernel table") from None


# ------------------------------------------------------------------------- sources
SOURCE_NAMES = ("codec.cuh", "codec_base.cuh", "staging.cuh", "residual.cuh", "codec_wire.cuh", "rotation.cuh",
                "reduce_quantize.cuh", "dequantize.cuh", "kernels.cuh", "fused_sync.cuh", "fused_phases.cuh",
                "fused_one_shot.cuh", "fused.cuh")
# The compile flags, one definition: exact IEEE arithmetic (no fmad contraction, no flush to
# zero, correctly rounded division and square root), C++17. NVRTC spells -std with two dashes.
_FLAGS = ("--fmad=false", "-ftz=false", "-prec-div=true", "-prec-sqrt=true")
NVRTC_OPTIONS = ("--std=c++17", *_FLAGS)
NVCC_FLAGS = ("-std=c++17", *_FLAGS)

_PKG_DIR = Path(__file__).resolve().parent
_INCLUDE_RE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"[^\n]*$', re.M)


def source_dirs() -> list[Path]:
    """Where ``cuda_src`` may be: the repository checkout, then the installed package data."""
    return [_PKG_DIR.parent / "cuda_src", _PKG_DIR / "cuda_src"]


def source_dir() -> Path:
    for d in source_dirs():
        if all((d / n).is_file() for n in SOURCE_NAMES):
            return d
    raise FileNotFoundError(f"echonccl's CUDA sources {SOURCE_NAMES} not found in {[str(d) for d in source_dirs()]}")


def prelude() -> str:
    """The launch constants, as the headers read them."""
    return (f"#define ECHO_BLOCK {BLOCK}\n#define ECHO_FUSED_MIN_BLOCKS {FUSED_BLOCKS_PER_SM}\n"
            f"#define ECHO_DQ_UNROLL16 {DQ_UNROLL['bf16']}\n#define ECHO_DQ_UNROLL32 {DQ_UNROLL['f32']}\n")


def source(kernels, inline: bool = True, directory: Path | None = None) -> str:
    """The CUDA source defining ``kernels`` (`Kernel` objects): the launch constants, the headers
    their families need and one macro line each. ``inline``: each header of ``directory`` (default
    `source_dir`) pasted in once, in place, so the text compiles with no include path and its hash
    covers every line compiled (the on-demand cache's key); else ``#include`` lines, for nvcc with
    ``-I``."""
    kernels = list(kernels)
    headers = (["kernels.cuh"] if any(not k.fused for k in kernels) else []) + (
        ["fused.cuh"] if any(k.fused for k in kernels) else [])
    body = (prelude() + "".join(f'#include "{h}"\n' for h in headers) + "\n"
            + "".join(k.line() + "\n" for k in kernels))
    return _inline(body, directory or source_dir()) if inline else body


def _inline(text: str, d: Path) -> str:
    seen: set = set()

    def paste(m):
        header = m.group(1)
        if not (d / header).is_file():
            raise FileNotFoundError(f'#include "{header}" is not in {d}')
        if header in seen:
            return ""
        seen.add(header)
        return _INCLUDE_RE.sub(paste, (d / header).read_text())

    return _INCLUDE_RE.sub(paste, text)


def fingerprint(kernels, options=NVCC_FLAGS, directory: Path | None = None) -> str:
    """sha256 of what compiling ``kernels`` with ``options`` reads: the inlined source and the
    flags (the prebuilt kernels' manifest records it; a changed header or table is a new one)."""
    h = hashlib.sha256()
    for part in (*options, source(kernels, True, directory)):
        h.update(part.encode() + b"\0")
    return h.hexdigest()
