#!/usr/bin/env bash
# One command for the CUDA paths: their correctness tests and the GPU benchmarks, as one JSON object on stdout (and in
# benchmarks/results/gpu_check.json). Under 10 minutes on one GPU. Without a CUDA GPU it prints
# {"status": "skipped", ...} and exits 0. Arguments go to benchmarks/gpu_check.py (--quick, --skip-tests, --budget-s N).
#
# The interpreter: $STEM_HF_PYTHON if set; else .venv/bin/python (made by `make .venv/.stem-hf-installed` when missing);
# else, where no venv can be made (an offline machine), a python3 whose torch sees a GPU, with the repository on
# PYTHONPATH. $STEM_HF_WHEELS may name a folder of wheels to install first (offline, into a temporary folder).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

has_torch() { "$1" -c "import torch, transformers" >/dev/null 2>&1; }
sees_gpu() { "$1" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; }

if [ -n "${STEM_HF_WHEELS:-}" ]; then
  site="${TMPDIR:-/tmp}/stem-hf-wheels"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
    "$STEM_HF_WHEELS"/*.whl >&2
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi

PY="${STEM_HF_PYTHON:-}"
if [ -z "$PY" ]; then
  if ! has_torch .venv/bin/python 2>/dev/null; then
    if command -v python3 >/dev/null && has_torch python3 && sees_gpu python3; then
      echo "gpu_check: no usable .venv; using $(command -v python3), whose torch sees a GPU" >&2
    else
      make .venv/.stem-hf-installed >&2 || echo "gpu_check: could not make .venv" >&2
    fi
  fi
  if has_torch .venv/bin/python 2>/dev/null && { sees_gpu .venv/bin/python || ! sees_gpu python3; }; then
    PY=.venv/bin/python
  elif command -v python3 >/dev/null && has_torch python3; then
    PY=python3
  else
    echo "gpu_check: no Python with torch and transformers (make .venv/.stem-hf-installed failed)" >&2
    exit 1
  fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" benchmarks/gpu_check.py "$@"
