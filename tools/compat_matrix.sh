#!/usr/bin/env bash
# The compatibility matrix (docs/compatibility.md): for each stack, a fresh venv with the pinned torch
# (and numpy where an old torch needs numpy<2), mmengine or its fork, then the README's install command
# (`bash tools/install.sh test`, on a copy of the working tree so the checkout's own build is left
# alone), then the tests; one table row per stack. mmpretrain imports mmcv: PyPI has mmcv 2.x only
# as source with compiled ops; its pure-Python part is the mmcv-lite wheel, which is what it needs.
#
#   tools/compat_matrix.sh                  # every stack, the compat subset (tools/compat_subset.txt)
#   tools/compat_matrix.sh oldest newest    # the stacks named (CI's two compat lanes)
#   SUBSET=all tools/compat_matrix.sh t26   # the whole suite
#   tools/compat_matrix.sh --list           # the stacks and their pins
#   BUILD=0 tools/compat_matrix.sh newest   # test the previous run's build of a stack again
#   PHASE=install tools/compat_matrix.sh oldest   # only make the venv and install the pins (CI does
#                                           # this in the background, then runs the stack with REUSE=1)
#
# MATRIX_DIR=dir holds one venv and one source copy per stack (default /tmp/mp_wrappers_matrix); a
# venv that already exists is reused (REUSE=0 rebuilds it). The exit status is 1 when a stack failed
# to install, to build or to pass its tests. Every torch comes from PyPI (or pip's find-links), so
# torch 2.1-2.6 are PyPI's CUDA builds (~2.5 GB with their nvidia-* wheels, no GPU needed to run on
# the CPU); the kernels built are CPU-only (MP_WRAPPERS_CUDA=0) on every stack, at -O1
# (MP_WRAPPERS_CXX_OPT, build_config.py; set it to -O3 to build as users do): a stack checks how
# the code meets its torch and mmengine, the main lane checks the -O3 build, and every level
# computes the same bits. -O1 builds in ~2/3 of the CPU time (its tests take as long).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
MATRIX_DIR=${MATRIX_DIR:-/tmp/mp_wrappers_matrix}
CXX_OPT=${MP_WRAPPERS_CXX_OPT:--O1}
SUBSET=${SUBSET:-compat}
BASE_PY=${PYTHON:-python}

# name | torch | mmengine requirement | extra requirements (space-separated) | what it stands for
STACKS=(
  "oldest|2.1.2|mmengine==0.10.4|numpy<2|oldest supported: mmcv's last compiled-ops torch"
  "t24|2.4.1|mmengine==0.10.5|numpy<2|first torch with register_fake"
  "t26|2.6.0|mmengine==0.10.7||first torch with torch.load(weights_only=True) by default"
  "today|2.13.0|mmengine==0.10.7||the main CI lane's stack"
  "newest|2.14.1|onedl-mmengine==0.10.12|opencv-python-headless|newest torch installable here + mmengine's maintained fork (which leaves opencv to the user)"
  "mmpretrain|2.1.2|mmengine==0.10.4|numpy<2 torchvision==0.16.2 mmpretrain==1.2.0 mmcv-lite==2.1.0|an OpenMMLab toolbox on the oldest stack"
)

usage() { sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; }
stack_line() { local s; for s in "${STACKS[@]}"; do [ "${s%%|*}" = "$1" ] && { echo "$s"; return 0; }; done; return 1; }

if [ "${1:-}" = --list ]; then
  printf '%-11s %-7s %-25s %-28s %s\n' stack torch mmengine extra why
  for s in "${STACKS[@]}"; do IFS='|' read -r n t m e w <<<"$s"; printf '%-11s %-7s %-25s %-28s %s\n' "$n" "$t" "$m" "${e:--}" "$w"; done
  exit 0
