#!/usr/bin/env bash
# The GPU check, for one GPU (A100, H100, H200, or a ROCm GPU such as an MI300X), within about 8 minutes
# (sized for an H200 with torch 2.11 and Triton 3.6 and no package registry). It records the device (its
# target, SM/CU count, warp size, L2) and the torch, Triton and NumPy versions in OUTDIR/env.json. Stages
# run in order of value; each writes its results to OUTDIR before the next starts, and a stage that fails
# is recorded in OUTDIR/stages.txt while the next one still runs:
#   1. correctness with the compiled kernels (<= 255 s): tests/helpers/gpu_checks.py (a training step
#      captured in a CUDA graph and replayed against eager, an empty batch in a graph, forward and
#      backward under torch.cuda.set_sync_debug_mode("error")), then the oracle tests of
#      tests/autograd/test_batchnorm.py and tests/autograd/test_epilogue.py (shapes, both layouts, fp32/fp16/bf16,
#      determinism, |mean|/std = 1e3) on the Triton backend, CUDA as the default device, then
#      tests/kernels/test_packed.py (the packed plans of odd NCHW planes: tl.gather and a segmented scan),
#      and tests/kernels/test_dtypes.py's fp16/bf16 module (<= 45 s).
#      Every eager launch there after a plan's first goes through tritonbn's direct launch
#      (tritonbn/backends/triton/_launch.py: the cached CompiledKernel's C launcher), so this stage is also
#      the direct launch's first run on a real driver (tests/kernels/test_launch.py checks it over a fake one);
#   2. the headline (<= 240 s): benchmarks/headline.py, ResNet-50 channels_last bf16 forward+backward
#      per BatchNorm shape and summed over the model, tritonbn against torch.nn.SyncBatchNorm's sync
#      path and cuDNN, then a whole ResNet-50 training step, eager and torch.compile; then the kernel
#      audit's time model (benchmarks/model.json) printed beside the measured per-layer times;
#   3. while time is left (<= 120 s, and only with at least 60 s left): `tritonbn bench --model resnet50`,
#      the built-in ResNet-50's BatchNorm inputs at batch 32, channels_last bf16, training and eval, into
#      OUTDIR/bench_model/; then the rest of the benchmark matrix, subset by subset; then the report.
# Usage: scripts/gpu_check.sh OUTDIR [TOTAL_SECONDS (default 470)]. Python: $PYTHON (default python3).
# Packages beyond torch and triton: wheels in .whl/ are installed into a temporary folder first, if
# there are any; pytest-benchmark and matplotlib are optional (stage 3 and the plots are skipped).
set -uo pipefail
out=${1:?usage: scripts/gpu_check.sh OUTDIR [TOTAL_SECONDS]}
total=${2:-470}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TRITONBN_TEST_DEVICE=cuda
unset TRITON_INTERPRET
if compgen -G ".whl/*.whl" >/dev/null; then
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/tritonbn-site \
        .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/tritonbn-site"
fi
: >"$out/stages.txt"
left() { echo $((total - SECONDS)); }
stage() {  # stage NAME SECONDS COMMAND...: run with a time limit, record its status
    local name=$1 limit=$2
    shift 2
    if ((limit > $(left))); then limit=$(left); fi
    if ((limit < 10)); then
        echo "$name: skipped, time budget spent" | tee -a "$out/stages.txt"
        return
    fi
    local t0=$SECONDS
    timeout -k 5 "$limit" "$@"
    local rc=$?
    echo "$name: exit $rc$([ $rc = 124 ] && echo ' (timed out)') in $((SECONDS - t0)) s" | tee -a "$out/stages.txt"
}
has() { "$python" -c "import $1" 2>/dev/null; }

