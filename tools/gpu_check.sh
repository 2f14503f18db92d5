#!/usr/bin/env bash
# The one command a GPU session runs (docs/cuda.md, "Paths unexercised until a GPU run" and
# "A GPU session, step by step"):
#   bash tools/gpu_check.sh                       # every step, from the repository root
#   GPU_CHECK_STEPS="build backend cuda-cases" bash tools/gpu_check.sh   # some steps only
# Steps, in order (GPU_CHECK_STEPS picks a subset; the order stays this one):
#   build              build the extension in place with CUDA (MP_WRAPPERS_CUDA=1, so any reason
#                      not to is an error; TORCH_CUDA_ARCH_LIST defaults to the visible GPU's arch)
#   backend            assert mp_wrappers.ops.backend()['cuda'] == 'cuda'
#   cuda-cases         the CUDA test cases, MP_WRAPPERS_TEST_REQUIRE_CUDA=1 (a CUDA case that would
#                      skip fails), tests/kernels/test_cuda_paths.py included (split launches, 2^31
#                      elements, offsets, side stream, graph capture, the fused O2 step under
#                      torch.cuda.set_sync_debug_mode('error'))
#   compiled-step      the CUDA cases of the torch.compile tests (MP_WRAPPERS_TEST_REQUIRE_CUDA=1):
#                      every fused optimizer's step and the wrappers' fused step through inductor,
#                      and replayed as CUDA graphs (mode='reduce-overhead') with no graph skipped
#   bench-quantized    benchmarks/bench_quantized_states.py --device cuda on 108M params: 8-bit and
#                      fp32 states (FusedAdam, O2, lean masters) vs torch's fused fp32 AdamW and,
#                      when carried (.whl/peers/, tools/gpu_wheels.sh peers), bitsandbytes and
#                      torchao AdamW8bit; the peers are installed for this step alone
#   profile-quantized  Nsight Compute over one step each of FusedAdam int8, FusedAdam fp32 and
#                      torch's fused AdamW on 108M params (benchmarks/profile_cuda_step.py: speed of
#                      light, occupancy, launch statistics, warp stalls): why the 8-bit kernel ran
#                      at 17% of the bandwidth on the H100 (benchmarks/RESULTS.md); before it, each
#                      pipeline's kernel table and a cProfile of its host work (--host-profile)
#   subnormal-and-norms  tests/kernels/test_subnormal.py and tests/wrappers/test_overflow_nonfinite_norm.py
#   full-suite         the whole test suite (--maxfail=25: one GPU run sees as many failures as it can)
#   sanitizer-memcheck, sanitizer-racecheck, sanitizer-initcheck
#                      compute-sanitizer over the op tests' small CUDA cases (it refuses the GPU
#                      under gVisor, as on some H200 machines: the step then fails, saying so)
#   bench-optimizers   benchmarks/bench_optimizers.py --device cuda on 108M params (FusedAdam vs
#                      torch fused and foreach; fused O2 step vs the composed torch pipeline; copy
#                      bandwidth; the summary states issue 13's targets)
#   bench-multi-tensor benchmarks/bench_multi_tensor.py --device cuda (unscale, L2 norm vs foreach)
#   bench-compiled     benchmarks/bench_compiled_step.py --device cuda (FusedAdam eager, compiled and
#                      as CUDA graphs vs torch's AdamW foreach/fused/compiled)
#   bench-host         benchmarks/bench_host_overhead.py --device cuda (the host time of a step on
#                      222 tiny tensors: FusedAdam/SGD/LAMB vs torch's fused and foreach)
#   fidelity-digits    tools/compare_precision.py, digits 900 iterations, O0 vs O1/O2 x fp16/bf16,
#                      bar: accuracy within 1 point of fp32
#   fidelity-charlm    the same on the char LM, 1000 iterations, bar: val_ce within 2% (its table
#                      also has the end-to-end O2 bf16 vs fp32 step time)
# Carried wheels in .whl/ (mmengine and its pure-Python dependencies: the GPU image has none; make
# them with tools/gpu_wheels.sh) are installed into /tmp/site first.
#
# Output, written as each step ends (so a run cut short still reports the steps it finished), in
# GPU_CHECK_OUT (default benchmarks/; on the lent machine pass $OUT): gpu_check_<host>_<time>.md
# (machine, a pass/fail/time line per step, the benchmark and fidelity tables) and
# gpu_check_<host>_<time>.log (every step's whole output): two files, within what the device tool
# brings back. GPU_CHECK_STEP_TIMEOUT=S stops any one step but the build after S seconds (a
# failure; the build took 95-150 s on an H100 with 16 jobs, and one cut short left every later
# test step to fail: MP_WRAPPERS_TEST_REQUIRE_CUDA=1 fails a CUDA case without our kernels);
# GPU_CHECK_DEADLINE=S skips the steps that would start S seconds or more after the script did
# (reported as skipped), so a run fits the device tool's 10-minute command limit and still reports.
# Exit status: non-zero if any step failed or was skipped; every selected step runs (time allowing)
# even after a failure.
set -uo pipefail
set -f  # step names are words, never globs
cd "$(dirname "$0")/.."
START=$(date +%s)
PY=${PYTHON:-python3}
ALL_STEPS="build backend cuda-cases compiled-step bench-quantized profile-quantized subnormal-and-norms full-suite sanitizer-memcheck
  sanitizer-racecheck sanitizer-initcheck bench-optimizers bench-multi-tensor bench-compiled
  bench-host fidelity-digits fidelity-charlm"
