#!/usr/bin/env bash
# The GPU acceptance run on a 2-GPU host: tests, kernel bandwidth (and the fused kernel's times),
# soak, echonccl-perf in three regimes (eager and CUDA graph), the depth study on the GPU engine.
#   bash tools/gpu_suite.sh OUTDIR [tests|kernels|soak|perf|accuracy|all]      (from any directory)
# Needs cupy, mpi4py, NCCL and an MPI launcher already installed, nothing else: echonccl comes from
# this checkout (PYTHONPATH). ECHONCCL_DEV_INSTALLED=1 runs against the installed (pip install .,
# non-editable) copy instead, from outside the checkout, and stops if there is none.
# PERF_ARGS overrides the perf sweep (e.g. add --rounds 2); REGIMES and SOCK_ARGS narrow it. Every multi-rank run goes through tools/launch.py, which sets
# NCCL_NVLS_ENABLE=0 and forwards it and PYTHONPATH (Open MPI: -x); $MPIEXEC picks the launcher.
set -uo pipefail
usage="usage: gpu_suite.sh OUTDIR [tests|kernels|soak|perf|accuracy|all]"
out=${1:?$usage}
what=${2:-all}
mkdir -p "$out" && out=$(cd "$out" && pwd)
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
PY=${PY:-python3}
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
if [[ ${ECHONCCL_DEV_INSTALLED:-} == 1 ]]; then
  # from outside the checkout, so that its echonccl/ cannot shadow the installed one
  where=$(cd / && "$PY" -c 'import echonccl; print(echonccl.__file__)' 2>&1) \
    || { echo "gpu_suite: ECHONCCL_DEV_INSTALLED=1 but $PY cannot import an installed echonccl (pip install .): ${where##*$'\n'}"; exit 2; }
  case $where in "$root"/*) echo "gpu_suite: ECHONCCL_DEV_INSTALLED=1 but echonccl is this checkout's ($where)"; exit 2 ;; esac
  echo "gpu_suite: echonccl installed at $where"
else
  # this checkout's echonccl, whether or not (or whatever) echonccl is installed
  export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
  where=$(cd / && "$PY" -c 'import echonccl; print(echonccl.__file__)' 2>&1) \
    || { echo "gpu_suite: $PY cannot import echonccl from $root (it needs numpy, ml_dtypes, mpi4py): ${where##*$'\n'}"; exit 2; }
  echo "gpu_suite: echonccl from this checkout: $where"
fi
LAUNCH="$PY $root/tools/launch.py -n 2"
PERF_ARGS=${PERF_ARGS:--b 8 -e 1G -f 4 -d bfloat16 -n 20 -w 5 --algo auto,two_shot,ring}
status=0

if [[ $what == tests || $what == all ]]; then
  nvidia-smi topo -m
  tests=(tests/test_gpu_kernels.py tests/test_gpu_single.py tests/test_gpu_solo.py tests/test_nccl_binding.py
         tests/test_gpu_nccl_symmetric.py tests/test_gpu_multirank.py tests/test_gpu_hardening.py tests/test_examples.py)
  if [[ ${ECHONCCL_DEV_INSTALLED:-} == 1 ]]; then
    # pytest from a scratch directory: only tools/ and tests/ of the checkout are on the path
    (cd "$out" && "$PY" -m pytest -q -ra --durations=12 -p no:cacheprovider -c "$root/pyproject.toml" --rootdir "$root" \
        "${tests[@]/#/$root/}") || status=1
  else
    "$PY" -m pytest -q -ra --durations=12 "${tests[@]}" || status=1
  fi
  # On one GPU, under MPS (which no pytest process may hold the GPU beside), after pytest:
  # a rank a call ahead of a slow peer (tests/mpi/checks.py check_fused_skew) races only when the
  # ranks' kernels run at once; and four and eight ranks' fused kernels against the reference
  # (pytest's test_gpu_single skips them on one GPU: taking turns, they wait a time slice a flag).
  if [[ $("$PY" -c 'import cupy; print(cupy.cuda.runtime.getDeviceCount())') -lt 2 ]]; then
    timeout 120 bash "$root/tools/with_mps.sh" $LAUNCH "$root/tests/mpi/checks.py" fused_skew gpu || status=1
    for n in 4 8; do
      timeout 300 bash "$root/tools/with_mps.sh" "$PY" "$root/tools/launch.py" -n $n "$root/tests/mpi/checks.py" \
          fused_reference gpu || status=1
    done
  fi
fi
if [[ $what == kernels || $what == all ]]; then
  "$PY" tools/kernel_bench.py || status=1
  # the fused two-shot alone (no NCCL): two ranks on two GPUs, or sharing one under MPS
  fb=("$PY" tools/launch.py -n 2 tools/fused_bench.py --sizes 16M 256M 1G)
  if [[ $("$PY" -c 'import cupy; print(cupy.cuda.runtime.getDeviceCount())') -ge 2 ]]; then "${fb[@]}" || status=1
  else bash tools/with_mps.sh "${fb[@]}" || status=1; fi
fi
if [[ $what == soak || $what == all ]]; then
  # a fresh size on most calls (over 1000 distinct sizes): memory must stay flat after warm-up
  $LAUNCH tools/soak.py --engine gpu --calls 3000 --distinct-sizes 0 --max-bytes 64M --seconds 150 || status=1
fi
if [[ $what == perf || $what == all ]]; then
  # REGIMES picks regimes and modes (default: all three, eager and -G); SOCK_ARGS overrides
  # PERF_ARGS over sockets (slow at large sizes)
  for regime in ${REGIMES:-nvlink nvlink_graph p2p p2p_graph sock sock_graph}; do
    case $regime in
      nvlink*) env=() ;;
      p2p*) env=(NCCL_P2P_DISABLE=1) ;;
      sock*) env=(NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1) ;;
    esac
    args=$PERF_ARGS
    [[ $regime == sock* && -n ${SOCK_ARGS:-} ]] && args=$SOCK_ARGS
    graph=""
    [[ $regime == *_graph ]] && graph="-G 5 -c 0"
    echo "### regime $regime: ${env[*]} $LAUNCH -m echonccl.perf.all_reduce $args $graph"
    env "${env[@]}" $LAUNCH -m echonccl.perf.all_reduce $args $graph \
        -J "$out/$regime.json" --plot "$out/$regime.png" || status=1
  done
fi
if [[ $what == accuracy || $what == all ]]; then
  # The model study needs no GPU run: the GPU engine is bit-exact with the CPU reference
  # (ACCURACY.md); the depth study checks the GPU engine's error stays bounded with depth.
  $LAUNCH studies/accuracy_depth.py --engine gpu --layers 128 --check --json "$out/depth_gpu.json" || status=1
fi
exit $status
