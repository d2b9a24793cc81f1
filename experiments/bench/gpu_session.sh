#!/usr/bin/env bash
# The GPU suite as one device call: a lent machine's whole session in a command that ends inside the
# call's 10-minute limit, leaving the table even when it is cut short.
#
#   bash experiments/bench/gpu_session.sh prepare    # here, once: the wheels the device image lacks, the commit
#   bash experiments/bench/gpu_session.sh run        # there: device run, carry [".whl"], timeout_s 600
#
# `prepare` downloads ml-collections, tensorboardX and zstandard for Python 3.12 into .whl/ (ignored by
# git, carried to the machine) and writes the tree's commit beside them. `run` installs them, runs the
# suite under BUDGET_S seconds (default 480) and writes GPU.md, GPU.json and suite.log into $OUT; copy
# GPU.md and GPU.json into experiments/bench/ and commit them. Rows run in the suite's order; a row the
# budget leaves out says so in its cell (`--rows` picks others for a second call).
set -euo pipefail
cd "$(dirname "$0")/../.."

prepare() {
  grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
  rm -rf .whl && mkdir .whl
  local platforms=()
  for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
           manylinux1_x86_64; do platforms+=(--platform "$p"); done
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .whl ml-collections tensorboardX zstandard
  local commit; commit=$(git rev-parse --short HEAD)
  [ -z "$(git status --porcelain --untracked-files=no)" ] || commit="$commit with uncommitted changes"
  echo "$commit" > .whl/COMMIT
  ls .whl
}

run() {
  local out=${OUT:-/tmp/gpu-suite}
  mkdir -p "$out"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl
  export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 SUITE_COMMIT="$(cat .whl/COMMIT)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 experiments/bench/gpu_suite.py --budget_s "${BUDGET_S:-480}" --record "$out/GPU.md" "$@" \
    2>&1 | tee "$out/suite.log"
}

case "${1:-}" in
  prepare) prepare ;;
  run) shift; run "$@" ;;
  *) echo "usage: bash experiments/bench/gpu_session.sh prepare|run [suite flags]" >&2; exit 2 ;;
esac
