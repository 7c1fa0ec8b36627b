#!/usr/bin/env bash
# The prepared one-GPU check (docs/benchmarks/README.md, "GPU check"): at most 8 minutes on one GPU,
# every section with its own timeout; writes gpu_check.json and gpu_check.md (the verdict table).
#   PYTHON=python3 scripts/gpu_check.sh [OUTDIR]    # on a CUDA machine (OUTDIR: default $OUT, else ./gpu_check)
#   scripts/gpu_check.sh OUTDIR --dry-run           # the plumbing without CUDA (commands, budget, table)
# Exit status: 0 all checks passed, 1 a check failed or a section did not finish, 2 usage.
set -euo pipefail
out="${OUT:-gpu_check}"
if [[ $# -gt 0 && $1 != -* ]]; then
  out="$1"
  shift
fi
out="$(mkdir -p "$out" && cd "$out" && pwd)"  # before the cd below
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"  # works without `pip install -e .` too
exec "${PYTHON:-python3}" -m dmuon.bench --gpu-check --out-dir "$out" "$@"
