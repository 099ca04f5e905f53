"""A tensor-parallel numpy Llama forward pass (float32), split like Megatron-LM.

Each rank holds only its shard of every block:

* attention: its query heads (rows of ``attn_q``), the key/value heads those
  queries read (rows of ``attn_k``/``attn_v``) and the matching columns of
  ``attn_output``: the block ends with a partial sum over its heads;
* MLP: its columns of ``ffn_gate``/``ffn_up`` (rows of the numpy matrices) and
  the matching input columns of ``ffn_down``: a partial sum over its neurons.

Both partial sums go through ``all_reduce`` (a callable) and are added into
the residual stream: 2 all-reduces per layer. Query heads are split into
contiguous, as-even-as-possible blocks (`head_split`); when a rank's query
heads straddle two key/value groups (GQA), the key/value heads they read are
replicated on each rank that needs them. Embedding and final norm are
replicated; the LM head is split by vocabulary rows (`score_slice`).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from smollm2 import LlamaConfig

_F32 = np.float32


def head_split(n_heads: int, nranks: int) -> list[np.ndarray]:
    """Query heads of each rank: contiguous blocks, sizes differing by at most one."""
    return np.array_split(np.arange(n_heads), nranks)


def kv_heads_for(q_heads: np.ndarray, cfg: LlamaConfig) -> np.ndarray:
    """The key/value heads the query heads ``q_heads`` read (GQA: head j reads j // group)."""
    return np.unique(q_heads // (cfg.n_heads // cfg.n_kv_heads))


@dataclass
class Shard:
    """One rank's weights: ``layers`` is a list of dicts of float32 arrays."""

    q_heads: np.ndarray
    kv_heads: np.ndarray
    kv_of_q: np.ndarray  # local kv index of each local query head
    layers: list


def _rows(w: np.ndarray, heads: np.ndarray, d: int) -> np.ndarray:
    idx = (heads[:, None] * d + np.arange(d)).reshape(-1)
    return np.ascontiguousarray(w[idx])


def make_shard(weights: dict, cfg: LlamaConfig, rank: int, nranks: int) -> Shard:
    """Rank ``rank``'s shard of ``nranks`` (``nranks = 1``: the unsplit model)."""
    d = cfg.head_dim
    q = head_split(cfg.n_heads, nranks)[rank]
    kv = kv_heads_for(q, cfg)
    kv_of_q = np.searchsorted(kv, q // (cfg.n_heads // cfg.n_kv_heads))
    cols = np.array_split(np.arange(cfg.ffn), nranks)[rank]
    layers = []
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        qidx = (q[:, None] * d + np.arange(d)).reshape(-1)
        layers.append(dict(
            attn_norm=weights[p + "attn_norm.weight"], ffn_norm=weights[p + "ffn_norm.weight"],
            wq=_rows(weights[p + "attn_q.weight"], q, d),
            wk=_rows(weights[p + "attn_k.weight"], kv, d),
            wv=_rows(weights[p + "attn_v.weight"], kv, d),
            wo=np.ascontiguousarray(weights[p + "attn_output.weight"][:, qidx]),
            wg=np.ascontiguousarray(weights[p + "ffn_gate.weight"][cols]),
            wu=np.ascontiguousarray(weights[p + "ffn_up.weight"][cols]),
            wd=np.ascontiguousarray(weights[p + "ffn_down.weight"][:, cols])))
    return Shard(q, kv, kv_of_q, layers)


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + _F32(eps))) * w


def rope_tables(n_pos: int, cfg: LlamaConfig) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin of shape (n_pos, head_dim/2): pair i turns by pos * base**(-2i/head_dim)."""
    inv = cfg.rope_base ** (-np.arange(0, cfg.head_dim, 2, dtype=np.float64) / cfg.head_dim)
    ang = np.arange(n_pos, dtype=np.float64)[:, None] * inv
    return np.cos(ang).astype(_F32), np.sin(ang).astype(_F32)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate adjacent pairs (2i, 2i+1) of ``x`` (B, heads, T, head_dim): GGUF's llama layout."""
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = a * cos - b * sin
    out[..., 1::2] = a * sin + b * cos
    return out


def _attention(shard: Shard, lw: dict, h: np.ndarray, cfg: LlamaConfig, cos, sin, mask) -> np.ndarray:
    B, T, _ = h.shape
    d = cfg.head_dim

    def heads(w):  # (B, T, n*d) -> (B, n, T, d)
        return (h @ w.T).reshape(B, T, -1, d).transpose(0, 2, 1, 3)

    q, k, v = apply_rope(heads(lw["wq"]), cos, sin), apply_rope(heads(lw["wk"]), cos, sin), heads(lw["wv"])
    k, v = k[:, shard.kv_of_q], v[:, shard.kv_of_q]
    s = (q @ k.transpose(0, 1, 3, 2)) * _F32(1.0 / np.sqrt(d)) + mask
    s = np.exp(s - s.max(axis=-1, keepdims=True))
    o = (s / s.sum(axis=-1, keepdims=True)) @ v
    return o.transpose(0, 2, 1, 3).reshape(B, T, -1) @ lw["wo"].T


def _mlp(lw: dict, h: np.ndarray) -> np.ndarray:
    g = h @ lw["wg"].T
    return ((g / (1 + np.exp(-g))) * (h @ lw["wu"].T)) @ lw["wd"].T


def forward_blocks(shard: Shard, cfg: LlamaConfig, x: np.ndarray, all_reduce) -> np.ndarray:
    """The residual stream after every block; ``x`` (B, T, hidden) float32 embeddings.

    ``all_reduce(partial) -> total`` sums a (B, T, hidden) float32 partial sum
    over the ranks (identity for the unsplit model). 2 calls per layer.
    """
    T = x.shape[1]
    cos, sin = rope_tables(T, cfg)
    mask = np.triu(np.full((T, T), -np.inf, dtype=_F32), 1)
    x = x.astype(_F32, copy=True)
    for lw in shard.layers:
        x += all_reduce(_attention(shard, lw, rms_norm(x, lw["attn_norm"], cfg.rms_eps), cfg, cos, sin, mask))
        x += all_reduce(_mlp(lw, rms_norm(x, lw["ffn_norm"], cfg.rms_eps)))
    return x


def vocab_slice(vocab: int, rank: int, nranks: int) -> tuple[int, int]:
    b = np.linspace(0, vocab, nranks + 1).astype(int)
    return int(b[rank]), int(b[rank + 1])


def score_slice(h: np.ndarray, w_out: np.ndarray, lo: int, targets: np.ndarray) -> np.ndarray:
    """Partial LM-head statistics of vocabulary rows ``lo : lo + len(w_out)``.

    ``h``: (N, hidden) final-normed states; ``targets``: (N,) token ids.
    Returns (N, 4) float64: max logit, sum of exp(logit - max), argmax id,
    target logit (-inf when the target is outside the slice). `combine_scores`
    merges the slices of all ranks.
    """
    z = (h @ w_out.T).astype(np.float64)
    m = z.max(axis=1)
    se = np.exp(z - m[:, None]).sum(axis=1)
    inside = (targets >= lo) & (targets < lo + w_out.shape[0])
    tl = np.where(inside, z[np.arange(len(h)), np.clip(targets - lo, 0, w_out.shape[0] - 1)], -np.inf)
    return np.stack([m, se, lo + z.argmax(axis=1), tl], axis=1)


def combine_scores(parts: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(negative log-likelihood of each target, argmax token) from every slice's `score_slice`."""
    p = np.stack(parts)  # (slices, N, 4)
    m = p[..., 0].max(axis=0)
    lse = m + np.log((p[..., 1] * np.exp(p[..., 0] - m)).sum(axis=0))
    best = p[..., 0].argmax(axis=0)
    top1 = p[best, np.arange(p.shape[1]), 2].astype(np.int64)
    return lse - p[..., 3].max(axis=0), top1
