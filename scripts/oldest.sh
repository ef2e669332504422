#!/usr/bin/env bash
# CI's second job: the oldest supported pair, torch 2.8.0 with the Triton it pins (3.4.0), in its own virtual
# environment (docs/contributing.md, "The oldest pair"). It runs what a user on that pair first does:
# import, a converted model trained one step and evaluated on the PyTorch backend and on the kernels under
# the interpreter, two gloo ranks synchronized, the direct launch over a fake driver, the quick AOT
# compile for sm_90, and torch.compile(fullgraph=True) in training at world size 1, which must keep
# tritonbn's custom op (scripts/compat_smoke.py; each column against torch's batch_norm in float64).
#
# OLDEST_VENV (default .venv-oldest) is made when missing; torch comes from the package index (a CUDA build
# of about 3 GB that runs on CPU), with the NumPy pip picks. OLDEST_TORCH overrides the version.
#
# `scripts/oldest.sh setup` only sets the environment up, `scripts/oldest.sh smoke` only runs the smoke in it (CI sets
# up in the background while the tests run: the set-up is mostly a download); no argument does both.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${OLDEST_VENV:-.venv-oldest}
torch_spec="torch==${OLDEST_TORCH:-2.8.0}"
step=${1:-all}
case "$step" in setup | smoke | all) ;; *) echo "usage: scripts/oldest.sh [setup|smoke]" >&2; exit 2 ;; esac
start=$SECONDS
if [ "$step" != smoke ]; then
    [ -x "$venv/bin/python" ] || "${PYTHON:-python3}" -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet "$torch_spec" numpy
    "$venv/bin/python" -m pip install --quiet --no-deps -e .
    echo "oldest pair: set up in $((SECONDS - start)) s"
fi
if [ "$step" != setup ]; then
    # --aot smoke: each kernel once per plan (12 compiles, ~12 s; --quick's 60 took ~45 s of the block's CPU), the
    # exhaustive compiles being the sweep's, with the newest pair
    "$venv/bin/python" scripts/compat_smoke.py --aot smoke --columns import,torch,interpreter,sync2,direct,aot,compile
    echo "oldest pair: smoke done in $((SECONDS - start)) s"
fi
