#!/usr/bin/env bash
# Run a command with the CUDA MPS control daemon up, then stop it: the kernels of several
# processes on one GPU then run at once (without MPS they take turns), which is what the fused
# kernels of ranks sharing a GPU need to be timed (tools/fused_bench.py). No other process may
# hold a CUDA context on the GPU meanwhile: the clients then hang (seen on the H200: e.g. when
# started from a pytest process that already ran GPU tests), so give the command a timeout.
#   bash tools/with_mps.sh [--percent N] CMD [ARGS...]
# --percent: CUDA_MPS_ACTIVE_THREAD_PERCENTAGE for the clients (each process gets N% of the SMs).
# Pipe and log directories under $TMPDIR (or /tmp); the command's exit status is returned.
set -uo pipefail
if [[ ${1:-} == --percent ]]; then export CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=${2:?--percent N}; shift 2; fi
[[ $# -gt 0 ]] || { echo "usage: with_mps.sh [--percent N] CMD [ARGS...]"; exit 2; }
base=$(mktemp -d "${TMPDIR:-/tmp}/mps.XXXXXX")
export CUDA_MPS_PIPE_DIRECTORY=$base/pipe CUDA_MPS_LOG_DIRECTORY=$base/log
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d || { echo "with_mps.sh: could not start nvidia-cuda-mps-control"; exit 2; }
"$@"
status=$?
echo quit | nvidia-cuda-mps-control
if [[ $status != 0 ]]; then   # what MPS said, e.g. a client refused because a non-MPS process holds the GPU
  echo "with_mps.sh: '$*' exited with $status; MPS logs:" >&2
  tail -n 5 "$CUDA_MPS_LOG_DIRECTORY"/*.log >&2
fi
exit $status
