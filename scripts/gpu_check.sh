#!/usr/bin/env bash
# The GPU check, for one CUDA GPU, in a few minutes:
#   1. the test suite with the compiled kernels (no interpreter), CUDA as the default device;
#      tests/test_gpu.py runs tests/gpu_checks.py in it: a training step captured in a CUDA graph and
#      replayed, forward and backward under torch.cuda.set_sync_debug_mode("error"), and the tensor
#      past 2^31 elements;
#   2. the benchmarks at full sizes, and their report (RESULTS.md, results.csv, plots) in OUTDIR.
# Usage: scripts/gpu_check.sh OUTDIR, with tritonbn and its `test` and `plot` extras importable by
# $PYTHON (default: python). Copy OUTDIR/RESULTS.md and the plots to benchmarks/ to publish them.
set -euo pipefail
out=${1:?usage: scripts/gpu_check.sh OUTDIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
python=${PYTHON:-python}
export TRITONBN_TEST_DEVICE=cuda
unset TRITON_INTERPRET
"$python" - <<'PY' | tee "$out/env.txt"
import torch, triton
assert torch.cuda.is_available(), "no CUDA device"
print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
PY
"$python" -m pytest -q -p no:cacheprovider tests 2>&1 | tee "$out/tests.txt"
"$python" -m pytest -q -p no:cacheprovider benchmarks --benchmark-json "$out/bench.json" \
    --benchmark-columns=median 2>&1 | tail -n 5 | tee "$out/bench.txt"
"$python" benchmarks/report.py "$out/bench.json" --out "$out"
