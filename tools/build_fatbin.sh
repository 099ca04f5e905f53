#!/usr/bin/env bash
# Build cuda_src/echo_kernels.fatbin (sm_80 + sm_90 SASS, compute_90 PTX for newer GPUs).
# echonccl.kernels_cuda loads it when present (else it compiles the source with NVRTC).
# Usage: tools/build_fatbin.sh [output path]   (NVCC=... to pick the compiler)
set -euo pipefail
cd "$(dirname "$0")/.."
NVCC="${NVCC:-nvcc}"
OUT="${1:-cuda_src/echo_kernels.fatbin}"
mkdir -p "$(dirname "$OUT")"
"$NVCC" -fatbin --fmad=false -ftz=false -prec-div=true -prec-sqrt=true -std=c++17 \
    -gencode arch=compute_80,code=sm_80 \
    -gencode arch=compute_90,code=sm_90 \
    -gencode arch=compute_90,code=compute_90 \
    -o "$OUT" cuda_src/echo_kernels.cu
# Fingerprint of the sources the fatbin was built from: kernels_cuda ignores a
# fatbin whose fingerprint does not match the sources next to it (stale build).
python3 - "$OUT" <<'PY'
import hashlib, pathlib, sys
h = hashlib.sha256()
for name in ("codec.cuh", "echo_kernels.cu"):
    h.update(pathlib.Path("cuda_src", name).read_bytes())
pathlib.Path(sys.argv[1] + ".sha256").write_text(h.hexdigest() + "\n")
PY
echo "built $OUT"
