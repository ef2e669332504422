#!/usr/bin/env bash
# CI's exhaustive compile sweep (the tests marked compile_sweep, which the README's test command leaves out):
# tests/helpers/aot_compile.py --quick for sm_90 and --smoke for every other target, the whole masked kernel audit
# (--quick --masked), the quick kernel audit's parts and the targets' audits that the README's command leaves out,
# and inductor's C++ builds (the AOTInductor package, a compiled checkpoint loop), with the newest torch/Triton
# (.venv), in one Triton cache. It is CPU work
# with no downloads, so CI runs it beside scripts/oldest.sh, whose set-up is mostly a download (docs/contributing.md,
# "Compiling without a GPU").
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
# Two workers, a test each at a time (--dist load): in CI the sweep outlasts the jobs beside it, then has both cores.
# Longest first: the masked audit (one job, one test), the compiles in parts of under a minute, inductor's builds,
# then the audit's parts (a job each, 5-20 s), which keep both workers busy to the end.
.venv/bin/python -m pytest -q -p no:cacheprovider -n 2 --dist load -m compile_sweep \
    tests/kernels/test_kernel_audit_masked.py tests/kernels/test_aot_compile.py tests/integrations/test_export.py \
    tests/distributed/test_checkpoint_loops.py tests/kernels/test_kernel_audit.py
echo "compile sweep: done in $((SECONDS - start)) s"
