#!/usr/bin/env bash
# On the lent GPU machine (shared/GPU.md): build this checkout in place, run the gpu-marked tests named in
# TESTS (none by default), then the bench components named in ONLY, each into its own JSON file; logs
# and JSON under $OUT. One call, so that the build is paid once.
#   TESTS="tests/memory/test_monitor_gpu.py" ONLY="photos-engines-off photos-12mp" bash tools/gpu_rows.sh
set -uo pipefail
OUT=${OUT:-/tmp/hotloop-rows}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ! HOTLOOP_CUDA_ARCHS=90 python3 -m pip install --no-build-isolation --no-deps -e . >"$OUT/build.log" 2>&1; then
    tail -30 "$OUT/build.log"
    exit 1
fi
status=0
if [[ -n ${TESTS:-} ]]; then
    # shellcheck disable=SC2086
    python3 -m pytest -m gpu -q -p no:cacheprovider -o addopts="" --timeout 300 $TESTS 2>&1 | tee "$OUT/tests.log" | tail -15
    status=${PIPESTATUS[0]}
fi
for row in ${ONLY:-}; do
    echo "== $row"
    python3 -m hotloop bench components --only "$row" --json "$OUT/$row.json" >"$OUT/$row.log" 2>&1 || status=1
    tail -25 "$OUT/$row.log"
done
exit $status
