"""The programs of mpi_examples/ run as they stand under mpiexec: exit status 0 and their key output lines.

CPU runs force the CPU engine (ECHONCCL_ENGINE=cpu) so the tests mean the same on any machine, and one
BLAS thread per rank (the ranks share the cores). GPU runs are skipped without two GPUs (and PyTorch,
for torch_interop.py).
"""
from __future__ import annotations

import importlib.util
import re

import pytest

pytestmark = pytest.mark.mpi


from conftest import visible_gpus


@pytest.fixture
def cpu(monkeypatch):
    monkeypatch.setenv("ECHONCCL_ENGINE", "cpu")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


def run_ok(mpirun, n, args, timeout=120):
    res = mpirun(n, args, timeout)
    assert res.returncode == 0, f"exit {res.returncode}\n{res.stdout[-4000:]}\n{res.stderr[-4000:]}"
    return res.stdout


def rel_errors(out: str) -> list[float]:
    return [float(v) for v in re.findall(r"relative (?:error|difference) ([0-9.]+)", out)]


@pytest.mark.parametrize("n", [2, 3])
def test_hello(mpirun, cpu, n):
    out = run_ok(mpirun, n, ["mpi_examples/hello_allreduce.py"])
    assert f"{n} ranks on cpu: 4-bit all-reduce of 1048576 float32" in out, out
    (err,) = rel_errors(out)
    assert 0 < err < 0.2, out                     # one 4-bit quantization of Gaussian data: ~0.12


def test_demo_shows_feedback_keeps_the_stream_error_flat(mpirun, cpu):
    out = run_ok(mpirun, 2, ["mpi_examples/demo_allreduce.py"])
    rows = {}
    for line in out.splitlines():
        for name in ("16-bit sum (NCCL)", "plain 4-bit, no feedback", "echonccl + feedback"):
            if line.startswith(name):
                rows[name] = [float(v) for v in line[len(name):].split()]
    assert len(rows) == 3, out
    bf16, plain, echo = rows.values()
    assert bf16[0] == 16 and plain[0] == echo[0] == 6.25, out         # wire bits: (4.5 + 8) / 2
    assert plain[-1] > 3 * plain[1], out                                # plain 4-bit: grows with depth
    assert echo[-1] <= echo[1] and echo[-1] < plain[-1] / 5, out        # feedback: one call's error
    assert bf16[-1] < echo[-1], out
    assert "one all-reduce of 65536 bfloat16: echonccl" in out, out


@pytest.mark.skipif(visible_gpus() > 0, reason="a GPU is visible: engine auto would pick it")
def test_hello_auto_engine_is_cpu_without_gpu(mpirun, monkeypatch):
    monkeypatch.delenv("ECHONCCL_ENGINE", raising=False)
    out = run_ok(mpirun, 2, ["mpi_examples/hello_allreduce.py"])
    assert "2 ranks on cpu:" in out, out


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_tp_transformer_block(mpirun, cpu, dtype):
    out = run_ok(mpirun, 2, ["mpi_examples/tp_transformer_block.py", "--dtype", dtype, "--iters", "1"])
    assert f"8 blocks, hidden 256, 8 heads, seq 64, {dtype}, 2 ranks on cpu" in out, out
    names = ("MPI", "4-bit + shared feedback", "4-bit + feedback + flush", "2 rounds + feedback", "4-bit, no feedback")
    lines = {name: line for name in names for line in out.splitlines() if line.strip().startswith(name)}
    assert len(lines) == 5, out
    assert all("passes identical: True" in line for line in lines.values()), out
    (base,), (echo,), (flush,), (two,), (plain,) = (rel_errors(lines[k]) for k in names)
    assert base == 0.0, out
    assert 0 < echo < 0.05, out                   # ~0.014 (bf16), ~0.011 (fp32)
    assert echo < plain / 2, out                  # shared feedback: well below plain 4-bit (~0.036)
    assert flush < 0.85 * echo, out               # the last call flushed: ~0.75x (bf16), ~0.42x (fp32)
    assert two < echo / 1.5, out                  # a second round: 2x closer (bf16 stream), 14x (fp32)


def test_tp_transformer_block_uneven_heads(mpirun, cpu):
    out = run_ok(mpirun, 3, ["mpi_examples/tp_transformer_block.py", "--layers", "2", "--iters", "1"])
    assert "2 blocks, hidden 256, 8 heads, seq 64, bfloat16, 3 ranks on cpu" in out, out


@pytest.mark.parametrize("n,extra", [(2, []), (3, ["--steps", "8", "--save-at", "3"])])
def test_checkpoint_feedback(mpirun, cpu, tmp_path, n, extra):
    out = run_ok(mpirun, n, ["mpi_examples/checkpoint_feedback.py", "--dir", str(tmp_path), *extra])
    assert "with the saved feedback state: match (bit for bit" in out, out
    assert "with a fresh feedback state:   differs" in out, out
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"feedback_rank{r:05d}.npz" for r in range(n)]


# -- GPU (skipped here; two GPUs needed) ---------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(visible_gpus() < 2, reason="needs cupy and two GPUs")
@pytest.mark.parametrize("args", [["mpi_examples/hello_allreduce.py"],
                                  ["mpi_examples/tp_transformer_block.py", "--iters", "1"],
                                  ["mpi_examples/checkpoint_feedback.py"]])
def test_examples_gpu(mpirun, monkeypatch, args):
    monkeypatch.setenv("ECHONCCL_ENGINE", "gpu")
    out = run_ok(mpirun, 2, args, timeout=600)
    assert "on gpu" in out, out
    assert "MISMATCH" not in out, out


@pytest.mark.gpu
@pytest.mark.skipif(visible_gpus() < 2, reason="needs cupy and two GPUs")
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs PyTorch")
def test_torch_interop(mpirun):
    out = run_ok(mpirun, 2, ["mpi_examples/torch_interop.py"], timeout=600)
    assert "echonccl modules using torch: none" in out, out
    assert out.rstrip().endswith("OK"), out
    assert all(e < 0.2 for e in rel_errors(out)) and len(rel_errors(out)) == 3, out