# The device and the versions (CUDA or ROCm: torch's CUDA API is HIP there), into env.txt and env.json.
"$python" - "$out/env.json" <<'PY' 2>&1 | tee "$out/env.txt"
import json, sys
import numpy, torch, triton
assert torch.cuda.is_available(), "no CUDA or ROCm device"
p = torch.cuda.get_device_properties(0)
hip = torch.version.hip
env = {"device": p.name, "platform": f"ROCm {hip}" if hip else f"CUDA {torch.version.cuda}",
       "target": getattr(p, "gcnArchName", "").split(":")[0] if hip else "sm_%d%d" % (p.major, p.minor),
       "sms": p.multi_processor_count, "warp_size": getattr(p, "warp_size", 32),
       "l2_bytes": getattr(p, "L2_cache_size", None), "memory_gib": round(p.total_memory / 2**30, 1),
       "torch": torch.__version__, "triton": triton.__version__, "numpy": numpy.__version__}
print(", ".join(f"{k} {v}" for k, v in env.items()))
json.dump(env, open(sys.argv[1], "w"), indent=1)
from tritonbn import _compat
problem = _compat.kernels_version_problem()
assert problem is None, problem
PY

# 1. Correctness with the compiled kernels.
stage gpu_checks 60 "$python" tests/helpers/gpu_checks.py 2>&1 | tee "$out/gpu_checks.txt"
stage oracle_tests 90 "$python" -m pytest -q -x -p no:cacheprovider -o addopts="-ra" -k "triton" \
    tests/autograd/test_batchnorm.py tests/autograd/test_epilogue.py 2>&1 | tee "$out/oracle_tests.txt"
stage packed_tests 60 "$python" -m pytest -q -x -p no:cacheprovider -o addopts="-ra" tests/kernels/test_packed.py 2>&1 |
    tee "$out/packed_tests.txt"
# A module in fp16/bf16 (parameters and buffers too): the compiled fp64 -> bf16 stores of the running
# statistics and the weight and bias gradients (tritonbn.kernels._common.rounded_for).
stage half_module_tests 45 "$python" -m pytest -q -x -p no:cacheprovider -o addopts="-ra" -k "triton" \
    tests/kernels/test_dtypes.py::test_half_precision_module 2>&1 | tee "$out/half_module_tests.txt"

# 2. The headline table and the training step.
stage headline 240 "$python" benchmarks/headline.py --out "$out" --budget-s 200 2>&1 | tee "$out/headline.txt"
# The kernel audit's time model (benchmarks/model.json, made without a GPU) next to the measured layers.
[ -f "$out/headline.jsonl" ] && "$python" benchmarks/model_check.py --model benchmarks/model.json \
    --headline "$out/headline.jsonl" 2>&1 | tee "$out/model_check.txt"

# 3. tritonbn bench on the built-in ResNet-50 (a budget that leaves it time to write its table), then the
# rest of the matrix, most valuable subsets first, each into its own JSON.
if (($(left) >= 60)); then
    budget=$(($(left) - 30))
    ((budget > 90)) && budget=90
    stage bench_model 120 "$python" -m tritonbn bench --model resnet50 --dtype bf16 --channels-last --reps 20 \
        --budget-s "$budget" --out "$out/bench_model" 2>&1 | tee "$out/bench_model.txt"
else
    echo "bench_model: skipped, less than 60 s left" | tee -a "$out/stages.txt"
fi
if has pytest_benchmark; then
    n=0
    for subset in "resnet50 and channels_last and bf16" "epilogue" "sweep" "resnet50 and contiguous and bf16" \
        "resnet50 and fp16" "resnet50 and fp32"; do
        n=$((n + 1))
        stage "bench[$subset]" 600 "$python" -m pytest -q -p no:cacheprovider benchmarks/test_bench_batchnorm.py \
            -k "$subset" --benchmark-json "$out/bench-$n.json" --benchmark-columns=median 2>&1 |
            tail -n 3 | tee -a "$out/bench.txt"
    done
    jsons=$(ls "$out"/bench-*.json 2>/dev/null)
    if [ -n "$jsons" ]; then
        # shellcheck disable=SC2086
        "$python" benchmarks/report.py $jsons --out "$out" 2>&1 | tee -a "$out/stages.txt"
    fi
else
    echo "benchmark matrix: skipped, pytest-benchmark is not installed" | tee -a "$out/stages.txt"
fi
echo "gpu_check: done in $SECONDS s; results in $out" | tee -a "$out/stages.txt"
