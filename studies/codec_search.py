"""Codec search on SmolLM2-135M: many 4-bit codecs, P values and texts in one process.

    python studies/codec_search.py --P 2 4 8 --texts lee wiki --json docs/codec_search.json

The model is split tensor-parallel over P simulated ranks (`tp_llama`
shards, all in this process) and each of its 60 all-reduces per forward pass runs
through `simcodec.SimTwoShot` (the two_shot data flow with error
feedback, in numpy) with one codec variant; the unsplit reference is computed once
per text. Partial sums are handed over in bfloat16 and the output rounded to
bfloat16 (as ``studies/accuracy_smollm2.py --dtype bfloat16``). Reported per
variant, P and text: bits per element on the wire, perplexity change against the
unsplit model and top-1 agreement with it. The real code path is
``studies/accuracy_smollm2.py`` under mpiexec; this tool only ranks codecs.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

import bpe, corpus, reducers, smollm2, tp_llama as tl  # noqa: E402
from simcodec import Codec, Quantizer as Q, Rotation as R, SimTwoShot  # noqa: E402


def codecs() -> dict:
    return {
        "int4 G32 (today)": Codec("int4 G32", R(0), [Q(32)]),
        "int4 G32 H16": Codec("int4 G32 H16", R(16), [Q(32)]),
        "int4 G32 H32": Codec("int4 G32 H32", R(32), [Q(32)]),
        "int4 G32 H64": Codec("int4 G32 H64", R(64), [Q(32)]),
        "int4 G64 H64": Codec("int4 G64 H64", R(64), [Q(64)]),
        "int4 G32 H32 mse": Codec("int4 G32 H32 mse", R(32), [Q(32, mse=True)]),
        "int4 G16 H16 e8m0": Codec("int4 G16 H16 e8m0", R(16), [Q(16, "e8m0")]),
        "int4 G16 H16 m3": Codec("int4 G16 H16 m3", R(16), [Q(16, "m3")]),
        "int4 G32 H32 m3": Codec("int4 G32 H32 m3", R(32), [Q(32, "m3")]),
        "int4 G32 H32 m7": Codec("int4 G32 H32 m7", R(32), [Q(32, "m7")]),
        "int4 G32 H32 e8m0": Codec("int4 G32 H32 e8m0", R(32), [Q(32, "e8m0")]),
        "int4 G16 H16 fp32": Codec("int4 G16 H16 fp32", R(16), [Q(16)]),
        # finer groups inside the 32-point rotation, at most 5 bits an element
        "int4 G16 H32 m3": Codec("int4 G16 H32 m3", R(32), [Q(16, "m3")]),
        "int4 G16 H32 m7": Codec("int4 G16 H32 m7", R(32), [Q(16, "m7")]),
        "int4 G8 H32 m3": Codec("int4 G8 H32 m3", R(32), [Q(8, "m3")]),
        "int7 G16 H32 m7": Codec("int7 G16 H32 m7", R(32), [Q(16, "m7", levels=63)]),
        "int4 G32 H32, round 2 G128": Codec("int4 G32 H32, r2 G128", R(32), [Q(32), Q(128)]),
        "int4 G32 H32, round 2 implicit": Codec("int4 G32 H32, r2 implicit", R(32), [Q(32), Q(32, "implicit")]),
        "int4 G32 (today), round 2 G128": Codec("int4 G32, r2 G128", R(0), [Q(32), Q(128)]),
        # at most 8 bits an element (issue 13's accuracy mode): wider codes, or a 3-bit second round
        "int7 G32 H32": Codec("int7 G32 H32", R(32), [Q(32, levels=63)]),
        "int6 G32 H32": Codec("int6 G32 H32", R(32), [Q(32, levels=31)]),
        "int4 G32 H32, sums int7 G16 m7": Codec("int4 G32 H32, sums int7 G16 m7", R(32), [Q(32)],
                                                 Q(16, "m7", levels=63)),
        "int4 G32 H32, round 2 int7": Codec("int4 G32 H32, r2 int7", R(32), [Q(32), Q(32, levels=63)]),
        "int4 G32 H32, round 2 implicit int3": Codec("int4 G32 H32, r2 implicit int3", R(32),
                                                     [Q(32), Q(32, "implicit", levels=3, implicit_div=6.0)]),
    }


# (label, codec key, kwargs of SimTwoShot)
VARIANTS = {
    "today": ("int4 G32 (today)", {}),
    "today+flush": ("int4 G32 (today)", dict(flush=True)),
    "today plain": ("int4 G32 (today)", dict(feedback=False)),
    "today x2": ("int4 G32 (today)", dict(rounds=2)),
    "today bf16-res": ("int4 G32 (today)", dict(residual_dtype="bf16")),
    "today+flush bf16-res": ("int4 G32 (today)", dict(flush=True, residual_dtype="bf16")),
    "H16": ("int4 G32 H16", {}),
    "H32": ("int4 G32 H32", {}),
    "H32+flush": ("int4 G32 H32", dict(flush=True)),
    "H32 plain": ("int4 G32 H32", dict(feedback=False)),
    "H32 bf16-res": ("int4 G32 H32", dict(residual_dtype="bf16")),
    "H32+flush bf16-res": ("int4 G32 H32", dict(flush=True, residual_dtype="bf16")),
    "H64": ("int4 G32 H64", {}),
    "G64 H64": ("int4 G64 H64", {}),
    "H32 mse": ("int4 G32 H32 mse", {}),
    "G16 H16 e8m0": ("int4 G16 H16 e8m0", {}),
    "G16 H16 e8m0+flush": ("int4 G16 H16 e8m0", dict(flush=True)),
    "G16 H16 m3": ("int4 G16 H16 m3", {}),
    "G16 H16 m3+flush": ("int4 G16 H16 m3", dict(flush=True)),
    "H32 m3": ("int4 G32 H32 m3", {}),
    "H32 m7": ("int4 G32 H32 m7", {}),
    "H32 m7+flush": ("int4 G32 H32 m7", dict(flush=True)),
    "H32 e8m0": ("int4 G32 H32 e8m0", {}),
    "G16 H16 fp32": ("int4 G16 H16 fp32", {}),
    "G16 H32 m3": ("int4 G16 H32 m3", {}),
    "G16 H32 m3+flush": ("int4 G16 H32 m3", dict(flush=True)),
    "G16 H32 m7": ("int4 G16 H32 m7", {}),
    "G16 H32 m7+flush": ("int4 G16 H32 m7", dict(flush=True)),
    "G8 H32 m3": ("int4 G8 H32 m3", {}),
    "G8 H32 m3+flush": ("int4 G8 H32 m3", dict(flush=True)),
    "G16 H32 m7 int7": ("int7 G16 H32 m7", {}),
    "H32 x2": ("int4 G32 H32", dict(rounds=2)),
    "H32 x2+flush": ("int4 G32 H32", dict(rounds=2, flush=True)),
    "H32 x2 (r2 G128)": ("int4 G32 H32, round 2 G128", dict(rounds=2)),
    "H32 x2 (r2 implicit)": ("int4 G32 H32, round 2 implicit", dict(rounds=2)),
    "H32 x2 (r2 implicit)+flush": ("int4 G32 H32, round 2 implicit", dict(rounds=2, flush=True)),
    "today x2 (r2 G128)": ("int4 G32 (today), round 2 G128", dict(rounds=2)),
    "H32 int7": ("int7 G32 H32", {}),
    "H32+flush int7": ("int4 G32 H32, round 2 int7", dict(flush=True)),
    "H32 sums int7": ("int4 G32 H32, sums int7 G16 m7", {}),
    "H32 sums int7+flush": ("int4 G32 H32, sums int7 G16 m7", dict(flush=True)),
    "H32 sums int7 bf16-res": ("int4 G32 H32, sums int7 G16 m7", dict(residual_dtype="bf16")),
    "H32 int6": ("int6 G32 H32", {}),
    "H32 int6+flush": ("int6 G32 H32", dict(flush=True)),
    "H32 x2 (r2 implicit int3)": ("int4 G32 H32, round 2 implicit int3", dict(rounds=2)),
}
SHORT = ["today", "today+flush", "H32", "H32+flush", "G16 H16 m3", "G16 H16 m3+flush", "H32 x2",
         "H32 x2 (r2 implicit)", "H32 x2 (r2 implicit)+flush"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--P", type=int, nargs="+", default=[2])
    p.add_argument("--texts", nargs="+", default=["lee"], choices=corpus.TEXTS)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), help=f"of {list(VARIANTS)}; 'short'")
    p.add_argument("--sequences", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--json", help="append results to this JSON file (one record per line)")
    a = p.parse_args(argv)
    if a.variants == ["short"]:
        a.variants = SHORT
    return a


def tokens(tok, text, n, T):
    seqs = []
    for doc in corpus.documents(text):
        ids = tok.encode(doc)
        if len(ids) >= T:
            seqs.append(ids[:T])
        if len(seqs) == n:
            return np.array(seqs, dtype=np.int64)
    raise ValueError(f"{text}: only {len(seqs)} documents of >= {T} tokens")


def forward(shards, cfg, x, red):
    """The residual stream of the model split over ``shards``, each all-reduce through ``red``."""
    T = x.shape[1]
    cos, sin = tl.rope_tables(T, cfg)
    mask = np.triu(np.full((T, T), -np.inf, dtype=np.float32), 1)
    x = x.astype(np.float32, copy=True)
    for i in range(cfg.n_layers):
        parts = np.stack([tl._attention(s, s.layers[i], tl.rms_norm(x, s.layers[i]["attn_norm"], cfg.rms_eps),
                                        cfg, cos, sin, mask) for s in shards])
        x += red(parts)
        parts = np.stack([tl._mlp(s.layers[i], tl.rms_norm(x, s.layers[i]["ffn_norm"], cfg.rms_eps))
                          for s in shards])
        x += red(parts)
    return x


def score(h, w, norm, eps, toks):
    hn = tl.rms_norm(h, norm, eps).reshape(-1, h.shape[-1])
    tgt = np.roll(toks, -1, axis=1).reshape(-1)
    nll, top = tl.combine_scores([tl.score_slice(hn, w, 0, tgt)])
    B, T = toks.shape
    return nll.reshape(B, T)[:, :-1], top.reshape(B, T)[:, :-1]


def main(argv=None) -> int:
    a = parse_args(argv)
    reader = smollm2.open_gguf()
    cfg = smollm2.config_of(reader)
    tok = bpe.BPETokenizer.from_gguf(reader)
    w = smollm2.load_weights(reader)
    cods = codecs()
    bf16 = reducers.BF16
    for text in a.texts:
        toks = tokens(tok, text, a.sequences, a.seq_len)
        emb = w["token_embd.weight"][toks]
        t0 = time.perf_counter()
        full = tl.make_shard(w, cfg, 0, 1)
        h_ref = forward([full], cfg, emb, lambda p: p[0])
        nll_ref, top_ref = score(h_ref, w["output.weight"], w["output_norm.weight"], cfg.rms_eps, toks)
        ppl_ref = float(np.exp(nll_ref.mean()))
        print(f"# {text}: {toks.shape} tokens, unsplit ppl {ppl_ref:.3f} ({time.perf_counter() - t0:.1f} s)",
              flush=True)
        for P in a.P:
            shards = [tl.make_shard(w, cfg, r, P) for r in range(P)]
            for v in a.variants:
                key, kw = VARIANTS[v]
                kw = dict(kw)
                if kw.get("residual_dtype") == "bf16":
                    kw["residual_dtype"] = bf16
                red = SimTwoShot(cods[key], P, in_dtype=bf16, calls_per_pass=2 * cfg.n_layers, **kw)
                t1 = time.perf_counter()
                h = forward(shards, cfg, emb, red)
                nll, top = score(h, w["output.weight"], w["output_norm.weight"], cfg.rms_eps, toks)
                ppl = float(np.exp(nll.mean()))
                rounds = kw.get("rounds", 1)
                bits = cods[key].bits(rounds) + (cods[key].quantizer(rounds).bits() / (2 * cfg.n_layers)
                                                 if kw.get("flush") else 0)
                rec = dict(text=text, P=P, variant=v, codec=key, bits=round(bits, 3), ppl=ppl, ppl_ref=ppl_ref,
                           dppl=ppl / ppl_ref - 1, agree=float((top == top_ref).mean()),
                           wall_s=time.perf_counter() - t1)
                print(f"| {text} | P={P} | {v} | {bits:.2f} | {rec['dppl']:+.2%} | {rec['agree']:.2%} | "
                      f"{rec['wall_s']:.0f} s |", flush=True)
                if a.json:
                    with open(a.json, "a") as f:
                        f.write(json.dumps(rec) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
