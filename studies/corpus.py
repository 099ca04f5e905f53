"""Real text for the model study: the Lee news corpus shipped inside the ``gensim`` distribution.

gensim is never installed: ``pip download --no-deps`` fetches its wheel (or
sdist) once and ``gensim/test/test_data/lee_background.cor`` (300 Australian
news articles, one per line) is read out of the archive and cached.
"""
from __future__ import annotations

import glob
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile

MEMBER = "gensim/test/test_data/lee_background.cor"
GENSIM_REQ = "gensim==4.4.0"


def cache_dir() -> str:
    d = os.environ.get("ECHONCCL_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "echonccl")
    os.makedirs(d, exist_ok=True)
    return d


def _read_member(archive: str) -> str:
    if archive.endswith(".whl") or archive.endswith(".zip"):
        with zipfile.ZipFile(archive) as z:
            return z.read(MEMBER).decode("utf-8")
    with tarfile.open(archive) as t:
        name = next(n for n in t.getnames() if n.endswith(MEMBER))
        return t.extractfile(name).read().decode("utf-8")


def lee_documents(path: str | None = None) -> list[str]:
    """The corpus's documents. ``path``: a .cor file or a gensim wheel/sdist; default: cached download."""
    if path is None:
        path = os.path.join(cache_dir(), "lee_background.cor")
        if not os.path.exists(path):
            with tempfile.TemporaryDirectory() as tmp:
                r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q",
                                    "-d", tmp, GENSIM_REQ], capture_output=True, text=True)
                if r.returncode:
                    raise RuntimeError(f"pip download {GENSIM_REQ} failed: {r.stderr.strip()[-2000:]}")
                archive = glob.glob(os.path.join(tmp, "gensim-*"))[0]
                text = _read_member(archive)
            with open(path + ".tmp", "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(path + ".tmp", path)
    if not path.endswith(".cor"):
        text = _read_member(path)
    else:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    return [line.strip() for line in text.splitlines() if line.strip()]
