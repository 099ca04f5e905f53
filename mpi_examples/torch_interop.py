"""PyTorch tensors through echonccl (DLPack / CUDA array interface, zero-copy), and an autograd Function.

    mpirun -np 2 python mpi_examples/torch_interop.py                 # GPU only: PyTorch with CUDA, cupy
    mpirun -np 2 python mpi_examples/torch_interop.py --dtype float32

echonccl imports no PyTorch: it reads the tensors' memory in place. The calls
run on PyTorch's current CUDA stream (``stream=``), so they are ordered with
the surrounding PyTorch work, and return without synchronizing the host.

``AllReduce4bit`` sums a tensor over the ranks in forward (with a forward
`Feedback`) and sums its gradient over the ranks in backward (with a separate
backward `Feedback`): the adjoint of the sum when each rank's copy of the
output feeds its own part of the loss. In a Megatron-style block the same two
collectives sit at the row-parallel output (forward) and at the
column-parallel input (backward). One state per direction, reset at the start
of each pass; the check compares both directions with ``baseline_all_reduce``.
"""
import argparse
import sys

try:
    import torch
except ImportError:
    sys.exit("torch_interop.py needs PyTorch with CUDA (pip install torch)")
if not torch.cuda.is_available():
    sys.exit("torch_interop.py needs a CUDA GPU (one per rank) and PyTorch built with CUDA")

from mpi4py import MPI

import echonccl

p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
p.add_argument("--tokens", type=int, default=4096)
p.add_argument("--hidden", type=int, default=4096)
args = p.parse_args()

comm = echonccl.Communicator(engine="gpu", algorithm="two_shot")   # always 4-bit
torch.cuda.set_device(comm.engine.device.id)                       # the GPU echonccl picked
dev, dtype = torch.device("cuda", comm.engine.device.id), getattr(torch, args.dtype)


def stream():
    return torch.cuda.current_stream().cuda_stream                # cudaStream_t, an int


def all_reduce(t, fb):
    """Sum of ``t`` over the ranks into a new tensor, on PyTorch's current stream."""
    t = t.detach().contiguous()                                    # echonccl reads raw memory
    out = torch.empty_like(t)
    comm.all_reduce(t, out, feedback=fb, stream=stream())
    return out


class AllReduce4bit(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fb_forward, fb_backward):
        ctx.fb_backward = fb_backward
        return all_reduce(x, fb_forward)

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad, ctx.fb_backward), None, None


def rel(a, b):
    a, b = a.detach().float(), b.detach().float()
    return (torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b)).item()


# 1. Plain tensors, in place: x becomes the sum over ranks.
g = torch.Generator(device=dev).manual_seed(comm.rank)
x = torch.randn(args.tokens, args.hidden, device=dev, dtype=dtype, generator=g)
ref = torch.empty_like(x)
comm.baseline_all_reduce(x, ref, stream=stream())
comm.all_reduce(x, x, feedback=False, stream=stream())
err_inplace = rel(x, ref)                                          # .item() waits for the stream

# 2. The autograd Function: forward sums the partials, backward sums the gradients.
fb_fwd, fb_bwd = comm.new_feedback(), comm.new_feedback()
partial = torch.randn(args.tokens, args.hidden, device=dev, dtype=dtype, generator=g).requires_grad_()
weight = torch.randn(args.tokens, args.hidden, device=dev, dtype=dtype, generator=g)  # differs per rank
fb_fwd.reset()                                                     # a new forward pass
y = AllReduce4bit.apply(partial, fb_fwd, fb_bwd)
loss = (y.float() * weight.float()).sum()                          # this rank's part of the loss
fb_bwd.reset()                                                     # a new backward pass
loss.backward()                                                    # d loss_total / d partial = sum of weights

y_ref = torch.empty_like(y)
comm.baseline_all_reduce(partial.detach(), y_ref, stream=stream())
g_ref = torch.empty_like(weight)
comm.baseline_all_reduce(weight, g_ref, stream=stream())
err_fwd, err_bwd = rel(y, y_ref), rel(partial.grad, g_ref)

torch.cuda.synchronize()
uses_torch = [n for n, m in list(sys.modules.items()) if n.startswith("echonccl") and "torch" in vars(m)]
ok = MPI.COMM_WORLD.allreduce(max(err_inplace, err_fwd, err_bwd), op=MPI.MAX) < 0.2   # on every rank
if comm.rank == 0:
    print(f"{comm.size} ranks, torch {torch.__version__}, {args.tokens}x{args.hidden} {args.dtype} tensors "
          f"on {comm.engine.describe()}; echonccl modules using torch: {uses_torch or 'none'}")
    print(f"  in-place all_reduce(x, x):      relative error {err_inplace:.4f} vs NCCL")
    print(f"  AllReduce4bit forward:          relative error {err_fwd:.4f} vs NCCL")
    print(f"  AllReduce4bit backward (grad):  relative error {err_bwd:.4f} vs NCCL")
    print("OK" if ok else "FAILED: error above 0.2")
comm.close()
sys.exit(0 if ok else 1)