fi
case "${1:-}" in -h|--help) usage; exit 0 ;; esac
case "$SUBSET" in compat|all) ;; *) echo "compat_matrix: SUBSET=$SUBSET: expected compat or all" >&2; exit 2 ;; esac
case "${PHASE:=all}" in install|all) ;; *) echo "compat_matrix: PHASE=$PHASE: expected install or all" >&2; exit 2 ;; esac
NAMES=("$@")
if [ ${#NAMES[@]} -eq 0 ]; then for s in "${STACKS[@]}"; do NAMES+=("${s%%|*}"); done; fi
for n in "${NAMES[@]}"; do
  stack_line "$n" >/dev/null || { echo "compat_matrix: unknown stack '$n'; known: $(for s in "${STACKS[@]}"; do printf '%s ' "${s%%|*}"; done)" >&2; exit 2; }
done

if [ "$SUBSET" = compat ]; then
  mapfile -t TESTS < <(grep -v '^\s*#' tools/compat_subset.txt | grep -v '^\s*$')
else
  TESTS=(tests)
fi
# Python, torch, mmengine (or the fork) and numpy of a stack, '|'-separated.
read -r -d '' VERSIONS_PY <<'PYEOF' || true
import sys
from importlib import metadata
import mmengine, numpy, torch
try:
    metadata.version('onedl-mmengine')
    dist = 'onedl-mmengine'
except metadata.PackageNotFoundError:
    dist = 'mmengine'
print(f'{sys.version.split()[0]}|{torch.__version__}|{dist} {mmengine.__version__}|{numpy.__version__}')
PYEOF
mkdir -p "$MATRIX_DIR"
ROWS=()
status=0
echo "compat_matrix: $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), subset=$SUBSET, stacks: ${NAMES[*]}"

run_stack() {  # name: installs, builds, tests; appends one row to ROWS
  local name=$1 line torch mm extra why
  line=$(stack_line "$name"); IFS='|' read -r name torch mm extra why <<<"$line"
  local venv="$MATRIX_DIR/$name/venv" src="$MATRIX_DIR/$name/src" log="$MATRIX_DIR/$name/log"
  local start=$(date +%s) build=no passed=0 failed=0 skipped=0 errors=0 gated='' note=''
  mkdir -p "$MATRIX_DIR/$name"; : >"$log"
  echo "== $name: torch $torch, $mm${extra:+, $extra} (log: $log)"
  [ "${REUSE:-1}" = 0 ] && rm -rf "$venv"
  [ -x "$venv/bin/python" ] || { rm -rf "$venv"; "$BASE_PY" -m venv "$venv" >>"$log" 2>&1; }
  local py="$venv/bin/python" ok=1
  # The pins go in one pip call, so the resolver sees the numpy bound and torch's pin together
  # (an old torch's ABI needs numpy<2; mmengine's opencv dependency is then resolved to match).
  # In a reused venv that already has them pip only checks them.
  # shellcheck disable=SC2086
  "$py" -m pip install -q "torch==$torch" "$mm" $extra >>"$log" 2>&1 || { ok=0; note='pip install of the stack failed'; }
  if [ "$PHASE" = install ]; then
    [ $ok = 1 ] || { status=1; echo "   $name: pip install of the stack failed (see $log)"; }
    echo "   $name: installed in $(( $(date +%s) - start )) s"
    return
  fi
  if [ "${BUILD:-1}" = 0 ] && [ -d "$src/mp_wrappers" ]; then
    # BUILD=0: test what the previous run of this stack installed (its copy of the tree, built
    # with the README's install command); the row says so.
    build=reused; note='BUILD=0: tested the previous build of this stack'
  else
    rm -rf "$src"; mkdir -p "$src"
    git ls-files -z --cached --others --exclude-standard | tar --null -T - -cf - | tar -xf - -C "$src"
  fi
  if [ $ok = 1 ] && [ "$build" != reused ]; then
    # The README's install command, with this venv's python.
    if (cd "$src" && MP_WRAPPERS_CUDA=0 MP_WRAPPERS_CXX_OPT=$CXX_OPT MAX_JOBS=${MAX_JOBS:-2} \
          PYTHON="$py" bash tools/install.sh test) >>"$log" 2>&1; then
      build="ok ($CXX_OPT)"
    else
      build=FAILED; ok=0; note=${note:-"build failed: $(grep -m1 -E 'error:|Error' "$log" | cut -c1-150)"}
    fi
  fi
  # Every python below runs in the stack's copy: from the checkout, `import mp_wrappers` would find
  # the checkout's own package and its extension, built against another torch.
  if [ $ok = 1 ] && ! (cd "$src" && "$py" -c 'import mp_wrappers, sys; sys.exit(0 if mp_wrappers.ops.backend()["extension"] else 1)') >>"$log" 2>&1; then
    build=FAILED; ok=0; note=${note:-"the built extension does not load: see $log"}
  fi
  local versions
  versions=$(cd "$src" && "$py" -c "$VERSIONS_PY" 2>/dev/null) || versions="?|$torch|$mm|?"
  if [ $ok = 1 ]; then
    gated=$(cd "$src" && "$py" -c 'from mp_wrappers import compat
print(", ".join(f"{k} (torch>={f.min_torch})" for k, f in compat.FEATURES.items() if not compat.has(k)) or "none")')
    local extra_tests=()
    [[ "$extra" == *mmpretrain* ]] && extra_tests=(tests/toolboxes/test_mmpretrain_stack.py)
    (cd "$src" && timeout "${TEST_TIMEOUT:-1800}" "$py" -m pytest -q -x -p no:cacheprovider -rs \
        --junitxml="$MATRIX_DIR/$name/junit.xml" "${TESTS[@]}" "${extra_tests[@]}") >>"$log" 2>&1
    read -r passed failed skipped errors < <("$py" - "$MATRIX_DIR/$name/junit.xml" <<'PYEOF'
import sys, xml.etree.ElementTree as ET
try:
    root = ET.parse(sys.argv[1]).getroot()
except Exception:
    print(0, 0, 0, 1); sys.exit()
suites = [root] if root.tag == 'testsuite' else list(root)
t = lambda k: sum(int(s.get(k, 0)) for s in suites)
print(t('tests') - t('failures') - t('errors') - t('skipped'), t('failures'), t('skipped'), t('errors'))
PYEOF
)
    tail -n 3 "$log" | sed "s/^/   $name: /"
    if [ "$failed" != 0 ] || [ "$errors" != 0 ] || [ "$passed" = 0 ]; then ok=0; note=${note:-"see $log"}; fi
  fi
  [ $ok = 1 ] || status=1
  local wall=$(( $(date +%s) - start ))
  IFS='|' read -r pyv tv mmv npv <<<"$versions"
  ROWS+=("| $name | $pyv | $tv | $mmv | $npv | $build | $passed | $((failed + errors)) | $skipped | $((wall / 60))m$((wall % 60))s | ${gated:-} | ${note:-} |")
  echo "${ROWS[-1]}"
}

for n in "${NAMES[@]}"; do run_stack "$n"; done
[ "$PHASE" = install ] && exit $status

echo
echo "| stack | python | torch | mmengine | numpy | build | passed | failed | skipped | wall | gated features | note |"
echo "|---|---|---|---|---|---|---|---|---|---|---|---|"
printf '%s\n' "${ROWS[@]}"
exit $status
