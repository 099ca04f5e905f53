#!/usr/bin/env bash
# The one-GPU acceptance run (one H200; BENCHMARKS.md section 2), in parts that each fit one
# device call of 600 s:
#   bash tools/one_gpu_run.sh OUTDIR tests     tools/gpu_suite.sh OUTDIR/suite tests (the longest part)
#   bash tools/one_gpu_run.sh OUTDIR solo      one rank alone (tools/fused_solo.py), P = 2, 4 and 8,
#                                              16 MiB - 1 GiB, the whole, general and q_whole kernels,
#                                              eager and -G
#   bash tools/one_gpu_run.sh OUTDIR corners   odd counts (the any-count twins) and buffers one element
#                                              off alignment (the general kernel) at P = 2 and 8; the
#                                              MPS proxy (two ranks sharing the GPU) on whole sizes
#                                              and odd counts
#   bash tools/one_gpu_run.sh OUTDIR all       the three (longer than one call)
# Each run writes OUTDIR/NAME.txt under a time limit. At the end: the time tables the runs printed,
# the last lines of any run that failed, then a line a run with its status and seconds. Exit status
# 1 if any run failed. echonccl comes from this checkout, with its prebuilt kernels where built
# (python -m echonccl.build --arch sm_90, or the folder ECHONCCL_KERNEL_DIR names; without them
# each kernel is compiled on first use). For the tests part, a build of every kernel of the table
# (python -m echonccl.build --all --arch sm_90 --out DIR; ECHONCCL_KERNEL_DIR=DIR) compiles none:
# 274 s against 535 on an H100; its kernels' SASS is not the default build's: time the default. Needs
# what gpu_suite.sh needs. BASELINE=DIR (a prebuilt folder built at another commit): the corners'
# misaligned run also times the general kernel as that build left it (fused_solo.py --baseline).
set -uo pipefail
usage="usage: one_gpu_run.sh OUTDIR [tests|solo|corners|all]"
out=${1:?$usage}
what=${2:-all}
case $what in tests|solo|corners|all) ;; *) echo "$usage"; exit 2 ;; esac
mkdir -p "$out" && out=$(cd "$out" && pwd)
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
PY=${PY:-python3}
export PYTHONPATH="$root:$root/tools${PYTHONPATH:+:$PYTHONPATH}" NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
"$PY" -c 'from echonccl import kernel_loader as kl, kernel_table as kt
print(f"one_gpu_run: {len(kl.LOADER.prebuilt_names())} of the {len(kt.ALL)} kernels prebuilt; the rest compile on first use")'
SOLO=("$PY" tools/fused_solo.py --iters 20 --reps 2)
ODD=(--sizes 16M 16777214 256M 268435454 1G 1073741822)
BASE=(${BASELINE:+--baseline "$BASELINE"})
status=0
summary=()
failed=()

run() {   # run NAME SECONDS CMD...: CMD's output to OUTDIR/NAME.txt, stopped after SECONDS
  local name=$1 limit=$2 t0=$SECONDS rc
  shift 2
  echo "### $name: $*" | tee "$out/$name.txt"
  timeout "$limit" "$@" >> "$out/$name.txt" 2>&1
  rc=$?
  [[ $rc == 0 ]] || { status=1; failed+=("$name"); }
  summary+=("| $name | $([[ $rc == 0 ]] && echo ok || echo "FAILED ($rc)") | $((SECONDS - t0)) |")
}

if [[ $what == tests || $what == all ]]; then
  run suite 570 bash tools/gpu_suite.sh "$out/suite" tests
fi
if [[ $what == solo || $what == all ]]; then
  run solo 420 "${SOLO[@]}" --ranks 2 4 8 --sizes 16M 64M 256M 1G --kernels whole general q_whole -G
fi
if [[ $what == corners || $what == all ]]; then
  run odd_counts 200 "${SOLO[@]}" --ranks 2 8 "${ODD[@]}" --kernels whole general -G
  # off alignment every kernel is the general one (the aligned whole kernel: the solo part)
  run misaligned 150 "${SOLO[@]}" --ranks 2 8 --sizes 16M 256M 1G --kernels general --offset 1 "${BASE[@]}"
  run mps_proxy 200 bash tools/with_mps.sh "$PY" tools/launch.py -n 2 tools/fused_bench.py \
      --sizes 16M 64M 256M 1G 16777214 268435454 1073741822 --kernels whole general q_whole --iters 20 --reps 2
fi

for name in solo odd_counts misaligned mps_proxy; do
  # the time tables (a heading, its rows up to the blank line after them), not the bandwidth ones
  [[ -f $out/$name.txt ]] && { echo; echo "## $name"; awk '/^## P =|^# fused kernels/ {print; p = 1; rows = 0; next}
      /^# check/ {print; next} p && /^\|/ {print; rows = 1; next} p && rows && /^$/ {p = 0}' "$out/$name.txt"; }
done
[[ -f $out/suite.txt ]] && { echo; echo "## suite"; grep -E '^[0-9]+ (passed|failed)|^(FAILED|ERROR) |OK fused' "$out/suite.txt" | tail -n 8; }
for name in "${failed[@]}"; do echo; echo "## $name failed: the end of $out/$name.txt"; tail -n 6 "$out/$name.txt"; done
echo
echo "| run | status | s |"
echo "|---|---|---:|"
printf '%s\n' "${summary[@]}"
exit $status
