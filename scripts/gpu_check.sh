#!/usr/bin/env bash
# The prepared one-GPU check (docs/benchmarks/README.md, "GPU check"): Triton SYRK kernel, standard vs Gram NS,
# `dmuon bench` on one rank and the training recipe, all figures in one JSON.
#   scripts/gpu_check.sh                       # on a CUDA machine; writes gpu_check.json
#   scripts/gpu_check.sh --dry-run --json x.json   # the same code paths at tiny sizes on CPU
# Exit status: 0 all checks passed, 1 a check failed or a section did not finish, 2 usage.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"  # works without `pip install -e .` too
exec "${PYTHON:-python}" -m dmuon.bench --gpu-check "$@"
