"""Real text for the model study, both shipped inside the ``gensim`` distribution.

* ``lee``: the Lee news corpus, ``gensim/test/test_data/lee_background.cor``
  (300 Australian news articles, one per line);
* ``wiki``: English Wikipedia, the 2016 dump sample
  ``gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2``
  (encyclopedic prose: the lead paragraphs of each article, wiki markup stripped by
  `wiki_plain_text`), a second text of another register than news.

gensim is never installed. Only when asked (``--download-corpus`` of accuracy_smollm2.py,
``make corpus``, or ``python studies/corpus.py --download``), ``pip download --no-deps``
fetches its wheel once, and both texts are read out of the archive and cached (`cache_dir`).
Otherwise a text is its cached copy (the Lee corpus may also be a file given with ``--corpus``).
"""
from __future__ import annotations

import argparse
import bz2
import glob
import html
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import zipfile

MEMBER = "gensim/test/test_data/lee_background.cor"
WIKI_MEMBER = "gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
GENSIM_REQ = "gensim==4.4.0"
TEXTS = ("lee", "wiki")


def cache_dir() -> str:
    from echonccl import settings

    d = settings.get("ECHONCCL_DEV_CORPUS_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "echonccl")
    os.makedirs(d, exist_ok=True)
    return d


def _read_member(archive: str, member: str = MEMBER) -> str:
    if archive.endswith(".whl") or archive.endswith(".zip"):
        with zipfile.ZipFile(archive) as z:
            data = z.read(member)
    else:
        with tarfile.open(archive) as t:
            name = next(n for n in t.getnames() if n.endswith(member))
            data = t.extractfile(name).read()
    if member.endswith(".bz2"):
        data = bz2.decompress(data)
    return data.decode("utf-8")


class CorpusNotFound(FileNotFoundError):
    pass


def cached_path(text: str = "lee") -> str:
    return os.path.join(cache_dir(), {"lee": "lee_background.cor", "wiki": "enwiki_leads.txt"}[text])


def _write(path: str, text: str) -> None:
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def fetch() -> str:
    """Fetch the gensim distribution with pip and cache both texts out of it; the Lee path."""
    with tempfile.TemporaryDirectory() as tmp:
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q",
                            "-d", tmp, GENSIM_REQ], capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"pip download {GENSIM_REQ} failed: {r.stderr.strip()[-2000:]}")
        archive = glob.glob(os.path.join(tmp, "gensim-*"))[0]
        _write(cached_path("lee"), _read_member(archive, MEMBER))
        _write(cached_path("wiki"), wiki_plain_text(_read_member(archive, WIKI_MEMBER)))
    return cached_path("lee")


def _cached_text(text: str, download: bool) -> str:
    path = cached_path(text)
    if not os.path.exists(path):
        if not download:
            raise CorpusNotFound(
                f"the {text} text is not cached at {path}: pass --download-corpus (pip download "
                f"--no-deps {GENSIM_REQ}, once; or make corpus)"
                + (" or --corpus FILE (lee_background.cor or a gensim wheel/sdist)" if text == "lee" else ""))
        lee = fetch()
        path = lee if text == "lee" else path
    with open(path, encoding="utf-8") as f:
        return f.read()


def lee_documents(path: str | None = None, download: bool = False) -> list[str]:
    """The corpus's documents. ``path``: a .cor file or a gensim wheel/sdist; default: the cached
    copy, fetched first (`fetch`) only when ``download`` is true, else `CorpusNotFound`."""
    if path is None:
        text = _cached_text("lee", download)
    elif not path.endswith(".cor"):
        text = _read_member(path)
    else:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    return [line.strip() for line in text.splitlines() if line.strip()]


_TEXT_RE = re.compile(r"<text[^>]*>(.*?)</text>", re.S)


def wiki_plain_text(xml: str) -> str:
    """The prose of a MediaWiki XML dump, one article per line: its paragraphs before the
    first section heading, with templates, tables, references, files and markup removed."""
    out = []
    for m in _TEXT_RE.finditer(xml):
        t = html.unescape(m.group(1))
        if t.lstrip().upper().startswith("#REDIRECT"):
            continue
        t = re.sub(r"<!--.*?-->", "", t, flags=re.S)
        t = re.sub(r"<ref[^>]*/>", "", t)
        t = re.sub(r"<ref[^>]*>.*?</ref>", "", t, flags=re.S)
        for _ in range(4):                                   # nested templates and tables
            t = re.sub(r"\{\{[^{}]*\}\}", "", t)
            t = re.sub(r"\{\|.*?\|\}", "", t, flags=re.S)
        t = t.split("\n==")[0]                                # the lead section
        t = re.sub(r"\[\[(?:File|Image|Category):[^\[\]]*(?:\[\[[^\]]*\]\][^\[\]]*)*\]\]", "", t)
        t = re.sub(r"\[\[(?:[^|\]]*\|)?([^\]]*)\]\]", r"\1", t)
        t = re.sub(r"\[https?://\S+ ?([^\]]*)\]", r"\1", t)
        t = re.sub(r"'{2,}", "", t)
        t = re.sub(r"<[^>]+>", "", t)
        paras = [p.strip() for p in t.split("\n") if p.strip() and p.strip()[0] not in "*#:;|!{}"]
        text = " ".join(paras)
        text = re.sub(r"\s+", " ", re.sub(r"\(\s*[,;]?\s*\)", "", text)).strip()
        if len(text) > 200:
            out.append(text)
    return "\n".join(out)


def wiki_documents(download: bool = False) -> list[str]:
    """The Wikipedia text's articles (lead sections), from the cache (`fetch` fills it)."""
    return [line.strip() for line in _cached_text("wiki", download).splitlines() if line.strip()]


def documents(text: str = "lee", path: str | None = None, download: bool = False) -> list[str]:
    """The documents of ``text`` (one of `TEXTS`); ``path`` overrides the Lee corpus file."""
    if text == "lee":
        return lee_documents(path, download)
    if text == "wiki":
        return wiki_documents(download)
    raise ValueError(f"text must be one of {TEXTS}, got {text!r}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="the texts of the SmolLM2 study: where they are cached")
    p.add_argument("--download", action="store_true", help=f"fetch them (pip download {GENSIM_REQ}) if not cached")
    a = p.parse_args(argv)
    try:
        for text in TEXTS:
            print(f"{cached_path(text)}: {len(documents(text, download=a.download))} documents")
    except CorpusNotFound as exc:
        print(exc, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
