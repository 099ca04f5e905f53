#!/usr/bin/env bash
# Build cuda_src/echo_kernels.fatbin (sm_80 + sm_90 SASS, compute_90 PTX for newer GPUs) and its
# .sha256 source fingerprint; echonccl.kernels_cuda loads it when present (else NVRTC compiles the
# source). The work (flags, fingerprint) is tools/cuda_build.py's; this is `make fatbin` by hand.
# Usage: tools/build_fatbin.sh [output path]   (NVCC=... to pick the compiler, PY=... the Python)
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"   # this checkout's echonccl, installed or not
exec "${PY:-python3}" tools/cuda_build.py fatbin "$@"
