#!/usr/bin/env bash
# One device session for the fused peer-memory path (issue 12) on a 2-GPU host: correctness
# (fused vs the NCCL path, GPU vs CPU reference, graph replay, rounds), then echonccl-perf
# over NVLink for kernel variants, then the full sweep eager and -G. Logs under $OUT.
#   OUT=dir bash tools/fused_device_run.sh [STEP[,STEP...]|all]
#   steps: check host variants ncclpath sweep primitives exchange timeline
# (primitives and exchange are the NCCL path's, issue 14: nccl-tests binaries in build/nccl-tests,
# built here against the NCCL of the device image; see BENCHMARKS.md.)
# Prebuilt fatbins (fb/*.fatbin, built with nvcc here) skip NVRTC; see BENCHMARKS.md "Fused path".
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}
OUT=${OUT:-/tmp/fused-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD:$PWD/tools${PYTHONPATH:+:$PYTHONPATH} NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 ECHONCCL_TIMEOUT=${ECHONCCL_TIMEOUT:-30}
[[ -f fb/echo.fatbin ]] && export ECHONCCL_FATBIN=$PWD/fb/echo.fatbin
[[ -f fb/fused.fatbin ]] && export ECHONCCL_FUSED_FATBIN=${ECHONCCL_FUSED_FATBIN:-$PWD/fb/fused.fatbin}
PY=${PY:-python3}
MPI="mpirun --allow-run-as-root --bind-to none -np 2"
for v in PYTHONPATH NCCL_NVLS_ENABLE PYTHONUNBUFFERED ECHONCCL_TIMEOUT ECHONCCL_FATBIN ECHONCCL_FUSED_FATBIN \
         ECHONCCL_FUSED_BLOCKS_PER_SM; do MPI+=" -x $v"; done
status=0
want() { [[ $what == all || ,$what, == *,$1,* ]]; }
step() {  # step NAME TIMEOUT CMD...
  local name=$1 t=$2; shift 2
  local t0=$SECONDS
  timeout "$t" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "step $name rc=$rc $((SECONDS - t0))s"
  [[ $rc == 0 ]] || { status=1; tail -25 "$OUT/$name.log"; }
  return $rc
}
if want check; then
  nvidia-smi topo -m | head -4
  step kernels 300 $PY -m pytest -q -x tests/test_gpu_kernels.py; tail -1 "$OUT/kernels.log"
  for c in fused fused_reference matches_reference rounds graph_replay; do
    step "check_$c" 300 $MPI $PY tests/mpi/checks.py $c gpu
  done
  step hardening_replay 300 $MPI $PY tests/mpi/hardening.py replay gpu
fi
if want variants; then
  # VARIANTS="fatbin:blocks_per_sm:tiles:residual ..." (tiles 0: the default)
  for v in ${VARIANTS:-A:4:0:input}; do
    IFS=: read -r fbn bps tiles res <<<"$v"
    name="variant_${fbn}_${bps}_${tiles}_${res}"
    ECHONCCL_FUSED_FATBIN=$PWD/fb/fused$fbn.fatbin ECHONCCL_FUSED_BLOCKS_PER_SM=$bps ECHONCCL_FUSED_TILES=${tiles/#0/} \
      step "$name" 240 $MPI -x ECHONCCL_FUSED_TILES \
        $PY -m echonccl.perf.all_reduce -b ${VB:-1M} -e ${VE:-1G} -f 4 -n 20 -w 5 -c 0 --algo two_shot --residual "$res" --quiet
    grep -E "^ +[0-9]" "$OUT/$name.log" | awk -v v="$v" '{printf "%-24s %11s NCCL %8s fused %8s x%s\n", v, $1, $4, $10, $13}'
  done
fi
if want host; then
  step host_profile 120 $MPI $PY tools/host_profile.py
  grep -E "host time|tottime|^ +[0-9]+ +[0-9.]+ +[0-9.]+" "$OUT/host_profile.log" | head -30
fi
if want ncclpath; then
  # the NCCL send/recv path (ECHONCCL_FUSED=0): replays bitwise (graphs), host time, then
  # NCCL_P2P_DISABLE=1 (host memory), where only that path runs
  ECHONCCL_FUSED=0 step replay_nccl 300 $MPI -x ECHONCCL_FUSED $PY tests/mpi/hardening.py replay gpu
  ECHONCCL_FUSED=0 step host_nccl 120 $MPI -x ECHONCCL_FUSED $PY tools/host_profile.py --profile two_shot
  grep "host time" "$OUT/host_nccl.log"
  ECHONCCL_FUSED=0 ECHONCCL_GRAPH_SCHEDULES=0 step host_nccl_nograph 120 $MPI -x ECHONCCL_FUSED \
      -x ECHONCCL_GRAPH_SCHEDULES $PY tools/host_profile.py --profile two_shot
  grep "host time" "$OUT/host_nccl_nograph.log"
  NCCL_P2P_DISABLE=1 step p2p_eager 400 $MPI -x NCCL_P2P_DISABLE $PY -m echonccl.perf.all_reduce -b 8 -e ${P2P_E:-256M} -f 4 -n 20 -w 5 \
      --algo two_shot,auto --quiet -J "$OUT/p2p_eager.json"
  grep -E "^ +[0-9]" "$OUT/p2p_eager.log" | awk '{printf "%11s NCCL %9s two_shot %9s x%-5s auto %9s x%s\n", $1, $4, $10, $13, $18, $21}'
fi
if want sweep; then
  step sweep_eager 400 $MPI $PY -m echonccl.perf.all_reduce -b 8 -e 1G -f 4 -n 20 -w 5 --algo two_shot,one_shot,auto \
      --quiet -J "$OUT/nvlink_eager.json"
  step sweep_graph 400 $MPI $PY -m echonccl.perf.all_reduce -b 8 -e 1G -f 4 -n 20 -w 5 -G 5 -c 0 \
      --algo two_shot,one_shot,auto --quiet -J "$OUT/nvlink_graph.json"
  grep -E "^ +[0-9]|speed|#" "$OUT/sweep_eager.log" | tail -30
  grep -E "^ +[0-9]" "$OUT/sweep_graph.log" | tail -20
fi
if want primitives; then
  # NCCL's own all-reduce, all-gather and send/recv (nccl-tests, one process driving both GPUs)
  # in the regimes where the NCCL path runs; SOCK_TUNE: the socket settings tried besides NCCL's defaults.
  nlib=$($PY -c 'import nvidia.nccl as m, os; print(os.path.join(list(m.__path__)[0], "lib"))')
  for regime in ${PRIM_REGIMES:-p2p sock sock_tuned}; do
    case $regime in
      p2p) env=(NCCL_P2P_DISABLE=1); args="-b 4M -e 1G -f 4 -n 10 -w 5" ;;
      sock) env=(NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1); args="-b 4M -e 256M -f 4 -n 5 -w 5" ;;
      sock_tuned) env=(NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 ${SOCK_TUNE:-NCCL_NSOCKS_PERTHREAD=4 NCCL_SOCKET_NTHREADS=4})
                  args="-b 4M -e 256M -f 4 -n 5 -w 5" ;;
    esac
    for t in ${PRIM_TESTS:-all_reduce all_gather sendrecv}; do
      (export LD_LIBRARY_PATH="$nlib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "${env[@]}"
       step "nt_${regime}_$t" 150 build/nccl-tests/${t}_perf $args -g 2 -d bfloat16 -c 0) || status=1
      grep -E "^ +[0-9]+ " "$OUT/nt_${regime}_$t.log" | awk -v n="$regime $t" '{printf "%-22s %11s B  %9s us  busbw %7s GB/s\n", n, $1, $6, $8}'
    done
  done
