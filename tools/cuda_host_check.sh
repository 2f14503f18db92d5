#!/usr/bin/env bash
# Host execution of the CUDA kernels (docs/cuda.md "Host execution"): builds the host-execution
# modules of the same .cu sources (real and tiny launch geometry, with gcov; and the tiny geometry
# with AddressSanitizer + UndefinedBehaviorSanitizer), runs tests/kernels/test_cuda_host*.py on each, and
# prints `cuda host coverage: NN.N%` for the kernel sources. Exits non-zero on any failure or when
# coverage is below CUDA_HOST_MIN_COVERAGE (default 95). Needs no GPU and no nvcc.
#
# Usage: bash tools/cuda_host_check.sh            (everything)
#        bash tools/cuda_host_check.sh coverage   (the real and tiny builds, their tests, coverage)
#        bash tools/cuda_host_check.sh sanitize   (the sanitizer pass only: its build is its own)
#        CUDA_HOST_SANITIZE=0 bash tools/cuda_host_check.sh   (skip the sanitizer pass)
# CI runs the two stages in its two pipelines (.ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."
STAGE=${1:-all}
case "$STAGE" in
  all|coverage|sanitize) ;;
  *) echo "cuda_host_check: stage '$STAGE' is not allowed; expected all, coverage or sanitize" >&2
     exit 2 ;;
esac
# tests/: the host-execution harness (tests/cuda_host.py) is test code, not part of the package.
export PYTHONPATH="$PWD:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}"
export MAX_JOBS=${MAX_JOBS:-2}
MIN=${CUDA_HOST_MIN_COVERAGE:-95}
# pytest's temporary directories of its own: CI runs the stages beside other pytest runs, and pytest
# deletes all but the 3 newest /tmp/pytest-of-<user>/pytest-N, whoever made them.
TMP_ROOT=$(mktemp -d /tmp/cuda_host_check.XXXXXX)
trap 'rm -rf "$TMP_ROOT"' EXIT
TESTS=(tests/kernels/test_cuda_host.py tests/kernels/test_cuda_host_planner.py tests/kernels/test_cuda_host_lean.py
       tests/kernels/test_cuda_host_adam8bit.py tests/kernels/test_cuda_host_alignment.py
       tests/kernels/test_cuda_host_traffic.py tests/kernels/test_cuda_host_boundaries.py
       tests/kernels/test_cuda_host_lean_traffic.py tests/kernels/test_cuda_host_adam8bit_lean.py
       tests/kernels/test_cuda_host_adam8bit_edges.py tests/kernels/test_cuda_host_optim_traffic.py
       tests/kernels/test_cuda_host_param_limit.py tests/kernels/test_cuda_host_nonfinite.py
       tests/kernels/test_cuda_host_partials.py tests/kernels/test_cuda_host_sgd8bit.py
       tests/kernels/test_cuda_host_sgd8bit_lean.py tests/kernels/test_cuda_host_emulation.py)

if [ "$STAGE" != sanitize ]; then
echo "== cuda host: building real, tiny (gcov)"
python - <<'PY'
import cuda_host
for variant in ('real', 'tiny'):
    cuda_host.build(variant)
    print(f'built {variant}: {cuda_host.build_dir(variant)}')
PY
# Fresh counters: coverage is that of this run's tests only.
find build/cuda_host/real build/cuda_host/tiny -name '*.gcda' -delete

echo "== cuda host: tests, real and tiny geometry"
MP_WRAPPERS_CUDA_HOST_VARIANTS=real,tiny python -m pytest -q -p no:cacheprovider --durations=15 \
  --basetemp "$TMP_ROOT/coverage" "${TESTS[@]}"

echo "== cuda host: coverage of the kernel sources"
python tools/cuda_host_coverage.py --variants real,tiny --min "$MIN"
fi

if [ "$STAGE" = sanitize ] || { [ "$STAGE" = all ] && [ "${CUDA_HOST_SANITIZE:-1}" = 1 ]; }; then
  echo "== cuda host: AddressSanitizer + UndefinedBehaviorSanitizer (tiny geometry)"
  PRELOAD=$(python -c 'import cuda_host; print(cuda_host.sanitizer_preload())')
  # build() imports the module, so the building process needs the ASan runtime first too.
  LD_PRELOAD="$PRELOAD" ASAN_OPTIONS=detect_leaks=0 \
    python -c 'import cuda_host; cuda_host.build("asan")'
  # Python itself is not instrumented: leak checking would report the interpreter's arenas.
  # Every test runs here, the error paths (-k rejects) too: PRELOAD holds libstdc++ beside libasan
  # so that a c10::Error thrown out of the sanitized module reaches Python (see sanitizer_preload).
  # --capture=sys: a sanitizer report is written to fd 2 just before the abort; pytest's default
  # fd capture would swallow it and leave only "Fatal Python error: Aborted" in the log.
  # ASan prints once that it does not fully support swapcontext: the emulation's fibers announce
  # every switch to it (__sanitizer_start_switch_fiber, emulation.h), which is what it asks for.
  LD_PRELOAD="$PRELOAD" ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 \
    UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 MP_WRAPPERS_CUDA_HOST_VARIANTS=asan \
    python -m pytest -q -p no:cacheprovider --capture=sys --basetemp "$TMP_ROOT/sanitize" \
    "${TESTS[@]}"
fi
echo "cuda host check: passed ($STAGE)"
