#!/usr/bin/env bash
# The two-GPU acceptance run (two H200s, one process per GPU; BENCHMARKS.md sections 1 and 7):
#   bash tools/two_gpu_run.sh OUTDIR
# 1. tools/gpu_suite.sh OUTDIR/suite all: tests, kernel bench, soak, echonccl-perf in the three
#    regimes eager and -G (both NCCL columns), the depth study on the GPU engine;
# 2. the variants that decide the defaults, NVLink and host memory, eager and -G: two_shot and
#    one_shot_q in the default codec and in int4-h32, rounding on (the default is off), float32 and int8 residuals;
# 3. the one-GPU measures against the two-GPU one: the fused kernels with a rank on each GPU,
#    one rank alone (fused_solo) and two ranks sharing GPU 0 under MPS, for the same sizes.
# Every run writes its output (and echonccl-perf its JSON) under OUTDIR; the exit status is 1 if
# any failed. Needs what gpu_suite.sh needs; echonccl comes from this checkout.
set -uo pipefail
out=${1:?usage: two_gpu_run.sh OUTDIR}
mkdir -p "$out" && out=$(cd "$out" && pwd)
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
PY=${PY:-python3}
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
PERF="$PY tools/launch.py -n 2 -m echonccl.perf.all_reduce -b 4M -e 1G -f 4 -n 20 -w 10"
SIZES=(--sizes 16M 64M 256M 1G)
status=0

run() {   # run NAME CMD...: CMD's output to OUTDIR/NAME.txt, its status into $status
  local name=$1; shift
  echo "### $name: $*" | tee "$out/$name.txt"
  "$@" >> "$out/$name.txt" 2>&1 || { status=1; echo "### $name FAILED" | tee -a "$out/$name.txt"; }
}

bash tools/gpu_suite.sh "$out/suite" all || status=1

for regime in nvlink p2p; do
  env=(env)
  [[ $regime == p2p ]] && env=(env NCCL_P2P_DISABLE=1)
  for mode in eager graph; do
    g=()
    [[ $mode == graph ]] && g=(-G 5 -c 0)
    tag=${regime}_$mode
    for codec in int4-h32/int7-h32 int4-h32; do
      c=${codec//\//_}
      run "perf_${tag}_$c" "${env[@]}" $PERF --algo two_shot,one_shot_q --codec "$codec" "${g[@]}" -J "$out/perf_${tag}_$c.json"
    done
    run "perf_${tag}_rounding_on" "${env[@]}" ECHONCCL_FEEDBACK_ROUNDING=1 $PERF --algo two_shot "${g[@]}" \
        -J "$out/perf_${tag}_rounding_on.json"
    for rd in float32 int8; do
      run "perf_${tag}_res_$rd" "${env[@]}" $PERF --algo two_shot --residual "$rd" "${g[@]}" -J "$out/perf_${tag}_res_$rd.json"
    done
  done
done

for codec in int4-h32/int7-h32 int4-h32; do
  c=${codec//\//_}
  run "fused_2gpu_$c" $PY tools/launch.py -n 2 tools/fused_bench.py --codec "$codec" "${SIZES[@]}" \
      --kernels whole general q_whole --iters 20
  run "fused_solo_$c" env PYTHONPATH="$PYTHONPATH:$root/tools" $PY tools/fused_solo.py --ranks 2 --codec "$codec" \
      "${SIZES[@]}" --kernels whole general q_whole --iters 20
  run "fused_mps_$c" env CUDA_VISIBLE_DEVICES=0 bash tools/with_mps.sh $PY tools/launch.py -n 2 tools/fused_bench.py \
      --codec "$codec" "${SIZES[@]}" --kernels whole general q_whole --iters 20
done
exit $status