fi
if want exchange; then
  # The NCCL path with its all-gathers as ncclAllGather (default) or as send/recv rounds
  # (ECHONCCL_NCCL_ALLGATHER=0), side by side with NCCL, host memory and sockets.
  for regime in ${EX_REGIMES:-p2p p2p_graph sock}; do
    case $regime in
      p2p*) env=(NCCL_P2P_DISABLE=1); args=${EX_P2P_ARGS:--b 4M -e 1G -f 4 -n 10 -w 5 --algo two_shot,two_shot_pipelined} ;;
      sock*) env=(NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 ${EX_SOCK_ENV:-})
             args=${EX_SOCK_ARGS:--b 16M -e 256M -f 4 -n 5 -w 5 --algo two_shot} ;;
    esac
    graph=""
    [[ $regime == *_graph ]] && graph="-G 5 -c 0"
    for ag in ${EX_AG:-1 0}; do
      [[ $regime == *_graph && $ag == 0 ]] && continue
      xs=""
      for kv in "${env[@]}" ECHONCCL_NCCL_ALLGATHER=$ag; do xs+=" -x ${kv%%=*}"; done
      (export "${env[@]}" ECHONCCL_NCCL_ALLGATHER=$ag
       step "ex_${regime}_ag$ag" 300 $MPI $xs $PY -m echonccl.perf.all_reduce $args $graph --quiet \
           -J "$OUT/ex_${regime}_ag$ag.json") || status=1
      grep -E "^ +[0-9]" "$OUT/ex_${regime}_ag$ag.log" | awk -v n="$regime ag=$ag" '{printf "%-16s %s\n", n, $0}' | cut -c1-170
    done
  done
