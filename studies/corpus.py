"""Real text for the model study: the Lee news corpus shipped inside the ``gensim`` distribution.

gensim is never installed. Only when asked (``--download-corpus`` of accuracy_smollm2.py,
``make corpus``, or ``python studies/corpus.py --download``), ``pip download --no-deps``
fetches its wheel once, and ``gensim/test/test_data/lee_background.cor`` (300 Australian news
articles, one per line) is read out of the archive and cached (`cache_dir`). Otherwise the
corpus is the cached copy or a file given with ``--corpus``.
"""
from __future__ import annotations

import argparse
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


class CorpusNotFound(FileNotFoundError):
    pass


def cached_path() -> str:
    return os.path.join(cache_dir(), "lee_background.cor")


def fetch() -> str:
    """Fetch the gensim distribution with pip, cache the corpus out of it; its path."""
    path = cached_path()
    with tempfile.TemporaryDirectory() as tmp:
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q",
                            "-d", tmp, GENSIM_REQ], capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"pip download {GENSIM_REQ} failed: {r.stderr.strip()[-2000:]}")
        text = _read_member(glob.glob(os.path.join(tmp, "gensim-*"))[0])
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(path + ".tmp", path)
    return path


def lee_documents(path: str | None = None, download: bool = False) -> list[str]:
    """The corpus's documents. ``path``: a .cor file or a gensim wheel/sdist; default: the cached
    copy, fetched first (`fetch`) only when ``download`` is true, else `CorpusNotFound`."""
    if path is None:
        path = cached_path()
        if not os.path.exists(path):
            if not download:
                raise CorpusNotFound(
                    f"the Lee corpus is not cached at {path}: pass --download-corpus (pip download "
                    f"--no-deps {GENSIM_REQ}, once; or make corpus) or --corpus FILE "
                    f"(lee_background.cor or a gensim wheel/sdist)")
            path = fetch()
    if not path.endswith(".cor"):
        text = _read_member(path)
    else:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    return [line.strip() for line in text.splitlines() if line.strip()]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="the Lee corpus of the SmolLM2 study: where it is cached")
    p.add_argument("--download", action="store_true", help=f"fetch it (pip download {GENSIM_REQ}) if not cached")
    a = p.parse_args(argv)
    try:
        docs = lee_documents(download=a.download)
    except CorpusNotFound as exc:
        print(exc, file=sys.stderr)
        return 1
    print(f"{cached_path()}: {len(docs)} documents")
    return 0


if __name__ == "__main__":
    sys.exit(main())
