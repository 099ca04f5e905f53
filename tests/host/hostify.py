"""The CUDA headers of cuda_src/ made compilable by a host C++ compiler: every inline PTX
statement (``asm [volatile] (template : outputs : inputs : clobbers)``) becomes a call of
``echo_host::ptx(template, {operands})``, which warp_host.h interprets (the few instructions the
sources use; an unknown one aborts). Nothing else of the text changes."""
from __future__ import annotations

import re
from pathlib import Path

_ASM = re.compile(r"\basm\s*(?:volatile\s*)?\(")


def _close(text: str, i: int) -> int:
    """Index of the parenthesis closing the one before ``i``, string literals skipped."""
    depth, q = 1, None
    while depth:
        c = text[i]
        if q:
            if c == "\\":
                i += 1
            elif c == q:
                q = None
        elif c in "\"'":
            q = c
        elif c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
        i += 1
    return i - 1


def _split(text: str, sep: str) -> list[str]:
    """``text`` split at ``sep`` outside parentheses and string literals."""
    out, depth, q, cur = [], 0, None, ""
    for i, c in enumerate(text):
        if q:
            q = None if c == q and text[i - 1] != "\\" else q
        elif c == '"':
            q = c
        elif c in "([":
            depth += 1
        elif c in ")]":
            depth -= 1
        elif c == sep and depth == 0:
            out.append(cur)
            cur = ""
            continue
        cur += c
    return out + [cur]


def _operand(op: str, output: bool) -> str:
    m = re.fullmatch(r'\s*"([=+&]*)(\w)"\s*\((.*)\)\s*', op, re.S)
    if not m:
        raise ValueError(f"unparsed asm operand {op!r}")
    return f"echo_host::{'out' if output else 'in'}({m.group(3)})"


def hostify_text(text: str) -> str:
    out, pos = [], 0
    for m in _ASM.finditer(text):
        if m.start() < pos:
            continue
        end = _close(text, m.end())
        parts = _split(text[m.end():end], ":") + ["", ""]
        outs = [_operand(o, True) for o in _split(parts[1], ",") if o.strip()]
        ins = [_operand(o, False) for o in _split(parts[2], ",") if o.strip()]
        out.append(text[pos:m.start()])
        out.append(f"echo_host::ptx({parts[0].strip()}, {{{', '.join(outs + ins)}}})")
        pos = end + 1
    return "".join(out) + text[pos:]


def hostify(src: Path, dst: Path) -> None:
    """Every ``*.cuh`` of ``src`` into ``dst``, hostified."""
    dst.mkdir(parents=True, exist_ok=True)
    for f in sorted(Path(src).glob("*.cuh")):
        (dst / f.name).write_text(hostify_text(f.read_text()))


if __name__ == "__main__":
    import sys

    hostify(Path(sys.argv[1]), Path(sys.argv[2]))