fi
if want timeline; then
  # The NCCL path through host memory: CUPTI kernel timelines of two_shot and two_shot_pipelined
  # (wheels/: cupti-python and nvidia-cuda-cupti, unzipped here; fetch them where PyPI is reachable:
  #   pip download --no-deps --only-binary=:all: --python-version 3.12 -d wheels \
  #       --platform manylinux2014_x86_64 --platform manylinux_2_25_x86_64 cupti-python==13.0.1 nvidia-cuda-cupti==13.0.85
  # ), then the pipelined schedule with the codec kernels' grids capped (ECHONCCL_CODEC_MAX_BLOCKS; 0 = no cap).
  tl=/tmp/cupti-wheels; mkdir -p $tl
  for w in wheels/*.whl; do $PY -m zipfile -e "$w" $tl; done
  export PYTHONPATH=$PYTHONPATH:$tl LD_LIBRARY_PATH=$tl/nvidia/cu13/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  MPI+=" -x LD_LIBRARY_PATH"
  for kv in ${TL_ENV:-}; do export "${kv?}"; MPI+=" -x ${kv%%=*}"; done   # e.g. TL_ENV="ECHONCCL_COMM_PRIORITY=1"
  for c in ${TL_COUNTS:-134217728 536870912}; do
    for algo in ${TL_ALGOS:-two_shot two_shot_pipelined}; do
      (export NCCL_P2P_DISABLE=1 ECHONCCL_CODEC_MAX_BLOCKS=${TL_CAP:-0}
       step "tl_${algo}_$c" 150 $MPI -x NCCL_P2P_DISABLE -x ECHONCCL_CODEC_MAX_BLOCKS \
           $PY tools/timeline.py --count "$c" --algo "$algo") || status=1
      grep -E "^call" "$OUT/tl_${algo}_$c.log"
    done
  done
  for cap in ${CAPS:-0 264 132 66}; do
    (export NCCL_P2P_DISABLE=1 ECHONCCL_CODEC_MAX_BLOCKS=$cap
     step "cap_$cap" 200 $MPI -x NCCL_P2P_DISABLE -x ECHONCCL_CODEC_MAX_BLOCKS $PY -m echonccl.perf.all_reduce \
         ${CAP_ARGS:--b 64M -e 1G -f 4 -n 10 -w 5 -c 0 --algo two_shot,two_shot_pipelined} --quiet) || status=1
    grep -E "^ +[0-9]" "$OUT/cap_$cap.log" | awk -v n="cap=$cap" '{printf "%-9s %s\n", n, $0}'   # every algorithm's columns
  done
fi
exit $status
