#!/usr/bin/env bash
# Set up .venv with tritonbn (editable) and its test, plot, lint and docs tools. Safe to run again.
#
# torch is installed first, on its own, so that pip never resolves a plain `torch` requirement to a
# multi-GB CUDA build where the CPU build is wanted. TORCH_SPEC chooses it (default: torch==2.13.0,
# which on the project's CI machines is a CPU build kept on disk). An importable torch is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
    .venv/bin/python -m pip install --quiet "${TORCH_SPEC:-torch==2.13.0}"
fi
# The installed torch is pinned for the rest (lightning, in the test extras, depends on torch): pip keeps it.
torch_version=$(.venv/bin/python -c "import torch; print(torch.__version__)")
.venv/bin/python -m pip install --quiet -e ".[test,plot,dev,docs]" "torch==$torch_version"
# yapf (imported by mmengine, in the test extras) regenerates its grammar cache (~/.cache/YAPF) on its first import
# after an install; parallel test workers importing it at once can read a half-written cache (EOFError while
# collecting tests/integrations/test_mmengine.py). One import here writes it before any worker starts.
.venv/bin/python -c "import yapf" 2>/dev/null || true
