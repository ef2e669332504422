#!/usr/bin/env bash
# The compatibility table (docs/support.md): one row per torch release, each in a fresh virtual environment
# with the Triton that torch pins and the NumPy pip picks, every column of scripts/compat_smoke.py.
# Not in the default test run: each environment downloads a torch of about 3 GB.
#
#   scripts/compat.sh [VERSION|PYTHON ...]    default: 2.8.0 2.9.1 2.10.0 2.11.0 2.12.0 2.13.0
#
# A VERSION gets $COMPAT_VENVS/torch-VERSION (default /tmp/tritonbn-compat), made when missing; a path to a
# python executable runs that environment as it is (tritonbn is installed into it, editable, without deps).
set -uo pipefail
cd "$(dirname "$0")/.."
root=${COMPAT_VENVS:-/tmp/tritonbn-compat}
versions=("$@")
[ ${#versions[@]} -gt 0 ] || versions=(2.8.0 2.9.1 2.10.0 2.11.0 2.12.0 2.13.0)
echo "| torch | Triton | NumPy | import | PyTorch backend | kernels, interpreter | compiled for sm_90 \
| direct launch (fake driver) | 2-rank sync, interpreter | \`torch.compile\` (fullgraph, training) |"
echo "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
failed=0
for v in "${versions[@]}"; do
    if [ -x "$v" ]; then
        py=$v
    else
        py=$root/torch-$v/bin/python
        if [ ! -x "$py" ]; then
            python3 -m venv "$root/torch-$v" && "$py" -m pip install --quiet "torch==$v" numpy >&2 || {
                echo "| $v | install failed | | | | | | | | |"; failed=1; continue; }
        fi
    fi
    # torch's CPU builds pin no Triton (the 2.13.0+cpu wheel on CI's disk): the newest one, as tritonbn's own
    # requirement would bring
    "$py" -c "import triton" 2>/dev/null || "$py" -m pip install --quiet triton >&2
    "$py" -m pip install --quiet --no-deps -e . >&2
    "$py" scripts/compat_smoke.py --markdown --columns import,torch,interpreter,aot,direct,sync2,compile || failed=1
done
exit $failed
