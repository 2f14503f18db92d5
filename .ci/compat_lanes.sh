#!/usr/bin/env bash
# CI's two compatibility lanes (docs/compatibility.md): the oldest supported stack (torch 2.1.2 +
# mmengine 0.10.4) and the newest (torch 2.14.1 + onedl-mmengine 0.10.12), each in a fresh venv with
# the README's install command and the compat subset of the tests (tools/compat_subset.txt). The
# newest lane is also the check that the extension builds against the newest torch pip offers here.
# Prints one table row per lane; fails when either lane fails.
set -euo pipefail
cd "$(dirname "$0")/.."
MATRIX_DIR=${MATRIX_DIR:-$(mktemp -d /tmp/mp_wrappers_ci_compat.XXXXXX)} REUSE=0 SUBSET=compat \
  bash tools/compat_matrix.sh oldest newest