STEPS=$(echo "${GPU_CHECK_STEPS:-$ALL_STEPS}" | tr ',' ' ')
for s in $STEPS; do
  case " $(echo $ALL_STEPS) " in
    *" $s "*) ;;
    *) echo "gpu_check: unknown step '$s' in GPU_CHECK_STEPS; steps: $(echo $ALL_STEPS)" >&2
       exit 2 ;;
  esac
done
STEP_TIMEOUT=${GPU_CHECK_STEP_TIMEOUT:-0}
DEADLINE=${GPU_CHECK_DEADLINE:-0}
for v in "GPU_CHECK_STEP_TIMEOUT=$STEP_TIMEOUT" "GPU_CHECK_DEADLINE=$DEADLINE"; do
  case ${v#*=} in
    ''|*[!0-9]*) echo "gpu_check: ${v%%=*} must be a whole number of seconds (0: none), got '${v#*=}'" >&2
                 exit 2 ;;
  esac
done
STAMP=$(date -u +%Y%m%dT%H%M%SZ)
OUTDIR=${GPU_CHECK_OUT:-benchmarks}
BASE="$OUTDIR/gpu_check_${HOSTNAME:-$(uname -n)}_$STAMP"
REPORT="$BASE.md"
FULL_LOG="$BASE.log"
WORK=$(mktemp -d)
mkdir -p "$OUTDIR"
status=0

selected() { case " $(echo $STEPS) " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

step() {  # step NAME COMMAND...: run if selected; log, time, and report the result at once
  local name=$1; shift
  selected "$name" || return 0
  local log="$WORK/$name.log" start rc
  start=$(date +%s)
  if [ "$DEADLINE" -gt 0 ] && [ $(( start - START )) -ge "$DEADLINE" ]; then
    echo "- **$name**: SKIPPED, GPU_CHECK_DEADLINE=$DEADLINE s reached: \`$*\`" >>"$REPORT"
    status=1
    return 1
  fi
  echo "== $name: $*" | tee "$log"
  if [ "$STEP_TIMEOUT" -gt 0 ] && [ "$name" != build ]; then
    timeout -k 30 "$STEP_TIMEOUT" "$@" >>"$log" 2>&1
  else
    "$@" >>"$log" 2>&1
  fi
  rc=$?
  tail -n 25 "$log"
  cat "$log" >>"$FULL_LOG"
  local verdict=pass
  [ $rc -eq 0 ] || verdict="FAIL (rc $rc$([ $rc -eq 124 ] && echo ', timed out'))"
  echo "- **$name**: $verdict, $(( $(date +%s) - start )) s: \`$*\`" >>"$REPORT"
  [ $rc -eq 0 ] || status=1
  return $rc
}

attach() {  # attach TITLE FILE: append a step's table to the report
  [ -s "$2" ] || return 0
  { echo; echo "### $1"; echo; cat "$2"; echo; } >>"$REPORT"
}

WHEELS_NOTE="none carried (.whl/ absent)"
if [ -d .whl ]; then
  set +f
  wheels=(.whl/*.whl)
  set -f
  if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site "${wheels[@]}" >"$WORK/wheels.log" 2>&1; then
    WHEELS_NOTE="installed: ${wheels[*]}"
  else
    WHEELS_NOTE="FAILED to install ${wheels[*]}: $(tail -n 3 "$WORK/wheels.log" | tr '\n' ' ')"
    status=1
  fi
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1

{
  echo "# GPU check $STAMP"
  echo
  echo '```'
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
  nvcc --version 2>&1 | tail -n 2
  "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0))' 2>&1
  "$PY" -c 'import mmengine; print("mmengine", mmengine.__version__)' 2>&1
  git log -1 --oneline 2>/dev/null
  echo "steps: $(echo $STEPS)"
  echo "wheels: $WHEELS_NOTE"
  echo '```'
  echo
} >"$REPORT"

if [ -z "${TORCH_CUDA_ARCH_LIST:-}" ]; then
  TORCH_CUDA_ARCH_LIST=$("$PY" -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability(0))')
  export TORCH_CUDA_ARCH_LIST
fi
step build env MP_WRAPPERS_CUDA=1 MAX_JOBS="${MAX_JOBS:-16}" "$PY" setup.py build_ext --inplace
step backend "$PY" -c 'import mp_wrappers; b = mp_wrappers.ops.backend(); print(b); assert b["cuda"] == "cuda", b'

export MP_WRAPPERS_TEST_REQUIRE_CUDA=1
OP_TESTS=(tests/ops/test_multi_tensor.py tests/kernels/test_cpu_kernels.py tests/kernels/test_cuda_paths.py
          tests/ops/test_quantized_states.py tests/optim/test_quantized_state.py tests/ops/test_lean.py
          tests/ops/test_quantized_sgd.py tests/optim/test_quantized_sgd_optim.py)
step cuda-cases "$PY" -m pytest -q -rs -k cuda "${OP_TESTS[@]}"
step compiled-step "$PY" -m pytest -q -rs -k cuda tests/optim/test_fused_optimizers_compile.py \
  tests/wrappers/test_compiled_step.py tests/wrappers/test_compiled_step_setup.py
PEERS_PATH=$PYTHONPATH
if [ -d .whl/peers ] && selected bench-quantized; then
  # Their own folder: mmengine imports bitsandbytes when it finds it, which the tests must not see.
  set +f
  if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/peers .whl/peers/*.whl >"$WORK/peers.log" 2>&1; then
    PEERS_PATH=/tmp/peers:$PYTHONPATH
  else
    echo "- peers: FAILED to install .whl/peers: $(tail -n 3 "$WORK/peers.log" | tr '\n' ' ')" >>"$REPORT"
  fi
  set -f
fi
step bench-quantized env PYTHONPATH="$PEERS_PATH" "$PY" benchmarks/bench_quantized_states.py \
  --device cuda --threads 1 --width 640 --layers 22 --iters 20 --peer-iters 20
attach bench-quantized "$WORK/bench-quantized.log"
# The kernel table first (torch.profiler: device time against wall time, no counters needed), then
# Nsight Compute, which needs the GPU's performance counters (some machines refuse them).
step profile-quantized bash -c '"$0" benchmarks/profile_cuda_step.py --device cuda --steps 3 \
  --kernel-table --host-profile 50 && ncu --clock-control none --nvtx --nvtx-include "profiled/" \
  --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
  "$0" benchmarks/profile_cuda_step.py --device cuda' "$PY"
step subnormal-and-norms "$PY" -m pytest -q -rs tests/kernels/test_subnormal.py tests/wrappers/test_overflow_nonfinite_norm.py
step full-suite "$PY" -m pytest -q -rs --maxfail=25

for tool in memcheck racecheck initcheck; do
  selected "sanitizer-$tool" || continue
  if ! command -v compute-sanitizer >/dev/null 2>&1; then
    echo "- **sanitizer-$tool**: FAIL, no compute-sanitizer on PATH" >>"$REPORT"
    status=1
    continue
  fi
  # Small cases only: the sanitizer slows kernels down 10-100x. Only our kernels are checked where
  # compute-sanitizer filters by kernel name: the tests' float64 references launch hundreds of
  # torch kernels a case, and memcheck instrumenting every one took ~10 s a case on an H100
  # (benchmarks/RESULTS.md, "sixth session"). The filter is tried on a trivial run first, so a
  # release that spells it otherwise checks every kernel rather than failing. -v names each case
  # in the log as it starts, so a step cut short by its time limit says where it was.
  filter=()
  for opt in --kernel-name --kernel-regex --filter; do
    if compute-sanitizer --tool "$tool" "$opt" kns=mp_wrappers true >/dev/null 2>&1; then
      filter=("$opt" kns=mp_wrappers)
      break
    fi
  done
  [ ${#filter[@]} -gt 0 ] || echo "gpu_check: compute-sanitizer takes no kernel-name filter: every kernel checked" >&2
  step "sanitizer-$tool" compute-sanitizer --tool "$tool" ${filter[@]+"${filter[@]}"} --error-exitcode 1 \
    "$PY" -m pytest -v -x -p no:cacheprovider -k 'cuda and not 2_pow_31 and not split_across' \
    tests/ops/test_quantized_states.py tests/ops/test_multi_tensor.py tests/kernels/test_cpu_kernels.py tests/kernels/test_cuda_paths.py \
    tests/ops/test_lean.py tests/ops/test_quantized_sgd.py
done

step bench-optimizers "$PY" benchmarks/bench_optimizers.py --device cuda --threads 1 \
  --width 640 --layers 22
attach bench-optimizers "$WORK/bench-optimizers.log"
step bench-multi-tensor "$PY" benchmarks/bench_multi_tensor.py --device cuda
attach bench-multi-tensor "$WORK/bench-multi-tensor.log"
step bench-compiled "$PY" benchmarks/bench_compiled_step.py --device cuda --sizes 1048576 33554432 \
  --iters 30
attach bench-compiled "$WORK/bench-compiled.log"
step bench-host "$PY" benchmarks/bench_host_overhead.py --device cuda --rounds 300
attach bench-host "$WORK/bench-host.log"

step fidelity-digits "$PY" tools/compare_precision.py configs/digits/cnn_fp32.py --iters 900 \
  --levels O0 O1 O2 --dtypes float16 bfloat16 --bar accuracy=1 --no-progress \
  --work-dir "$WORK/compare_digits" --out "$WORK/fidelity_digits.md"
attach 'fidelity-digits (bar: accuracy within 1 point of O0)' "$WORK/fidelity_digits.md"
step fidelity-charlm "$PY" tools/compare_precision.py configs/charlm/lm_fp32.py --iters 1000 \
  --levels O0 O1 O2 --dtypes float16 bfloat16 --bar val_ce=2 --no-progress \
  --work-dir "$WORK/compare_charlm" --out "$WORK/fidelity_charlm.md"
attach 'fidelity-charlm (bar: val_ce within 2% of O0; speed-up vs O0 is the end-to-end ratio)' \
  "$WORK/fidelity_charlm.md"

echo >>"$REPORT"
echo "gpu_check: $([ $status -eq 0 ] && echo passed || echo FAILED)" >>"$REPORT"
rm -rf "$WORK"
echo "gpu_check: $([ $status -eq 0 ] && echo passed || echo FAILED); report: $REPORT; log: $FULL_LOG"
exit $status
